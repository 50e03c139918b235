"""The data-parallel group's collectives, asynchronous and recorded.

Every collective goes through :class:`Comm`, which keeps a record of what it
launched, when, how many bytes, and when it finished: the engine's overlap
figures and the tests' overlap assertions are read from it. With one process
and no process group the collectives are local copies, so single-process
training needs no ``init_process_group``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from fastzero.comm.logger import comms_logger

# torch 2.13 renamed the tensor collectives; older torch has only the old names
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _check_split(op: str, whole: tuple[str, Tensor], part: tuple[str, Tensor], world: int) -> None:
    """`whole` (a name, a tensor) must be `world` times `part`, both contiguous, of one dtype."""
    (wn, w), (pn, p) = whole, part
    if w.numel() != world * p.numel() or not (w.is_contiguous() and p.is_contiguous()):
        raise ValueError(
            f"{op}: the {wn} ({w.numel()} elements) must be {world} times the {pn} ({p.numel()}), both contiguous"
        )
    if w.dtype != p.dtype:
        raise TypeError(f"{op}: the {wn} is {w.dtype} and the {pn} {p.dtype}; give one dtype")


def reduce_scatter_by_all_to_all(out: Tensor, inp: Tensor, group=None, async_op: bool = False):
    """A reduce-scatter as an all-to-all plus a local sum: rank r's `out` is
    the sum over ranks, in rank order, of each rank's r-th chunk of `inp`.
    For Gloo, whose own reduce-scatter took 1.3-3.8x as long as this on 2-4
    ranks at 1-32 MB (the same bytes cross: (w - 1) / w of `inp` per rank),
    docs/zero.md. Returns (work, finish): `out` holds the sum once
    ``finish()`` has run after ``work.wait()`` (work is None without
    async_op, when it has already run)."""
    world = dist.get_world_size(group)
    _check_split("reduce-scatter", ("input", inp), ("output", out), world)
    if out.numel() == 0:  # nothing to send on any rank (the sizes match on every rank)
        return None, lambda: None
    recv = torch.empty_like(inp)
    # bytes only cross, so any dtype goes as bytes (Gloo's all-to-all lacks some dtypes)
    work = dist.all_to_all_single(
        recv.view(-1).view(torch.uint8), inp.view(-1).view(torch.uint8), group=group, async_op=async_op
    )

    def finish() -> None:
        rows = recv.view(world, -1)
        dest = out.view(-1)
        torch.add(rows[0], rows[1], out=dest)
        for j in range(2, world):
            dest.add_(rows[j])

    if not async_op:
        finish()
        return None, lambda: None
    return work, finish


class _Exchange:
    """Point-to-point sends and receives waited on as one work."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> bool:
        while self.works:  # each once: waiting on a finished Gloo receive again would wait for another
            self.works[0].wait()
            self.works.pop(0)
        return True

    def __del__(self) -> None:
        # dropped unwaited (an engine discarded with its gathers in flight): waited here, as freeing a receive
        # early would leave its peer's bytes nowhere to land. Short: every peer posts its side at launch
        try:
            self.wait()
        except Exception:  # the group is gone (destroyed, a peer died): nothing left to keep
            pass


_tags: dict[str, int] = {}  # group name -> exchanges launched on it by this process


def _next_tag(group) -> int:
    """A tag of its own for each exchange on `group`, the same on every rank
    (each rank launches the group's exchanges in the same order, as
    collectives require): with several gathers in flight on one group, a
    send can only match the receive it was meant for. Above the small tags
    users' own sends and receives pick."""
    name = (group or dist.group.WORLD).group_name
    n = _tags.get(name, 0)
    _tags[name] = n + 1
    return (1 << 28) + n % (1 << 27)


def all_gather_by_send_recv(out: Tensor, inp: Tensor, group=None, async_op: bool = False):
    """An all-gather as sends and receives: rank r's `inp` goes straight to
    every other rank, into chunk r of its `out` (`inp` may be this rank's
    chunk of `out` itself). For Gloo, whose all_gather_into_tensor took
    1.1-2.5x as long as this on 2-4 ranks at 1-32 MB, with the same bytes
    sent (docs/zero.md). Returns a work to wait on with async_op, else None."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_split("all-gather", ("output", out), ("input", inp), world)
    if inp.numel() == 0:  # nothing to send on any rank (the sizes match on every rank)
        return _Exchange([]) if async_op else None
    # bytes only cross, so any dtype goes as bytes
    rows, mine = out.view(-1).view(torch.uint8).view(world, -1), inp.view(-1).view(torch.uint8)
    if rows[rank].data_ptr() != mine.data_ptr():
        rows[rank].copy_(mine)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(world)  # torch's peers are global
    tag = _next_tag(group)
    works = []
    for k in range(1, world):  # rank r sends to r + k while it receives from r - k: every link busy at once
        dst, src = (rank + k) % world, (rank - k) % world
        works.append(dist.isend(mine, ranks[dst], group=group, tag=tag))
        works.append(dist.irecv(rows[src], ranks[src], group=group, tag=tag))
    work = _Exchange(works)
    if not async_op:
        work.wait()
        return None
    return work


@dataclass
class CommEvent:
    op: str  # "all_reduce", "reduce_scatter", "all_gather", "broadcast"
    tag: str  # who asked: "grad", "param", "norm", ...
    nbytes: int  # bytes of the input tensor
    launched: float  # time.perf_counter() at launch
    done: float | None = None  # when the collective completed (seen by a callback or the wait)
    world_size: int = 1
    waited: float = 0.0  # seconds callers spent blocked in Handle.wait on it
    wait_site: str = ""  # who waited first ("forward:<module>", "step", ...; "wait" unnamed; "" nobody yet)
    ranks: tuple[int, ...] = ()  # the group's global ranks, in group-rank order (which links the bytes cross)
    device: str = "cpu"  # where the tensor lives ("cuda": `done` is when the work was queued, not finished)

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends with the bandwidth-optimal (ring) algorithm:
        what compressing a collective saves is counted in these."""
        w = self.world_size
        if w == 1:
            return 0.0
        return (
            self.nbytes
            * {
                "all_reduce": 2 * (w - 1) / w,
                "reduce_scatter": (w - 1) / w,
                "all_to_all": (w - 1) / w,
                "all_gather": w - 1,
                "broadcast": 1,
            }[self.op]
        )


# the record's ops under deepspeed.comm's names, for the communication logger
_LOG_NAMES = {
    "reduce_scatter": "reduce_scatter_tensor",
    "all_gather": "all_gather_into_tensor",
    "all_to_all": "all_to_all_single",
}


def _log(event: CommEvent, synchronize: bool = False) -> None:
    """A finished collective to the communication logger (fastzero.comm.logger), if it wants it: timed from
    launch to completion (`synchronize`: a device collective, whose end is a torch.cuda.synchronize(), as in
    DeepSpeed's logger), its message the bytes one rank puts in (a reduce-scatter's chunk)."""
    name = _LOG_NAMES.get(event.op, event.op)
    if not comms_logger.wants(name):
        return
    if synchronize:
        torch.cuda.synchronize()
    end = time.perf_counter() if synchronize else event.done
    size = event.nbytes // event.world_size if event.op == "reduce_scatter" else event.nbytes
    record = comms_logger.record_name(name, f"fastzero:{event.tag}" if event.tag else "fastzero")
    comms_logger.append(name, record, (end - event.launched) * 1e3, size, event.world_size)


class Handle:
    """An in-flight collective; :meth:`wait` blocks until it is done."""

    def __init__(self, work, event: CommEvent, finish=None) -> None:
        self.work, self.event = work, event
        self._finish = finish  # run once, right after the work completes (a reduce-scatter's local sum)
        self._logged = False  # a device collective goes to the communication logger at its first wait
        if work is None:
            event.done = event.launched
        else:
            try:  # completion time as the backend reports it, not when we happen to wait
                work.get_future().add_done_callback(lambda _f: self._mark())
            except (RuntimeError, AttributeError):
                pass

    def _mark(self) -> None:
        if self.event.done is None:
            self.event.done = time.perf_counter()
            if self.event.device == "cpu":  # a device collective's future completes when it is queued
                _log(self.event)

    def wait(self, site: str = "") -> None:
        """Blocks until done; the time blocked is added to the event's
        ``waited``, and the first waiter's `site` ("wait" when unnamed) is its ``wait_site``."""
        if not self.event.wait_site:
            self.event.wait_site = site or "wait"
        if self.work is not None:
            start = time.perf_counter()
            self.work.wait()
            self._mark()
            if self.event.device == "cuda" and not self._logged:
                self._logged = True
                _log(self.event, synchronize=True)
            if self._finish is not None:
                finish, self._finish = self._finish, None
                finish()
            self.event.waited += time.perf_counter() - start


def new_groups(mine: list[list[int]], backend: str | None = None) -> list:
    """Process groups of the global ranks in each list of `mine` (the groups
    this rank belongs to), created collectively: every rank of the world
    calls it, each with its own lists; one all-gather of the lists over the
    world, then every distinct list is created in the same order everywhere,
    as ``new_group`` requires. Returns this rank's groups, in `mine`'s order."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [list(m) for m in mine])
    created = {}
    for ranks in dict.fromkeys(tuple(m) for lists in everyone for m in lists):
        created[ranks] = dist.new_group(list(ranks), backend=backend)
    return [created[tuple(m)] for m in mine]


def gloo_twin(group=None):
    """A Gloo group of the same ranks as `group` (None: the world), for
    host-side agreement that must not wait behind device collectives. Every
    rank calls it."""
    if group is None:
        return dist.new_group(backend="gloo")
    return new_groups([dist.get_process_group_ranks(group)], backend="gloo")[0]


def cross_node_bytes(event: CommEvent, node_of: dict[int, int]) -> float:
    """Bytes this rank receives from ranks on other nodes for `event`, with
    the direct algorithm (each piece sent straight from the rank that has it
    to the rank that needs it; `node_of`: global rank -> node): all-gather,
    one input from each other-node rank; reduce-scatter and all-to-all, one
    world-th of the input from each; all-reduce, twice that (reduce-scatter
    then all-gather); broadcast, the tensor if the root is elsewhere. What a
    hierarchical collective saves on slow links is counted in these."""
    ranks = event.ranks or tuple(range(event.world_size))
    w = len(ranks)
    if w <= 1:
        return 0.0
    me = dist.get_rank() if dist.is_available() and dist.is_initialized() else ranks[0]
    others = sum(node_of.get(r) != node_of.get(me) for r in ranks)
    per_peer = {"all_gather": 1.0, "reduce_scatter": 1 / w, "all_to_all": 1 / w, "all_reduce": 2 / w}
    if event.op == "broadcast":
        return float(event.nbytes) * others / max(1, w - 1)
    return event.nbytes * per_peer[event.op] * others


class Comm:
    """Collectives over `group` (the default process group when None)."""

    def __init__(self, group=None, record_limit: int = 4096) -> None:
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        # the global ranks of the group, in group-rank order
        self.ranks = dist.get_process_group_ranks(group) if self.distributed and group is not None else None
        self.ranks = tuple(self.ranks or range(self.world_size))
        backend = dist.get_backend(group) if self.distributed else None
        nccl = backend == "nccl"
        self.gloo = backend == "gloo"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.record: deque[CommEvent] = deque(maxlen=record_limit)  # the latest collectives

    def _event(self, op: str, tag: str, t: Tensor) -> CommEvent:
        nbytes = t.numel() * t.element_size()
        event = CommEvent(
            op, tag, nbytes, time.perf_counter(), world_size=self.world_size, ranks=self.ranks, device=t.device.type
        )
        self.record.append(event)
        return event

    def _local(self) -> bool:
        return not self.distributed or self.world_size == 1

    def all_reduce(self, t: Tensor, tag: str = "", op=dist.ReduceOp.SUM) -> Handle:
        event = self._event("all_reduce", tag, t)
        if self._local():
            return Handle(None, event)
        return Handle(dist.all_reduce(t, op=op, group=self.group, async_op=True), event)

    def reduce_scatter(self, out: Tensor, inp: Tensor, tag: str = "") -> Handle:
        """Sums `inp` (world_size * out.numel() elements) over ranks; rank r
        gets the r-th chunk of the sum in `out`. Over Gloo: an all-to-all and
        a sum in rank order when the handle is waited on
        (:func:`reduce_scatter_by_all_to_all`)."""
        event = self._event("reduce_scatter", tag, inp)
        if self._local():
            out.copy_(inp)
            return Handle(None, event)
        if self.gloo:
            work, finish = reduce_scatter_by_all_to_all(out, inp, self.group, async_op=True)
            return Handle(work, event, finish)
        return Handle(_reduce_scatter(out, inp, group=self.group, async_op=True), event)

    def all_gather(self, out: Tensor, inp: Tensor, tag: str = "") -> Handle:
        """Concatenates every rank's `inp` into `out`; `inp` may be this
        rank's chunk of `out` itself. Over Gloo: sends and receives
        (:func:`all_gather_by_send_recv`), whose completion is seen when
        the handle is waited on (Gloo's point-to-point works have no future)."""
        event = self._event("all_gather", tag, inp)
        if self._local():
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return Handle(None, event)
        if self.gloo:
            return Handle(all_gather_by_send_recv(out, inp, self.group, async_op=True), event)
        return Handle(_all_gather(out, inp, group=self.group, async_op=True), event)

    def all_to_all(self, out: Tensor, inp: Tensor, tag: str = "") -> Handle:
        """Rank r's `inp` chunk j (world_size equal chunks) lands in rank j's
        `out` chunk r."""
        event = self._event("all_to_all", tag, inp)
        if self._local():
            out.copy_(inp)
            return Handle(None, event)
        return Handle(dist.all_to_all_single(out, inp, group=self.group, async_op=True), event)

    def broadcast(self, t: Tensor, src: int = 0, tag: str = "") -> Handle:
        """`src`'s `t` to every rank; `src` is a rank in this Comm's group (as :attr:`rank` is)."""
        event = self._event("broadcast", tag, t)
        if self._local():
            return Handle(None, event)
        root = src if self.group is None else dist.get_global_rank(self.group, src)  # torch's src is global
        return Handle(dist.broadcast(t, src=root, group=self.group, async_op=True), event)

    def all_reduce_scalars(self, values: list[float], op=dist.ReduceOp.SUM, tag: str = "") -> list[float]:
        """A few numbers summed (or max-ed) over ranks, in one small collective."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.all_reduce(t, tag, op).wait()
        return t.tolist()

    def all_gather_objects(self, obj) -> list:
        """Every rank's `obj` (any picklable value), in rank order: for small
        control data (agreement checks, error reports), not tensors."""
        if self._local():
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if not self._local():
            dist.barrier(group=self.group)

    def events(self, op: str | None = None, tag: str | None = None) -> list[CommEvent]:
        return [e for e in self.record if (op is None or e.op == op) and (tag is None or e.tag == tag)]
