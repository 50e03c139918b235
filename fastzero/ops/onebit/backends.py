"""The 1-bit family's backends, fastest first (see fastzero.ops.backend for
the rule that picks one). Each target is a module with
``onebit_pack(x, error, bits, scales, chunks)`` and
``onebit_unpack(bits, scales, out, average)`` over checked buffers."""

from fastzero.ops.backend import Backend, Family, always, cpu_status, cuda_status, triton_status

FAMILY = Family(
    "onebit",
    "1-bit pack/unpack",
    [
        Backend("cuda", ("cuda",), ("cuda",), cuda_status, "fastzero.ops.onebit.cuda"),
        Backend("triton", ("cuda",), ("cuda", "cpu"), triton_status, "fastzero.triton_kernels.onebit"),
        Backend("cpu", ("cpu",), ("cpu",), cpu_status, "fastzero.ops.onebit.cpu"),
        Backend("reference", ("cpu", "cuda"), ("cpu", "cuda"), always, "fastzero.ops.onebit.reference"),
    ],
)
