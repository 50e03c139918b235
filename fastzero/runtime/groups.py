"""The engine's declared interface to its ZeRO groups, and the state API that
checkpoints use.

A *group* is one param group of the model, sharded some way: stages 0-2's
:class:`~fastzero.runtime.partition.FlatGroup` and stage 3's
:class:`~fastzero.runtime.stage3.Stage3Group` today; tensor- and
pipeline-parallel groups plug in the same way. The engine calls only what
:class:`ZeroGroup` declares: around backward (``begin_backward``,
``grad_ready`` per param, ``end_backward``), at the step (``grads``,
``optimizer_params``, ``gather``, ``zero_grads``, ``unreduced``), for
reports (``memory``), after a non-finite gradient norm,
``first_non_finite``, and after the module's params were changed outside
training, ``reload_from_params``.

Checkpoints see a group through its *pieces*: each :class:`Piece` is a range
``[lo, hi)`` of one logical param, flattened, whose fp32 master and optimizer
state this rank holds (the group's split), and where that lives in the
optimizer's tensors. :meth:`ZeroGroup.pieces_out` hands out the state of the
owned pieces, :meth:`ZeroGroup.pieces_in` loads saved pieces of any split
back, so a checkpoint written with one layout loads into any other. State
that belongs to a rank rather than to a logical param (1-bit Adam's
error-feedback buffers) goes through ``rank_state``/``load_rank_state``.
"""

from __future__ import annotations

import weakref
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from fastzero.comm import Handle
from fastzero.runtime import packed_states
from fastzero.runtime.optimizer_builder import param_state

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")  # what an Adam-family piece carries: fp32, hi - lo elements each
SCALAR_KEYS = ("step",)  # state that is one value per tensor, never per element, whatever the tensor's shape


@dataclass(frozen=True)
class Piece:
    """Elements ``[lo, hi)`` of the flattened logical param `name` that this
    rank owns: they are elements ``[offset, offset + hi - lo)`` of the
    optimizer's tensor `opt_param` (and of its state)."""

    name: str
    lo: int
    hi: int
    opt_param: Tensor
    offset: int


@dataclass
class PieceState:
    """The state of elements ``[lo, hi)`` of logical param `name`:
    `tensors` maps ``master`` and each per-element state of the optimizer
    (:data:`STATE_KEYS` for the Adam family; ``momentum_buffer``, ``sum``,
    ``square_avg``... for others) to ``hi - lo`` elements (views of the live
    state from :meth:`ZeroGroup.pieces_out`); `scalars` the state that is one
    value for the whole optimizer tensor (``step``), kept as it is."""

    name: str
    lo: int
    hi: int
    tensors: dict[str, Tensor]
    scalars: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class ZeroGroup(Protocol):
    """What the engine relies on from one ZeRO group. Implementations
    subclass it to inherit :meth:`pieces_out` and :meth:`pieces_in`, which
    are built on :meth:`owned`."""

    params: list[Tensor]  # the model's trainable params of this group, in order (their grad hooks call grad_ready)
    names: list[str]  # their names in the module
    shapes: list[torch.Size]  # their logical shapes (a partitioned param is empty between uses)
    device: torch.device  # where the group's buffers live

    # -- backward ------------------------------------------------------------------------
    def begin_backward(self, first: bool, boundary: bool) -> None:
        """Before a micro-batch's backward: `first` of the accumulation,
        `boundary` the last before a step (and gradients are to be reduced)."""
        ...

    def grad_ready(self, i: int, p: Tensor) -> None:
        """``params[i]``'s gradient is final for this backward."""
        ...

    def end_backward(self) -> None:
        """After backward: every reduction launched is complete."""
        ...

    def unreduced(self) -> bool:
        """Whether gradients were left on the params without being reduced
        (a plain ``loss.backward()``)."""
        ...

    # -- the step ------------------------------------------------------------------------
    def grads(self) -> Tensor:
        """This rank's reduced gradients (summed over ranks, not averaged),
        flat: what the gradient norm is taken over."""
        ...

    def optimizer_params(self) -> list[Tensor]:
        """The tensors the optimizer updates for this group, each with its
        ``.grad`` set (called once, when the optimizer is built)."""
        ...

    def reduced_grads(self) -> list[Tensor]:
        """Per tensor of :meth:`optimizer_params`, in order, this rank's
        reduced gradient of it (summed over ranks, not averaged): passed to
        :meth:`owned` in place of the optimizer's tensors, it places each
        owned piece's gradient."""
        ...

    def set_whole(self, i: int, value: Tensor) -> None:
        """``params[i]``, where this rank holds it whole, set to `value` (the
        same on every rank): after its pieces were written (a param set from
        outside, ``fastzero.utils.safe_set_full_fp32_param``)."""
        ...

    def gather(self) -> list[Handle]:
        """After the step: brings the updated params back to where the model
        uses them; the engine waits for the handles."""
        ...

    def zero_grads(self) -> None:
        """After the step: the gradients start again from zero."""
        ...

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds for the group, by kind (see
        :meth:`fastzero.runtime.Engine.memory_breakdown`)."""
        ...

    # -- state ---------------------------------------------------------------------------
    def owned(self, opt_params: list[Tensor]) -> list[Piece]:
        """The pieces of logical params this rank owns (their split), given
        the optimizer's tensors for this group (``param_groups[i]["params"]``,
        in the order of :meth:`optimizer_params`)."""
        ...

    def rank_state(self) -> Any:
        """State of this rank that is not a piece of a logical param (it does
        not move to another world size), or None."""
        ...

    def load_rank_state(self, state: Any) -> None:
        """Restores :meth:`rank_state` (None: start it afresh)."""
        ...

    def first_non_finite(self) -> str | None:
        """The name of the first param whose gradient on this rank (its
        owned pieces, as reduced) holds an inf or NaN, or None. Only called
        after a non-finite gradient norm, so it may be slow."""
        for piece in self.owned(self.optimizer_params()):
            grad = piece.opt_param.grad
            if grad is None:
                continue
            window = grad.reshape(-1)[piece.offset : piece.offset + piece.hi - piece.lo]
            if not bool(torch.isfinite(window).all()):
                return piece.name
        return None

    def pieces_out(
        self, optimizer: torch.optim.Optimizer, opt_params: list[Tensor], names: Container[str] | None = None
    ) -> list[PieceState]:
        """Pieces out: the fp32 master and every per-element state tensor of
        each owned piece (of the params `names`, None: all), as views of the
        live state (Adam's created as the first step would create it when no
        step has run), and the scalar state of its optimizer tensor. States
        in a packed format (bf16, int8) are fp32 values instead, decoded once
        per optimizer tensor into CPU memory
        (:mod:`fastzero.runtime.packed_states`)."""
        out = []
        decoded: tuple[Tensor, dict] | None = None  # packed formats: the last optimizer tensor's states, decoded
        for piece in self.owned(opt_params):
            if names is not None and piece.name not in names:
                continue
            live = param_state(optimizer, piece.opt_param)
            # fastzero's fused optimizers: state["step"] mirrors the group's counter, which the manifest keeps
            scalars = {} if getattr(optimizer, "group_steps", False) else _scalars(live)
            if packed_states.packed(optimizer):
                if decoded is None or decoded[0] is not piece.opt_param:
                    decoded = (piece.opt_param, packed_states.unpack(optimizer, live))
                live = decoded[1]
            state = _flat_state(live, piece.opt_param)
            window = slice(piece.offset, piece.offset + piece.hi - piece.lo)
            out.append(PieceState(piece.name, piece.lo, piece.hi, {k: v[window] for k, v in state.items()}, scalars))
        return out

    def pieces_in(
        self,
        optimizer: torch.optim.Optimizer,
        opt_params: list[Tensor],
        saved: Mapping[str, Sequence[PieceState]],
        keys: Sequence[str] | None = None,
    ) -> None:
        """Pieces in: copies the `saved` pieces (by param name, any split;
        together they must cover what this rank owns) into the owned pieces,
        then each low-precision param from its master. `keys` None: the whole
        state as saved (each optimizer tensor's state becomes the saved keys:
        one it lacks is created, one the save lacks is dropped, the scalars
        are the saved ones); else only those keys (``("master",)``: the
        weights). States in a packed format (bf16, int8) are decoded to fp32
        per optimizer tensor, the pieces written into those, and encoded once
        after all are in: a piece may start mid-block."""
        packed = packed_states.packed(optimizer)
        codec = packed and (keys is None or any(k != "master" for k in keys))
        with torch.no_grad():
            reset: set[int] = set()  # the optimizer tensors whose state was made the saved keys
            unpacked: dict[int, tuple[dict, dict]] = {}  # packed formats: optimizer tensor -> (live, decoded)
            for piece in self.owned(opt_params):
                live = param_state(optimizer, piece.opt_param)
                if codec:
                    if id(piece.opt_param) not in unpacked:
                        unpacked[id(piece.opt_param)] = (live, packed_states.unpack(optimizer, live))
                    live = unpacked[id(piece.opt_param)][1]
                sources = [s for s in saved.get(piece.name, ()) if max(piece.lo, s.lo) < min(piece.hi, s.hi)]
                if keys is None and sources and id(piece.opt_param) not in reset:
                    reset.add(id(piece.opt_param))
                    _reset_state(live, piece.opt_param, sources[0])
                # the weights alone into a packed format: its per-block state is not read
                state = _flat_state(live, piece.opt_param) if codec or not packed else _master_only(live, piece)
                for src in sources:
                    lo, hi = max(piece.lo, src.lo), min(piece.hi, src.hi)
                    dst = slice(piece.offset + lo - piece.lo, piece.offset + hi - piece.lo)
                    for key in src.tensors if keys is None else keys:
                        if key not in state:  # a key another saved piece of this tensor lacked
                            live[key] = torch.zeros_like(
                                state["master"].view_as(live.get("master_param", piece.opt_param))
                            )
                            state = _flat_state(live, piece.opt_param)
                        state[key][dst].copy_(src.tensors[key][lo - src.lo : hi - src.lo])
                master = state["master"]
                if master.data_ptr() != piece.opt_param.data_ptr():  # low precision: the param from its master
                    window = slice(piece.offset, piece.offset + piece.hi - piece.lo)
                    piece.opt_param.reshape(-1)[window].copy_(master[window])
            for live, work in unpacked.values():
                packed_states.pack(optimizer, work, live)

    def reload_from_params(
        self, optimizer: torch.optim.Optimizer, opt_params: list[Tensor], params: list[Tensor]
    ) -> None:
        """The rank's pieces of `params` (some of :attr:`params`, whole, with
        their current values, the same on every rank) into what the optimizer
        updates (this rank's low-precision chunk, or the param itself at
        stage 0) and into its fp32 master, where one exists; exp_avg,
        exp_avg_sq and the step count are kept. Local: no collectives."""
        index = {id(p): i for i, p in enumerate(self.params)}
        whole = {}
        for p in params:
            i = index[id(p)]
            if p.shape != self.shapes[i]:
                raise ValueError(
                    f"{self.names[i]} is not whole on this rank (shape {tuple(p.shape)}, the param's is "
                    f"{tuple(self.shapes[i])}): gather it first (inside engine.gathered() or "
                    "fastzero.zero.GatheredParameters)"
                )
            whole[self.names[i]] = p.detach().reshape(-1)
        with torch.no_grad():
            for piece in self.owned(opt_params):
                src = whole.get(piece.name)
                if src is None:
                    continue
                src = src[piece.lo : piece.hi]
                window = slice(piece.offset, piece.offset + piece.hi - piece.lo)
                dst = piece.opt_param.detach().reshape(-1)[window]
                if dst.data_ptr() != src.data_ptr():  # stages 0-2: the param is (a view of) it already
                    dst.copy_(src)
                master = optimizer.state.get(piece.opt_param, {}).get("master_param")
                if master is not None:  # none before the first step: the step makes it from the param
                    master.reshape(-1)[window].copy_(src)


def _is_scalar(key: str, value: Any, opt_param: Tensor) -> bool:
    """Whether a state entry is one value for the whole tensor (``step``, a
    number, a 0-d tensor of a tensor that is not 0-d itself)."""
    if key in SCALAR_KEYS or not isinstance(value, Tensor):
        return True
    return value.dim() == 0 and opt_param.dim() > 0


def _flat_state(state: dict, opt_param: Tensor) -> dict[str, Tensor]:
    """The master (the tensor itself where no separate one is kept: fp32
    training, or bf16 params without masters, whose values a load rounds to
    nearest) and every per-element state tensor of one optimizer tensor,
    flattened. State of
    another size cannot follow the elements to another layout: refused."""
    out = {"master": state.get("master_param", opt_param).reshape(-1)}
    for key, value in state.items():
        if key == "master_param" or _is_scalar(key, value, opt_param):
            continue
        if value.numel() != opt_param.numel():
            raise ValueError(
                f"optimizer state {key!r} has shape {tuple(value.shape)}, not one value per element of its param "
                f"(shape {tuple(opt_param.shape)}): checkpoints split state by element across ranks, so this "
                "optimizer's state cannot be saved"
            )
        out[key] = value.reshape(-1)
    return out


def _master_only(state: dict, piece: Piece) -> dict[str, Tensor]:
    return {"master": state.get("master_param", piece.opt_param).reshape(-1)}


def _scalars(state: dict) -> dict[str, Any]:
    """The scalar state of one optimizer tensor, detached copies (on the CPU)."""
    out = {}
    for key, value in state.items():
        if key == "master_param" or isinstance(value, Tensor) and value.dim() > 0:
            continue
        out[key] = value.detach().cpu().clone() if isinstance(value, Tensor) else value
    return out


def _reset_state(live: dict, opt_param: Tensor, src: PieceState) -> None:
    """`live` (one optimizer tensor's state) made to hold exactly the saved
    keys: per-element tensors it lacks are created (fp32, zeros, beside the
    master: filled by the copies that follow), those the save lacks dropped,
    the scalars set."""
    master = live.get("master_param", opt_param)
    for key in [k for k, v in live.items() if k != "master_param" and not _is_scalar(k, v, opt_param)]:
        if key not in src.tensors:
            del live[key]
    for key in src.tensors:
        if key != "master" and key not in live:
            live[key] = torch.zeros_like(master, dtype=torch.float32, memory_format=torch.contiguous_format)
    for key in [k for k, v in live.items() if k != "master_param" and _is_scalar(k, v, opt_param)]:
        if key not in src.scalars:
            del live[key]
    for key, value in src.scalars.items():
        current = live.get(key)
        if isinstance(value, Tensor):  # where and in what dtype the optimizer keeps it (torch: a CPU fp32 step)
            like = current if isinstance(current, Tensor) else value
            live[key] = value.detach().to(device=like.device, dtype=like.dtype).clone()
        else:
            live[key] = value


@runtime_checkable
class CompressingGroup(ZeroGroup, Protocol):
    """A group that can also run 1-bit Adam past its ``freeze_step`` (ZeRO
    stages 0-1): gradients stay local and are exchanged compressed."""

    def local_grads(self) -> Tensor:
        """This rank's own (unreduced) gradients, flat."""
        ...

    def compressed_reduce(self, divisor: float) -> None:
        """The gradient shard from every rank's local gradients, 1-bit
        compressed with error feedback (see FlatGroup)."""
        ...


# -- which engine trains a param --------------------------------------------------------------
# fastzero.zero.GatheredParameters finds the engine whose masters to refresh from the params alone. A registry
# of weak references, not an attribute on the param: a marked param still pickles and deep-copies.
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def mark_owner(owner: Any, params: Iterable[Tensor]) -> None:
    """`owner` (an engine, held weakly) trains `params`."""
    for p in params:
        key = id(p)
        _OWNERS[key] = (weakref.ref(p, lambda _ref, key=key: _OWNERS.pop(key, None)), weakref.ref(owner))


def owner_of(p: Tensor) -> Any:
    """The live engine that trains `p`, or None."""
    entry = _OWNERS.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()
