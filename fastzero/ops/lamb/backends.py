"""The LAMB family's backends, fastest first (see fastzero.ops.backend for
the rule that picks one). Device targets also take ``coeffs_out``, the
tensor the trust ratios are written to; host targets return them."""

from fastzero.ops.backend import Backend, Family, always, cpu_status, cuda_status, triton_status

FAMILY = Family(
    "lamb",
    "LAMB (FusedLamb)",
    [
        Backend("cuda", ("cuda",), ("cuda",), cuda_status, "fastzero.ops.lamb.cuda:launch"),
        Backend("triton", ("cuda",), ("cuda", "cpu"), triton_status, "fastzero.triton_kernels.lamb:launch"),
        Backend("cpu", ("cpu",), ("cpu",), cpu_status, "fastzero.ops.lamb.cpu:launch"),
        Backend("reference", ("cpu", "cuda"), ("cpu", "cuda"), always, "fastzero.ops.lamb.reference:lamb_step"),
    ],
)
