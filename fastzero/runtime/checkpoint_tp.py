"""Tensor-parallel params in checkpoints: how a param split across the
tensor group maps to the logical (unsplit) param, both ways.

A split param carries Megatron's attributes (``partition_dim`` d,
``partition_stride`` s; :func:`fastzero.parallel.mark_tensor_parallel`):
cut the logical param along d into s * T equal pieces (T the tensor size);
rank r holds pieces r, r + T, ..., r + (s - 1) T, concatenated. Stride 1 is
the r-th contiguous chunk; GPT-2's fused q/k/v is stride 3 (each rank its
heads of q, k and v). A checkpoint records each split param's (d, s) and
the tensor size it was saved at, so a load at any other tensor size
assembles the logical param from the saved pieces and takes its own."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fastzero.parallel.groups import is_tensor_parallel


@dataclass(frozen=True)
class Split:
    """How a param is split across a tensor group of `size` ranks."""

    dim: int
    stride: int
    size: int

    def local_shape(self, full: list[int]) -> list[int]:
        shape = list(full)
        shape[self.dim] //= self.size
        return shape

    def full_shape(self, local: list[int]) -> list[int]:
        shape = list(local)
        shape[self.dim] *= self.size
        return shape

    def take(self, full: Tensor, rank: int) -> Tensor:
        """Rank `rank`'s piece of the logical `full`."""
        if full.shape[self.dim] % (self.size * self.stride):
            raise ValueError(
                f"a param of shape {tuple(full.shape)} does not split along dim {self.dim} into {self.size} ranks x "
                f"stride {self.stride}"
            )
        pieces = full.chunk(self.size * self.stride, self.dim)
        return torch.cat(pieces[rank :: self.size], self.dim)

    def assemble(self, locals_: list[Tensor]) -> Tensor:
        """The logical param from every rank's piece (`locals_` in tensor-rank order)."""
        if len(locals_) != self.size:
            raise ValueError(f"{len(locals_)} pieces for a param split over {self.size} ranks")
        parts = [t.chunk(self.stride, self.dim) for t in locals_]
        return torch.cat([parts[r][k] for k in range(self.stride) for r in range(self.size)], self.dim)


def split_of(param: Tensor, size: int) -> Split | None:
    """The split of `param` over a tensor group of `size` ranks, or None when it is whole on every rank."""
    if size <= 1 or not is_tensor_parallel(param):
        return None
    return Split(int(param.partition_dim), int(getattr(param, "partition_stride", 1)), size)


def qualified(name: str, split: Split | None, rank: int) -> str:
    """The name a piece of `name` is saved under: tensor rank `rank`'s piece of a split param gets its own."""
    return name if split is None else f"{name}@tp{rank}"
