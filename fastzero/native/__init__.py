"""Native code plumbing, the lowest layer: how csrc/ is built
(:mod:`fastzero.native.build`, standard library only), the codes and
signatures shared with it (:mod:`fastzero.native.abi`), and how the built
libraries are loaded (:mod:`fastzero.native.loader`). It imports nothing
from the rest of fastzero; ``fastzero.ops`` and the benchmarks use the names
below.
"""

from fastzero.native.abi import CUDA_ABI_VERSION, CUDA_SIGNATURES, DTYPE_CODES, ISA_NAMES, NO_DTYPE
from fastzero.native.build import BuildError
from fastzero.native.loader import (
    best_isa,
    bind_cuda,
    check_rc,
    cpu_isa,
    cpu_ops,
    cpu_ops_error,
    cuda_available,
    cuda_lib,
    supported_isas,
)

__all__ = [
    "CUDA_ABI_VERSION",
    "CUDA_SIGNATURES",
    "DTYPE_CODES",
    "ISA_NAMES",
    "NO_DTYPE",
    "BuildError",
    "best_isa",
    "bind_cuda",
    "check_rc",
    "cpu_isa",
    "cpu_ops",
    "cpu_ops_error",
    "cuda_available",
    "cuda_lib",
    "supported_isas",
]
