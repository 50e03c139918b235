"""The LAMB family: LambHyperparams, the plain-PyTorch reference, the cpu,
cuda and triton backends (registered in backends.py), the functional CPU step
and the optimizer FusedLamb."""

from fastzero.ops.lamb.backends import FAMILY
from fastzero.ops.lamb.cpu import cpu_lamb_step
from fastzero.ops.lamb.hyperparams import LambHyperparams
from fastzero.ops.lamb.optimizers import FusedLamb
from fastzero.ops.lamb.reference import lamb_step

__all__ = ["FAMILY", "FusedLamb", "LambHyperparams", "cpu_lamb_step", "lamb_step"]
