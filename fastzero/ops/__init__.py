"""fastzero's public kernel API, one folder per kernel family (adam, lamb,
onebit, sparse_attention: each with its hyperparameters, reference, input
checks and registered backends, the torch.optim classes on top). Every op
picks its backend by one rule (fastzero.ops.backend): ``backend=`` >
``FASTZERO_BACKEND`` > the fastest available, and says which ran."""

from fastzero.ops import onebit, reference, tolerances
from fastzero.ops.adam import AdamHyperparams, CPUAdam, FusedAdam, cpu_adam_step
from fastzero.ops.backend import backends, report
from fastzero.ops.lamb import FusedLamb, LambHyperparams, cpu_lamb_step
from fastzero.ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseAttention,
    SparsityConfig,
    VariableSparsityConfig,
    block_sparse_attention,
    pad_to_block_size,
    unpad_sequence_output,
)

__all__ = [
    "AdamHyperparams",
    "BSLongformerSparsityConfig",
    "BigBirdSparsityConfig",
    "CPUAdam",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "FusedAdam",
    "FusedLamb",
    "LambHyperparams",
    "LocalSlidingWindowSparsityConfig",
    "OneBitAdam",
    "SparseAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
    "backends",
    "block_sparse_attention",
    "cpu_adam_step",
    "cpu_lamb_step",
    "onebit",
    "pad_to_block_size",
    "reference",
    "report",
    "tolerances",
    "unpad_sequence_output",
]


def __getattr__(name: str):
    # A compatibility re-export, the one edge from ops up to the runtime: OneBitAdam needs process groups, so it
    # lives in fastzero.runtime.onebit_adam (layers import downward only); `from fastzero.ops import OneBitAdam`
    # keeps working by importing it lazily, on first use.
    if name == "OneBitAdam":
        from fastzero.runtime.onebit_adam import OneBitAdam

        return OneBitAdam
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
