"""ZeRO stage 3: parameters partitioned too.

Each trainable param is a :class:`Unit`: this rank keeps one chunk of it (a
view of its group's contiguous shard buffer), and the whole param exists only
while a module that uses it runs: :class:`ParamFetcher`'s module hooks
all-gather a module's params before its forward (and again before its
backward), asynchronously and all in flight together, and release them
after. Params smaller than ``stage3_param_persistence_threshold`` stay whole.

After the first micro-batch has recorded the order in which units are
needed, the fetcher prefetches the next ones while the current module
computes (up to ``stage3_prefetch_bucket_size`` elements in flight and
``stage3_max_live_parameters`` gathered), and keeps a released unit that is
needed again within ``stage3_max_reuse_distance`` elements. When the order
changes (another code path), it stops prefetching and records again.

Gradients are reduce-scattered into each unit's chunk of the gradient shard
as backward produces them (the stage 2 reducer, one per param, sharing one
buffer pool); the param is released as soon as its gradient is out.

After the step, the persistent params (whole on every rank) are refreshed
from every rank's updated chunks by one flat all-gather per dtype over all
of them (:func:`refresh_persistent`), not one per param: a model with
hundreds of LayerNorms would otherwise pay a collective's latency hundreds
of times.

:class:`Stage3Group` implements :class:`~fastzero.runtime.groups.ZeroGroup`.
The marks stage 3 leaves on the user's params and modules (a param's chunk
from ``fastzero.zero.Init``, a module's external params, its fetcher) are
read and written only through the helpers at the end of this module.
"""

from __future__ import annotations

import itertools
import re
import time
import zlib
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor

from fastzero.comm import BufferPool, Comm, FlatLayout, GradQuant, GradReducer, Handle, QuantFormat, gather_chunks
from fastzero.runtime.groups import Piece, ZeroGroup

WHOLE = 1 << 62  # one bucket per param
# what torch says when an op meets a released param (empty, 1-D): a zero-size dim, or a 1-D weight
EMPTY_PARAM_ERROR = re.compile(r"\(0\)|\[0\]|\b0x\d|\dx0\b|got 1-D|must be 2-D|size 0\b")


class Stage3Divergence(RuntimeError):
    """The ranks ran different modules at stage 3 (a branch that differs across ranks)."""


class ZeroParamStatus(Enum):
    """DeepSpeed's ``deepspeed.zero.ZeroParamStatus``: a partitioned param's ``ds_status``."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


_DS_IDS = itertools.count()


def mark_ds(p: Tensor, shard: Tensor, shape: torch.Size, status: ZeroParamStatus) -> None:
    """DeepSpeed's attributes of a ZeRO-3 param, which scripts and libraries
    read (Hugging Face counts a partitioned model's params as
    ``p.ds_numel if hasattr(p, "ds_tensor") else p.numel()``): its whole
    size and shape, this rank's chunk, an id, and whether it is whole now."""
    p.ds_numel, p.ds_shape, p.ds_tensor, p.ds_status = shape.numel(), shape, shard, status
    if not hasattr(p, "ds_id"):
        p.ds_id = next(_DS_IDS)


def released_like(p: Tensor) -> Tensor:
    return torch.empty(0, dtype=p.dtype, device=p.device)


class _Frozen:
    """What the fetcher's two kinds of frozen unit share: `full`, the whole
    param, made on demand and dropped at release, where an edit made while
    it was whole (``load_state_dict``, ``GatheredParameters``: torch bumps
    the version counter) is kept by :meth:`_keep_edit`."""

    persistent = False
    exact = True
    handle = None
    full: Tensor | None
    _version: int

    @property
    def gathered(self) -> bool:
        return self.full is not None

    def release(self) -> None:
        if self.full is None:
            return
        self.wait()
        if self.full._version != self._version:
            self._keep_edit()
        self.param.data = released_like(self.param)
        self.full = None

    def invalidate(self) -> None:
        pass


class FrozenUnit(_Frozen):
    """A frozen param kept as int8 codes (``zero_quantized_nontrainable_weights``):
    whole on every rank, not partitioned, its values the codes' from then on.
    The fetcher treats it as a :class:`Unit` whose gather is a local
    dequantization into `full`; an edit is quantized back at release."""

    def __init__(self, param: Tensor, name: str, fmt: QuantFormat) -> None:
        self.param, self.name, self.shape, self.fmt = param, name, param.shape, fmt
        self.numel = param.numel()
        self.packed = torch.empty(fmt.packed_bytes(self.numel), dtype=torch.uint8, device=param.device)
        fmt.pack(param.detach().reshape(-1), self.packed)
        self.full = None
        self.refs, self._version = 0, 0
        param.data = released_like(param)

    def start_gather(self, exact: bool = False) -> None:
        if self.full is None:
            self.full = torch.empty(self.numel, dtype=self.param.dtype, device=self.param.device)
            self.refresh()

    def refresh(self, exact: bool = False) -> None:
        self.fmt.dequantize(self.packed, self.full)
        self._version = self.full._version
        return None  # nothing in flight

    def wait(self) -> None:
        if self.full is not None:
            self.param.data = self.full.view(self.shape)

    def _keep_edit(self) -> None:
        self.fmt.pack(self.full, self.packed)


class FrozenShard(_Frozen):
    """A frozen param that ``fastzero.zero.Init`` partitioned: it stays
    partitioned (frozen weights are often the bulk of a model built under
    Init, as in fine-tuning adapters), and the fetcher gathers it whole and
    exact for the modules that use it and releases it after, as it does a
    trained one; it has no gradient and no optimizer state. An edit is kept
    as each rank's chunk of it, at release."""

    def __init__(self, param: Tensor, name: str, comm: Comm, shard: Tensor) -> None:
        self.param, self.name, self.comm = param, name, comm
        self.shard = shard.to(device=param.device, dtype=param.dtype)  # the engine's dtype, as the trained ones'
        self.shape = logical_shape(param)
        self.numel = shard.numel() * comm.world_size
        self.full = None
        self.handle = None
        self.refs, self._version = 0, 0
        mark_ds(param, self.shard, self.shape, ZeroParamStatus.NOT_AVAILABLE)

    def start_gather(self, exact: bool = False) -> None:
        if self.full is None:
            self.full = torch.empty(self.numel, dtype=self.shard.dtype, device=self.shard.device)
            self.handle = self.refresh()
            self.param.ds_status = ZeroParamStatus.INFLIGHT

    def refresh(self, exact: bool = False):
        return self.comm.all_gather(self.full, self.shard, f"param:{self.name}")

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
            self._version = self.full._version
            self.param.data = self.full[: self.shape.numel()].view(self.shape)
            self.param.ds_status = ZeroParamStatus.AVAILABLE

    def _keep_edit(self) -> None:
        size = self.shard.numel()
        self.shard.copy_(self.full[self.comm.rank * size : (self.comm.rank + 1) * size])

    def release(self) -> None:
        super().release()
        self.param.ds_status = ZeroParamStatus.NOT_AVAILABLE

    def nbytes(self) -> int:
        return self.shard.numel() * self.shard.element_size() + (0 if self.full is None else self.full.nbytes)


def check_init_ranks(name: str, p: Tensor, comm: Comm) -> None:
    """A param ``fastzero.zero.Init`` partitioned over other ranks than the engine's data-parallel group is refused."""
    ranks = p.__dict__.pop("_fz_init_ranks", None)
    if ranks is not None and list(ranks) != list(comm.ranks):
        raise ValueError(
            f"{name} was partitioned by fastzero.zero.Init over ranks {list(ranks)}, but the engine "
            f"partitions over its data-parallel group, ranks {list(comm.ranks)}: build the model under "
            "zero.Init over the same group (make the topology current first, or pass Init(mpu=...) or "
            "data_parallel_group=)"
        )


@dataclass(frozen=True)
class ZeroPP:
    """ZeRO++ at stage 3: `weights` (qwZ: gathers in int8 codes), `grads`
    (qgZ: the reduce-scatter as an all-to-all of codes), `hpz` (hpZ: the
    group of ranks a param's secondary pieces are spread over); None: off."""

    weights: QuantFormat | None = None
    grads: GradQuant | None = None
    hpz: Comm | None = None

    def comms(self) -> list[Comm]:
        """The groups of their own these parts communicate over."""
        h = self.grads.hierarchy if self.grads is not None else None
        return [c for c in (self.hpz, h and h.intra, h and h.inter) if c is not None]


class Unit:
    """One param, partitioned: `shard` is this rank's chunk, `full` the
    gathered param (None while released)."""

    def __init__(
        self,
        param: Tensor,
        name: str,
        shape: torch.Size,
        comm: Comm,
        shard: Tensor,
        grad_shard: Tensor,
        pool: BufferPool,
        persistent: bool,
        pre_scale: float = 1.0,
        zeropp: ZeroPP | None = None,
    ) -> None:
        self.param, self.name, self.shape, self.comm = param, name, shape, comm
        self.device = grad_shard.device  # where the whole param lives (the shard may be offloaded to the CPU)
        self.layout = FlatLayout([shape.numel()], comm.world_size, WHOLE)
        self.numel = self.layout.total  # elements while gathered (padded)
        self.shard, self.grad_shard, self.persistent = shard, grad_shard, persistent
        zeropp = zeropp or ZeroPP()
        self.reducer = GradReducer(
            comm,
            self.layout,
            "reduce_scatter",
            shard=grad_shard,
            pool=pool,
            comm_dtype=pool.dtype,
            pre_scale=pre_scale,
            quant=zeropp.grads,
            key=zlib.crc32(name.encode()),
        )
        # qwZ: gathers for a forward or backward travel as int8 codes (persistent units are refreshed exactly)
        self.weight_quant = None if persistent else zeropp.weights
        # hpZ: this rank's piece of the param over its group, kept when the step's first gather is released, so
        # that the step's later gathers stay inside the group
        self.hpz = None if persistent else zeropp.hpz
        self.secondary: Tensor | None = None
        self.secondary_valid = False
        self.full: Tensor | None = None
        self.handle = None
        self._fill_secondary = False
        self.exact = True  # `full` holds the shards' values bit for bit (not dequantized codes)
        self.refs = 0  # forwards running that use it

    @property
    def gathered(self) -> bool:
        return self.full is not None

    def start_gather(self, exact: bool = False) -> None:
        """Launches the gather into `full` (see :meth:`refresh`), if not whole already."""
        if self.full is None:
            self.full = torch.empty(self.numel, dtype=self.shard.dtype, device=self.device)
            self.handle = self.refresh(exact)
            self.param.ds_status = ZeroParamStatus.INFLIGHT

    def refresh(self, exact: bool = False):
        """Gathers the param into `full`: from the hpZ group's pieces when
        they hold this step's values, else from every rank's chunk (an
        offloaded chunk travels to the device first), as int8 codes with qwZ
        unless `exact` (the shards bit for bit: for readers of the weights,
        never the secondary pieces)."""
        tag = f"param:{self.name}"
        if not exact and self.hpz is not None and self.secondary_valid:
            self.exact = self.weight_quant is None  # the pieces hold what the step's first gather brought
            return self.hpz.all_gather(self.full, self.secondary, tag)
        src = self.shard if self.shard.device == self.device else self.shard.to(self.device, non_blocking=True)
        fmt = None if exact else self.weight_quant
        self.exact = fmt is None or self.comm.world_size == 1
        self._fill_secondary = not exact and self.hpz is not None
        return gather_chunks(self.comm, self.full, src, tag, fmt)

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
            self.param.data = self.full[: self.shape.numel()].view(self.shape)
            self.param.ds_status = ZeroParamStatus.AVAILABLE

    def invalidate(self) -> None:
        """The shards changed (a step, a load): the hpZ pieces are stale."""
        self.secondary_valid = self._fill_secondary = False

    def release(self) -> None:
        if self.full is not None and not self.persistent:
            self.wait()  # never drop a buffer a collective still writes
            if self._fill_secondary:  # hpZ: keep this rank's piece of what the step's first gather brought
                self._fill_secondary = False
                size = self.numel // self.hpz.world_size
                if self.secondary is None:
                    self.secondary = torch.empty(size, dtype=self.full.dtype, device=self.device)
                self.secondary.copy_(self.full[self.hpz.rank * size : (self.hpz.rank + 1) * size])
                self.secondary_valid = True
            self.param.data = released_like(self.param)
            self.param.ds_status = ZeroParamStatus.NOT_AVAILABLE
            self.full = None


class Stage3Group(ZeroGroup):
    """One param group at stage 3: its units, their shard and gradient
    shard buffers, and what the optimizer updates (each unit's chunk)."""

    def __init__(
        self,
        params: list[Tensor],
        names: list[str],
        *,
        comm: Comm,
        persistence_threshold: int,
        offload: bool = False,
        pin_memory: bool = False,
        comm_dtype: torch.dtype | None = None,
        pre_scale: float = 1.0,
        zeropp: ZeroPP | None = None,
    ) -> None:
        """`comm_dtype` and `pre_scale`: the gradient reduction's (see
        fastzero.comm.buckets); `zeropp`: qwZ, qgZ and hpZ (:class:`ZeroPP`)."""
        self.params, self.names, self.comm, self.stage = params, names, comm, 3
        self.shapes = [logical_shape(p) for p in params]
        self.dtype, self.device = params[0].dtype, params[0].device
        layouts = [FlatLayout([s.numel()], comm.world_size, WHOLE) for s in self.shapes]
        sizes = [lay.shard_size for lay in layouts]
        # offload_param: the shards live in CPU memory between uses
        self.offload = offload
        pin = offload and pin_memory and torch.cuda.is_available()
        self.shard = torch.zeros(sum(sizes), dtype=self.dtype, device="cpu" if offload else self.device, pin_memory=pin)
        self.grad_shard = torch.zeros(sum(sizes), dtype=self.dtype, device=self.device)
        self.pool = BufferPool(comm_dtype or self.dtype, self.device)
        self.units: list[Unit] = []
        offset = 0
        for p, name, shape, lay, size in zip(params, names, self.shapes, layouts, sizes):
            unit = Unit(
                p,
                name,
                shape,
                comm,
                self.shard[offset : offset + size],
                self.grad_shard[offset : offset + size],
                self.pool,
                persistent=shape.numel() < persistence_threshold,
                pre_scale=pre_scale,
                zeropp=zeropp,
            )
            offset += size
            self._partition(unit, lay)
            self.units.append(unit)
        self.on_released = None  # set by the fetcher: a unit's gradient is out
        self.on_changed = None  # set by the fetcher: the shards changed

    def _partition(self, unit: Unit, lay: FlatLayout) -> None:
        p = unit.param
        pre = take_init_shard(p)  # partitioned at construction by fastzero.zero.Init
        if pre is not None:
            check_init_ranks(unit.name, p, self.comm)
            unit.shard.copy_(pre)
        else:
            lo, hi = lay.buckets[0].owned(self.comm.rank)
            flat = p.detach().reshape(-1)
            n = max(0, min(hi, flat.numel()) - lo)
            unit.shard[:n].copy_(flat[lo : lo + n])
            unit.shard[n:].zero_()
        mark_ds(p, unit.shard, unit.shape, ZeroParamStatus.NOT_AVAILABLE)
        if unit.persistent:
            unit.start_gather()
            unit.wait()
        else:
            p.data = released_like(p)

    # -- the engine's interface (as FlatGroup's) --------------------------------------
    def optimizer_params(self) -> list[Tensor]:
        for u in self.units:
            u.shard.grad = u.grad_shard
        return [u.shard for u in self.units]

    def begin_backward(self, first: bool, boundary: bool) -> None:
        for u in self.units:
            u.reducer.begin(accumulate=not first)

    def grad_ready(self, i: int, p: Tensor) -> None:
        unit = self.units[i]
        if unit.reducer.active:
            unit.reducer.ready(0, p.grad)
            p.grad = None
            if unit.reducer.launched and self.on_released is not None:
                self.on_released(unit)

    def end_backward(self) -> None:
        for u in self.units:
            u.reducer.finish()

    def unreduced(self) -> bool:
        return any(p.grad is not None for p in self.params)

    def grads(self) -> Tensor:
        return self.grad_shard

    def reduced_grads(self) -> list[Tensor]:
        """Per unit (the tensors of :meth:`optimizer_params`), its reduced gradient shard."""
        return [u.grad_shard for u in self.units]

    def regather(self, i: int) -> None:
        """Param i's gathered copy, where it stays gathered (persistent),
        gathered again from every rank's shard: a collective, after this
        rank's shard of it changed alone."""
        u = self.units[i]
        if u.persistent and u.full is not None:
            u.wait()
            u.handle = u.refresh(exact=True)
            u.wait()

    def set_whole(self, i: int, value: Tensor) -> None:
        """Param i's gathered copy set to `value` where it stays gathered
        (persistent); a partitioned one is gathered from the shards when next used."""
        u = self.units[i]
        if u.persistent and u.full is not None:
            u.wait()
            u.full[: u.shape.numel()].copy_(value.reshape(-1))

    def zero_grads(self) -> None:
        pass  # the first micro-batch's reduce-scatter overwrites the shard

    def gather(self) -> list[Handle]:
        """After the step: persistent params are refreshed from every rank's
        chunk (:func:`refresh_persistent`); the others are gathered when next used."""
        return refresh_persistent([self])

    def invalidate(self) -> None:
        """The shards changed (the step, a checkpoint load, a reload): what
        was kept of the old values is stale: hpZ's secondary pieces, and any
        param still whole from before (the fetcher releases or regathers it)."""
        for u in self.units:
            u.invalidate()
        if self.on_changed is not None:
            self.on_changed(self)

    def pieces_in(self, optimizer, opt_params, saved, keys=None) -> None:
        super().pieces_in(optimizer, opt_params, saved, keys)
        self.invalidate()

    def owned(self, opt_params: list[Tensor]) -> list[Piece]:
        """Each unit's chunk (one optimizer tensor per unit)."""
        return [
            Piece(u.name, s.lo, s.hi, opt, s.shard_offset)
            for u, opt in zip(self.units, opt_params)
            for s in u.layout.segments(self.comm.rank)
        ]

    def reload_from_params(
        self, optimizer: torch.optim.Optimizer, opt_params: list[Tensor], params: list[Tensor]
    ) -> None:
        """As :meth:`ZeroGroup.reload_from_params` (the params gathered);
        a unit that stays gathered (persistent, or held) gets the values in
        its whole buffer too, which its param views again."""
        super().reload_from_params(optimizer, opt_params, params)
        self.invalidate()
        by_param = {id(u.param): u for u in self.units}
        with torch.no_grad():
            for p in params:
                u = by_param[id(p)]
                if u.full is not None and p.data_ptr() != u.full.data_ptr():  # p.data was replaced
                    u.wait()
                    u.full[: u.shape.numel()].copy_(p.detach().reshape(-1))
                    p.data = u.full[: u.shape.numel()].view(u.shape)

    def rank_state(self) -> Any:
        return None  # every state is a piece of a logical param

    def load_rank_state(self, state: Any) -> None:
        if state is not None:
            raise ValueError("stage 3 groups keep no per-rank state")

    def memory(self) -> dict[str, int]:
        nbytes = lambda t: t.numel() * t.element_size()
        held = sum(nbytes(u.full) for u in self.units if u.full is not None)
        out = dict(params=held, grads=nbytes(self.grad_shard), grad_buckets=self.pool.nbytes())
        secondary = sum(nbytes(u.secondary) for u in self.units if u.secondary is not None)
        if secondary:  # hpZ's pieces, each a 1/group-size slice of its param
            out["hpz_params"] = secondary
        if self.offload:
            out["offload_params"] = nbytes(self.shard)
        else:
            out["params"] += nbytes(self.shard)
        return out


class PersistentRefresh:
    """One flat all-gather of persistent units in flight: rank r's chunks of
    every unit back to back (`per_rank` elements) land as row r of `recv`;
    :meth:`wait` then copies each unit's column of chunks into its whole
    buffer (which its param views)."""

    def __init__(self, handle: Handle, recv: Tensor, units: list[Unit], per_rank: int) -> None:
        self.handle, self.recv, self.units, self.per_rank = handle, recv, units, per_rank
        self.event = handle.event

    def wait(self, site: str = "") -> None:
        if self.handle is None:
            return
        self.handle.wait(site)
        self.handle = None
        rows = self.recv.view(-1, self.per_rank)
        offset = 0
        for u in self.units:
            chunk = u.shard.numel()
            u.full.view(-1, chunk).copy_(rows[:, offset : offset + chunk])
            offset += chunk
        self.recv = None


def refresh_persistent(groups: list[Stage3Group]) -> list[PersistentRefresh]:
    """After the step (or a load): what was kept of the old shards is
    dropped (:meth:`Stage3Group.invalidate`), and every persistent unit of
    `groups` is refreshed by one all-gather per (dtype, device) over all of
    them, tagged ``param:persistent``. Wait on what it returns."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[Unit]] = {}
    for g in groups:
        g.invalidate()
        for u in g.units:
            if u.persistent:
                u.wait()  # its whole buffer is written below
                by_kind.setdefault((u.shard.dtype, u.device), []).append(u)
    out = []
    for (dtype, device), units in by_kind.items():
        comm = units[0].comm
        send = torch.cat([u.shard.to(device, non_blocking=True) for u in units])  # offloaded chunks come over
        recv = torch.empty(comm.world_size * send.numel(), dtype=dtype, device=device)
        out.append(PersistentRefresh(comm.all_gather(recv, send, "param:persistent"), recv, units, send.numel()))
    return out


class ParamFetcher:
    """Module hooks that gather each module's params before it runs and
    release them after, with the recorded order's prefetch."""

    def __init__(
        self,
        module: torch.nn.Module,
        groups: list[Stage3Group],
        *,
        prefetch_elements: int,
        max_live: int,
        max_reuse: int,
        check: Comm | None = None,
        frozen: list[FrozenUnit] = (),
    ) -> None:
        """`frozen`: frozen params kept as codes, gathered (dequantized) and
        released as the partitioned ones are."""
        self.prefetch_elements, self.max_live, self.max_reuse = prefetch_elements, max_live, max_reuse
        self.root = module
        # ranks must gather the same params in the same order: `check` (a host-side group) agrees on each forward
        self.check = check if check is not None and check.world_size > 1 else None
        self.index = {m: i for i, m in enumerate(module.modules())}
        self.unit_of = {id(u.param): u for g in groups for u in g.units}
        self.frozen = list(frozen)
        self.unit_of.update({id(u.param): u for u in self.frozen})
        for g in groups:
            g.on_released = self._released
            g.on_changed = self._shards_changed
        self.needs: dict[torch.nn.Module, list[Unit]] = {}
        self.names = {m: n for n, m in module.named_modules()}
        for m in module.modules():
            set_fetcher(m, self)  # for fastzero.zero.register_external_parameter after initialize
            used = [*m.parameters(recurse=False), *external_params(m)]
            direct = [self.unit_of.get(id(p)) for p in used]
            units = list({id(u): u for u in direct if u is not None and not u.persistent}.values())
            if units:
                self._hook(m, units)
        self.trace: list[Unit] | None = None  # the units in the order one micro-batch needed them
        self.recording: list[Unit] | None = []  # None: this micro-batch's order is not recorded
        self.cursor = 0
        self.retraced = 0  # how often the order changed
        self.live = self.peak_live = 0  # elements of gathered (or in-flight) non-persistent params
        self.active: list[torch.nn.Module] = []
        self.timeline: list[tuple[float, str, str]] = []  # (time, "forward_end", module name), for tests
        self.record_timeline = False

    def _hook(self, m: torch.nn.Module, units: list[Unit]) -> None:
        if m in self.needs:
            self.needs[m] = list({id(u): u for u in self.needs[m] + units}.values())
            return
        self.needs[m] = units
        m.register_forward_pre_hook(lambda mod, _args: self._before(mod, forward=True))
        m.register_forward_hook(lambda mod, _args, _out: self._after_forward(mod))
        m.register_full_backward_pre_hook(lambda mod, _grad: self._before(mod, forward=False))

    def register_external(self, module: torch.nn.Module, param: Tensor) -> None:
        unit = self.unit_of.get(id(param))
        if unit is None:
            raise ValueError("register_external_parameter: the param is not one the engine partitions")
        if not unit.persistent:
            self._hook(module, [unit])

    def hint(self, exc: BaseException) -> str | None:
        """For an error raised inside a forward that looks like the use of a
        released (empty) param: the module whose forward was running, the
        partitioned params inside it that were not gathered for it (a param
        used outside the forward of the module that owns it is empty there),
        and the fix. None for any other error (a shape error of the model's
        own, a dead peer)."""
        if isinstance(exc, Stage3Divergence) or not EMPTY_PARAM_ERROR.search(str(exc)):
            return None
        active = self.active[-1] if self.active else self.root
        own = {id(u) for u in self.needs.get(active, [])}
        inside = {id(p) for p in active.parameters()}
        names = [u.name for u in self.unit_of.values() if id(u.param) in inside and id(u) not in own and not u.gathered]
        if not names:
            return None
        where = self.names.get(active, "") or "the model"
        return (
            f"fastzero ZeRO stage 3: this error came from the forward of {where!r}. If it uses a param outside the "
            f"forward of the module that owns it (released params are empty there), e.g. "
            f"{', '.join(names[:5]) or 'a param of another module'}, register it with "
            "engine.register_external_parameter(module, param) so it is gathered for that module."
        )

    # -- gathering --------------------------------------------------------------------
    def _need(self, unit: Unit) -> None:
        """Follows (or records) the order, then prefetches what comes next."""
        if self.trace is None:
            if self.recording is not None:
                self.recording.append(unit)
            return
        if self.cursor < len(self.trace) and self.trace[self.cursor] is unit:
            self.cursor += 1
            self._prefetch()
        else:  # another code path: stop prefetching; the next micro-batch records afresh
            self.trace = self.recording = None
            self.retraced += 1

    def _prefetch(self) -> None:
        budget = self.prefetch_elements
        for u in self.trace[self.cursor :]:
            if budget <= 0:
                break
            if u.gathered:
                continue
            if self.live + u.numel > self.max_live:
                break
            u.start_gather()
            self._count(u.numel)
            budget -= u.numel

    def _count(self, delta: int) -> None:
        self.live += delta
        self.peak_live = max(self.peak_live, self.live)

    def _fetch(self, units: list[Unit]) -> None:
        for u in units:
            self._need(u)
        for u in units:
            if not u.gathered:
                self._make_room(u.numel)
                u.start_gather()
                self._count(u.numel)
        for u in units:
            u.wait()

    def _make_room(self, numel: int) -> None:
        """Over the live limit: release kept units that no forward uses."""
        for u in {id(u): u for g in self.needs.values() for u in g}.values():
            if self.live + numel <= self.max_live:
                return
            if u.gathered and u.refs == 0 and u.handle is None and all(u not in self.needs[m] for m in self.active):
                self._release(u)

    def _release(self, u: Unit) -> None:
        if u.gathered and not u.persistent:  # persistent params stay whole and were never counted as live
            u.release()
            self._count(-u.numel)

    def _reused_soon(self, u: Unit) -> bool:
        if self.trace is None:
            return False
        distance = 0
        for v in self.trace[self.cursor :]:
            if v is u:
                return distance < self.max_reuse and self.live <= self.max_live
            distance += v.numel
        return False

    # -- agreement across ranks -----------------------------------------------------------
    def agree(self, m: torch.nn.Module | None) -> None:
        """Every rank is about to gather for the forward of the same module
        (`m`), or to start backward (None): one tiny host-side all-reduce.
        A data-dependent branch that differs across ranks would otherwise
        issue mismatched all-gathers (a Gloo abort, an NCCL hang); here every
        rank raises :class:`Stage3Divergence` naming the first diverging module."""
        if self.check is None:
            return
        code = -1 if m is None else self.index[m]
        t = torch.tensor([code, -code], dtype=torch.int64)
        self.check.all_reduce(t, "stage3_order", op=torch.distributed.ReduceOp.MAX).wait()
        if int(t[0]) == -int(t[1]):
            return
        codes = self.check.all_gather_objects(code)
        modules = list(self.index)
        name = lambda c: self.names[modules[c]] or "the model"
        what = lambda c: "the start of backward" if c < 0 else f"the forward of {name(c)!r}"
        each = ", ".join(f"rank {r} is at {what(c)}" for r, c in enumerate(codes))
        raise Stage3Divergence(
            f"fastzero ZeRO stage 3: the ranks' forwards diverged ({each}); every rank must run the same modules in "
            "the same order (a data-dependent branch must take the same path on every rank: decide it on rank 0 "
            "and broadcast it), or params would be gathered out of step"
        )

    # -- hooks ------------------------------------------------------------------------
    def _before(self, m: torch.nn.Module, forward: bool) -> None:
        if forward:
            self.agree(m)
        units = self.needs[m]
        self._fetch(units)
        if forward:
            self.active.append(m)
            for u in units:
                u.refs += 1

    def _after_forward(self, m: torch.nn.Module) -> None:
        self.active.remove(m)
        for u in self.needs[m]:
            u.refs -= 1
            if u.refs == 0 and not self._reused_soon(u):
                self._release(u)
        if self.record_timeline:
            self.timeline.append((time.perf_counter(), "forward_end", self.names.get(m, "")))

    def _released(self, u: Unit) -> None:
        if u.refs == 0:
            self._release(u)

    def _shards_changed(self, group: Stage3Group) -> None:
        """The step or a load wrote `group`'s shards: a param still whole from
        before holds the old values (prefetched or kept for reuse by a
        forward that no backward followed, e.g. an evaluation between
        backward and step). Released; gathered again where something holds
        it (``GatheredParameters``)."""
        stale = [u for u in group.units if u.gathered and not u.persistent]
        for u in stale:
            if u.refs == 0:
                self._release(u)
        held = [u for u in stale if u.gathered]
        for u in held:
            u.wait()
            u.handle = u.refresh(exact=True)
        for u in held:
            u.wait()

    def end_backward(self) -> None:
        """After a micro-batch: everything non-persistent is released (the
        step changes the shards); the recorded order becomes the trace."""
        for u in self.unit_of.values():
            self._release(u)
        if self.trace is None:  # a whole micro-batch recorded becomes the trace; else record the next
            self.trace = self.recording or None
            self.recording = [] if self.trace is None else None
        self.cursor = 0
        self.active.clear()

    def hold(self, params: list[Tensor], exact: bool = True) -> tuple[list[Unit], list[Unit]]:
        """``fastzero.zero.GatheredParameters``: the units of `params`
        gathered (counted as live) and held, so that no module's forward
        end releases them, until :meth:`unhold`. Returns them and the ones
        this call gathered (the others were whole already: persistent, or
        gathered for a forward, ``engine.gathered()`` or a prefetch). The
        gathers are exact (for readers of the weights) unless `exact` is
        False (the pipeline engine holds its stage's params for a step's
        training: through qwZ's codes, when on)."""
        units = [self.unit_of[id(p)] for p in params]
        fresh = [u for u in units if not u.gathered]
        for u in fresh:
            u.start_gather(exact=exact)
            self._count(u.numel)
        if exact:
            self._make_exact(units)
        for u in units:
            u.wait()
            u.refs += 1
        return units, fresh

    def _make_exact(self, units: list[Unit]) -> None:
        """Units whole with dequantized codes (qwZ) gathered again bit for
        bit from the shards, so a reader of the weights gets them exactly;
        one a running forward uses keeps what that forward computes with."""
        stale = [u for u in units if u.gathered and not u.exact and u.refs == 0]
        for u in stale:
            u.wait()
            u.handle = u.refresh(exact=True)
        for u in stale:
            u.wait()

    def unhold(self, units: list[Unit], fresh: list[Unit], discard: list[Unit] = ()) -> None:
        """Ends a :meth:`hold`: the units it gathered are released unless a
        forward still uses them; the `discard` ones that stay whole are
        gathered again from the shards, which drops edits made to them."""
        for u in units:
            u.refs -= 1
        for u in fresh:
            if u.refs == 0 and not u.persistent:
                self._release(u)
        kept = [u for u in discard if u.gathered]
        for u in kept:
            u.wait()
            u.handle = u.refresh(exact=True)
        for u in kept:
            u.wait()

    def gather_all(self) -> tuple[list[Unit], list[Unit]]:
        """Every param whole and exact, held (a forward inside does not
        release them) for reading or saving the weights (``engine.gathered()``);
        end with :meth:`unhold` of what it returns, then :meth:`end_backward`."""
        return self.hold([u.param for u in self.unit_of.values() if not u.persistent])


# -- the marks on the user's params and modules ----------------------------------------------
# fastzero.zero.Init leaves each param's chunk and logical shape on it, register_external_parameter a list on
# the module, the fetcher itself on every module; these helpers are the only code that touches those attributes.


def mark_partitioned(p: Tensor, shard: Tensor, shape: torch.Size) -> None:
    """`p` was partitioned at construction: `shard` is this rank's chunk of it, `shape` its logical shape."""
    p._fz_shard, p._fz_shape = shard, shape
    mark_ds(p, shard, shape, ZeroParamStatus.NOT_AVAILABLE)


def is_partitioned(p: Tensor) -> bool:
    """Whether `p` was partitioned by ``fastzero.zero.Init`` and not yet taken over by an engine."""
    return hasattr(p, "_fz_shard")


def init_shard(p: Tensor) -> Tensor | None:
    """The chunk ``fastzero.zero.Init`` left on `p` (None if none), kept on it."""
    return p.__dict__.get("_fz_shard")


def take_init_shard(p: Tensor) -> Tensor | None:
    """The chunk ``fastzero.zero.Init`` left on `p` (None if none), removed from it."""
    return p.__dict__.pop("_fz_shard", None)


def logical_shape(p: Tensor) -> torch.Size:
    """`p`'s shape as the model defines it, also while it is partitioned (empty)."""
    return getattr(p, "_fz_shape", p.shape)


def external_params(m: torch.nn.Module) -> list[Tensor]:
    """The params `m`'s forward uses although another module owns them."""
    return m.__dict__.get("_fz_external", [])


def add_external_param(m: torch.nn.Module, p: Tensor) -> None:
    external = m.__dict__.setdefault("_fz_external", [])
    if all(q is not p for q in external):
        external.append(p)


def set_fetcher(m: torch.nn.Module, fetcher: ParamFetcher) -> None:
    m.__dict__["_fz_fetcher"] = fetcher


def fetcher_of(m: torch.nn.Module) -> ParamFetcher | None:
    """The fetcher of the engine that trains `m` at stage 3, if any."""
    return m.__dict__.get("_fz_fetcher")
