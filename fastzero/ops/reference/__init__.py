"""Plain-PyTorch references: each states one kernel's math in a few readable
lines. Every backend is tested against them, and they are the fallback where
no faster backend exists."""

from fastzero.ops.reference.adam import adam_step
from fastzero.ops.reference.lamb import lamb_step

__all__ = ["adam_step", "lamb_step"]
