"""The autograd functions under the tensor-parallel layers (Megatron-LM's
``tensor_parallel/mappings.py``), on any backend (Gloo and NCCL).

Tensor-parallel region (split along the last, hidden, dim)::

    copy_to_tensor_group       forward: identity          backward: all-reduce
    reduce_from_tensor_group   forward: all-reduce        backward: identity
    scatter_to_tensor_group    forward: split last dim    backward: all-gather last dim
    gather_from_tensor_group   forward: all-gather last   backward: split last dim

Sequence-parallel region (split along the sequence, dim 0 of Megatron's
``[s, b, h]`` by default, any dim through ``seq_dim``)::

    scatter_to_sequence_parallel_region         forward: split        backward: all-gather
    gather_from_sequence_parallel_region        forward: all-gather   backward: reduce-scatter
                                                (or split, with tensor_parallel_output_grad=False)
    reduce_scatter_to_sequence_parallel_region  forward: reduce-scatter  backward: all-gather

``group=None`` means the current tensor group (:func:`fastzero.parallel.tensor_group`).
With one rank in the group every function is the identity. Rank r holds the
r-th contiguous chunk of the split dim; the split dim must divide by the group
size (a ValueError names both otherwise). Outputs are contiguous.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from fastzero.comm import functional
from fastzero.comm.collectives import all_gather_by_send_recv, reduce_scatter_by_all_to_all
from fastzero.comm.logger import timer
from fastzero.parallel.groups import group_rank, group_size, tensor_group

# torch 2.13 renamed the tensor collectives; older torch has only the old names (as fastzero.comm.collectives)
_dist_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_dist_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_TAG = "fastzero:tensor"  # the caller the communication logger names in debug mode

# Gloo in older torch (and some dtypes there) has no reduce-scatter of one
# tensor; the first failure switches to all-reduce + slice for the process.
# The failure is raised before any bytes move, on every rank alike, so no rank
# is left waiting in a half-done collective.
_native_reduce_scatter = True


def _dim(x: Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def _chunk(x: Tensor, dim: int, world: int, what: str) -> int:
    size = x.shape[dim]
    if size % world:
        raise ValueError(
            f"{what}: dim {dim} of a tensor of shape {tuple(x.shape)} has {size} elements, not divisible by the "
            f"{world} ranks of the tensor group; make that size a multiple of {world}"
        )
    return size // world


def _all_reduced(x: Tensor, group) -> Tensor:
    """A new contiguous tensor: the sum of `x` over the group (`x` is left as it is)."""
    out = x.clone(memory_format=torch.contiguous_format)
    functional.all_reduce(out, group=group)  # logged by the communication logger as fastzero.comm's calls are
    return out


def _split(x: Tensor, dim: int, group, what: str) -> Tensor:
    world = group_size(group)
    if world == 1:
        return x
    dim = _dim(x, dim)
    chunk = _chunk(x, dim, world, what)
    return x.narrow(dim, group_rank(group) * chunk, chunk).contiguous()


def _gather(x: Tensor, dim: int, group, async_op: bool = False):
    """All-gather along `dim` (rank r's piece at position r). With async_op,
    returns (work, finish) where finish() gives the result after work.wait()."""
    world = group_size(group)
    dim = _dim(x, dim)
    if world == 1:
        return (None, lambda: x) if async_op else x
    # gather along dim 0 of the moved tensor, then move the dim back: one collective whatever the dim
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((world * front.shape[0], *front.shape[1:]), dtype=x.dtype, device=x.device)
    logged = timer("all_gather_into_tensor", front.numel() * front.element_size(), world, _TAG)
    if dist.get_backend(group) == "gloo":  # Gloo's own all-gather is the slow path (docs/zero.md)
        work = all_gather_by_send_recv(out, front, group, async_op=async_op)
    else:
        work = _dist_all_gather(out, front, group=group, async_op=async_op)

    def finish() -> Tensor:
        if logged is not None:
            logged()
        return out.movedim(0, dim).contiguous()

    return (work, finish) if async_op else finish()


def _reduce_scatter(x: Tensor, dim: int, group, what: str, async_op: bool = False):
    """Sum over the group, rank r keeps the r-th chunk along `dim`. With
    async_op, returns (work, finish) as :func:`_gather`."""
    global _native_reduce_scatter
    world = group_size(group)
    dim = _dim(x, dim)
    if world == 1:
        return (None, lambda: x) if async_op else x
    chunk = _chunk(x, dim, world, what)
    front = x.movedim(dim, 0).contiguous()
    logged = timer("reduce_scatter_tensor", front.numel() * front.element_size() // world, world, _TAG)
    work = None
    if dist.get_backend(group) == "gloo":  # Gloo's own reduce-scatter is the slow path (docs/zero.md)
        out = torch.empty((chunk, *front.shape[1:]), dtype=x.dtype, device=x.device)
        work, summed = reduce_scatter_by_all_to_all(out, front, group, async_op=async_op)

        def finish_gloo() -> Tensor:
            summed()
            if logged is not None:
                logged()
            return out.movedim(0, dim).contiguous()

        return (work, finish_gloo) if async_op else finish_gloo()
    if _native_reduce_scatter:
        out = torch.empty((chunk, *front.shape[1:]), dtype=x.dtype, device=x.device)
        try:
            work = _dist_reduce_scatter(out, front, group=group, async_op=async_op)
        except (RuntimeError, NotImplementedError) as e:
            if "support" not in str(e).lower():  # a real failure, not a missing collective
                raise
            _native_reduce_scatter = False
    if not _native_reduce_scatter:
        if front.data_ptr() == x.data_ptr():  # contiguous already: front is x itself, which must stay as it is
            front = front.clone()
        work = dist.all_reduce(front, group=group, async_op=async_op)
        out = None

    def finish() -> Tensor:
        if logged is not None:
            logged()
        res = out if out is not None else front.narrow(0, group_rank(group) * chunk, chunk)
        return res.movedim(0, dim).contiguous()

    return (work, finish) if async_op else finish()


class _CopyToTensorGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduced(grad, ctx.group), None


class _ReduceFromTensorGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduced(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group, "scatter_to_tensor_group")

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, -1, ctx.group), None


class _GatherFromTensorGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group, "gather_from_tensor_group (backward)"), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group, "scatter_to_sequence_parallel_region")

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, tensor_parallel_output_grad):
        ctx.group, ctx.dim, ctx.tp_grad = group, dim, tensor_parallel_output_grad
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        what = "gather_from_sequence_parallel_region (backward)"
        if ctx.tp_grad:  # each rank holds a partial grad of the whole sequence: sum them
            return _reduce_scatter(grad, ctx.dim, ctx.group, what), None, None, None
        return _split(grad, ctx.dim, ctx.group, what), None, None, None  # the grad is already whole on every rank


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group, "reduce_scatter_to_sequence_parallel_region")

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tensor_group(x: Tensor, group=None) -> Tensor:
    """Identity forward; all-reduce (sum) of the grad backward: the input of a column-parallel layer."""
    group = tensor_group(group)
    return x if group_size(group) == 1 else _CopyToTensorGroup.apply(x, group)


def reduce_from_tensor_group(x: Tensor, group=None) -> Tensor:
    """All-reduce (sum) forward; identity backward: the output of a row-parallel layer."""
    group = tensor_group(group)
    return x if group_size(group) == 1 else _ReduceFromTensorGroup.apply(x, group)


def scatter_to_tensor_group(x: Tensor, group=None) -> Tensor:
    """Keeps this rank's chunk of the last dim forward; all-gathers the grad backward."""
    group = tensor_group(group)
    return x if group_size(group) == 1 else _ScatterToTensorGroup.apply(x, group)


def gather_from_tensor_group(x: Tensor, group=None) -> Tensor:
    """All-gathers the last dim forward; keeps this rank's chunk of the grad backward."""
    group = tensor_group(group)
    return x if group_size(group) == 1 else _GatherFromTensorGroup.apply(x, group)


def scatter_to_sequence_parallel_region(x: Tensor, group=None, seq_dim: int = 0) -> Tensor:
    """Keeps this rank's chunk of the sequence forward; all-gathers the grad backward."""
    group = tensor_group(group)
    return x if group_size(group) == 1 else _ScatterToSequence.apply(x, group, _dim(x, seq_dim))


def gather_from_sequence_parallel_region(
    x: Tensor, tensor_parallel_output_grad: bool = True, group=None, seq_dim: int = 0
) -> Tensor:
    """All-gathers the sequence forward. Backward: reduce-scatter, since the
    gathered sequence feeds a tensor-parallel layer whose ranks each hold a
    partial grad; with ``tensor_parallel_output_grad=False`` (the consumer is
    replicated, every rank's grad already whole) just this rank's chunk."""
    group = tensor_group(group)
    if group_size(group) == 1:
        return x
    return _GatherFromSequence.apply(x, group, _dim(x, seq_dim), tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: Tensor, group=None, seq_dim: int = 0) -> Tensor:
    """Sums over the group and keeps this rank's chunk of the sequence
    forward (a row-parallel layer's output under sequence parallelism);
    all-gathers the grad backward."""
    group = tensor_group(group)
    return x if group_size(group) == 1 else _ReduceScatterToSequence.apply(x, group, _dim(x, seq_dim))
