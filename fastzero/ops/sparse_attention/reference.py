"""Block-sparse attention in plain PyTorch, densely: the math every
sparse-attention path is tested against."""

from __future__ import annotations

import torch
from torch import Tensor


def expand_layout(layout: Tensor, block: int, causal: bool) -> Tensor:
    """The element mask [heads, seq, seq] (bool) a block layout keeps."""
    mask = layout.to(torch.bool).repeat_interleave(block, 1).repeat_interleave(block, 2)
    if causal:
        mask = mask & torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    return mask


def softmax_rows(scores: Tensor) -> Tensor:
    """Softmax over the last dim; rows with nothing kept give zeros, not NaN."""
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    p = torch.exp(scores - top)
    total = p.sum(-1, keepdim=True)
    return p / torch.where(total == 0, torch.ones_like(total), total)


def dense_attention(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, scale: float, additive: Tensor | None = None
) -> Tensor:
    """The reference: softmax(q k^T * scale + additive, masked to `keep`) v,
    in q's dtype (tests pass fp64). `keep` broadcasts to [B, H, S, S]
    (None: everything); `additive` too."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if additive is not None:
        scores = scores + additive.to(scores.dtype)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.matmul(softmax_rows(scores), v)
