"""fastzero's parallelism layer (above comm, below the runtime): the process
topology and its groups, tensor-parallel layers, AutoTP, sequence
parallelism and activation checkpointing."""

from fastzero.parallel.cross_entropy import vocab_parallel_cross_entropy
from fastzero.parallel.groups import (
    current,
    data_group,
    is_tensor_parallel,
    mark_tensor_parallel,
    set_current,
    tensor_group,
)
from fastzero.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from fastzero.parallel.mappings import (
    copy_to_tensor_group,
    gather_from_sequence_parallel_region,
    gather_from_tensor_group,
    reduce_from_tensor_group,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_group,
)
from fastzero.parallel.sequence_parallel import (
    allreduce_sequence_parallel_grads,
    is_sequence_parallel,
    mark_sequence_parallel,
    register_sequence_parallel_grad_hooks,
)
from fastzero.parallel.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    Topology,
)

__all__ = [
    "ColumnParallelLinear",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "ProcessTopology",
    "RowParallelLinear",
    "Topology",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "copy_to_tensor_group",
    "current",
    "data_group",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_group",
    "is_sequence_parallel",
    "is_tensor_parallel",
    "mark_sequence_parallel",
    "mark_tensor_parallel",
    "reduce_from_tensor_group",
    "reduce_scatter_to_sequence_parallel_region",
    "register_sequence_parallel_grad_hooks",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_group",
    "set_current",
    "tensor_group",
    "vocab_parallel_cross_entropy",
]
