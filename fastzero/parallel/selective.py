"""The cost-ranked selective policy of activation checkpointing:
``checkpoint(fn, *args, policy="selective")`` or
``policy=SelectivePolicy(max_kept_ratio=...)``.

A checkpointed block recomputes its forward before its backward. The
recompute is made cheaper three ways, each exact (the gradients equal the
un-checkpointed run's bit for bit):

1. **Kept outputs.** Keeping an op's output saves recomputing that op, at
   the price of its bytes. The ops worth keeping are those whose recompute
   costs the most per byte kept, counted in floating-point operations:

   - ``mm``, ``bmm``, ``addmm``, ``baddbmm``: ``2 * m * n * k`` over ``4 * m * n``
     bytes (fp32), i.e. ``k / 2`` FLOPs per byte: the inner dimension decides;
   - the attention kernels (``_scaled_dot_product_*``, ``_flash/_efficient_attention_forward``):
     ``B * h * T * S * (4 * d + 5)``: the two matmuls and the softmax between
     them (max, subtract, exp, sum, scale per score; causal masking not subtracted);
   - ``convolution``: ``2 * outputs * (in_channels / groups) * kernel size``;
   - everything else (elementwise, normalisation, views): 0, never kept.

   The first forward of a block holds every costed output until the block
   ends, ranks them by FLOPs per byte (ties: the smaller, then the earlier)
   and keeps them while their bytes fit ``max_kept_ratio`` times the block's
   tensor inputs' bytes (one that does not fit is skipped and smaller ones are
   still tried). Later forwards of the same block (:func:`block_key`) hold
   only what it kept last time. An output an in-place op changed later in the
   block (through any alias: writes are matched by storage) or that shares
   storage with the block's outputs is not kept; the recompute takes the kept
   outputs back in order, matched by op, call number, argument signature and
   the point of the op sequence (:class:`_Chain`); one that does not match is
   recomputed.

2. **Dropout masks as bits.** A block's random draws are its 0/1 dropout
   masks (``bernoulli``) on the CPU; each is kept at one bit per value
   (counted in the limit, first) and written back in the recompute instead of
   drawn, the generator then set where the forward's draw left it. All of a
   block's random ops or none: one random op that is not a mask (noise,
   ``native_dropout``) keeps no masks, and the generator replays.

3. **Skipping what nothing reads.** The recompute's outputs are only the
   roots of the block's backward: their values are never read. The first
   recompute of a block learns which ops' outputs neither a later op nor
   autograd (saved-tensor hooks) reads, e.g. an MLP's down-projection, its
   dropout multiply and the residual add; later recomputes skip the costed
   ones (the down-projection) with NaN-filled stand-ins in their place and
   run the cheap ones (a :class:`Plan`). A planned run checks, before
   each op, that the op, its argument signature, which earlier op made each
   tensor argument and the grad flags of the tensors from outside the block
   are those it was learned from, that no op reading values reads a stand-in,
   and that autograd saves none; otherwise it stops (:class:`Miss`) and the
   block is recomputed plainly, its generator replayed. Blocks that write a
   tensor from outside in place (BatchNorm's running statistics), use a
   custom autograd Function (whose ctx may hold tensors no hook sees) or push
   saved-tensor hooks of their own are never planned. Reads outside torch's
   ops (``.tolist()``, ``.numpy()``) are invisible: stand-ins hold NaN so
   that such a read shows, and ``SelectivePolicy(skip_unread=False)`` turns
   the skips off.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from fastzero.ops.onebit import pack_mask, unpack_mask

__all__ = ["SelectivePolicy", "forget_plans", "op_flops"]

_aten = torch.ops.aten


@dataclass(frozen=True)
class SelectivePolicy:
    """Keep the dropout masks (as bits) and the op outputs whose recompute
    costs the most FLOPs per byte, up to ``max_kept_ratio`` times the bytes
    of the block's tensor inputs (which a checkpoint keeps anyway): 1.25 (the
    default, ``"selective"``) keeps at most 2.25x what a fully recomputed
    block keeps (room for an attention output beside a block input of the
    same shape, and its masks); 0 keeps nothing (full recompute, nothing
    skipped); ``math.inf`` keeps every matmul and attention output.

    ``skip_unread=False`` turns off the learned skips (module docstring, 3.):
    for a block that reads tensor values outside torch's ops (``.tolist()``,
    ``.numpy()``, printing) and feeds what it read back into its computation,
    which no check can see. A stand-in reads as NaN, so such a read shows."""

    max_kept_ratio: float = 1.25
    skip_unread: bool = True

    def __post_init__(self) -> None:
        r = self.max_kept_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or math.isnan(r) or r < 0:
            raise ValueError(
                f"SelectivePolicy(max_kept_ratio={r!r}): give a number >= 0, the bytes kept per byte of the "
                "block's inputs (math.inf: keep every matmul and attention output)"
            )
        if not isinstance(self.skip_unread, bool):
            raise TypeError(f"SelectivePolicy(skip_unread={self.skip_unread!r}): give True or False")


def _mm(args, out) -> int:  # mm(a, b), bmm(a, b)
    return 2 * out.numel() * args[0].shape[-1]


def _addmm(args, out) -> int:  # addmm(bias, a, b), baddbmm(c, a, b)
    return 2 * out.numel() * args[1].shape[-1]


SOFTMAX_FLOPS = 5  # per attention score: max, subtract, exp, sum, scale


def _attention(q: Tensor, kv_len: int) -> int:
    """The two matmuls (4 * d per score) and the softmax between them, over q's scores against kv_len keys."""
    scores = q.numel() // max(q.shape[-1], 1) * kv_len
    return scores * (4 * q.shape[-1] + SOFTMAX_FLOPS)


def _attention_bhtd(args, out) -> int:  # q, k: (batch, heads, T, d), (batch, heads, S, d)
    return _attention(args[0], args[1].shape[-2])


def _attention_bthd(args, out) -> int:  # q, k: (batch, T, heads, d), (batch, S, heads, d)
    return _attention(args[0], args[1].shape[1] if args[1].dim() == 4 else args[1].shape[0])


def _convolution(args, out) -> int:  # (input, weight, bias, stride, padding, dilation, transposed, ...)
    first = out[0] if isinstance(out, (tuple, list)) else out
    per_output = args[1][0].numel()  # (in_channels / groups) * kernel size
    return 2 * (args[0].numel() if args[6] else first.numel()) * per_output


_COSTS: dict[Any, Callable] = {}
for _names, _fn in (
    (("mm", "bmm"), _mm),
    (("addmm", "baddbmm"), _addmm),
    (
        (
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
        ),
        _attention_bhtd,
    ),
    (("_flash_attention_forward", "_efficient_attention_forward"), _attention_bthd),
    (("convolution",), _convolution),
):
    for _name in _names:
        if hasattr(_aten, _name):
            _COSTS[getattr(_aten, _name).default] = _fn


def op_flops(func: Any, args: tuple, out: Any) -> int:
    """The recompute cost of one aten call in FLOPs (module docstring); 0 for ops not costed."""
    fn = _COSTS.get(func)
    return int(fn(args, out)) if fn is not None else 0


def _tensors(out: Any) -> list[Tensor]:
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, Tensor)]


def _nbytes(out: Any) -> int:
    return sum(t.untyped_storage().nbytes() for t in _tensors(out))


def _hashable(a: Any) -> Any:
    if isinstance(a, Tensor):
        return (a.shape, a.dtype, a.stride(), a.device)  # a torch.Size hashes and compares as the tuple
    if isinstance(a, (tuple, list)):
        return tuple([_hashable(x) for x in a])
    if isinstance(a, dict):
        return tuple(sorted([(k, _hashable(v)) for k, v in a.items()]))
    return a


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What must match for a kept output to stand for a recomputed call (every op of a planned recompute is
    checked so: kept lean)."""
    return tuple([_hashable(a) for a in args]), _hashable(kwargs) if kwargs else ()


def _detached(out: Any) -> Any:
    if isinstance(out, Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(_detached(o) for o in out)
    return out


def _flat_tensors(args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensor arguments of a call, those inside lists (``cat``) included."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            out.append(a)
        elif isinstance(a, (tuple, list)):
            out.extend([x for x in a if isinstance(x, Tensor)])
    return out


@dataclass(frozen=True)
class _OpInfo:
    """What the modes ask of an op, read once from its schema."""

    mutable: bool  # writes an argument in place
    written: tuple[int, ...]  # positions of those arguments
    names: tuple[str, ...]  # argument names (for keyword arguments)
    random: bool  # draws from a generator (nondeterministic_seeded) ...
    dropout_p: int | None  # ... unless this argument is 0 (attention)
    dropout_default: Any
    shape_only: bool  # reads only its tensor arguments' shapes (``empty_like``, ``new_zeros``)
    view: bool  # returns an alias of an argument (its schema says so: ``view``, ``detach``, ``transpose``)


_INFO: dict[Any, _OpInfo] = {}


def _info(func: Any) -> _OpInfo:
    info = _INFO.get(func)
    if info is None:
        schema = func._schema
        arguments = schema.arguments
        written = tuple(i for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write)
        dropout = [i for i, a in enumerate(arguments) if a.name == "dropout_p"]
        name = schema.name.split("::")[-1]
        info = _INFO[func] = _OpInfo(
            mutable=schema.is_mutable,
            written=written,
            names=tuple(a.name for a in arguments),
            random=torch.Tag.nondeterministic_seeded in func.tags,
            dropout_p=dropout[0] if dropout else None,
            dropout_default=arguments[dropout[0]].default_value if dropout else None,
            shape_only=name.endswith("_like") or name.startswith("new_"),
            view=any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns),
        )
    return info


def _argument(info: _OpInfo, i: int, args: tuple, kwargs: dict, default: Any = None) -> Any:
    return args[i] if i < len(args) else kwargs.get(info.names[i], default)


def _written(info: _OpInfo, args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors an op writes in place."""
    out: list[Tensor] = []
    for i in info.written:
        v = _argument(info, i, args, kwargs)
        out.extend(x for x in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(x, Tensor))
    return out


def _random(info: _OpInfo, args: tuple, kwargs: dict) -> bool:
    """Whether the call draws from a generator: a random op, unless its dropout_p is 0 (attention)."""
    if not info.random:
        return False
    if info.dropout_p is not None:
        return _argument(info, info.dropout_p, args, kwargs, info.dropout_default) != 0
    return True


def _storage(t: Tensor) -> int | None:
    """The identity of `t`'s storage while it is alive (None: empty, nothing to track)."""
    st = t.untyped_storage()
    return st.data_ptr() if st.nbytes() else None


# -- dropout masks kept as bits -----------------------------------------------------------------------------------

# The random ops whose output is a 0/1 mask: (in place, the output is args[0]) or (functional, a new tensor)
_MASK_OPS = {
    getattr(getattr(_aten, name), overload): in_place
    for name, overload, in_place in (
        ("bernoulli_", "float", True),
        ("bernoulli_", "Tensor", True),
        ("bernoulli", "p", False),
        ("bernoulli", "default", False),
    )
    if hasattr(getattr(_aten, name, None), overload)
}


# -- what a recompute can skip: outputs no backward reads --------------------------------------------------------


class Miss(Exception):
    """A recompute left what it was planned from (its op sequence, dataflow or
    saved tensors, or the forward's random ops): it is run again plainly."""


@dataclass
class Plan:
    """What the recompute of one block can skip, learned from a plain
    recompute: per op, the key it must match (op, argument signature, which
    earlier op made each tensor argument, and whether an outside tensor needs
    grad), and the ops whose outputs no later op nor the backward reads: the
    costed ones skipped (with the shapes of the outputs that stand in for
    them), the cheap ones run."""

    keys: list[tuple]
    dead: dict[int, tuple]  # op position -> (output type, per output (shape, stride, dtype, device) or None)
    unread: frozenset  # positions of cheap ops whose outputs nothing reads: they run, maybe on stand-ins
    shallow: frozenset  # positions of the ops that read no values (views, empty_like): they may run on stand-ins
    dead_calls: frozenset  # (op, call number) of those: the forward keeps none of their outputs
    dead_flops: int


# block key -> Plan, or None where a block cannot be planned (an outside tensor written, a custom autograd
# Function, saved-tensor hooks of its own, repeated misses); the oldest go first
_PLANS: OrderedDict[int, Plan | None] = OrderedDict()
_MISSES: dict[int, int] = defaultdict(int)
_CHOICES: OrderedDict[int, frozenset] = OrderedDict()  # block key -> the (op, call number)s it kept last time
_MAX_PLANS = 256
_MAX_MISSES = 2


def forget_plans() -> None:
    """Drops every learned plan (tests; a model changed in ways its op sequence does not show)."""
    _PLANS.clear()
    _MISSES.clear()
    _CHOICES.clear()


def _remember(cache: OrderedDict, key: int, value: Any) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > _MAX_PLANS:
        cache.popitem(last=False)


def block_key(function: Callable, args: tuple, policy: SelectivePolicy) -> int:
    """What one checkpointed call is known by across steps: the function (a module or bound method by its
    object, a function by its code and closure), its training flag, the policy and its tensor arguments'
    shapes, strides, dtypes and grad flags. A plan or choice found under it is still checked as it is used."""
    owner = getattr(function, "__self__", None)
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    if isinstance(function, torch.nn.Module) or code is None:
        who: Any = _serial(function)
    else:
        cells = getattr(function, "__closure__", None) or ()
        who = (code, _serial(owner), tuple(_cell_id(c) for c in cells))
    tensors = tuple(
        (tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad) if isinstance(a, Tensor) else type(a)
        for a in args
    )
    return hash((who, getattr(function, "training", getattr(owner, "training", None)), policy, tensors))


_PLAIN = (int, float, str, bool, type(None))


def _cell_id(cell) -> Any:
    """A closure cell's contents by value where they are plain (numbers, names; a per-call list of keyword
    names), else by object."""
    try:
        v = cell.cell_contents
    except ValueError:  # an empty cell
        return None
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, (tuple, list)) and all(isinstance(x, _PLAIN) for x in v):
        return tuple(v)
    return _serial(v)


_SERIALS: dict[int, int] = {}  # id -> serial number, while the object lives
_NEXT_SERIAL = itertools.count(1)


def _serial(obj: Any) -> Any:
    """A number for `obj` no later object gets: an id is reused once its object is freed, and a new model at
    a freed one's address would find the old model's plans and kept choices (checked, so still exact, but
    chosen for another block: a different peak). Objects without weak references go by id."""
    if obj is None:
        return None
    key = id(obj)
    serial = _SERIALS.get(key)
    if serial is None:
        try:
            weakref.finalize(obj, _SERIALS.pop, key, None)
        except TypeError:
            return ("id", key)
        serial = _SERIALS[key] = next(_NEXT_SERIAL)
    return serial


class Kept:
    """What one checkpointed call keeps: op outputs keyed by (op, its call
    number), and its dropout masks as bits (all of its random ops or none)."""

    def __init__(self, block_key: int | None = None, plan: Plan | None = None) -> None:
        self.outputs: dict[tuple[Any, int], tuple] = {}
        # (op, call) -> (chain, signature, bits, shape, generator, its state after the draw, meter handle)
        self.masks: dict[tuple[Any, int], tuple] = {}
        self.flops = 0  # the recompute FLOPs these outputs and the plan's skipped ops save
        self.nbytes = 0
        self.block_key = block_key
        self.plan = plan


@dataclass
class _Held:
    func: Any
    index: int  # the op's call number in the block
    chain: int  # the hash of the block's ops up to this one (see _Chain)
    signature: tuple
    out: Any  # detached aliases of the op's outputs: they share its version counters
    handles: list  # the meter's, held as long as the output
    flops: int
    nbytes: int
    storages: set[int]
    versions: list[int]  # of the outputs when made: an in-place op since then changed what they hold
    written: bool = False  # an op of the block wrote its storage (through any alias)

    def unchanged(self) -> bool:
        return not self.written and _versions(self.out) == self.versions


def _versions(out: Any) -> list[int]:
    return [t._version for t in _tensors(out)]


class _Chain:
    """The hash of a block's op sequence so far, views left out (autograd adds ``detach`` calls with grad on).
    A kept output or mask stands for a recomputed call only at the same point of the same sequence: without
    grad, some composite ops decompose otherwise (``matmul`` of a 2-D and a 3-D tensor: ``bmm`` without grad,
    ``mm`` with it), which shifts the call numbers."""

    def __init__(self) -> None:
        self.value = 0

    def step(self, func: Any, info: _OpInfo) -> int:
        if not info.view:
            self.value = hash((self.value, func))
        return self.value


def _generator_of(args: tuple, kwargs: dict) -> Any:
    """The generator a random op draws from: its ``generator`` argument, else its device's default (None: a
    device this module does not know)."""
    gen = kwargs.get("generator")
    if gen is not None:
        return gen
    device = args[0].device
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return None


class Record(TorchDispatchMode):
    """The forward's mode: holds every costed output (counted by `count`,
    which returns a handle to hold beside it; once a block kept some, only
    those) and every dropout mask as bits with the generator's state after
    it; then :meth:`choose` keeps the best under the limit and drops the
    rest."""

    def __init__(self, count: Callable[[Tensor], Any] | None, key: int | None = None) -> None:
        super().__init__()
        self.count = count
        self.calls: dict[Any, int] = defaultdict(int)
        self.chain = _Chain()
        self.held: list[_Held] = []
        self.by_storage: dict[int, list[_Held]] = defaultdict(list)
        self.masks: dict[tuple[Any, int], tuple] | None = {}  # None: a random op that is no 0/1 mask ran
        self.key = key
        # what this block kept last time: only those are held (holding every costed output until the block ends
        # costs the allocator its reuse); None: hold every one and rank them
        self.expected = _CHOICES.get(key) if key is not None else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        info = _INFO.get(func) or _info(func)
        calls = self.calls
        index = calls[func]
        calls[func] = index + 1
        chain = self.chain.step(func, info)
        if info.mutable and self.by_storage:  # a write through any alias changes a held output
            for t in _written(info, args, kwargs):
                for h in self.by_storage.get(_storage(t), ()):
                    h.written = True
        if _random(info, args, kwargs):
            self._mask(func, index, chain, args, kwargs, out)
        flops = op_flops(func, args, out) if self.expected is None or (func, index) in self.expected else 0
        if flops > 0:
            kept = _detached(out)
            storages = {_storage(t) for t in _tensors(out)} - {None}
            handles = [self.count(t) for t in _tensors(kept)] if self.count is not None else []
            signature = _signature(args, kwargs)
            h = _Held(func, index, chain, signature, kept, handles, flops, _nbytes(out), storages, _versions(kept))
            self.held.append(h)
            for st in storages:
                self.by_storage[st].append(h)
        return out

    def _mask(self, func, index, chain, args, kwargs, out) -> None:
        if self.masks is None:
            return
        gen = _generator_of(args, kwargs) if func in _MASK_OPS and isinstance(out, Tensor) else None
        if gen is None:
            self.masks = None  # one random op the recompute must draw: it draws them all (the generator replays)
            return
        bits = pack_mask(out)
        handle = self.count(bits) if self.count is not None else None
        # the generator's state after the draw: the recompute sets it, so that what reads the generator later in
        # the block (a checkpoint nested in it) finds it as the forward did
        self.masks[(func, index)] = (chain, _signature(args, kwargs), bits, out.shape, gen, gen.get_state(), handle)

    def choose(self, limit: float, outputs: Any = None) -> Kept:
        """Keeps the best of what was held under `limit` bytes; never an output sharing storage with the block's
        `outputs` (the caller may write those in place)."""
        plan = _PLANS.get(self.key) if self.key is not None else None
        kept = Kept(self.key, plan)
        if self.masks:  # first: a mask's recompute costs a random draw per value, kept at one bit per value
            nbytes = sum(m[2].numel() for m in self.masks.values())
            if nbytes <= limit:
                kept.masks, kept.nbytes = self.masks, nbytes
        self.masks = None
        dead = plan.dead_calls if plan is not None else frozenset()
        if plan is not None:
            kept.flops += plan.dead_flops
        returned = {_storage(t) for t in _flat_outputs(outputs)}
        # most FLOPs per byte first; ties: the smaller, then the earlier (sorted() is stable)
        ranked = sorted(self.held, key=lambda h: (-h.flops / max(h.nbytes, 1), h.nbytes))
        for h in ranked:
            if (h.func, h.index) in dead or not h.unchanged() or h.storages & returned:
                continue
            if kept.nbytes + h.nbytes <= limit:
                kept.outputs[(h.func, h.index)] = (h.chain, h.signature, h.out, h.handles, h.versions)
                kept.nbytes += h.nbytes
                kept.flops += h.flops
        self.held, self.by_storage = [], {}  # the others (and their handles) go now
        if self.key is not None:
            _remember(_CHOICES, self.key, frozenset(kept.outputs))
        return kept


def _flat_outputs(outputs: Any) -> list[Tensor]:
    if isinstance(outputs, Tensor):
        return [outputs]
    if isinstance(outputs, (tuple, list)):
        return [t for o in outputs for t in _flat_outputs(o)]
    if isinstance(outputs, dict):
        return [t for o in outputs.values() for t in _flat_outputs(o)]
    return []


@dataclass
class _Op:
    """One recomputed call, as learning sees it."""

    func: Any
    call: int
    reads: list[int]  # positions of the ops that made the tensor arguments whose values it reads
    fresh: bool  # functional with new storages: skippable
    always: bool  # must run whatever reads it: writes in place, draws random numbers, returns no tensor
    view: bool  # only aliases its inputs: runs, reads no values
    dead: tuple | None  # what stands in for its outputs if it is skipped: (output type, templates)
    flops: int


class Replay(TorchDispatchMode):
    """The recompute's mode: a kept call returns its output instead of
    running, a random call its mask; with a :class:`Plan` the costed ops no
    later op nor the backward reads are not run (NaN-filled tensors stand in); with
    `learn`, the run is watched to make that plan. Leaving the plan (or the
    masks) raises :class:`Miss`: :meth:`fallback` gives the mode to run the
    recompute again plainly."""

    def __init__(self, kept: Kept, *, learn: bool = False, use_plan: bool = True, use_masks: bool = True) -> None:
        super().__init__()
        self.kept = kept
        self.plan = kept.plan if use_plan else None
        self.masks = kept.masks if use_masks else {}
        self.may_learn = learn
        self.learn = learn and kept.block_key is not None and kept.block_key not in _PLANS
        self._pack = None  # this mode's saved-tensor pack hook, while tracking
        self.track = self.plan is not None or self.learn
        self.planned = self.plan is not None  # stand-ins may run: an error in such a run is retried plainly
        self.calls: dict[Any, int] = defaultdict(int)
        self.chain = _Chain()
        self.taken: dict[tuple[Any, int], tuple] = {}
        self.position = 0
        self.producer: dict[int, int] = {}  # storage -> position of the op that made it (this run)
        # what the run made, held until it ends: no storage of it is freed and its address reused meanwhile, so
        # an address names one storage (and a tensor made outside the ops, torch.tensor(list), never a made one)
        self.alive: list[Tensor] = []
        self.garbage: set[int] = set()  # storages standing in for skipped ops' outputs
        self.ops: list[_Op] = []
        self.keys: list[tuple] = []
        self.saved_by: set[int] = set()  # positions of the ops whose outputs autograd saved
        self.plannable = True
        self._hooks = None

    # the mode and, while tracking, saved-tensor hooks (chained to any outer ones, the meter's)
    def __enter__(self):
        if self.track:
            outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
            pack_outer, unpack_outer = outer if outer is not None else (None, None)

            def pack(t: Tensor):
                self._saved(t)
                return pack_outer(t) if pack_outer is not None else t

            def unpack(packed):
                return unpack_outer(packed) if unpack_outer is not None else packed

            self._pack = pack
            self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
            self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._hooks is not None:
                self._hooks.__exit__(*exc)
                self._hooks = self._pack = None  # the hook holds this mode: no cycle left behind
            self.alive = []

    def _saved(self, t: Tensor) -> None:
        ptr = _storage(t)
        if ptr is None:
            return
        if ptr in self.garbage:
            raise Miss("the backward saves an output the plan skipped")
        made = self.producer.get(ptr)
        if made is not None:
            self.saved_by.add(made)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        calls = self.calls
        index = calls[func]
        calls[func] = index + 1
        info = _INFO.get(func) or _info(func)
        chain = self.chain.step(func, info)
        if not self.track:
            return self._run(func, info, index, chain, args, kwargs)
        position = self.position
        self.position = position + 1
        top = _top_hooks(False)
        if top is None or top[0] is not self._pack:
            # saved-tensor hooks pushed inside the block (a torch.utils.checkpoint, save_on_cpu) save tensors
            # this mode does not see: nothing can be known unread
            if self.plan is not None:
                raise Miss(f"op {position} ({func}) runs under saved-tensor hooks of the block's own")
            self.plannable = False
        tensors = _flat_tensors(args, kwargs)
        ptrs = [_storage(t) for t in tensors]
        producer = self.producer
        reads = tuple([producer.get(p, -1) if p is not None else -1 for p in ptrs])
        outside = tuple([t.requires_grad for t, r in zip(tensors, reads) if r < 0])
        key = (func, _signature(args, kwargs), reads, outside)
        plan = self.plan
        if plan is not None:
            if position >= len(plan.keys) or plan.keys[position] != key:
                raise Miss(f"op {position} ({func}) is not the one the plan was learned from")
            dead = plan.dead.get(position)
            if dead is not None:
                return self._stand_in(dead, position)
            if self.garbage and position not in plan.shallow and position not in plan.unread:
                if any(p in self.garbage for p in ptrs):
                    raise Miss(f"op {position} ({func}) reads an output the plan skipped")
        out = self._run(func, info, index, chain, args, kwargs)
        if isinstance(out, Tensor):
            outs: Any = (out,)
            made = [out]
        else:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            made = [o for o in outs if isinstance(o, Tensor)]
        made_ptrs = {_storage(o) for o in made}
        made_ptrs.discard(None)
        aliases = not made_ptrs.isdisjoint(ptrs)
        if not aliases:  # new storages
            self.alive.extend(made)
            for q in made_ptrs:
                producer[q] = position
            if plan is not None and position in plan.unread:
                self.garbage |= made_ptrs  # computed from stand-ins: no later op reads it, autograd saves none
        if self.learn:
            fresh = (
                bool(made)
                and not aliases
                and not info.mutable
                and all(o is None or isinstance(o, Tensor) for o in outs)
                and not _random(info, args, kwargs)
            )
            self._learn(func, info, index, args, kwargs, out, outs, key, reads, fresh, bool(made) and aliases)
        return out

    def _learn(self, func, info, index, args, kwargs, out, outs, key, reads, fresh, aliases) -> None:
        self.keys.append(key)
        if info.mutable and any(self.producer.get(_storage(t), -1) < 0 for t in _written(info, args, kwargs)):
            self.plannable = False  # writes an outside tensor (a buffer, an input): never skip around it
        view = aliases and not info.mutable
        always = not (fresh or view)  # writes in place, draws random numbers or returns no tensor
        dead = None
        if fresh:
            kind = Tensor if isinstance(out, Tensor) else type(out)
            dead = (kind, [(tuple(o.shape), o.stride(), o.dtype, o.device) if o is not None else None for o in outs])
        flops = op_flops(func, args, out) if fresh else 0
        values = [] if view or info.shape_only else [r for r in reads if r >= 0]
        self.ops.append(_Op(func, index, values, fresh, always, view, dead, flops))

    def _run(self, func, info, index, chain, args, kwargs):
        if self.masks and _random(info, args, kwargs):
            entry = self.masks.get((func, index))
            if entry is None or entry[0] != chain or entry[1] != _signature(args, kwargs):
                raise Miss(f"random op {func} was not drawn in the forward: the generator must replay")
            _, _, bits, shape, gen, state, _ = entry
            if _MASK_OPS[func]:  # in place: the mask goes where the op would have drawn it
                out = unpack_mask(bits, args[0])
            else:
                out = unpack_mask(bits, torch.empty(shape, dtype=args[0].dtype, device=args[0].device))
            if gen is torch.default_generator or (torch.cuda.is_initialized() and gen in torch.cuda.default_generators):
                gen.set_state(state)  # where the forward's draw left it (the checkpoint restores defaults after)
            return out
        entry = self.kept.outputs.pop((func, index), None)
        if entry is not None:
            self.taken[(func, index)] = entry
            kept_chain, signature, out, _, versions = entry
            if kept_chain == chain and signature == _signature(args, kwargs) and _versions(out) == versions:
                return out
        return func(*args, **kwargs)

    def _stand_in(self, dead: tuple, position: int) -> Any:
        """Uninitialised tensors of the skipped op's output shapes (nothing reads their values)."""
        kind, templates = dead
        outs = []
        for t in templates:
            if t is None:
                outs.append(None)
                continue
            shape, stride, dtype, device = t
            o = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            if o.is_floating_point() or o.is_complex():
                o.fill_(math.nan)  # a read no check saw (.tolist(), .numpy()) shows as NaN, not as stale memory
            ptr = _storage(o)
            self.alive.append(o)
            if ptr is not None:
                self.garbage.add(ptr)
                self.producer[ptr] = position  # as in the run the plan was learned from
            outs.append(o)
        return outs[0] if kind is Tensor else kind(outs)

    def finish(self, outputs: Any) -> None:
        """After the recompute, before its backward: a planned run that used
        a custom autograd Function (whose ctx may hold tensors no hook sees)
        or ended early misses; a learning run stores its plan."""
        custom = _custom_function_in(outputs)
        if self.plan is not None and (custom or self.position != len(self.plan.keys)):
            raise Miss("the recompute's graph is not the one the plan was learned from")
        if self.learn:
            key = self.kept.block_key
            _remember(_PLANS, key, None if custom or not self.plannable else self._plan())
            _CHOICES.pop(key, None)  # chosen without knowing what the recompute skips: chosen again

    def _plan(self) -> Plan:
        live = set(self.saved_by)
        for position in range(len(self.ops) - 1, -1, -1):
            op = self.ops[position]
            if op.always or position in live:
                live.update(op.reads)
        unread = [i for i, op in enumerate(self.ops) if op.fresh and i not in live]
        # only the costed ops are skipped; the cheap ones nothing reads still run (on the stand-ins, if they come
        # after one), so what the block hands out of band (an attribute it sets) is wrong only if it derives
        # from a skipped matmul's output
        dead = {i: self.ops[i].dead for i in unread if self.ops[i].flops > 0}
        return Plan(
            keys=self.keys,
            dead=dead,
            unread=frozenset(i for i in unread if i not in dead),
            shallow=frozenset(i for i, op in enumerate(self.ops) if op.view or not op.reads),
            dead_calls=frozenset((self.ops[i].func, self.ops[i].call) for i in dead),
            dead_flops=sum(self.ops[i].flops for i in dead),
        )

    def fallback(self) -> Replay:
        """The mode for running the recompute again after a :class:`Miss`:
        the kept outputs it took back are returned to it, no plan, no masks
        (the generator replays), learning again unless this block missed
        too often."""
        self.kept.outputs.update(self.taken)
        key = self.kept.block_key
        if key is not None:
            _MISSES[key] += 1
            if _MISSES[key] >= _MAX_MISSES:
                _remember(_PLANS, key, None)
            else:
                _PLANS.pop(key, None)
        return Replay(self.kept, learn=self.may_learn, use_plan=False, use_masks=False)


_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def _custom_function_in(outputs: Any) -> bool:
    """Whether the autograd graph behind `outputs` holds a custom autograd Function's node."""
    seen: set = set()
    stack = [o.grad_fn for o in _tensors(outputs) if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            return True
        stack.extend(n for n, _ in node.next_functions)
    return False
