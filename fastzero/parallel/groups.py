"""Which process groups the parallelism layer uses, in one place.

Tensor-parallel layers, activation-checkpoint partitioning and the engine
ask here for the tensor (model-parallel) and data-parallel groups. The
source is, in order: a group passed explicitly; a topology or mpu passed
explicitly; the *current* one (set by :class:`fastzero.parallel.Topology`
when made current, or by ``initialize(mpu=...)``); else the whole world for
the tensor group. Anything with Megatron's ``mpu`` interface
(``get_model_parallel_group()`` or the newer
``get_tensor_model_parallel_group()``, and ``get_data_parallel_group()``)
works, so a user's own Megatron-style mpu plugs in unchanged.

Params split across the tensor group carry Megatron's attributes
(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``), set by
:func:`mark_tensor_parallel`: the engine reads them to count a replicated
param's gradient norm once and to record each param's split in checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

_current: Any = None  # the current topology or mpu (None: no tensor/pipe parallelism set up)


def set_current(mpu: Any) -> None:
    """Makes `mpu` (a Topology, or anything with Megatron's mpu interface) the current one; None clears it."""
    global _current
    _current = mpu


def current() -> Any:
    """The current topology or mpu, or None."""
    return _current


def _model_parallel_group(mpu: Any):
    for name in ("get_tensor_model_parallel_group", "get_model_parallel_group"):
        fn = getattr(mpu, name, None)
        if fn is not None:
            return fn()
    raise TypeError(
        f"{type(mpu).__name__} has no get_model_parallel_group() or get_tensor_model_parallel_group(): pass a "
        "fastzero.parallel.Topology or a Megatron-style mpu"
    )


def tensor_group(group: Any = None, *, topology: Any = None, mpu: Any = None):
    """The tensor-parallel process group: `group` if given, else that of
    `topology` or `mpu`, else the current one's, else None (the default
    group: the whole world is one tensor group)."""
    if group is not None:
        return group
    source = topology if topology is not None else mpu if mpu is not None else _current
    return None if source is None else _model_parallel_group(source)


def data_group(*, topology: Any = None, mpu: Any = None):
    """The data-parallel process group of `topology`, `mpu` or the current
    one; None (the whole world) when there is none."""
    source = topology if topology is not None else mpu if mpu is not None else _current
    return None if source is None else source.get_data_parallel_group()


def group_size(group: Any) -> int:
    """Ranks in `group` (None: the default group); 1 when torch.distributed is not initialized."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_rank(group: Any) -> int:
    """This process's rank in `group` (None: the default group); 0 when torch.distributed is not initialized."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def mark_tensor_parallel(param: Tensor, dim: int, stride: int = 1) -> Tensor:
    """Marks `param` as split along `dim` across the tensor group (Megatron's attributes)."""
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = stride
    return param


def is_tensor_parallel(param: Tensor) -> bool:
    """Whether `param` is split across the tensor group (each rank holds a different piece)."""
    return bool(getattr(param, "tensor_model_parallel", False))
