"""fastzero's public kernel API: each op picks the fastest backend it has
(FASTZERO_BACKEND forces one) and says which ran."""

from fastzero.ops import onebit, reference
from fastzero.ops.backend import backends, report
from fastzero.ops.cpu_adam import CPUAdam, cpu_adam_step
from fastzero.ops.cpu_lamb import cpu_lamb_step
from fastzero.ops.fused_adam import FusedAdam
from fastzero.ops.fused_lamb import FusedLamb
from fastzero.ops.sparse_attention import (
    SparseAttention,
    block_sparse_attention,
    pad_to_block_size,
    unpad_sequence_output,
)
from fastzero.ops.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

__all__ = [
    "BSLongformerSparsityConfig", "BigBirdSparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig", "SparsityConfig", "VariableSparsityConfig",
    "CPUAdam", "FusedAdam", "FusedLamb", "OneBitAdam", "SparseAttention", "backends", "cpu_adam_step", "cpu_lamb_step",
    "block_sparse_attention", "onebit", "pad_to_block_size", "reference", "report", "unpad_sequence_output",
]  # fmt: skip


def __getattr__(name: str):
    # A compatibility re-export, the one edge from ops up to the runtime: OneBitAdam needs process groups, so it
    # lives in fastzero.runtime.onebit_adam (layers import downward only); `from fastzero.ops import OneBitAdam`
    # keeps working by importing it lazily, on first use.
    if name == "OneBitAdam":
        from fastzero.runtime.onebit_adam import OneBitAdam

        return OneBitAdam
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
