"""fastzero: fast kernels and a thin ZeRO runtime for training large models.

The kernels are in :mod:`fastzero.ops` (``from fastzero.ops import CPUAdam``).
"""

__version__ = "0.1.0"
