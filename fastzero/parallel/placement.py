"""Activation checkpointing placed under a memory budget:
``fastzero.checkpointing.apply(model, budget_bytes, sample_input=x)``
checkpoints the fewest blocks that keep the saved activations under the
budget and says what it chose.

One sample forward (and backward) measures, per block, with saved-tensor
hooks (:class:`fastzero.parallel.checkpointing.SavedBytes`, each storage
once, params left out):

- ``full[i]``: the bytes block i saves when it is not checkpointed;
- ``kept[i]``: the bytes it keeps when it is (its inputs, or what the
  configured partitioning / CPU copy / selective policy keeps);
- ``transient[i]``: the most its recompute adds during its backward
  (measured for the full policy's reentrant recompute; where the recompute
  runs under torch's own hooks, out of sight, as with the selective policy
  or keyword inputs: ``full[i]``, an upper bound);
- ``outside``: what the rest of the model saves, of which ``after`` after
  the last block (its backward, and so its release, comes before any
  block's recompute).

For a placement P (blocks run in list order, and backward in reverse), with
``cost[j] = kept[j] if j in P else full[j]``::

    peak(P) = max(outside + sum(cost),
                  max over i in P of outside - after + sum(cost[:i]) + kept[i] + transient[i])

The placement is the smallest P with ``peak(P) <= budget`` (every subset of
each size is tried while there are at most 50,000 of that size, else the
blocks that save the most, greedily), ties broken by the lower peak. The
generator states, buffers (batch-norm statistics) and ``.grad`` of the model
are put back after the measurement.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fastzero.parallel.checkpointing import SavedBytes, _RNGSnapshot, checkpoint, non_reentrant_checkpoint

log = logging.getLogger(__name__)

BEFORE, AFTER = "<before>", "<after>"  # the tags of what is saved outside the blocks
EXHAUSTIVE = 50_000  # subsets of one size tried one by one up to this many (cheap sums), else greedy


@dataclass
class Placement:
    """What :func:`apply` measured and chose; ``str()`` is a table."""

    budget_bytes: int
    policy: str
    blocks: list[str]  # every block's name, in forward order
    chosen: list[str]  # the blocks checkpointed
    full: list[int]
    kept: list[int]
    transient: list[int]
    outside: int
    after: int  # of `outside`, saved after the last block
    peak_bytes: int  # predicted with the chosen blocks checkpointed
    peak_bytes_none: int  # with none

    def __str__(self) -> str:
        lines = [
            f"activation checkpointing under a budget of {self.budget_bytes:,} bytes ({self.policy} policy): "
            f"{len(self.chosen)} of {len(self.blocks)} blocks checkpointed, peak saved activations "
            f"{self.peak_bytes:,} bytes (none checkpointed: {self.peak_bytes_none:,})",
            f"{'block':<32} {'saves':>14} {'checkpointed':>14} {'chosen':>7}",
        ]
        for name, f, k in zip(self.blocks, self.full, self.kept):
            lines.append(f"{name:<32} {f:>14,} {k:>14,} {'yes' if name in self.chosen else '':>7}")
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


def _wrap(block: nn.Module, policy: str, probe: Any = None) -> None:
    """Replaces the block's forward with a checkpointed call of it (names and state_dict unchanged)."""
    _unwrap(block)
    inner = block.forward

    def run(*args: Any) -> Any:
        if probe is not None and torch.is_grad_enabled():  # the reentrant recompute (its forward runs without grad)
            probe()
        return inner(*args)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs:  # keyword tensors may need grads: the non-reentrant form passes them through autograd
            if policy == "full":
                return non_reentrant_checkpoint(inner, *args, **kwargs)
            from fastzero.parallel.checkpointing import selective_checkpoint

            return selective_checkpoint(inner, *args, policy=policy, **kwargs)
        return checkpoint(run, *args, policy=policy)

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


def _measure(model: nn.Module, blocks: list[tuple[str, nn.Module]], sample: Any, policy: str) -> tuple:
    """(full, kept, transient, outside, after) in bytes (module docstring)."""
    params = list(model.parameters())
    names = [n for n, _ in blocks]

    def run(meter: SavedBytes, backward: bool) -> None:
        hooks = []
        meter.tag = BEFORE
        for i, (name, b) in enumerate(blocks):
            # saves between blocks count as before the last one (kept through every recompute): an upper bound
            then = AFTER if i == len(blocks) - 1 else BEFORE
            hooks.append(b.register_forward_pre_hook(lambda m, a, name=name: setattr(meter, "tag", name)))
            hooks.append(b.register_forward_hook(lambda m, a, o, then=then: setattr(meter, "tag", then)))
        try:
            out = _call(model, sample)
            meter.after_forward = meter.live
            if backward:
                floats = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
                if floats:
                    torch.autograd.backward([t.float().sum() for t in floats])
        finally:
            for h in hooks:
                h.remove()

    with _untouched(model):
        with SavedBytes(params) as plain:
            run(plain, backward=False)
        full = [plain.by_tag.get(n, 0) for n in names]
        outside = plain.after_forward - sum(full)
        after = plain.by_tag.get(AFTER, 0)

        transient = [0] * len(blocks)
        current = [None]
        base = {}
        seen: set[int] = set()  # blocks whose recompute ran in sight (reentrant: no keyword inputs)

        def make_probe(i: int):
            def probe() -> None:  # a recompute starts: the peak from here on is this block's
                seen.add(i)
                current[0] = i
                base[i] = meter.live
                meter.local = meter.live

            return probe

        meter = SavedBytes(params)
        meter.local = 0
        original_count = meter.count

        def count(t: Tensor) -> Any:
            handle = original_count(t)
            if current[0] is not None:
                meter.local = max(meter.local, meter.live)
                transient[current[0]] = max(transient[current[0]], meter.local - base[current[0]])
            return handle

        meter.count = count
        try:
            for i, (_, b) in enumerate(blocks):
                _wrap(b, policy, probe=make_probe(i) if policy == "full" else None)
            with meter:
                run(meter, backward=policy == "full")
        finally:
            for _, b in blocks:
                _unwrap(b)
        kept = [meter.by_tag.get(n, 0) for n in names]
    # a recompute under torch's own hooks (selective policy, keyword inputs) is out of sight: bound it by the
    # block's plain saves
    transient = [transient[i] if i in seen else full[i] for i in range(len(blocks))]
    return full, kept, transient, outside, after


def apply(
    model: nn.Module,
    budget_bytes: int,
    *,
    sample_input: Any = None,
    blocks: Any = None,
    policy: str = "full",
) -> Placement:
    """Checkpoints the fewest of `blocks` (default: the children of the
    model's largest ``nn.ModuleList``) that keep the peak of saved
    activations of a forward and backward on `sample_input` (a tensor, a
    tuple of positional inputs or a dict of keyword inputs) under
    `budget_bytes`; `policy` is ``"full"`` or ``"selective"``. Returns (and
    logs) the :class:`Placement`. Calling it again replaces the previous
    placement; :func:`unapply` removes it."""
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes = {budget_bytes!r}: must be a positive integer (bytes)")
    if sample_input is None:
        raise TypeError("apply() needs sample_input= (the input of one forward) to measure each block's activations")
    if policy not in ("full", "selective"):
        raise ValueError(f"policy = {policy!r}: use 'full' or 'selective'")
    named = _named(model, blocks)
    unapply(model)
    full, kept, transient, outside, after = _measure(model, named, sample_input, policy)
    chosen = choose(full, kept, transient, outside, after, budget_bytes)
    for i in sorted(chosen):
        _wrap(named[i][1], policy)
    report = Placement(
        budget_bytes=budget_bytes,
        policy=policy,
        blocks=[n for n, _ in named],
        chosen=[named[i][0] for i in sorted(chosen)],
        full=full,
        kept=kept,
        transient=transient,
        outside=outside,
        after=after,
        peak_bytes=peak(full, kept, transient, outside, after, chosen),
        peak_bytes_none=peak(full, kept, transient, outside, after, set()),
    )
    log.info("%s", report)
    return report
