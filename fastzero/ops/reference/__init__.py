"""Every kernel family's plain-PyTorch reference, found in one place (each
lives in its family's folder): each states one kernel's math in a few
readable lines. Every backend is tested against them, and they are the
fallback where no faster backend exists."""

from fastzero.ops.adam.reference import adam_step
from fastzero.ops.lamb.reference import lamb_step
from fastzero.ops.onebit import reference as onebit
from fastzero.ops.quant import reference as quant
from fastzero.ops.sparse_attention import reference as sparse_attention

__all__ = ["adam_step", "lamb_step", "onebit", "quant", "sparse_attention"]
