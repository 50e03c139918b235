"""Activation checkpointing placed under a memory budget:
``fastzero.checkpointing.apply(model, budget_bytes, sample_input=x)``
checkpoints the fewest blocks that keep the saved activations under the
budget (``policy="mixed"``: picks none / selective / full per block for the
least recompute work) and says what it chose.

One sample forward and backward per policy measures, per block, with
saved-tensor hooks (:class:`fastzero.parallel.checkpointing.SavedBytes`,
each storage once, params left out):

- ``full[i]``: the bytes block i saves when it is not checkpointed;
- ``kept[i]``: the bytes it keeps when it is (its inputs, or what the
  configured partitioning / CPU copy / selective policy keeps);
- ``transient[i]``: the most its recompute adds during its backward (every
  block is wrapped in the reentrant :func:`checkpoint`, keyword inputs
  passed positionally, so each recompute runs in sight of the hooks), or
  the most its forward holds above ``kept[i]`` (the selective policy holds
  every costed output until the block ends), whichever is more;
- ``flops[i]``: the recompute cost of the block's costed ops (matmuls,
  attention: :func:`fastzero.parallel.selective.op_flops`), and
  ``kept_flops[i]`` what the selective policy saves of it;
- ``outside``: what the rest of the model saves, of which ``after`` after
  the last block (its backward, and so its release, comes before any
  block's recompute).

For a placement P (blocks run in list order, and backward in reverse), with
``cost[j] = kept[j] if j in P else full[j]``::

    peak(P) = max(outside + sum(cost),
                  max over i in P of outside - after + sum(cost[:i]) + kept[i] + transient[i])

With one policy the placement is the smallest P with ``peak(P) <= budget``
(every subset of each size is tried while there are at most 50,000 of that
size, else the blocks that save the most, greedily), ties broken by the
lower peak. With ``"mixed"`` each block is none, selective or full (its
``kept``/``transient`` those of its mode) and the placement is the one of
least recompute FLOPs that fits (every assignment while there are at most
3^10, else greedy upgrades by peak saved per FLOP), ties broken by the lower
peak, then the fewer checkpointed blocks. The generator states, buffers
(batch-norm statistics) and ``.grad`` of the model are put back after the
measurement.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from fastzero.parallel.checkpointing import SavedBytes, _RNGSnapshot, checkpoint, selective_checkpoint
from fastzero.parallel.selective import SelectivePolicy, op_flops

log = logging.getLogger(__name__)

BEFORE, AFTER = "<before>", "<after>"  # the tags of what is saved outside the blocks
EXHAUSTIVE = 50_000  # subsets of one size tried one by one up to this many (cheap sums), else greedy
EXHAUSTIVE_MIXED = 3**10  # assignments of none / selective / full tried one by one up to this many
MODES = ("none", "selective", "full")


@dataclass
class Placement:
    """What :func:`apply` measured and chose; ``str()`` is a table."""

    budget_bytes: int
    policy: str  # "full", "selective" or "mixed"
    blocks: list[str]  # every block's name, in forward order
    chosen: list[str]  # the blocks checkpointed
    full: list[int]
    kept: list[int]  # per block, checkpointed under its mode (a block left alone: as it would be; mixed: full)
    transient: list[int]
    outside: int
    after: int  # of `outside`, saved after the last block
    peak_bytes: int  # predicted with the chosen blocks checkpointed
    peak_bytes_none: int  # with none
    modes: list[str] = None  # per block: "none", "selective" or "full"
    flops: list[int] = None  # per block: recompute FLOPs of its costed ops under full recompute
    kept_flops: list[int] = None  # per block: of those, what the selective policy keeps (mixed and selective)
    recompute_flops: int = 0  # of the placement chosen

    def __str__(self) -> str:
        lines = [
            f"activation checkpointing under a budget of {self.budget_bytes:,} bytes ({self.policy} policy): "
            f"{len(self.chosen)} of {len(self.blocks)} blocks checkpointed, peak saved activations "
            f"{self.peak_bytes:,} bytes (none checkpointed: {self.peak_bytes_none:,}), recompute "
            f"{self.recompute_flops:,} FLOPs",
            f"{'block':<32} {'saves':>14} {'checkpointed':>14} {'mode':>10}",
        ]
        for name, f, k, m in zip(self.blocks, self.full, self.kept, self.modes):
            lines.append(f"{name:<32} {f:>14,} {k:>14,} {m:>10}")
        lines.append(f"{'(outside the blocks)':<32} {self.outside:>14,}")
        return "\n".join(lines)


def peak(full: list[int], kept: list[int], transient: list[int], outside: int, after: int, chosen: set[int]) -> int:
    """The formula in the module docstring."""
    cost = [kept[i] if i in chosen else full[i] for i in range(len(full))]
    back = max((outside - after + sum(cost[:i]) + kept[i] + transient[i] for i in chosen), default=0)
    return max(outside + sum(cost), back)


def choose(full: list[int], kept: list[int], transient: list[int], outside: int, after: int, budget: int) -> set[int]:
    """The fewest blocks whose placement's peak fits `budget`; ValueError when none does."""
    n = len(full)
    best_any = None
    for k in range(n + 1):
        if math.comb(n, k) <= EXHAUSTIVE:
            candidates = (set(c) for c in itertools.combinations(range(n), k))
        else:  # the k blocks that save the most
            candidates = iter([set(sorted(range(n), key=lambda i: kept[i] - full[i])[:k])])
        scored = [(peak(full, kept, transient, outside, after, c), sorted(c)) for c in candidates]
        low = min(scored)
        best_any = low if best_any is None or low[0] < best_any[0] else best_any
        if low[0] <= budget:
            return set(low[1])
    raise ValueError(
        f"budget_bytes = {budget:,}: no placement of checkpoints fits it; the least peak of saved activations any "
        f"placement reaches is {best_any[0]:,} bytes (blocks {best_any[1]}), of which {outside:,} are saved outside "
        "the blocks. Raise the budget, pass smaller blocks= (finer blocks keep less), or shrink the batch"
    )


def _arrays(options: dict[str, tuple[list[int], list[int]]], modes: tuple[str, ...]) -> tuple[list, list, set]:
    """kept, transient and the checkpointed set of one per-block assignment of modes."""
    kept = [options[m if m != "none" else "full"][0][i] for i, m in enumerate(modes)]
    transient = [options[m if m != "none" else "full"][1][i] for i, m in enumerate(modes)]
    return kept, transient, {i for i, m in enumerate(modes) if m != "none"}


def recompute_flops(flops: list[int], kept_flops: list[int], modes: tuple[str, ...]) -> int:
    """FLOPs the recomputes of an assignment run: a full block's, a selective block's less what it keeps."""
    return sum(f if m == "full" else f - k if m == "selective" else 0 for f, k, m in zip(flops, kept_flops, modes))


def choose_mixed(
    full: list[int],
    options: dict[str, tuple[list[int], list[int]]],
    flops: list[int],
    kept_flops: list[int],
    outside: int,
    after: int,
    budget: int,
) -> tuple[str, ...]:
    """The per-block modes of least recompute FLOPs whose peak fits `budget` (module docstring)."""
    n = len(full)

    def score(modes: tuple[str, ...]) -> tuple[int, int, int]:
        kept, transient, chosen = _arrays(options, modes)
        p = peak(full, kept, transient, outside, after, chosen)
        return recompute_flops(flops, kept_flops, modes), p, len(chosen)

    if len(MODES) ** n <= EXHAUSTIVE_MIXED:
        scored = [(score(m), m) for m in itertools.product(MODES, repeat=n)]
    else:  # upgrade one block at a time: the most peak saved per FLOP added, until it fits
        modes = ("none",) * n
        scored = [(score(modes), modes)]
        while scored[-1][0][1] > budget:
            (f0, p0, _), now = scored[-1]
            steps = []
            for i in range(n):
                for m in MODES[MODES.index(now[i]) + 1 :]:
                    nxt = now[:i] + (m,) + now[i + 1 :]
                    s = score(nxt)
                    steps.append(((p0 - s[1]) / (s[0] - f0 + 1), s, nxt))
            if not steps:
                break
            _, s, nxt = max(steps, key=lambda t: t[0])
            scored.append((s, nxt))
    fits = [(s, m) for s, m in scored if s[1] <= budget]
    if not fits:
        least = min(scored, key=lambda t: t[0][1])
        raise ValueError(
            f"budget_bytes = {budget:,}: no placement of checkpoints fits it; the least peak of saved activations any "
            f"placement reaches is {least[0][1]:,} bytes (modes {list(least[1])}), of which {outside:,} are saved "
            "outside the blocks. Raise the budget, pass smaller blocks= (finer blocks keep less), or shrink the batch"
        )
    return min(fits)[1]


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of the model's largest ``nn.ModuleList`` (its layers)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of layers: pass blocks= (the modules to checkpoint)"
        )
    name, best = max(lists, key=lambda item: len(item[1]))
    return [(f"{name}.{i}" if name else str(i), m) for i, m in enumerate(best)]


def _named(model: nn.Module, blocks: Any) -> list[tuple[str, nn.Module]]:
    if blocks is None:
        return find_blocks(model)
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for b in blocks:
        if not isinstance(b, nn.Module) or id(b) not in names:
            raise ValueError(f"blocks= holds {type(b).__name__} that is not a submodule of the model")
        out.append((names[id(b)] or type(b).__name__, b))
    if not out:
        raise ValueError("blocks= is empty: give the modules to checkpoint")
    return out


# -- wrapping ---------------------------------------------------------------------------------------------------------


def _wrap(block: nn.Module, policy: Any, probe: Any = None) -> None:
    """Replaces the block's forward with a checkpointed call of it (names and state_dict unchanged): the
    reentrant checkpoint, keyword inputs passed to it positionally so that keyword tensors get grads."""
    _unwrap(block)
    inner = block.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        if probe is not None and torch.is_grad_enabled():  # the reentrant recompute (its forward runs without grad)
            probe()
        return inner(*args, **kwargs)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if policy == "full":
            if not kwargs:
                return checkpoint(run, *args)
            policy_now = SelectivePolicy(0.0)  # keeps nothing: full recompute, through the keyword-passing form
        else:
            policy_now = policy
        return selective_checkpoint(run, *args, policy=policy_now, **kwargs)

    block.forward = forward
    block._fastzero_checkpointed = policy


def _unwrap(block: nn.Module) -> None:
    if "_fastzero_checkpointed" in block.__dict__:
        del block.__dict__["forward"]
        del block.__dict__["_fastzero_checkpointed"]


def unapply(model: nn.Module) -> None:
    """Undoes :func:`apply`: every block runs its own forward again."""
    for m in model.modules():
        _unwrap(m)


# -- measuring --------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _untouched(model: nn.Module) -> Iterator[None]:
    """Puts back the generator states, buffers and grads the sample runs change."""
    rng = _RNGSnapshot.take()
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    try:
        yield
    finally:
        rng.restore()
        with torch.no_grad():
            for b, v in buffers:
                b.copy_(v)
        for p, g in grads:
            p.grad = g


def _tensors(out: Any) -> list[Tensor]:
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _tensors(v)]
    return []


def _call(model: nn.Module, sample: Any) -> Any:
    if isinstance(sample, dict):
        return model(**sample)
    if isinstance(sample, (tuple, list)):
        return model(*sample)
    return model(sample)


class _FlopsByTag(TorchDispatchMode):
    """Sums the costed ops' FLOPs (:func:`op_flops`) under the meter's current tag."""

    def __init__(self, meter: SavedBytes) -> None:
        super().__init__()
        self.meter = meter
        self.flops: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.meter.tag is not None:
            self.flops[self.meter.tag] += op_flops(func, args, out)
        return out


def _run(model: nn.Module, blocks: list[tuple[str, nn.Module]], sample: Any, meter: SavedBytes) -> None:
    """One forward and backward under `meter`, its tag set to the block running (or BEFORE / AFTER)."""
    hooks = []
    meter.tag = BEFORE
    for i, (name, b) in enumerate(blocks):
        # saves between blocks count as before the last one (kept through every recompute): an upper bound
        then = AFTER if i == len(blocks) - 1 else BEFORE
        hooks.append(b.register_forward_pre_hook(lambda m, a, name=name: setattr(meter, "tag", name)))
        hooks.append(b.register_forward_hook(lambda m, a, o, then=then: setattr(meter, "tag", then)))
    try:
        with meter:
            out = _call(model, sample)
            meter.after_forward = meter.live
            floats = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
            if floats:
                torch.autograd.backward([t.float().sum() for t in floats])
    finally:
        for h in hooks:
            h.remove()


def _measure_plain(model: nn.Module, blocks: list[tuple[str, nn.Module]], sample: Any) -> tuple:
    """(full, outside, after, flops) of the model without checkpoints (module docstring)."""
    names = [n for n, _ in blocks]
    plain = SavedBytes(model.parameters())
    counter = _FlopsByTag(plain)
    with counter:
        _run(model, blocks, sample, plain)
    full = [plain.by_tag.get(n, 0) for n in names]
    return full, plain.after_forward - sum(full), plain.by_tag.get(AFTER, 0), [counter.flops.get(n, 0) for n in names]


def _measure(model: nn.Module, blocks: list[tuple[str, nn.Module]], sample: Any, policy: Any) -> tuple:
    """(kept, transient, kept_flops) of every block checkpointed under `policy` (module docstring)."""
    names = [n for n, _ in blocks]
    transient = [0] * len(blocks)
    current = [None]
    base = {}
    # kept: what the block's forward leaves alive (its holds dropped at its end are not kept); forward: its most
    before, kept, forward, running = [0] * len(blocks), [0] * len(blocks), [0] * len(blocks), [None]

    def enter(i: int) -> None:
        running[0], before[i] = i, meter.live

    def leave(i: int) -> None:
        running[0], kept[i] = None, meter.live - before[i]

    def make_probe(i: int):
        def probe() -> None:  # a recompute starts: the peak from here on is this block's
            current[0] = i
            base[i] = meter.live
            meter.local = meter.live

        return probe

    meter = SavedBytes(model.parameters())
    meter.local = 0
    original_count = meter.count

    def count(t: Tensor) -> Any:
        handle = original_count(t)
        if current[0] is not None:
            meter.local = max(meter.local, meter.live)
            transient[current[0]] = max(transient[current[0]], meter.local - base[current[0]])
        if running[0] is not None:
            forward[running[0]] = max(forward[running[0]], meter.live - before[running[0]])
        return handle

    meter.count = count
    hooks = []
    try:
        for i, (_, b) in enumerate(blocks):
            _wrap(b, policy, probe=make_probe(i))
            hooks.append(b.register_forward_pre_hook(lambda m, a, i=i: enter(i)))
            hooks.append(b.register_forward_hook(lambda m, a, o, i=i: leave(i)))
        _run(model, blocks, sample, meter)
    finally:
        for h in hooks:
            h.remove()
        for _, b in blocks:
            _unwrap(b)
    transient = [max(t, f - k) for t, f, k in zip(transient, forward, kept)]
    return kept, transient, [meter.kept_flops.get(n, 0) for n in names]


def _policy(policy: Any, selective: Any) -> tuple[str, Any]:
    """(its name, what _wrap takes) of apply's policy argument."""
    if selective is not None and not isinstance(selective, SelectivePolicy):
        raise TypeError(f"selective = {selective!r}: give a fastzero.checkpointing.SelectivePolicy")
    if isinstance(policy, SelectivePolicy):
        return "selective", policy
    if isinstance(policy, str) and policy in ("full", "selective", "mixed"):
        return policy, "full" if policy == "full" else selective or SelectivePolicy()
    raise ValueError(
        f"policy = {policy!r}: use 'full', 'selective' (or a SelectivePolicy), or 'mixed' (none, selective or full "
        "per block, the least recompute work that fits)"
    )


def apply(
    model: nn.Module,
    budget_bytes: int,
    *,
    sample_input: Any = None,
    blocks: Any = None,
    policy: Any = "full",
    selective: SelectivePolicy | None = None,
) -> Placement:
    """Checkpoints blocks of `model` (default: the children of its largest
    ``nn.ModuleList``; else `blocks`) so that the peak of saved activations
    of a forward and backward on `sample_input` (a tensor, a tuple of
    positional inputs or a dict of keyword inputs) stays under
    `budget_bytes`. `policy`: ``"full"`` or ``"selective"`` (or a
    :class:`SelectivePolicy`) checkpoints the fewest blocks with that
    policy; ``"mixed"`` picks none, selective (`selective`, default
    ``SelectivePolicy()``) or full per block, for the least recompute FLOPs.
    Returns (and logs) the :class:`Placement`. Calling it again replaces the
    previous placement; :func:`unapply` removes it."""
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes = {budget_bytes!r}: must be a positive integer (bytes)")
    if sample_input is None:
        raise TypeError("apply() needs sample_input= (the input of one forward) to measure each block's activations")
    name, wrap_policy = _policy(policy, selective)
    named = _named(model, blocks)
    unapply(model)
    with _untouched(model):
        full, outside, after, flops = _measure_plain(model, named, sample_input)
        options, kept_flops = {}, [0] * len(named)
        for mode in ("full", "selective") if name == "mixed" else (name,):
            kept, transient, saved = _measure(model, named, sample_input, "full" if mode == "full" else wrap_policy)
            options[mode] = (kept, transient)
            kept_flops = saved if mode == "selective" else kept_flops
    if name == "mixed":
        modes = choose_mixed(full, options, flops, kept_flops, outside, after, budget_bytes)
    else:
        chosen = choose(full, *options[name], outside, after, budget_bytes)
        modes = tuple(name if i in chosen else "none" for i in range(len(named)))
    for (_, block), mode in zip(named, modes):
        if mode != "none":
            _wrap(block, "full" if mode == "full" else wrap_policy)
    shown = options if "full" in options else {**options, "full": options[name]}  # for the blocks left alone
    kept, transient, chosen = _arrays(shown, modes)
    report = Placement(
        budget_bytes=budget_bytes,
        policy=name,
        blocks=[n for n, _ in named],
        chosen=[named[i][0] for i in sorted(chosen)],
        full=full,
        kept=kept,
        transient=transient,
        outside=outside,
        after=after,
        peak_bytes=peak(full, kept, transient, outside, after, chosen),
        peak_bytes_none=outside + sum(full),
        modes=list(modes),
        flops=flops,
        kept_flops=kept_flops,
        recompute_flops=recompute_flops(flops, kept_flops, modes),
    )
    log.info("%s", report)
    return report
