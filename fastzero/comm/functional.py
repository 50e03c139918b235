"""torch.distributed's functional surface under DeepSpeed's names
(``import deepspeed.comm as dist`` becomes ``import fastzero.comm as dist``;
names and defaults from ``deepspeed/comm/comm.py``, v0.14-0.16).

Each call is a thin delegation to :mod:`torch.distributed` once a process
group exists. Without one, in a process that is alone in its job (the
launcher's environment says world size 1, or says nothing), every collective
is what it is on one rank: all_reduce, reduce, broadcast and barrier leave the
tensor as it is; all_gather, gather, scatter, all_gather_into_tensor,
reduce_scatter_tensor and all_to_all_single copy the input to the output.
So a script written for several ranks also runs as one plain process, as
:class:`fastzero.comm.Comm` does. With ``async_op=True`` they return a work
handle that is already done. Send and receive have no peer there and raise.
Without a process group in a job of several ranks, every collective raises
RuntimeError (call :func:`fastzero.comm.init_distributed` first) rather than
return one rank's values as if they were the job's.

Every collective, send and receive takes DeepSpeed's profiling keywords
(``prof``, ``log_name``, ``debug``): while the communication logger is on
(the ``comms_logger`` config section, or :func:`fastzero.comm.configure`),
a call it wants is timed until it completes (an asynchronous one too:
through its future, or when its handle is waited on) and logged under
`log_name` (:mod:`fastzero.comm.logger`). ``debug``'s value is not read: the
logger's own ``debug`` setting names the caller.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from fastzero.comm.env import dist_env
from fastzero.comm.logger import caller_name, comms_logger, timer

ReduceOp = dist.ReduceOp

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "get_all_ranks_from_group",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "has_all_gather_into_tensor",
    "has_all_reduce_coalesced",
    "has_coalescing_manager",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]


class _Done:
    """The handle of a collective that finished when it was called (one process, no group)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


def _result(async_op: bool):
    return _Done() if async_op else None


def is_available() -> bool:
    """Whether this torch build has torch.distributed."""
    return dist.is_available()


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def _alone(what: str, group=None) -> bool:
    """True when `what` must run locally: no process group and a job of one
    process. RuntimeError when there is no group but the launcher started
    several ranks, or a group object is passed without a process group."""
    if is_initialized():
        return False
    env = dist_env()
    if env.world_size > 1:
        raise RuntimeError(
            f"{what}: torch.distributed is not initialized but this is rank {env.rank} of {env.world_size}; "
            "call fastzero.comm.init_distributed() (or fastzero.initialize) first"
        )
    if group is not None:
        raise RuntimeError(f"{what}: group={group!r} given but torch.distributed is not initialized")
    return True


def _root(what: str, name: str, value) -> None:
    if value not in (0, None):
        raise ValueError(f"{what}: {name}={value!r} but the only rank of a single process is 0")


def _copy(what: str, out: Tensor, inp: Tensor) -> None:
    if out.numel() != inp.numel():
        raise ValueError(
            f"{what}: output has {out.numel()} elements and input {inp.numel()}; on one rank they are the same"
        )
    out.copy_(inp.reshape(out.shape))


def _one(what: str, tensors: Sequence, name: str) -> None:
    if tensors is None or len(tensors) != 1:
        n = None if tensors is None else len(tensors)
        raise ValueError(f"{what}: {name} has {n} entries; a single process needs exactly 1")


# --- who is where ---------------------------------------------------------------------------


def get_rank(group=None) -> int:
    """This process's rank in `group` (the default group when None); without a
    process group, the launcher's RANK (0 in a plain process)."""
    if is_initialized():
        return dist.get_rank(group)
    return dist_env().rank


def get_world_size(group=None) -> int:
    """The number of ranks in `group`; without a process group, the launcher's
    WORLD_SIZE (1 in a plain process)."""
    if is_initialized():
        return dist.get_world_size(group)
    return dist_env().world_size


def get_local_rank() -> int:
    """This process's rank on its host: LOCAL_RANK (or OpenMPI's / SLURM's), 0 when unset."""
    return dist_env().local_rank


def get_global_rank(group=None, group_rank: int = 0) -> int:
    """The global rank of `group_rank` in `group` (the default group when None)."""
    if is_initialized():
        return dist.get_global_rank(group if group is not None else dist.group.WORLD, group_rank)
    _root("get_global_rank", "group_rank", group_rank)
    return 0


def get_world_group():
    """The default group (``torch.distributed.group.WORLD``; None without a process group)."""
    return dist.group.WORLD if is_initialized() else None


def new_group(ranks=None, **kwargs):
    """A group of `ranks` (torch.distributed.new_group; every rank must call it).
    Without a process group, only ``[0]`` (or None) and returns None, the default group."""
    if is_initialized():
        return dist.new_group(ranks, **kwargs)
    _alone("new_group")
    if ranks is not None and list(ranks) != [0]:
        raise ValueError(f"new_group: ranks={list(ranks)!r} but a single process has only rank 0")
    return None


def destroy_process_group(group=None) -> None:
    """Destroys `group` (the default group and every other when None); nothing without one."""
    if is_initialized():
        dist.destroy_process_group(group)


# --- the communication logger's timing ---------------------------------------------------------

# the argument whose bytes are an op's message: what one rank puts in (fastzero.comm.logger); none: 0 bytes
_MESSAGE = {
    "all_gather_into_tensor": "input_tensor",
    "reduce_scatter_tensor": "output_tensor",
    "reduce_scatter": "output",
    "all_to_all": "input_tensor_list",
    "all_reduce_coalesced": "tensors",
}
_NO_MESSAGE = ("barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list")


def _nbytes(message) -> int:
    """A tensor's bytes, or a list's of tensors together."""
    if isinstance(message, Tensor):
        return message.numel() * message.element_size()
    if isinstance(message, (list, tuple)):
        return sum(_nbytes(t) for t in message)
    return 0


class _TimedWork:
    """A work without a future (Gloo's sends and receives): logged when waited
    on (one only polled with ``is_completed()`` is not). Returned only while
    the logger times the call."""

    def __init__(self, work, done) -> None:
        self._work, self._done = work, done

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        if self._done is not None:
            done, self._done = self._done, None
            done()
        return result

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def _timed(fn):
    """Takes DeepSpeed's ``prof``, ``log_name`` and ``debug`` keywords and, when the communication logger wants
    the call, times it to completion and logs it."""
    name = fn.__name__
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, prof: bool = False, log_name: str | None = None, debug=None, **kwargs):
        if not comms_logger.wants(name if log_name is None else log_name, prof) or not is_initialized():
            return fn(*args, **kwargs)  # alone: nothing moves, nothing logged
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{name}(): {exc}") from None
        bound.apply_defaults()
        message = None if name in _NO_MESSAGE else bound.arguments[_MESSAGE.get(name, "tensor")]
        size = _nbytes(message)
        world = dist.get_world_size(bound.arguments.get("group"))  # -1 off the group: not logged
        done = timer(name, size, world, caller_name(2), log_name, prof)
        out = fn(*args, **kwargs)
        if done is None:
            return out
        first = message[0] if isinstance(message, (list, tuple)) and message else message
        if isinstance(first, Tensor) and first.is_cuda:  # a future completes when the work is queued
            torch.cuda.synchronize()  # as DeepSpeed's logger: the collective's real end, at a sync's cost
            done()
            return out
        if out is None or not hasattr(out, "wait"):  # ran to completion (sync; recv returns the sender's rank)
            done()
            return out
        try:
            out.get_future().add_done_callback(done)
        except (RuntimeError, AttributeError):  # no future: logged when waited on
            return _TimedWork(out, done)
        return out

    call.__signature__ = signature.replace(
        parameters=[
            *signature.parameters.values(),
            inspect.Parameter("prof", inspect.Parameter.KEYWORD_ONLY, default=False),
            inspect.Parameter("log_name", inspect.Parameter.KEYWORD_ONLY, default=name),
            inspect.Parameter("debug", inspect.Parameter.KEYWORD_ONLY, default=None),
        ]
    )
    return call


# --- collectives ----------------------------------------------------------------------------


@_timed
def barrier(group=None, async_op: bool = False, device_ids=None):
    if _alone("barrier", group):
        return _result(async_op)
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


@_timed
def all_reduce(tensor: Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """`tensor` becomes the reduction (`op`) of every rank's `tensor`, in place."""
    if _alone("all_reduce", group):
        return _result(async_op)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


@_timed
def reduce(tensor: Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """Rank `dst`'s `tensor` becomes the reduction of every rank's."""
    if _alone("reduce", group):
        _root("reduce", "dst", dst)
        return _result(async_op)
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


@_timed
def broadcast(tensor: Tensor, src: int, group=None, async_op: bool = False):
    """Every rank's `tensor` becomes rank `src`'s."""
    if _alone("broadcast", group):
        _root("broadcast", "src", src)
        return _result(async_op)
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


@_timed
def all_gather(tensor_list: list[Tensor], tensor: Tensor, group=None, async_op: bool = False):
    """``tensor_list[r]`` becomes rank r's `tensor`."""
    if _alone("all_gather", group):
        _one("all_gather", tensor_list, "tensor_list")
        _copy("all_gather", tensor_list[0], tensor)
        return _result(async_op)
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


@_timed
def all_gather_into_tensor(output_tensor: Tensor, input_tensor: Tensor, group=None, async_op: bool = False):
    """`output_tensor` (world size times the input) becomes every rank's input, in rank order."""
    if _alone("all_gather_into_tensor", group):
        _copy("all_gather_into_tensor", output_tensor, input_tensor)
        return _result(async_op)
    return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


@_timed
def reduce_scatter_tensor(
    output_tensor: Tensor, input_tensor: Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False
):
    """Rank r's `output_tensor` becomes chunk r of the reduction of every rank's `input_tensor`."""
    if _alone("reduce_scatter_tensor", group):
        _copy("reduce_scatter_tensor", output_tensor, input_tensor)
        return _result(async_op)
    return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


@_timed
def gather(tensor: Tensor, gather_list: list[Tensor] | None = None, dst: int = 0, group=None, async_op=False):
    """Rank `dst`'s ``gather_list[r]`` becomes rank r's `tensor`."""
    if _alone("gather", group):
        _root("gather", "dst", dst)
        _one("gather", gather_list, "gather_list")
        _copy("gather", gather_list[0], tensor)
        return _result(async_op)
    return dist.gather(tensor, gather_list, dst, group=group, async_op=async_op)


@_timed
def scatter(tensor: Tensor, scatter_list: list[Tensor] | None = None, src: int = 0, group=None, async_op=False):
    """Rank r's `tensor` becomes rank `src`'s ``scatter_list[r]``."""
    if _alone("scatter", group):
        _root("scatter", "src", src)
        _one("scatter", scatter_list, "scatter_list")
        _copy("scatter", tensor, scatter_list[0])
        return _result(async_op)
    return dist.scatter(tensor, scatter_list, src, group=group, async_op=async_op)


@_timed
def all_to_all_single(
    output: Tensor,
    tensor: Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group=None,
    async_op: bool = False,
):
    """Rank r's chunk j of `tensor` lands in rank j's `output` as chunk r."""
    if _alone("all_to_all_single", group):
        _copy("all_to_all_single", output, tensor)
        return _result(async_op)
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


@_timed
def all_gather_object(object_list: list, obj, group=None):
    """``object_list[r]`` becomes rank r's picklable `obj`."""
    if _alone("all_gather_object", group):
        _one("all_gather_object", object_list, "object_list")
        object_list[0] = obj
        return None
    return dist.all_gather_object(object_list, obj, group=group)


@_timed
def broadcast_object_list(object_list: list, src: int = 0, group=None, device: torch.device | None = None):
    """Every rank's `object_list` becomes rank `src`'s."""
    if _alone("broadcast_object_list", group):
        _root("broadcast_object_list", "src", src)
        return None
    return dist.broadcast_object_list(object_list, src, group=group, device=device)


@_timed
def all_to_all(output_tensor_list: list[Tensor], input_tensor_list: list[Tensor], group=None, async_op=False):
    """Rank r's ``input_tensor_list[j]`` lands in rank j's ``output_tensor_list[r]``."""
    if _alone("all_to_all", group):
        _one("all_to_all", output_tensor_list, "output_tensor_list")
        _one("all_to_all", input_tensor_list, "input_tensor_list")
        _copy("all_to_all", output_tensor_list[0], input_tensor_list[0])
        return _result(async_op)
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


@_timed
def reduce_scatter(output: Tensor, input_list: list[Tensor], op=ReduceOp.SUM, group=None, async_op: bool = False):
    """Rank r's `output` becomes the reduction of every rank's ``input_list[r]``."""
    if _alone("reduce_scatter", group):
        _one("reduce_scatter", input_list, "input_list")
        _copy("reduce_scatter", output, input_list[0])
        return _result(async_op)
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


@_timed
def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False):
    """A barrier that names the ranks that did not arrive within `timeout` (Gloo only, as torch's)."""
    if _alone("monitored_barrier", group):
        return None
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


class _Then:
    """A work whose result needs one more local step once it completes (copying a flat buffer back)."""

    def __init__(self, work, then) -> None:
        self._work, self._then = work, then

    def wait(self, *args, **kwargs) -> bool:
        self._work.wait(*args, **kwargs)
        if self._then is not None:
            then, self._then = self._then, None
            then()
        return True

    def is_completed(self) -> bool:
        if self._then is not None and self._work.is_completed():
            self.wait()  # done: take the local step now, so polling alone sees the result
        return self._then is None

    def get_future(self):
        return self._work.get_future()


@_timed
def all_reduce_coalesced(tensors: list[Tensor], op=ReduceOp.SUM, group=None, async_op: bool = False):
    """Each of `tensors` becomes its reduction over the ranks, in one
    collective: flattened into one buffer (they must share a dtype and
    device), reduced, copied back (with `async_op`, when the work is waited on)."""
    tensors = list(tensors)
    if not tensors:
        return _result(async_op)
    kinds = {(t.dtype, t.device) for t in tensors}
    if len(kinds) > 1:
        raise ValueError(f"all_reduce_coalesced: the tensors are of {len(kinds)} dtypes/devices; give one of each")
    if _alone("all_reduce_coalesced", group):
        return _result(async_op)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    work = dist.all_reduce(flat, op=op, group=group, async_op=async_op)

    def copy_back() -> None:
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    if not async_op:
        copy_back()
        return None
    return _Then(work, copy_back)


@_timed
def inference_all_reduce(tensor: Tensor, op=ReduceOp.SUM, group=None):
    """DeepSpeed's inference all-reduce: `tensor` summed in place over the
    group (returns it, as DeepSpeed does, on a group of one rank)."""
    if _alone("inference_all_reduce", group) or dist.get_world_size(group) <= 1:
        return tensor
    return dist.all_reduce(tensor, op=op, group=group)


def reduce_scatter_fn(output_tensor: Tensor, tensor: Tensor, op=ReduceOp.SUM, group=None, async_op=False, **log):
    """DeepSpeed's helper: :func:`reduce_scatter_tensor` (which every supported torch has)."""
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op, **log)


def allgather_fn(output_tensor: Tensor, input_tensor: Tensor, group=None, async_op=False, **log):
    """DeepSpeed's helper: :func:`all_gather_into_tensor` (which every supported torch has)."""
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op, **log)


def get_all_ranks_from_group(group=None) -> list[int]:
    """The global ranks of `group` (the default group when None), in group-rank order; ``[0]`` alone."""
    if is_initialized():
        return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    _alone("get_all_ranks_from_group", group)
    return [0]


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    """True: :func:`all_reduce_coalesced` works on every backend (one flat all-reduce)."""
    return True


def has_coalescing_manager() -> bool:
    """Whether this torch has ``distributed_c10d._coalescing_manager`` (DeepSpeed's check)."""
    return hasattr(dist.distributed_c10d, "_coalescing_manager")


# --- point to point -------------------------------------------------------------------------


def _no_peer(what: str, group) -> None:
    if _alone(what, group):
        raise RuntimeError(f"{what}: a single process without a process group has no peer to talk to")


@_timed
def send(tensor: Tensor, dst: int, group=None, tag: int = 0) -> None:
    _no_peer("send", group)
    return dist.send(tensor, dst, group=group, tag=tag)


@_timed
def recv(tensor: Tensor, src: int | None = None, group=None, tag: int = 0) -> int:
    _no_peer("recv", group)
    return dist.recv(tensor, src, group=group, tag=tag)


@_timed
def isend(tensor: Tensor, dst: int, group=None, tag: int = 0):
    _no_peer("isend", group)
    return dist.isend(tensor, dst, group=group, tag=tag)


@_timed
def irecv(tensor: Tensor, src: int | None = None, group=None, tag: int = 0):
    _no_peer("irecv", group)
    return dist.irecv(tensor, src, group=group, tag=tag)
