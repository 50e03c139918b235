"""The Adam family: AdamHyperparams, the plain-PyTorch reference, the cpu,
cuda and triton backends (registered in backends.py), the functional CPU step
and the optimizers CPUAdam (also under DeepSpeed's name, DeepSpeedCPUAdam)
and FusedAdam."""

from fastzero.ops.adam.backends import FAMILY
from fastzero.ops.adam.cpu import cpu_adam_step
from fastzero.ops.adam.hyperparams import AdamHyperparams
from fastzero.ops.adam.optimizers import CPUAdam, FusedAdam
from fastzero.ops.adam.reference import adam_step

DeepSpeedCPUAdam = CPUAdam  # DeepSpeed's name (``deepspeed.ops.adam.DeepSpeedCPUAdam``): the same arguments

__all__ = ["FAMILY", "AdamHyperparams", "CPUAdam", "DeepSpeedCPUAdam", "FusedAdam", "adam_step", "cpu_adam_step"]
