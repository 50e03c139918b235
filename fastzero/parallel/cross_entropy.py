"""Cross entropy over logits split along the vocabulary (Megatron-LM's
``vocab_parallel_cross_entropy``), equal to ``F.cross_entropy`` on the
gathered logits, ignore_index and label smoothing included; the full-vocab
logits never exist on one rank.

For a token with logits z (vocabulary V, rank r holding z[r V/tp : (r+1) V/tp]),
target t and smoothing e, with m = max z and S = sum_j exp(z_j - m)::

    loss = log S - (1 - e) (z_t - m) - e / V * sum_j (z_j - m)
    d loss / d z_j = softmax(z)_j - (1 - e) [j == t] - e / V

m is one all-reduce (max); S, z_t - m (only the rank owning t contributes)
and the sum of z - m travel together in a second one (sum), 3 numbers a
token. A token whose target is ``ignore_index`` has loss 0 and grad 0;
"mean" divides by the tokens not ignored, as PyTorch does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from fastzero.comm import functional  # logged by the communication logger
from fastzero.parallel.groups import group_rank, group_size, tensor_group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, ignore_index, group):
        world, rank = group_size(group), group_rank(group)
        part = logits.shape[-1]
        vocab = part * world
        z = logits.reshape(-1, part).float()
        t = target.reshape(-1)
        ignored = t == ignore_index

        m = z.max(dim=-1).values
        if world > 1:
            functional.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = z - m.unsqueeze(-1)  # a new tensor: becomes the softmax saved for backward

        start = rank * part
        foreign = (t < start) | (t >= start + part) | ignored
        local_t = (t - start).masked_fill(foreign, 0)
        rows = torch.arange(z.shape[0], device=z.device)
        sums = torch.stack(
            [
                shifted[rows, local_t].masked_fill(foreign, 0.0),  # z_t - m, on the rank owning t
                shifted.sum(dim=-1),  # for the smoothing term
                shifted.exp_().sum(dim=-1),  # S; shifted now holds exp(z - m)
            ]
        )
        if world > 1:
            functional.all_reduce(sums, group=group)
        target_logit, logit_sum, sum_exp = sums
        log_s = sum_exp.log()
        loss = log_s - (1 - label_smoothing) * target_logit - label_smoothing / vocab * logit_sum
        loss = loss.masked_fill(ignored, 0.0)

        softmax = shifted.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, foreign, ignored)
        ctx.smoothing, ctx.vocab, ctx.dtype, ctx.shape = label_smoothing, vocab, logits.dtype, logits.shape
        ctx.used = False
        return loss.reshape(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.used:
            raise RuntimeError(
                "vocab_parallel_cross_entropy: backward ran twice through one loss (retain_graph=True); its saved "
                "softmax becomes the grad in place to save memory, so compute the loss again instead"
            )
        ctx.used = True
        softmax, local_t, foreign, ignored = ctx.saved_tensors
        grad = softmax  # becomes the grad in place: no second [tokens, V/tp] buffer
        if ctx.smoothing:
            grad.sub_(ctx.smoothing / ctx.vocab)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= (1 - ctx.smoothing) * (~foreign).float()
        scale = grad_loss.reshape(-1).float().masked_fill(ignored, 0.0)
        grad.mul_(scale.unsqueeze(-1))
        return grad.to(ctx.dtype).reshape(ctx.shape), None, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: Tensor,
    target: Tensor,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    *,
    group=None,
) -> Tensor:
    """``F.cross_entropy(gathered_logits.flatten(0, -2), target.flatten(), ...)``
    reshaped to ``target``'s shape for ``reduction="none"``, from this rank's
    slice of the vocabulary: ``vocab_parallel_logits [..., V/tp]`` (the output
    of a ColumnParallelLinear with ``gather_output=False``), ``target [...]``
    (whole-vocabulary ids, the same on every rank of the tensor group).
    The vocabulary is the last dim (Megatron's layout, not PyTorch's dim 1).
    Computed in fp32; the loss and the grad come back in the logits' dtype.
    ``group=None``: the current tensor group."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none', not {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing must lie in [0, 1], got {label_smoothing}")
    if not vocab_parallel_logits.is_floating_point():
        raise TypeError(
            f"vocab_parallel_cross_entropy: logits must be floating point, not {vocab_parallel_logits.dtype}"
        )
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"vocab_parallel_cross_entropy: target must hold int64 class ids, not {target.dtype}")
    if tuple(target.shape) != tuple(vocab_parallel_logits.shape[:-1]):
        raise ValueError(
            f"vocab_parallel_cross_entropy: target has shape {tuple(target.shape)}; it must be the logits' shape "
            f"{tuple(vocab_parallel_logits.shape)} without the last (vocabulary) dim"
        )
    group = tensor_group(group)
    vocab = vocab_parallel_logits.shape[-1] * group_size(group)
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        raise ValueError(
            f"vocab_parallel_cross_entropy: target {int(target[bad][0])} is outside the vocabulary [0, {vocab}) "
            f"and is not ignore_index={ignore_index}"
        )
    loss = _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, ignore_index, group)
    if reduction == "none":
        return loss.to(vocab_parallel_logits.dtype)
    total = loss.sum()
    if reduction == "mean":
        total = total / (target != ignore_index).sum()
    return total.to(vocab_parallel_logits.dtype)
