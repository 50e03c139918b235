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
from fastzero.runtime.checkpoint_manifest import tp_piece_name
from fastzero.runtime.groups import PieceState


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
    return name if split is None else tp_piece_name(name, rank)


def engine_tp(engine) -> tuple[int, int]:
    """(tensor size, tensor rank) of `engine` ((1, 0) without tensor parallelism)."""
    tensor = getattr(engine, "tensor_comm", None)
    return (1, 0) if tensor is None else (tensor.world_size, tensor.rank)


def engine_splits(engine) -> dict[str, Split]:
    """The split of each of the engine's trained params that is split across its tensor group, by name."""
    size, _ = engine_tp(engine)
    out = {}
    for g in engine.groups:
        for name, p in zip(g.names, g.params):
            split = split_of(p, size)
            if split is not None:
                out[name] = split
    return out


def saved_splits(manifest: dict) -> dict[str, Split]:
    """The split of each param the checkpoint saved split, by name (none without tensor parallelism)."""
    tp = manifest.get("tensor_parallel")
    if not tp:
        return {}
    return {name: Split(int(d), int(s), int(tp["size"])) for name, (d, s) in tp["splits"].items()}


def manifest_entry(splits: dict[str, Split], size: int) -> dict | None:
    """What the manifest records of the tensor split (None without tensor parallelism)."""
    if size <= 1:
        return None
    return {"size": size, "splits": {n: [sp.dim, sp.stride] for n, sp in sorted(splits.items())}}


def joined(pieces: list[PieceState], numel: int) -> tuple[dict[str, Tensor], dict]:
    """The per-element tensors of `pieces` that together cover [0, numel) of one flat param, joined (every key the
    pieces all hold), and the first piece's scalars."""
    keys = set.intersection(*(set(p.tensors) for p in pieces)) if pieces else set()
    out = {k: torch.empty(numel, dtype=torch.float32) for k in keys}
    for p in pieces:
        for k in keys:
            out[k][p.lo : p.hi] = p.tensors[k]
    return out, (pieces[0].scalars if pieces else {})


def wanted_for(
    name: str, full_shape: list[int], mine: Split | None, saved: Split | None, rank: int, ranges
) -> dict[str, list[tuple[int, int]]]:
    """The saved pieces (by saved name, element ranges) a rank needs for its `ranges` of `name`: its own
    tensor rank's pieces when the split is the same, else the whole logical param (every saved rank's)."""
    if mine == saved:
        return {qualified(name, saved, rank): list(ranges)}
    numel = int(torch.Size(full_shape).numel())
    if saved is None:
        return {name: [(0, numel)]}
    return {qualified(name, saved, r): [(0, numel // saved.size)] for r in range(saved.size)}


def resplit(
    name: str, full_shape: list[int], mine: Split | None, saved: Split | None, rank: int, got: dict
) -> list[PieceState]:
    """This rank's pieces of `name` from the saved pieces read for it (`got`, by saved name): renamed when
    the split is the same, else the logical param assembled from the saved split and this rank's piece taken."""
    if mine == saved:
        return [PieceState(name, p.lo, p.hi, p.tensors, p.scalars) for p in got.get(qualified(name, saved, rank), [])]
    numel = int(torch.Size(full_shape).numel())
    if saved is None:
        full, scalars = joined(got.get(name, []), numel)
        full = {k: v.view(full_shape) for k, v in full.items()}
    else:
        local = saved.local_shape(full_shape)
        parts = [joined(got.get(qualified(name, saved, r), []), numel // saved.size) for r in range(saved.size)]
        scalars = parts[0][1]
        keys = set.intersection(*(set(t) for t, _ in parts))
        full = {k: saved.assemble([t[k].view(local) for t, _ in parts]) for k in keys}
    mine_t = {k: (mine.take(v, rank) if mine is not None else v).reshape(-1).contiguous() for k, v in full.items()}
    n = next(iter(mine_t.values())).numel() if mine_t else 0
    return [PieceState(name, 0, n, mine_t, scalars)]
