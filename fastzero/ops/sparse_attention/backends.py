"""The sparse-attention family's backends: the Triton block-sparse flash
kernels, else the plain-PyTorch path (dense for short sequences, a
flash-style blocked loop beyond; see attention.py)."""

from fastzero.ops.backend import Backend, Family, always, triton_status

FAMILY = Family(
    "sparse_attention",
    "SparseAttention",
    [
        Backend("triton", ("cuda",), ("cuda", "cpu"), triton_status, "fastzero.triton_kernels.sparse_attention"),
        Backend("reference", ("cpu", "cuda"), ("cpu", "cuda"), always, "fastzero.ops.sparse_attention.attention"),
    ],
)
