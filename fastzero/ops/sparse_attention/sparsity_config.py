"""Block-sparse attention layouts: which (query block, key block) pairs an attention head computes.

A layout is an int64 tensor ``[num_heads, seq_len // block, seq_len // block]`` of 0/1; ``layout[h, i, j] == 1``
means head ``h`` lets the queries of block ``i`` attend to the keys of block ``j``. The configs, their parameters,
defaults, validation and layouts follow DeepSpeed's ``deepspeed/ops/sparse_attention/sparsity_config.py`` (read at
deepspeedai/DeepSpeed@985acb15; DeepSpeed 0.19 no longer ships it), so a script that built one of DeepSpeed's configs
builds the same layout here. Where we differ from DeepSpeed (at a bug or a crash), the class docstring says so.

``attention="unidirectional"`` is causal at the block level: a layout has no block above the diagonal. The
upper triangle *inside* each diagonal block is the attention kernel's job (or ``dense_mask(..., causal=True)``).

Random blocks (``VariableSparsityConfig``, ``BigBirdSparsityConfig``) are drawn from a ``random.Random`` owned by the
config (``seed=`` or ``generator=``), never from the global RNG. The draws are made in DeepSpeed's order (head, then
row, one ``sample`` per row), so with ``seed=s`` a bidirectional config's first layout is DeepSpeed's after
``random.seed(s)``. Like DeepSpeed, each ``make_layout`` call draws afresh: two configs with the same seed give the
same sequence of layouts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "BSLongformerSparsityConfig",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparsityConfig",
    "VariableSparsityConfig",
    "dense_mask",
    "layout_density",
]

_ATTENTIONS = ("unidirectional", "bidirectional")


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_attention(attention: str) -> str:
    # NotImplementedError, as DeepSpeed raises: other attention kinds are not wrong, just not built.
    if attention not in _ATTENTIONS:
        raise NotImplementedError(f"attention must be 'unidirectional' or 'bidirectional', got {attention!r}")
    return attention


def _check_horizontal(horizontal_global_attention: bool, attention: str) -> bool:
    # A global block attending to every other block would attend to the future.
    if horizontal_global_attention and attention != "bidirectional":
        raise ValueError(f"horizontal_global_attention=True needs attention='bidirectional', got {attention!r}")
    return bool(horizontal_global_attention)


def _check_global_spans(starts: Sequence[int], ends: Sequence[int] | None) -> tuple[list[int], list[int] | None]:
    starts = [_check_int(f"global_block_indices[{i}]", s, 0) for i, s in enumerate(starts)]
    if ends is None:
        return starts, None
    ends = [_check_int(f"global_block_end_indices[{i}]", e, 1) for i, e in enumerate(ends)]
    if len(ends) != len(starts):
        raise ValueError(
            f"global_block_end_indices has {len(ends)} entries but global_block_indices has {len(starts)}; "
            "they must have the same length"
        )
    for i, (s, e) in enumerate(zip(starts, ends)):
        if s >= e:
            raise ValueError(
                f"global_block_indices[{i}] ({s}) must be smaller than global_block_end_indices[{i}] ({e})"
            )
    return starts, ends


def _check_fits(name: str, value: int, num_blocks: int) -> None:
    if value > num_blocks:
        raise ValueError(f"{name} ({value}) must be at most the number of blocks in a row ({num_blocks})")


def _make_rng(seed: int | None, generator: random.Random | None) -> random.Random:
    if generator is not None and seed is not None:
        raise ValueError(f"pass seed or generator, not both (got seed={seed!r} and a generator)")
    if generator is not None:
        if not isinstance(generator, random.Random):
            raise ValueError(f"generator must be a random.Random, got {type(generator).__name__}")
        return generator
    return random.Random(seed)


def _sliding_window(num_blocks: int, num_window_blocks: int) -> Tensor:
    """Row i keeps blocks i - w .. i + w, w = num_window_blocks // 2 (DeepSpeed's rule: an even window gets
    one block wider, e.g. 4 -> 5 blocks)."""
    idx = torch.arange(num_blocks)
    return ((idx[:, None] - idx[None, :]).abs() <= num_window_blocks // 2).to(torch.int64)


class SparsityConfig:
    """Base of every layout: holds ``num_heads``, ``block`` and whether heads get their own layout.

    ``make_layout`` builds head 0 (or each head with ``different_layout_per_head``) through ``_set_head_layout``,
    applies causality once for ``attention="unidirectional"``, and copies head 0 to the other heads when they share.
    """

    attention = "bidirectional"  # the configs without an attention parameter (Dense) are bidirectional

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False):
        self.num_heads = _check_int("num_heads", num_heads, 1)
        self.block = _check_int("block", block, 1)
        self.different_layout_per_head = bool(different_layout_per_head)
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> Tensor:
        """Zeros, int64 ``[num_heads, seq_len // block, seq_len // block]``."""
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1 or seq_len % self.block:
            raise ValueError(f"seq_len ({seq_len!r}) must be a positive multiple of block ({self.block})")
        num_blocks = seq_len // self.block
        return torch.zeros((self.num_heads, num_blocks, num_blocks), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout: Tensor) -> Tensor:
        """Copies head 0's layout to every head unless each head has its own."""
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def make_layout(self, seq_len: int) -> Tensor:
        """The 0/1 int64 layout ``[num_heads, seq_len // block, seq_len // block]``."""
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self._set_head_layout(h, layout)
        if self.attention == "unidirectional":
            # One place for causality: the setters write each pattern whole, and no block above the diagonal
            # survives this (DeepSpeed leaves some there; see Fixed and Variable).
            layout.tril_()
        return self.check_and_propagate_first_head_layout(layout)

    def _set_head_layout(self, h: int, layout: Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not define a layout; use one of its subclasses")


class DenseSparsityConfig(SparsityConfig):
    """Every block is kept: dense attention, for comparison. ``different_layout_per_head`` is accepted and moot."""

    def _set_head_layout(self, h: int, layout: Tensor) -> None:
        layout[h] = 1


class FixedSparsityConfig(SparsityConfig):
    """The `Fixed` pattern of Sparse Transformers (Child et al. 2019, arXiv:1904.10509), as DeepSpeed customized it.

    - Local: the blocks are cut into windows of ``num_local_blocks``; each block attends to every block of its
      window (causal: to the earlier ones and itself). A short last window is a window too.
    - Global: in each window, ``num_global_blocks`` consecutive blocks represent the window, and every block attends
      to them (a global column; causal: from the global block's row down). Head 0 uses the *last*
      ``num_global_blocks`` of each window; with ``different_layout_per_head`` and ``num_different_global_patterns``
      p > 1, head h uses the group (h % p) + 1 from the end. In a short last window, the group is moved left until
      it fits in the sequence.
    - ``horizontal_global_attention`` (bidirectional only): the global blocks also attend to every block (rows).

    Differs from DeepSpeed: causal layouts with ``num_global_blocks > 1`` have no block above the diagonal
    (DeepSpeed keeps the global group's full width from the group's first row down, e.g. block (2, 3) for
    ``num_local_blocks=4, num_global_blocks=2``).
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_local_blocks: int = 4,
        num_global_blocks: int = 1,
        attention: str = "bidirectional",
        horizontal_global_attention: bool = False,
        num_different_global_patterns: int = 1,
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_local_blocks = _check_int("num_local_blocks", num_local_blocks, 1)
        self.num_global_blocks = _check_int("num_global_blocks", num_global_blocks, 1)
        if num_local_blocks % num_global_blocks:
            raise ValueError(
                f"num_local_blocks ({num_local_blocks}) must be a multiple of num_global_blocks ({num_global_blocks})"
            )
        self.attention = _check_attention(attention)
        self.horizontal_global_attention = _check_horizontal(horizontal_global_attention, attention)
        _check_int("num_different_global_patterns", num_different_global_patterns, 1)
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError(
                f"num_different_global_patterns ({num_different_global_patterns}) > 1 needs "
                "different_layout_per_head=True (a single layout shared by all heads has one global pattern)"
            )
        groups = num_local_blocks // num_global_blocks
        if num_different_global_patterns > groups:
            raise ValueError(
                f"num_different_global_patterns ({num_different_global_patterns}) must be at most "
                f"num_local_blocks // num_global_blocks = {num_local_blocks} // {num_global_blocks} = {groups}"
            )
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h: int, layout: Tensor) -> Tensor:
        num_blocks, n = layout.shape[1], self.num_local_blocks
        for start in range(0, num_blocks, n):
            layout[h, start : start + n, start : start + n] = 1
        return layout

    def set_global_layout(self, h: int, layout: Tensor) -> Tensor:
        num_blocks, n, g = layout.shape[1], self.num_local_blocks, self.num_global_blocks
        offset = n - (1 + h % self.num_different_global_patterns) * g  # head 0: the last g blocks of each window
        full = num_blocks - num_blocks % n  # blocks in whole windows
        starts = list(range(offset, full, n))
        if full < num_blocks:  # a short last window: same offset, moved left to fit (never left of block 0)
            starts.append(max(0, min(full + offset, num_blocks - g)))
        for s in starts:
            layout[h, :, s : s + g] = 1
            if self.horizontal_global_attention:
                layout[h, s : s + g, :] = 1
        return layout

    def _set_head_layout(self, h: int, layout: Tensor) -> None:
        self.set_local_layout(h, layout)
        self.set_global_layout(h, layout)


class VariableSparsityConfig(SparsityConfig):
    """An extension of `Fixed` with windows of varying size, global blocks by index, and random blocks.

    - Random: each row attends to ``num_random_blocks`` blocks drawn without replacement (causal: from the blocks
      up to the row's own; fewer where the row has fewer).
    - Local: consecutive windows of ``local_window_blocks[0]``, ``[1]``, ... blocks; the last size repeats to the
      end of the sequence. Each block attends to its window (causal: to the earlier ones and itself).
    - Global: the blocks in ``global_block_indices`` (or, with ``global_block_end_indices``, each span
      ``[start, end)``) are attended to by every block (causal: by the later ones); with
      ``horizontal_global_attention`` (bidirectional only) they also attend to every block. Global blocks past the
      end of the sequence are skipped.

    Differs from DeepSpeed, which draws random blocks from the whole row even when causal and keeps a global span's
    full width from its first row down: here causal layouts have no block above the diagonal.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 0,
        local_window_blocks: Sequence[int] = (4,),
        global_block_indices: Sequence[int] = (0,),
        global_block_end_indices: Sequence[int] | None = None,
        attention: str = "bidirectional",
        horizontal_global_attention: bool = False,
        *,
        seed: int | None = None,
        generator: random.Random | None = None,
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = _check_int("num_random_blocks", num_random_blocks, 0)
        if not local_window_blocks:
            raise ValueError(f"local_window_blocks must list at least one window size, got {local_window_blocks!r}")
        self.local_window_blocks = [
            _check_int(f"local_window_blocks[{i}]", n, 1) for i, n in enumerate(local_window_blocks)
        ]
        self.global_block_indices, self.global_block_end_indices = _check_global_spans(
            global_block_indices, global_block_end_indices
        )
        self.attention = _check_attention(attention)
        self.horizontal_global_attention = _check_horizontal(horizontal_global_attention, attention)
        self.rng = _make_rng(seed, generator)

    def set_random_layout(self, h: int, layout: Tensor) -> Tensor:
        num_blocks = layout.shape[1]
        _check_fits("num_random_blocks", self.num_random_blocks, num_blocks)
        _set_random(self.rng, layout[h], self.num_random_blocks, causal=self.attention == "unidirectional")
        return layout

    def set_local_layout(self, h: int, layout: Tensor) -> Tensor:
        num_blocks, start = layout.shape[1], 0
        sizes = iter(self.local_window_blocks)
        while start < num_blocks:
            size = next(sizes, self.local_window_blocks[-1])
            layout[h, start : start + size, start : start + size] = 1
            start += size
        return layout

    def set_global_layout(self, h: int, layout: Tensor) -> Tensor:
        spans = self.global_block_indices, self.global_block_end_indices
        _set_global_spans(layout[h], *spans, rows=self.horizontal_global_attention)
        return layout

    def _set_head_layout(self, h: int, layout: Tensor) -> None:
        self.set_random_layout(h, layout)
        self.set_local_layout(h, layout)
        self.set_global_layout(h, layout)


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird (Zaheer et al. 2020, arXiv:2007.14062), block-sparse.

    - Random: each row attends to ``num_random_blocks`` blocks drawn without replacement (causal: from the blocks
      up to the row's own; fewer where the row has fewer).
    - Sliding window: row i attends to blocks i - w .. i + w, w = ``num_sliding_window_blocks // 2`` (causal:
      i - w .. i). An even window is one block wider than asked (4 -> 5), as in DeepSpeed.
    - Global: the first ``num_global_blocks`` blocks attend to every block and every block attends to them
      (causal: only the earlier ones, on both counts).

    Differs from DeepSpeed, which fails for a causal layout whose first rows have fewer blocks than
    ``num_random_blocks`` (``random.sample`` of a too-small population): here those rows take all they have.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 1,
        num_sliding_window_blocks: int = 3,
        num_global_blocks: int = 1,
        attention: str = "bidirectional",
        *,
        seed: int | None = None,
        generator: random.Random | None = None,
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = _check_int("num_random_blocks", num_random_blocks, 0)
        self.num_sliding_window_blocks = _check_int("num_sliding_window_blocks", num_sliding_window_blocks, 1)
        self.num_global_blocks = _check_int("num_global_blocks", num_global_blocks, 0)
        self.attention = _check_attention(attention)
        self.rng = _make_rng(seed, generator)

    def set_random_layout(self, h: int, layout: Tensor) -> Tensor:
        _check_fits("num_random_blocks", self.num_random_blocks, layout.shape[1])
        _set_random(self.rng, layout[h], self.num_random_blocks, causal=self.attention == "unidirectional")
        return layout

    def set_sliding_window_layout(self, h: int, layout: Tensor) -> Tensor:
        _check_fits("num_sliding_window_blocks", self.num_sliding_window_blocks, layout.shape[1])
        layout[h] |= _sliding_window(layout.shape[1], self.num_sliding_window_blocks)
        return layout

    def set_global_layout_itc(self, h: int, layout: Tensor) -> Tensor:
        # "itc": BigBird's internal transformer construction, where the global blocks are existing tokens.
        _check_fits("num_global_blocks", self.num_global_blocks, layout.shape[1])
        layout[h, : self.num_global_blocks, :] = 1
        layout[h, :, : self.num_global_blocks] = 1
        return layout

    def _set_head_layout(self, h: int, layout: Tensor) -> None:
        self.set_random_layout(h, layout)
        self.set_sliding_window_layout(h, layout)
        self.set_global_layout_itc(h, layout)


class BSLongformerSparsityConfig(SparsityConfig):
    """Longformer (Beltagy et al. 2020, arXiv:2004.05150), block-sparse (the original is element-wise).

    - Sliding window: row i attends to blocks i - w .. i + w, w = ``num_sliding_window_blocks // 2`` (causal:
      i - w .. i). An even window is one block wider than asked (4 -> 5), as in DeepSpeed.
    - Global: the blocks in ``global_block_indices`` (or, with ``global_block_end_indices``, each span
      ``[start, end)``) attend to every block and every block attends to them (causal: only the earlier ones).
      Global blocks past the end of the sequence are skipped.

    Differs from DeepSpeed, which takes any ``attention`` other than "unidirectional" as bidirectional: here other
    values raise NotImplementedError, as in the other configs.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_sliding_window_blocks: int = 3,
        global_block_indices: Sequence[int] = (0,),
        global_block_end_indices: Sequence[int] | None = None,
        attention: str = "bidirectional",
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_sliding_window_blocks = _check_int("num_sliding_window_blocks", num_sliding_window_blocks, 1)
        self.global_block_indices, self.global_block_end_indices = _check_global_spans(
            global_block_indices, global_block_end_indices
        )
        self.attention = _check_attention(attention)

    def set_sliding_window_layout(self, h: int, layout: Tensor) -> Tensor:
        _check_fits("num_sliding_window_blocks", self.num_sliding_window_blocks, layout.shape[1])
        layout[h] |= _sliding_window(layout.shape[1], self.num_sliding_window_blocks)
        return layout

    def set_global_layout(self, h: int, layout: Tensor) -> Tensor:
        _set_global_spans(layout[h], self.global_block_indices, self.global_block_end_indices, rows=True)
        return layout

    def _set_head_layout(self, h: int, layout: Tensor) -> None:
        self.set_sliding_window_layout(h, layout)
        self.set_global_layout(h, layout)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A purely local sliding window, the same for every head.

    Row i attends to blocks i - w .. i + w, w = ``num_sliding_window_blocks // 2``; causal (the default): i - w .. i,
    so the default window of 3 keeps 2 blocks per row, as in DeepSpeed.

    Differs from DeepSpeed, which takes any ``attention`` other than "bidirectional" as unidirectional: here other
    values raise NotImplementedError, as in the other configs.
    """

    def __init__(
        self, num_heads: int, block: int = 16, num_sliding_window_blocks: int = 3, attention: str = "unidirectional"
    ):
        super().__init__(num_heads, block)
        self.num_sliding_window_blocks = _check_int("num_sliding_window_blocks", num_sliding_window_blocks, 1)
        self.attention = _check_attention(attention)

    def set_sliding_window_layout(self, h: int, layout: Tensor) -> Tensor:
        _check_fits("num_sliding_window_blocks", self.num_sliding_window_blocks, layout.shape[1])
        layout[h] |= _sliding_window(layout.shape[1], self.num_sliding_window_blocks)
        return layout

    def _set_head_layout(self, h: int, layout: Tensor) -> None:
        self.set_sliding_window_layout(h, layout)


def _set_random(rng: random.Random, head: Tensor, k: int, causal: bool) -> None:
    num_blocks = head.shape[0]
    for row in range(num_blocks):
        population = row + 1 if causal else num_blocks
        head[row, rng.sample(range(population), min(k, population))] = 1


def _set_global_spans(head: Tensor, starts: list[int], ends: list[int] | None, rows: bool) -> None:
    # Spans past the end of the sequence slice to nothing: one config serves any seq_len, as in DeepSpeed.
    for s, e in zip(starts, ends if ends is not None else [s + 1 for s in starts]):
        head[:, s:e] = 1
        if rows:
            head[s:e, :] = 1


def layout_density(layout: Tensor) -> float:
    """The fraction of blocks a layout keeps (1.0 for dense attention)."""
    if layout.numel() == 0:
        raise ValueError(f"layout of shape {tuple(layout.shape)} has no blocks; its density is undefined")
    return layout.count_nonzero().item() / layout.numel()


def dense_mask(layout: Tensor, block: int, causal: bool = False) -> Tensor:
    """The element mask a layout stands for: bool ``[..., nb * block, nb * block]``, True where a query may attend
    to a key. ``causal`` also masks the upper triangle inside the diagonal blocks, as a causal kernel does."""
    block = _check_int("block", block, 1)
    if layout.dim() < 2 or layout.shape[-1] != layout.shape[-2]:
        raise ValueError(f"layout must be [..., num_blocks, num_blocks], got shape {tuple(layout.shape)}")
    mask = layout.bool().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    if causal:
        mask &= torch.ones(mask.shape[-2:], dtype=torch.bool).tril()
    return mask
