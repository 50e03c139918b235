"""``fastzero.zero.GatheredParameters``: DeepSpeed's context manager that
makes partitioned params whole for a block, and puts edits made in it back.

Three kinds of param come in, and each is handled its own way:

* partitioned by ``fastzero.zero.Init`` and not yet trained (before
  ``fastzero.initialize``): all-gathered from the chunks left on them; on
  exit each rank writes its chunk of the (broadcast) values back;
* trained by a stage-3 engine: gathered through its fetcher (held, so no
  module's forward end releases them); on exit the engine refreshes this
  rank's low-precision shard and fp32 master from them;
* whole (stages 0-2, a plain module, frozen params): nothing to gather
  (DeepSpeed's no-op); on exit with ``modifier_rank`` they are broadcast,
  and an engine that trains them refreshes its fp32 masters (fastzero's
  addition: DeepSpeed leaves the ranks or the masters stale).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import Tensor

from fastzero.comm import Comm, FlatLayout
from fastzero.runtime.groups import owner_of
from fastzero.runtime.stage3 import (
    WHOLE,
    add_external_param,
    fetcher_of,
    init_shard,
    logical_shape,
    released_like,
)

PLAIN, INIT, UNIT = 0, 1, 2  # the kinds of param above: whole, partitioned by Init, trained at stage 3

_DEPTH: dict[int, int] = {}  # id(param) -> how many GatheredParameters blocks hold it now (nesting)


def _param_list(params) -> list[Tensor]:
    """One param, or an iterable of params, as a list without repeats (in the given order: every rank must pass
    the same params in the same order, as in DeepSpeed)."""
    if isinstance(params, torch.nn.Module):
        raise TypeError("GatheredParameters(params=a module): pass module.parameters() (or a list of its params)")
    if isinstance(params, Tensor):
        params = [params]
    elif isinstance(params, Iterable) and not isinstance(params, (str, bytes)):
        params = list(params)
    else:
        raise TypeError(
            f"GatheredParameters(params={type(params).__name__}): pass a param, a list of params or module.parameters()"
        )
    out, seen = [], set()
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            fix = "module.parameters()" if isinstance(p, torch.nn.Module) else "params (torch.nn.Parameter)"
            raise TypeError(f"GatheredParameters: params[{i}] is a {type(p).__name__}, not a tensor; pass {fix}")
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class GatheredParameters:
    """``with fastzero.zero.GatheredParameters(params, modifier_rank=0):``
    (DeepSpeed's ``deepspeed.zero.GatheredParameters``, same arguments).

    `params`: one param, a list of params or ``module.parameters()``; every
    rank enters with the same ones in the same order (checked: one tiny
    all-reduce). Inside the block each is whole on every rank. On exit with
    `modifier_rank`, that rank's values are broadcast and every rank keeps
    its chunk of them (and, for an engine's params, the fp32 master of it);
    without it, edits to partitioned params are dropped (they go back to
    their chunks) and a detected edit warns. Blocks nest, over the same
    params too: an exit with `modifier_rank` commits the values; the
    outermost exit releases. An exception inside the block on any rank
    drops the edits on every rank. `fwd_module`: the partitioned params are
    registered as external params of it (gathered for its forward).
    ``enabled=False`` makes the block a no-op."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True) -> None:
        self.enabled = enabled
        if not enabled:
            return
        self.params = _param_list(params)
        self.comm = Comm()
        if modifier_rank is not None and (
            isinstance(modifier_rank, bool)
            or not isinstance(modifier_rank, int)
            or not 0 <= modifier_rank < self.comm.world_size
        ):
            raise ValueError(
                f"GatheredParameters(modifier_rank={modifier_rank!r}): there are {self.comm.world_size} ranks; pass a "
                f"rank in [0, {self.comm.world_size}) whose values to keep, or None to drop edits"
            )
        if fwd_module is not None and not isinstance(fwd_module, torch.nn.Module):
            raise TypeError(
                f"GatheredParameters(fwd_module={type(fwd_module).__name__}): pass a torch.nn.Module or None"
            )
        self.modifier_rank = modifier_rank
        if fwd_module is not None:
            self._register_external(fwd_module)

    @staticmethod
    def _kind(p: Tensor) -> int:
        engine = owner_of(p)
        if engine is not None and getattr(engine, "fetcher", None) is not None:
            return UNIT
        return INIT if init_shard(p) is not None else PLAIN

    @staticmethod
    def _shape(p: Tensor, kind: int) -> torch.Size:
        """`p`'s shape as the model defines it (a partitioned param is empty outside the block)."""
        return owner_of(p).fetcher.unit_of[id(p)].shape if kind == UNIT else logical_shape(p)

    def _register_external(self, module: torch.nn.Module) -> None:
        fetcher = fetcher_of(module)
        for p in self.params:
            kind = self._kind(p)
            if kind == INIT and fetcher is None:  # the engine built later gathers it for `module`
                add_external_param(module, p)
            elif kind == UNIT and fetcher is not None and id(p) in fetcher.unit_of:
                add_external_param(module, p)
                fetcher.register_external(module, p)

    # -- entering: agree, gather -------------------------------------------------------------
    def _agree(self, values: list[int], what: str) -> list[int]:
        """Every rank's `values` (the max over ranks) after checking they
        are the same everywhere."""
        if self.comm.world_size == 1:
            return values
        t = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64, device=self.comm.device)
        self.comm.all_reduce(t, "gathered_parameters", op=torch.distributed.ReduceOp.MAX).wait()
        n = len(values)
        high, low = t[:n].tolist(), [-v for v in t[n:].tolist()]
        if high != low:
            raise RuntimeError(f"fastzero.zero.GatheredParameters: {what}")
        return high

    def __enter__(self) -> None:
        if not self.enabled:
            return None
        self.kinds = [self._kind(p) for p in self.params]
        shapes = [self._shape(p, k).numel() for p, k in zip(self.params, self.kinds)]
        signature = sum((i + 1) * (n * 3 + k) for i, (n, k) in enumerate(zip(shapes, self.kinds))) % (1 << 61)
        rank = -1 if self.modifier_rank is None else self.modifier_rank
        self._agree(
            [len(self.params), signature, rank],
            "the ranks entered with different params or modifier_rank; every rank must pass the same params "
            "(same order, same sizes) and the same modifier_rank",
        )
        # id(fetcher) -> (it, params, their units, the units this block gathered)
        self.held: dict[int, tuple[object, list[Tensor], list, list]] = {}
        for p, kind in zip(self.params, self.kinds):
            if kind == UNIT:
                fetcher = owner_of(p).fetcher
                self.held.setdefault(id(fetcher), (fetcher, [], [], []))[1].append(p)
        for fetcher, params, units, fresh in self.held.values():
            got, gathered = fetcher.hold(params)
            units += got
            fresh += gathered
        # stages 1-2 with qwZ: the params hold dequantized codes after a step; the block sees the exact ones
        for engine in {id(e): e for p, k in zip(self.params, self.kinds) if k == PLAIN and (e := owner_of(p))}.values():
            engine.exact_params()
        try:
            self._gather_init([p for p, k in zip(self.params, self.kinds) if k == INIT and id(p) not in _DEPTH])
        except BaseException:
            for fetcher, _, units, fresh in self.held.values():
                fetcher.unhold(units, fresh)
            raise
        for p in self.params:
            _DEPTH[id(p)] = _DEPTH.get(id(p), 0) + 1
        self.before = [(p.data_ptr(), p._version) for p in self.params]
        return None

    def _gather_init(self, params: list[Tensor]) -> None:
        """Params partitioned by fastzero.zero.Init: whole from every rank's chunk."""
        world, device = self.comm.world_size, self.comm.device
        fulls, handles = [], []
        for p in params:
            shard = init_shard(p)
            if shard.numel() != FlatLayout([logical_shape(p).numel()], world, WHOLE).shard_size:
                raise RuntimeError(
                    f"GatheredParameters: a param of shape {tuple(logical_shape(p))} was partitioned by "
                    f"fastzero.zero.Init for another world size ({shard.numel()} elements here, {world} ranks); "
                    "build the model under Init in this process group"
                )
            full = torch.empty(shard.numel() * world, dtype=shard.dtype, device=device)
            handles.append(self.comm.all_gather(full, shard.to(device), "gathered_parameters"))
            fulls.append(full)
        for p, full, h in zip(params, fulls, handles):
            h.wait()
            shape = logical_shape(p)
            p.data = full[: shape.numel()].view(shape).to(init_shard(p).device)

    # -- leaving: agree, commit or drop, release -------------------------------------------------
    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enabled:
            return None
        for p in self.params:
            _DEPTH[id(p)] -= 1
            if _DEPTH[id(p)] == 0:
                del _DEPTH[id(p)]
        bad = self._misshapen() if exc_type is None and self.modifier_rank is not None else None
        failed = exc_type is not None or bad is not None
        peers = True  # every rank reached the exit: collectives are safe
        try:
            anyone_failed = self._any(failed)
        except Exception:
            if not failed:
                raise
            anyone_failed, peers = True, False  # the block's own error (a lost peer, say) goes on
        commit = self.modifier_rank is not None and not anyone_failed
        try:
            if commit:
                self._commit()
            elif self.modifier_rank is None and not failed:
                self._warn_if_edited()
        finally:
            for fetcher, params, units, fresh in self.held.values():
                # the edits dropped: what stays whole (persistent, a forward's) is gathered again from the shards
                outermost = [u for p, u in zip(params, units) if id(p) not in _DEPTH]
                fetcher.unhold(units, fresh, [] if commit or not peers else outermost)
            for p, kind in zip(self.params, self.kinds):
                if kind == INIT and id(p) not in _DEPTH:
                    p.data = released_like(p)
        if bad is not None:
            raise ValueError(bad)
        if anyone_failed and exc_type is None:
            raise RuntimeError(
                "fastzero.zero.GatheredParameters: another rank failed inside the block; the edits were dropped on "
                "every rank (see that rank's error)"
            )
        return None

    def _misshapen(self) -> str | None:
        for i, (p, kind) in enumerate(zip(self.params, self.kinds)):
            shape = self._shape(p, kind)
            if kind != PLAIN and p.shape != shape:
                return (
                    f"GatheredParameters: params[{i}] has shape {tuple(p.shape)} on exit, but it is a partitioned "
                    f"param of shape {tuple(shape)}; edit it in place (copy_ into it) or give it a tensor of its "
                    "shape. The edits were dropped on every rank"
                )
        return None

    def _any(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank."""
        if self.comm.world_size == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self.comm.device)
        self.comm.all_reduce(t, "gathered_parameters", op=torch.distributed.ReduceOp.MAX).wait()
        return bool(t.item())

    def _commit(self) -> None:
        """modifier_rank's values everywhere; each rank keeps its chunk of them (and its fp32 master)."""
        device, bufs, handles = self.comm.device, [], []
        for p in self.params:
            buf = p.detach()
            if buf.device != device or not buf.is_contiguous():
                buf = buf.to(device, memory_format=torch.contiguous_format)
            handles.append(self.comm.broadcast(buf, self.modifier_rank, "gathered_parameters"))
            bufs.append(buf)
        with torch.no_grad():
            for p, buf, h in zip(self.params, bufs, handles):
                h.wait()
                if buf.data_ptr() != p.data_ptr():
                    p.copy_(buf)
            engines: dict[int, tuple[object, list[Tensor]]] = {}
            for p, kind in zip(self.params, self.kinds):
                if kind == INIT:
                    self._write_init_chunk(p)
                elif (engine := owner_of(p)) is not None:
                    engines.setdefault(id(engine), (engine, []))[1].append(p)
            for engine, params in engines.values():
                engine.refresh_from_module(params)

    def _write_init_chunk(self, p: Tensor) -> None:
        shard = init_shard(p)
        lo, hi = FlatLayout([p.numel()], self.comm.world_size, WHOLE).buckets[0].owned(self.comm.rank)
        flat = p.detach().reshape(-1)
        n = max(0, min(hi, flat.numel()) - lo)
        shard[:n].copy_(flat[lo : lo + n])

    def _warn_if_edited(self) -> None:
        edited = [
            i
            for i, (p, (ptr, version)) in enumerate(zip(self.params, self.before))
            if (p.data_ptr(), p._version) != (ptr, version)
        ]
        if edited:
            warnings.warn(
                f"GatheredParameters(modifier_rank=None): params {edited[:8]} were edited on this rank inside the "
                "block; without modifier_rank partitioned params drop the edits and whole params keep them on this "
                "rank only (not in an engine's fp32 master). Pass modifier_rank=<the rank whose values to keep>",
                UserWarning,
                stacklevel=3,
            )
