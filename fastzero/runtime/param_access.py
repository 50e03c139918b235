"""One trained param's full fp32 value, optimizer state and gradient on a
ZeRO engine, whatever its split: what the DeepSpeed-named helpers of
:mod:`fastzero.utils.tensor_fragment` (``safe_get_full_fp32_param`` and
the rest) run on.

* **Reading the full value** assembles it from the ranks' pieces
  (:meth:`~fastzero.runtime.groups.ZeroGroup.pieces_out`): each rank writes
  the elements it owns into a zero buffer and one all-reduce over the
  data-parallel group sums them, so every rank of that group must call it
  (stage 0 holds everything whole: no collective). States in a packed
  format (bf16, int8) come out decoded, in fp32.
* **Writing the full value** copies the elements each rank owns into its
  pieces (:meth:`~fastzero.runtime.groups.ZeroGroup.pieces_in`; a packed
  state is encoded again), so every rank of the data-parallel group calls
  it with the same value; for the fp32 param also what the model reads:
  the whole param at stages 0-2 (each rank holds it), a persistent stage-3
  param's gathered copy; a partitioned one is gathered from the new shards
  when next used. Collectives: an optimizer state's key is agreed first
  (only the ranks owning elements of the param can check it), and at
  stage 3 the params held gathered (``GatheredParameters``,
  ``engine.gathered()``) are gathered again.
* **Gradients** are the reduced ones a boundary backward left for the step
  (:meth:`~fastzero.runtime.groups.ZeroGroup.reduced_grads`: summed over
  ranks and micro-batches, times the loss scale), divided by
  :meth:`Engine.grad_divisor <fastzero.runtime.engine.Engine.grad_divisor>`:
  the average gradient the step will use, before clipping. A gradient set
  here is the one the step (and its norm) uses.
* **Local** (stage 3): this rank's own elements of a param, one range
  ``[lo, hi)`` of it flattened (empty where the rank owns none).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from fastzero.runtime.groups import PieceState, ZeroGroup, owner_of

MASTER = "master"  # the fp32 param (its master copy where one is kept), beside the optimizer's state keys


@dataclass(frozen=True)
class _Slot:
    engine: object
    group: ZeroGroup
    gi: int  # the group's index (engine.groups, optimizer.param_groups)
    index: int  # the param's index in the group
    name: str
    shape: torch.Size

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def opt_params(self) -> list[Tensor]:
        return self.engine.optimizer.param_groups[self.gi]["params"]


_INDEX: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> {id(param): (group index, index)}


def locate(p: Tensor) -> _Slot | None:
    """Where the engine that trains `p` keeps it, or None (frozen, or no engine's)."""
    engine = owner_of(p)
    if engine is None:
        return None
    index = _INDEX.get(engine)
    if index is None:
        index = {id(q): (gi, i) for gi, g in enumerate(engine.groups) for i, q in enumerate(g.params)}
        _INDEX[engine] = index
    where = index.get(id(p))
    if where is None:
        return None
    gi, i = where
    group = engine.groups[gi]
    return _Slot(engine, group, gi, i, group.names[i], group.shapes[i])


def _key(key: str | None) -> str:
    if key is None:
        return MASTER
    if not isinstance(key, str):
        raise TypeError(f"optim_state_key={key!r}: give a state's name, such as 'exp_avg' or 'exp_avg_sq'")
    return key


def _unknown(slot: _Slot, key: str, keys: Iterable[str] | None) -> ValueError:
    known = ", ".join(repr(k) for k in sorted(set(keys) - {MASTER})) if keys is not None else None
    kept = f"its optimizer keeps {known} per element; pass one of those" if known else "no such state is kept"
    return ValueError(f"optimizer state {key!r} of {slot.name}: {kept} (the fp32 param: safe_get_full_fp32_param)")


def _all_reduce(slot: _Slot, buf: Tensor) -> None:
    if slot.engine.stage > 0:
        slot.engine.comm.all_reduce(buf, tag="param_access").wait()


def get_full(p: Tensor, key: str | None = None) -> Tensor | None:
    """`p`'s full fp32 value (`key` None) or optimizer state `key`, shaped
    as `p`, on the engine's device; None for a param no engine trains.
    Collective over the data-parallel group at stages 1-3."""
    slot = locate(p)
    if slot is None:
        return None
    key = _key(key)
    n = slot.numel
    buf = torch.zeros(n + 1, dtype=torch.float32, device=slot.engine.device)
    keys = None
    for piece in slot.group.pieces_out(slot.engine.optimizer, slot.opt_params(), names={slot.name}):
        t = piece.tensors.get(key)
        if t is None:
            keys = piece.tensors
            buf[n] = 1.0  # counted over ranks: every rank raises, none waits in a collective alone
            continue
        buf[piece.lo : piece.hi].copy_(t)
    _all_reduce(slot, buf)
    if buf[n].item() != 0:
        raise _unknown(slot, key, keys)
    return buf[:n].view(slot.shape)


def set_full(p: Tensor, value: Tensor, key: str | None = None) -> None:
    """Writes `value` (`p`'s shape, the same on every rank of the
    data-parallel group, each of which calls it) as `p`'s fp32 value (`key`
    None) or its optimizer state `key`."""
    slot = _trained(p, "safe_set_full_" + ("fp32_param" if key is None else "optimizer_state"))
    key = _key(key)
    src = _value(slot, value, slot.numel, "the param's")
    _write(slot, PieceState(slot.name, 0, slot.numel, {key: src}), key)
    if key == MASTER:
        slot.group.set_whole(slot.index, src.to(device=slot.engine.device, dtype=slot.group.dtype))


def get_full_grad(p: Tensor) -> Tensor | None:
    """`p`'s full averaged gradient (fp32, `p`'s shape), between a boundary
    backward and the step; None for a param no engine trains. Collective
    over the data-parallel group at stages 1-3."""
    slot = locate(p)
    if slot is None:
        return None
    _check_reduced(slot, "safe_get_full_grad")
    buf = torch.zeros(slot.numel, dtype=torch.float32, device=slot.engine.device)
    for piece in _grad_pieces(slot):
        buf[piece.lo : piece.hi].copy_(_window(piece))
    _all_reduce(slot, buf)
    return buf.div_(slot.engine.grad_divisor()).view(slot.shape)


def set_full_grad(p: Tensor, value: Tensor) -> None:
    """`p`'s gradient for the step becomes `value` (averaged, unscaled: as
    :func:`get_full_grad` gives it; the same on every rank of the
    data-parallel group, each of which calls it). No collective."""
    slot = _trained(p, "safe_set_full_grad")
    _check_reduced(slot, "safe_set_full_grad")
    src = _value(slot, value, slot.numel, "the param's")
    scale = slot.engine.grad_divisor()
    with torch.no_grad():
        for piece in _grad_pieces(slot):
            _window(piece).copy_(src[piece.lo : piece.hi] * scale)


def update_full_grads(params: Iterable[Tensor], fn: Callable[[Tensor, Tensor], Tensor]) -> None:
    """``set_full_grad(p, fn(get_full_grad(p), p))`` for each trained param of `params`."""
    for p in params:
        if locate(p) is not None:
            set_full_grad(p, fn(get_full_grad(p), p))


# -- local (stage 3): this rank's own elements ------------------------------------------------------------------


def get_local(p: Tensor, key: str | None = None) -> Tensor:
    """This rank's elements of `p`'s fp32 value or optimizer state `key`
    (fp32, 1-D, a copy). No collective."""
    slot = _stage3(p, "safe_get_local_" + ("fp32_param" if key is None else "optimizer_state"))
    key = _key(key)
    for piece in slot.group.pieces_out(slot.engine.optimizer, slot.opt_params(), names={slot.name}):
        if key not in piece.tensors:
            raise _unknown(slot, key, piece.tensors)
        return piece.tensors[key].detach().float().clone()
    return torch.zeros(0, dtype=torch.float32, device=slot.engine.device)


def set_local(p: Tensor, value: Tensor, key: str | None = None) -> None:
    """Writes this rank's elements of `p`'s fp32 value or optimizer state
    `key`. Every rank of the data-parallel group calls it, each with its
    own elements (none: an empty tensor), as :func:`set_full`; a persistent
    param's gathered copy is refreshed from every rank's (one all-gather)."""
    slot = _stage3(p, "safe_set_local_" + ("fp32_param" if key is None else "optimizer_state"))
    key = _key(key)
    lo, hi = _local_range(slot)
    src = _value(slot, value, hi - lo, "this rank's")
    _write(slot, PieceState(slot.name, lo, hi, {key: src}), key)
    if key == MASTER:
        slot.group.regather(slot.index)


def get_local_grad(p: Tensor) -> Tensor:
    """This rank's elements of `p`'s averaged gradient (fp32, 1-D)."""
    slot = _stage3(p, "safe_get_local_grad")
    _check_reduced(slot, "safe_get_local_grad")
    pieces = _grad_pieces(slot)
    if not pieces:
        return torch.zeros(0, dtype=torch.float32, device=slot.engine.device)
    return _window(pieces[0]).to(torch.float32, copy=True).div_(slot.engine.grad_divisor())


def set_local_grad(p: Tensor, value: Tensor) -> None:
    """This rank's elements of `p`'s gradient for the step (averaged, unscaled)."""
    slot = _stage3(p, "safe_set_local_grad")
    _check_reduced(slot, "safe_set_local_grad")
    lo, hi = _local_range(slot)
    src = _value(slot, value, hi - lo, "this rank's")
    for piece in _grad_pieces(slot):
        _window(piece).copy_(src * slot.engine.grad_divisor())


# -- helpers --------------------------------------------------------------------------------------------------------


def _trained(p: Tensor, what: str) -> _Slot:
    slot = locate(p)
    if slot is None:
        raise ValueError(
            f"{what}: this param is not one a live fastzero engine trains (frozen, or its model was not passed to "
            "fastzero.initialize): change it directly (param.data.copy_(value))"
        )
    slot.engine.wait_params(what)  # a post-step all-gather still in flight would overwrite what is written
    return slot


def _stage3(p: Tensor, what: str) -> _Slot:
    slot = _trained(p, what)
    if slot.engine.stage != 3:
        full = what.replace("_local_", "_full_")
        raise ValueError(
            f"{what} reads a stage-3 param's own partition, and this engine runs ZeRO stage {slot.engine.stage}, "
            f"where a rank's elements of a param are not one range: use {full}"
        )
    return slot


def _value(slot: _Slot, value: Tensor, numel: int, whose: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{slot.name}: the value must be a tensor, not {type(value).__name__}")
    whole = numel == slot.numel  # a full value: the param's shape, or flat
    if value.numel() != numel or (whole and value.shape != slot.shape and value.dim() != 1):
        raise ValueError(
            f"{slot.name}: the value has {value.numel()} elements (shape {tuple(value.shape)}) and {whose} "
            f"elements are {numel} (the param's shape is {tuple(slot.shape)}); pass "
            + ("a tensor of the param's shape (or flat)" if whole else "a 1-D tensor of that many elements")
        )
    if value.is_complex():
        raise TypeError(f"{slot.name}: the value is complex ({value.dtype}); pass a real tensor")
    return value.detach().reshape(-1).to(torch.float32)


def _write(slot: _Slot, piece: PieceState, key: str) -> None:
    """`piece` into the rank's pieces of the param, on every rank (an empty one where the rank owns none of it:
    stage 3 then drops what is gathered of the old values on every rank alike)."""
    engine = slot.engine
    if key != MASTER:  # a key the optimizer does not keep would be created by pieces_in: refused first
        keys = None
        for held in slot.group.pieces_out(engine.optimizer, slot.opt_params(), names={slot.name}):
            if key not in held.tensors:
                keys = held.tensors
        # only the ranks owning elements of the param can tell: agreed, so that every rank raises
        missing = torch.tensor([0.0 if keys is None else 1.0], device=engine.device)
        _all_reduce(slot, missing)
        if missing.item() != 0:
            raise _unknown(slot, key, keys)
    with torch.no_grad():
        slot.group.pieces_in(engine.optimizer, slot.opt_params(), {slot.name: [piece]}, keys=(key,))
        sync = getattr(engine.optimizer, "sync_device_params", None)
        if key == MASTER and sync is not None:  # separate masters (offloaded, a client optimizer's)
            sync()


def _local_range(slot: _Slot) -> tuple[int, int]:
    for piece in slot.group.owned(slot.opt_params()):
        if piece.name == slot.name:
            return piece.lo, piece.hi
    return 0, 0


def _grad_pieces(slot: _Slot) -> list:
    """This rank's pieces of the param, each placed in its reduced gradient tensor (``Piece.opt_param``)."""
    return [piece for piece in slot.group.owned(slot.group.reduced_grads()) if piece.name == slot.name]


def _window(piece) -> Tensor:
    return piece.opt_param.reshape(-1)[piece.offset : piece.offset + piece.hi - piece.lo]


def _check_reduced(slot: _Slot, what: str) -> None:
    if not slot.engine.has_reduced_grads():
        raise RuntimeError(
            f"{what}({slot.name}): there is no reduced gradient now: engine.backward(loss) reduces the gradients "
            "on the step's last micro-batch (the accumulation boundary) and engine.step() uses them up; call it "
            "between the two (past 1-bit Adam's freeze_step there is none: the gradients stay local)"
        )
