"""The grads of params used inside a sequence-parallel region.

Under sequence parallelism the LayerNorm (and dropout) regions run on each
rank's chunk of the sequence, so a param there (a LayerNorm's weight and
bias, a RowParallelLinear's bias) is replicated across the tensor group but
gets only its chunk's part of the grad on each rank. Those parts must be
summed over the tensor group after backward and before the optimizer (and
before any data-parallel reduction), as Megatron does for params marked
``sequence_parallel``: :func:`allreduce_sequence_parallel_grads`, one
collective per dtype, called after backward. Or, with no call to add to the
training loop: :func:`register_sequence_parallel_grad_hooks` sums each
marked param's grad during backward, before it is accumulated into
``.grad``, so whatever reads the grad later (the optimizer, the engine's
ZeRO reduction hooks, gradient accumulation) sees the sum; one small
collective per param per backward.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils.hooks import RemovableHandle

from fastzero.comm import functional  # logged by the communication logger
from fastzero.parallel.groups import group_size, tensor_group


def _params(items) -> list[Tensor]:
    if isinstance(items, (nn.Module, Tensor)):
        items = [items]
    out = []
    for item in items:
        if isinstance(item, nn.Module):
            out.extend(item.parameters())
        elif isinstance(item, Tensor):
            out.append(item)
        else:
            raise TypeError(f"expected modules or params, got {type(item).__name__}")
    return out


def mark_sequence_parallel(*items: nn.Module | Tensor | Iterable) -> None:
    """Marks every param of the given modules (or the given params) as used
    in a sequence-parallel region (Megatron's ``param.sequence_parallel = True``)."""
    for p in _params(items):
        p.sequence_parallel = True


def is_sequence_parallel(param: Tensor) -> bool:
    """Whether `param` is marked by :func:`mark_sequence_parallel`."""
    return bool(getattr(param, "sequence_parallel", False))


def allreduce_sequence_parallel_grads(
    params: nn.Module | Iterable[Tensor], group=None, *, topology=None, mpu=None
) -> int:
    """Sums the grads of the marked params (:func:`mark_sequence_parallel`; a
    RowParallelLinear with ``sequence_parallel=True`` marks its bias) over the
    tensor group, in place, one collective per dtype. Call it on every rank of
    the group after backward, before the optimizer step; a module gives all
    its params, unmarked ones and those without a grad are left alone.
    Returns how many grads were summed."""
    group = tensor_group(group, topology=topology, mpu=mpu)
    grads = [p.grad for p in _params(params) if is_sequence_parallel(p) and p.grad is not None]
    if group_size(group) == 1 or not grads:
        return len(grads)
    by_kind: dict[tuple, list[Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.dtype, g.device), []).append(g)
    for same in by_kind.values():
        flat = _flatten_dense_tensors(same)
        functional.all_reduce(flat, group=group)
        with torch.no_grad():
            for g, summed in zip(same, _unflatten_dense_tensors(flat, same)):
                g.copy_(summed)
    return len(grads)


def register_sequence_parallel_grad_hooks(
    params: nn.Module | Iterable[Tensor], group=None, *, topology=None, mpu=None
) -> list[RemovableHandle]:
    """Sums the grad of each marked param that requires grad over the tensor
    group as backward produces it (a tensor hook: before it reaches
    ``.grad``). Every rank of the group must register the same params.
    Returns the handles (``handle.remove()`` undoes it)."""
    group = tensor_group(group, topology=topology, mpu=mpu)
    if group_size(group) == 1:
        return []

    def summed(grad: Tensor) -> Tensor:
        out = grad.clone(memory_format=torch.contiguous_format)
        functional.all_reduce(out, group=group)
        return out

    return [p.register_hook(summed) for p in _params(params) if is_sequence_parallel(p) and p.requires_grad]
