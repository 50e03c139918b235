"""The split backward of zero-bubble schedules: B, the gradient of a stage's
input (what the previous stage waits for), now; W, the weight gradients,
later, in what would be the bubble.

Linear layers (``F.linear``, as ``nn.Linear`` calls it, and ``torch.addmm``
with a weight param, as Hugging Face's ``Conv1D`` does) carry most of a
transformer's FLOPs. Run under :class:`DeferWeightGrads`, their backward
computes ``dX = dY W`` only and keeps ``(X, dY)``; :meth:`WeightGradStore.take`
computes ``dW = dY^T X`` and the bias's ``sum(dY)`` at W. Every other param's
gradient is computed during B (autograd cannot split an arbitrary op) and
handed over at W, so a param's ``.grad`` changes only at W: one accumulation
per micro-batch, as the ZeRO reducer expects.

Limits: a linear inside a recomputed (activation-checkpointed) region is
recomputed without the mode, so zb schedules refuse activation checkpointing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

_filling: list[WeightGradStore] = []  # the store B is filling (module-wide: CUDA runs backward on other threads)


class WeightGradStore:
    """What one micro-batch's B leaves for its W: linear layers' inputs and
    output gradients, and other params' finished gradients."""

    def __init__(self) -> None:
        self.linear: list[tuple[Tensor | None, Tensor | None, Tensor, Tensor, bool]] = []  # (w, b, x, dy, x_first)
        self.other: list[tuple[Tensor, Tensor]] = []  # (param, grad)

    @contextlib.contextmanager
    def filling(self) -> Iterator[None]:
        _filling.append(self)
        try:
            yield
        finally:
            _filling.pop()

    def take(self) -> tuple[list[Tensor], list[Tensor]]:
        """The params and their gradients for this micro-batch (each param
        once, its contributions summed); empties the store."""
        out: dict[int, tuple[Tensor, Tensor]] = {}

        def add(p: Tensor, g: Tensor) -> None:
            prev = out.get(id(p))
            out[id(p)] = (p, g if prev is None else prev[1] + g)

        for w, b, x, dy, x_first in self.linear:
            x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
            if w is not None:  # F.linear's weight is [out, in]; addmm's (Conv1D) is [in, out]
                add(w, (dy2.t() @ x2) if x_first else (x2.t() @ dy2))
            if b is not None:
                add(b, dy2.sum(0))
        for p, g in self.other:
            add(p, g)
        self.linear.clear()
        self.other.clear()
        return [p for p, _ in out.values()], [g.to(p.dtype) for p, g in out.values()]

    def __len__(self) -> int:
        return len(self.linear) + len(self.other)


def _store() -> WeightGradStore:
    if not _filling:
        raise RuntimeError(
            "a linear layer run under DeferWeightGrads reached its backward outside a B phase: its weight "
            "gradient would be lost (run the backward inside WeightGradStore.filling())"
        )
    return _filling[-1]


def _wants(t: Tensor | None) -> Tensor | None:
    return t if t is not None and t.requires_grad else None


class _DeferredLinear(torch.autograd.Function):
    # `params`: the weight and bias params. `w` and `b` are them too, as inputs, so that the output needs a
    # gradient even where `x` does not (a stage's first layer on the raw batch: without, no backward would run
    # and its weight gradient would be lost); B gives them None, W their gradient.
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None, params: tuple) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.params = params
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w = ctx.saved_tensors
        _store().linear.append((*ctx.params, x, dy, True))
        return (dy @ w if ctx.needs_input_grad[0] else None), None, None, None


class _DeferredAddmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, b: Tensor, x: Tensor, w: Tensor, params: tuple) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.params = params
        return torch.addmm(b, x, w)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w = ctx.saved_tensors
        _store().linear.append((*ctx.params, x, dy, False))
        return None, (dy @ w.t() if ctx.needs_input_grad[1] else None), None, None


def _param(t) -> bool:
    return isinstance(t, torch.nn.Parameter) and t.requires_grad


def _split(w: Tensor, b: Tensor | None) -> tuple | None:
    """(weight, bias) to defer, or None where the layer is not a param's
    (or its bias needs a gradient that is no param's)."""
    if not _param(w) or (b is not None and b.requires_grad and not _param(b)):
        return None
    return w, (b if b is not None and b.requires_grad else None)


class DeferWeightGrads(TorchFunctionMode):
    """Inside it, linear layers whose weight is a trainable param leave their
    weight (and bias) gradients to :meth:`WeightGradStore.take`."""

    def __torch_function__(self, func, types, args: Sequence = (), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_grad_enabled():
            if func is F.linear:
                x = args[0] if args else kwargs["input"]
                w = args[1] if len(args) > 1 else kwargs["weight"]
                b = args[2] if len(args) > 2 else kwargs.get("bias")
                if (params := _split(w, b)) is not None:
                    return _DeferredLinear.apply(x, w, b, params)
            elif func is torch.addmm and not kwargs and len(args) == 3 and args[1].dim() == 2:
                b, x, w = args
                if (params := _split(w, b)) is not None:
                    return _DeferredAddmm.apply(b, x, w, params)
        return func(*args, **kwargs)
