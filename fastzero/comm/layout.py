"""Where each parameter lives in a flat, padded buffer, and which part of it
each data-parallel rank owns.

The buffer is cut into buckets of at most ``bucket_size`` elements, each a
multiple of the world size; rank r owns the r-th equal chunk of every bucket
and keeps its chunks back to back in one contiguous shard. So a bucket's
gradient goes to its owners with one true ``reduce_scatter`` (input: the
bucket, output: the rank's piece of its shard) and the updated params come
back with one ``all_gather`` into the bucket, with no copies on either side.
Params are laid out in reverse order, as backward produces their gradients,
so the first buckets fill first.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 16  # elements per rank chunk are a multiple of this: whole SIMD vectors, aligned views


@dataclass(frozen=True)
class Bucket:
    index: int
    start: int  # flat offset of the bucket
    size: int  # elements, world_size * chunk
    chunk: int  # elements each rank owns
    shard_start: int  # where this bucket's chunk sits in every rank's shard

    def owned(self, rank: int) -> tuple[int, int]:
        """The flat range of `rank`'s chunk."""
        lo = self.start + rank * self.chunk
        return lo, lo + self.chunk


@dataclass(frozen=True)
class Segment:
    """A piece of one param that a rank owns: elements [lo, hi) of the
    flattened param, at `shard_offset` in the rank's shard."""

    param: int
    lo: int
    hi: int
    shard_offset: int


class FlatLayout:
    """The layout of params with `numels` (in registration order) for
    `world_size` ranks."""

    def __init__(self, numels: list[int], world_size: int, bucket_size: int) -> None:
        if world_size < 1 or bucket_size < 1:
            raise ValueError(f"world_size {world_size}, bucket_size {bucket_size}: both must be >= 1")
        self.numels = list(numels)
        self.world_size = world_size
        self.order = list(reversed(range(len(numels))))  # backward produces grads last param first
        self.offsets = [0] * len(numels)
        pos = 0
        for i in self.order:
            self.offsets[i] = pos
            pos += numels[i]
        self.numel = pos  # elements that hold params
        unit = world_size * ALIGN
        cap = max(unit, bucket_size // unit * unit)
        self.buckets: list[Bucket] = []
        start = shard = 0
        while start < self.numel or not self.buckets:
            size = min(cap, -(-(self.numel - start) // unit) * unit) or unit
            self.buckets.append(Bucket(len(self.buckets), start, size, size // world_size, shard))
            start, shard = start + size, shard + size // world_size
        self.total = start  # padded
        self.shard_size = shard
        # the buckets each param touches, and how many of its elements fall in each
        self.param_buckets: list[list[tuple[int, int]]] = []
        for i, n in enumerate(self.numels):
            lo, hi = self.offsets[i], self.offsets[i] + n
            touched = [
                (b.index, min(hi, b.start + b.size) - max(lo, b.start))
                for b in self.buckets
                if b.start < hi and lo < b.start + b.size
            ]
            self.param_buckets.append(touched)
        self.bucket_numel = [0] * len(self.buckets)  # param elements per bucket (the rest is padding)
        for touched in self.param_buckets:
            for b, n in touched:
                self.bucket_numel[b] += n

    def segments(self, rank: int) -> list[Segment]:
        """The pieces of params that `rank` owns, in shard order."""
        out = []
        for b in self.buckets:
            lo, hi = b.owned(rank)
            for i in self.order:
                p_lo, p_hi = self.offsets[i], self.offsets[i] + self.numels[i]
                a, z = max(lo, p_lo), min(hi, p_hi)
                if a < z:
                    out.append(Segment(i, a - p_lo, z - p_lo, b.shard_start + a - lo))
        return out

    def chunk_segments(self, rank: int) -> list[list[tuple[int, int, int]]]:
        """Per bucket, the params in `rank`'s chunk: (param, start, stop) as
        offsets in the chunk, so that an optimizer stepping the chunks can
        work per param (LAMB's trust ratios)."""
        out = []
        for b in self.buckets:
            lo, hi = b.owned(rank)
            pieces = []
            for i in self.order:
                p_lo, p_hi = self.offsets[i], self.offsets[i] + self.numels[i]
                a, z = max(lo, p_lo), min(hi, p_hi)
                if a < z:
                    pieces.append((i, a - lo, z - lo))
            out.append(pieces)
        return out
