"""The Adam family: AdamHyperparams, the plain-PyTorch reference, the cpu,
cuda and triton backends (registered in backends.py), the functional CPU step
and the optimizers CPUAdam and FusedAdam."""

from fastzero.ops.adam.backends import FAMILY
from fastzero.ops.adam.cpu import cpu_adam_step
from fastzero.ops.adam.hyperparams import AdamHyperparams
from fastzero.ops.adam.optimizers import CPUAdam, FusedAdam
from fastzero.ops.adam.reference import adam_step

__all__ = ["FAMILY", "AdamHyperparams", "CPUAdam", "FusedAdam", "adam_step", "cpu_adam_step"]
