"""The cost-ranked selective policy of activation checkpointing:
``checkpoint(fn, *args, policy="selective")`` or
``policy=SelectivePolicy(max_kept_ratio=...)``.

A checkpointed block recomputes its forward before its backward. Keeping
an op's output saves recomputing that op, at the price of the output's
bytes. The ops worth keeping are those whose recompute costs the most per
byte kept; this module counts that cost in floating-point operations:

- ``mm``, ``bmm``, ``addmm``, ``baddbmm``: ``2 * m * n * k`` over ``4 * m * n``
  bytes (fp32), i.e. ``k / 2`` FLOPs per byte: the inner dimension decides
  (an MLP's down-projection, k = 4 * width, is worth 4x its up-projection);
- the attention kernels (``_scaled_dot_product_*``, ``_flash/_efficient_attention_forward``):
  ``4 * B * h * T * S * d`` (the two matmuls, causal masking not subtracted);
- ``convolution``: ``2 * outputs * (in_channels / groups) * kernel size``;
- everything else (elementwise, normalisation, dropout, views): 0, never kept.

In the block's forward every costed output is held until the block ends;
then they are ranked by FLOPs per byte (ties: the smaller first) and kept
while their bytes fit ``max_kept_ratio`` times the block's tensor inputs'
bytes (an output that does not fit is skipped and smaller ones are still
tried); the rest are dropped, and so is an output an in-place op changed
later in the block (it no longer holds what the op made; one changed after
the block, while its tensor is alive, is recomputed instead of taken back). The recompute runs every op again except the
kept ones, whose outputs it takes back in order (matched by op, call number
and input shapes; an op that does not match is simply recomputed), so the
results are bit for bit those of the plain run. Random ops are never kept
(their cost is 0), so the generator advances in the recompute as in the
forward.
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SelectivePolicy", "op_flops"]

_aten = torch.ops.aten


@dataclass(frozen=True)
class SelectivePolicy:
    """Keep the op outputs whose recompute costs the most FLOPs per byte,
    up to ``max_kept_ratio`` times the bytes of the block's tensor inputs
    (which a checkpoint keeps anyway): 1.0 (the default, ``"selective"``)
    at most doubles what a fully recomputed block keeps; 0 keeps nothing
    (full recompute); ``math.inf`` keeps every matmul and attention output."""

    max_kept_ratio: float = 1.0

    def __post_init__(self) -> None:
        r = self.max_kept_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or math.isnan(r) or r < 0:
            raise ValueError(
                f"SelectivePolicy(max_kept_ratio={r!r}): give a number >= 0, the bytes kept per byte of the "
                "block's inputs (math.inf: keep every matmul and attention output)"
            )


def _mm(args, out) -> int:  # mm(a, b), bmm(a, b)
    return 2 * out.numel() * args[0].shape[-1]


def _addmm(args, out) -> int:  # addmm(bias, a, b), baddbmm(c, a, b)
    return 2 * out.numel() * args[1].shape[-1]


def _attention_bhtd(args, out) -> int:  # q, k: (batch, heads, T, d), (batch, heads, S, d)
    return 4 * args[0].numel() * args[1].shape[-2]


def _attention_bthd(args, out) -> int:  # q, k: (batch, T, heads, d), (batch, S, heads, d)
    return 4 * args[0].numel() * (args[1].shape[1] if args[1].dim() == 4 else args[1].shape[0])


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


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What must match for a kept output to stand for a recomputed call."""

    def one(a):
        if isinstance(a, Tensor):
            return (tuple(a.shape), a.dtype, a.stride(), a.device)
        return a

    return tuple(one(a) for a in args), tuple(sorted((k, one(v)) for k, v in kwargs.items()))


def _detached(out: Any) -> Any:
    if isinstance(out, Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(_detached(o) for o in out)
    return out


class Kept:
    """The outputs one checkpointed call keeps, keyed by (op, its call number)."""

    def __init__(self) -> None:
        self.outputs: dict[tuple[Any, int], tuple[tuple, Any, Any]] = {}
        self.flops = 0  # the recompute FLOPs these outputs save
        self.nbytes = 0


@dataclass
class _Held:
    func: Any
    index: int  # the op's call number in the block
    signature: tuple
    out: Any
    handles: list  # the meter's, held as long as the output
    flops: int
    nbytes: int
    made: list[Tensor]  # the op's own outputs (a detached alias made here does not share their version counter)
    versions: list[int]  # of those when made: an in-place op since then changed what they hold

    def unchanged(self) -> bool:
        return [t._version for t in self.made] == self.versions


class Record(TorchDispatchMode):
    """The forward's mode: holds every costed output (counted by `count`,
    which returns a handle to hold beside it), then :meth:`choose` keeps the
    best under the limit and drops the rest."""

    def __init__(self, count: Callable[[Tensor], Any] | None) -> None:
        super().__init__()
        self.count = count
        self.calls: dict[Any, int] = defaultdict(int)
        self.held: list[_Held] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        index = self.calls[func]
        self.calls[func] += 1
        flops = op_flops(func, args, out)
        if flops > 0:
            nbytes = _nbytes(out)
            kept = _detached(out)
            handles = [self.count(t) for t in _tensors(kept)] if self.count is not None else []
            made = _tensors(out)
            versions = [t._version for t in made]
            self.held.append(_Held(func, index, _signature(args, kwargs), kept, handles, flops, nbytes, made, versions))
        return out

    def choose(self, limit: float) -> Kept:
        kept = Kept()
        # most FLOPs per byte first; ties: the smaller, then the earlier (sorted() is stable)
        ranked = sorted(self.held, key=lambda h: (-h.flops / max(h.nbytes, 1), h.nbytes))
        for h in ranked:
            if h.unchanged() and kept.nbytes + h.nbytes <= limit:
                refs = [weakref.ref(t) for t in h.made]  # weak: a block's output must not hold itself through ctx
                kept.outputs[(h.func, h.index)] = (h.signature, h.out, h.handles, refs, h.versions)
                kept.nbytes += h.nbytes
                kept.flops += h.flops
        self.held = []  # the others (and their handles) go now
        return kept


def _unchanged(refs: list, versions: list[int]) -> bool:
    """No in-place op changed the outputs since they were kept (as far as the ones still alive tell)."""
    return all(r() is None or r()._version == v for r, v in zip(refs, versions))


class Replay(TorchDispatchMode):
    """The recompute's mode: a kept call returns its output instead of running."""

    def __init__(self, kept: Kept) -> None:
        super().__init__()
        self.kept = kept
        self.calls: dict[Any, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        index = self.calls[func]
        self.calls[func] += 1
        entry = self.kept.outputs.pop((func, index), None)
        if entry is not None and entry[0] == _signature(args, kwargs) and _unchanged(entry[3], entry[4]):
            return entry[1]
        return func(*args, **kwargs)
