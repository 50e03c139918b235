"""fastzero's parallelism layer (above comm, below the runtime): the process
topology and its groups, tensor-parallel layers, AutoTP, sequence
parallelism and activation checkpointing."""

from fastzero.parallel.groups import (
    current,
    data_group,
    is_tensor_parallel,
    mark_tensor_parallel,
    set_current,
    tensor_group,
)
from fastzero.parallel.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    Topology,
)

__all__ = [
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "ProcessTopology",
    "Topology",
    "current",
    "data_group",
    "is_tensor_parallel",
    "mark_tensor_parallel",
    "set_current",
    "tensor_group",
]
