"""The sparse-attention family: DeepSpeed's sparsity configs, the
``SparseAttention`` module and :func:`block_sparse_attention` on the Triton
kernels or the plain-PyTorch path, and the dense reference."""

from fastzero.ops.sparse_attention import reference
from fastzero.ops.sparse_attention.attention import (
    SparseAttention,
    block_sparse_attention,
    pad_to_block_size,
    unpad_sequence_output,
)
from fastzero.ops.sparse_attention.backends import FAMILY
from fastzero.ops.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

__all__ = [
    "FAMILY",
    "BSLongformerSparsityConfig",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparseAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
    "block_sparse_attention",
    "pad_to_block_size",
    "reference",
    "unpad_sequence_output",
]
