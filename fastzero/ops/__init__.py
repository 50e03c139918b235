"""fastzero's public kernel API: each op picks the fastest backend it has
(FASTZERO_BACKEND forces one) and says which ran."""

from fastzero.ops import reference
from fastzero.ops.backend import backends, report
from fastzero.ops.cpu_adam import CPUAdam, cpu_adam_step

__all__ = ["CPUAdam", "backends", "cpu_adam_step", "reference", "report"]
