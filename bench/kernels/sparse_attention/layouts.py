"""The benchmark's block layouts: a local sliding window plus the global
first block column, at a target density or a fixed width, and the same
layout as FlexAttention's BlockMask."""

from __future__ import annotations

import torch


def _band_count(nb: int, left: int, right: int) -> int:
    """Blocks in the band -left <= j - i <= right of an nb x nb grid, plus the first column's outside it."""
    band = sum(nb - abs(d) for d in range(-left, right + 1) if abs(d) < nb)
    return band + max(0, nb - left - 1)


def window_extent(nb: int, density: float, causal: bool = False) -> tuple[int, int]:
    """(left, right): the window whose layout's kept fraction is nearest `density` (of the nb^2 blocks, or of
    the nb (nb + 1) / 2 a causal attention computes); left and right differ by at most one block."""
    total = nb * (nb + 1) // 2 if causal else nb * nb
    options = [(w, 0) for w in range(nb)] if causal else [(w + e, w) for w in range(nb) for e in (0, 1)]
    options = [(a, b) for a, b in options if a < nb and b < nb]
    return min(options, key=lambda o: (abs(_band_count(nb, *o) / total - density), o))


def window_layout(heads: int, nb: int, left: int, right: int, causal: bool = False) -> torch.Tensor:
    """[heads, nb, nb] bool: a local window (key blocks i - left .. i + right of query block i) and the global
    first block column; block-causal (j <= i) when `causal`."""
    i = torch.arange(nb)
    d = i[None, :] - i[:, None]  # j - i
    keep = ((d >= -left) & (d <= right)) | (i[None, :] == 0)
    if causal:
        keep &= d <= 0
    return keep.expand(heads, nb, nb).contiguous()


def density_layout(heads: int, nb: int, density: float, causal: bool = False) -> torch.Tensor:
    """The window + global column layout nearest `density`."""
    return window_layout(heads, nb, *window_extent(nb, density, causal), causal=causal)


def refine(layout: torch.Tensor, factor: int) -> torch.Tensor:
    """The same element mask in blocks `factor` times smaller."""
    return layout.repeat_interleave(factor, 1).repeat_interleave(factor, 2) if factor > 1 else layout


def kept_fraction(layout: torch.Tensor, causal: bool) -> float:
    nb = layout.shape[-1]
    total = nb * (nb + 1) // 2 if causal else nb * nb
    return float(layout.sum()) / (layout.shape[0] * total)


def _causal_mask(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def flex_block_mask(layout: torch.Tensor, block: int, seq: int, causal: bool = False, compiled: bool = True):
    """FlexAttention's BlockMask for `layout` [H, nb, nb] (bool, on the tensors' device): kept off-diagonal
    blocks are full blocks (no mask_mod evaluated in them), kept diagonal blocks of a causal layout partial
    (mask_mod: causal). The compiled kernels visit only the listed blocks, so that mask_mod is exact there and,
    being one function for every layout, costs no recompile per layout. FlexAttention's eager path (the tests'
    CPU runs) applies only the mask_mod, so ``compiled=False`` gives one that looks the layout up."""
    from torch.nn.attention.flex_attention import BlockMask, noop_mask

    lay = layout.to(torch.bool)
    diag = torch.eye(lay.shape[-1], dtype=torch.bool, device=lay.device)
    partial = lay & diag if causal else torch.zeros_like(lay)
    full = lay & ~partial

    def lists(m):
        counts = m.sum(-1).to(torch.int32)[None]
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)[None]
        return counts, order

    def lookup(b, h, q_idx, kv_idx):
        keep = lay[h, q_idx // block, kv_idx // block]
        return keep & (kv_idx <= q_idx) if causal else keep

    mask_mod = (_causal_mask if causal else noop_mask) if compiled else lookup
    return BlockMask.from_kv_blocks(
        *lists(partial), *lists(full), BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(seq, seq)
    )
