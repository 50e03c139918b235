"""Optimizer states kept packed, seen by checkpoints as fp32 values per element.

fastzero's Adam keeps exp_avg and exp_avg_sq in a state format
(:mod:`fastzero.ops.adam.state_formats`). Two are *packed*: ``"bf16"``
(bf16 tensors) and ``"int8"`` (uint8 codes with one fp32 scale per block of
each tensor, so an element's value depends on its whole block). Checkpoint
pieces hold fp32 values per element, which any split and any format can take,
so the groups' state API (:mod:`fastzero.runtime.groups`) decodes an optimizer
tensor's states before cutting pieces out of it (:func:`unpack`), and encodes
them once after every piece is written in (:func:`pack`): a piece may start
in the middle of a block, and encoding per piece would round the block's
other elements again. Encoding decoded values gives the same codes back, so a
resume at the same layout and format continues to the bit.

Both convert :data:`SLICE` elements at a time, bounding the temporaries on
the optimizer's device; the decoded values are kept in CPU memory, where
checkpoint pieces are read and written anyway.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastzero.ops.adam import state_formats

PACKED = ("bf16", "int8")
MOMENTS = ("exp_avg", "exp_avg_sq")
SLICE = 1 << 22  # elements converted at a time (a multiple of every int8 block size)


def packed(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer keeps its states in a packed format."""
    return getattr(optimizer, "state_format", None) in PACKED


def _window(state: dict, lo: int, hi: int, block: int | None) -> dict[str, Tensor]:
    """Elements [lo, hi) of the states (views), with the scales of their
    blocks for int8 (`lo` at a block's start)."""
    out = {key: state[key].reshape(-1)[lo:hi] for key in MOMENTS}
    if block is not None:
        blocks = slice(lo // block, -(-hi // block))
        out.update({key: state[key][blocks] for key in state_formats.SCALE_KEYS})
    return out


def unpack(optimizer: torch.optim.Optimizer, live: dict) -> dict:
    """One optimizer tensor's state `live` with exp_avg and exp_avg_sq as
    fp32 values in CPU memory (decoded, of their shape) and no block scales;
    its other entries (``master_param``, ``step``) are the same objects."""
    fmt, block = optimizer.state_format, optimizer.block_size
    out = {k: v for k, v in live.items() if k not in MOMENTS and k not in state_formats.SCALE_KEYS}
    shape, n = live["exp_avg"].shape, live["exp_avg"].numel()
    m, v = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
    for lo in range(0, n, SLICE):
        hi = min(lo + SLICE, n)
        m[lo:hi], v[lo:hi] = state_formats.to_fp32(fmt, _window(live, lo, hi, block), block)
    out["exp_avg"], out["exp_avg_sq"] = m.view(shape), v.view(shape)
    return out


def pack(optimizer: torch.optim.Optimizer, work: dict, live: dict) -> None:
    """`work` (from :func:`unpack`, then written) back into `live`: its fp32
    exp_avg and exp_avg_sq encoded in the optimizer's format into live's own
    tensors (rounded to nearest for bf16; fresh block scales for int8), its
    other entries as they are."""
    fmt, block = optimizer.state_format, optimizer.block_size
    m, v = (work[key].reshape(-1) for key in MOMENTS)
    kept = {k: live[k] for k in (*MOMENTS, *state_formats.SCALE_KEYS) if k in live}
    live.clear()
    live.update({k: t for k, t in work.items() if k not in MOMENTS})
    live.update(kept)
    for lo in range(0, m.numel(), SLICE):
        hi = min(lo + SLICE, m.numel())
        dst = _window(kept, lo, hi, block)
        fresh = state_formats.from_fp32(fmt, m[lo:hi], v[lo:hi], dst["exp_avg"], master=True, block=block)
        for key, t in dst.items():
            t.copy_(fresh[key])
