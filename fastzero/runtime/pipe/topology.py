"""``deepspeed.runtime.pipe.topology``: DeepSpeed's process topologies,
which fastzero keeps in :mod:`fastzero.parallel` (named axes, rank <->
coordinates, the axes' process groups)."""

from fastzero.parallel import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology"]
