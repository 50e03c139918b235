r"""1-bit compression with error feedback (1-bit Adam's), the reference.

Per chunk of n elements, with the error carried over from the last call:

.. math::
    y = x + e;\quad s = \lVert y \rVert_2 / \sqrt{n};\quad
    b_i = [y_i \ge 0];\quad e' = y - s\,(2b - 1)

The sign bits are packed eight to a byte, element i of the chunk in bit
``i % 8`` of byte ``i // 8``. ``decompress`` gives ``s (2b - 1)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_signs(y: Tensor) -> Tensor:
    """[..., 8k] -> uint8 [..., k]: bit j of byte i is y[8i + j] >= 0."""
    bits = (y >= 0).reshape(*y.shape[:-1], -1, 8).to(torch.uint8)
    return (bits * _BITS.to(y.device)).sum(-1, dtype=torch.uint8)


def unpack_signs(packed: Tensor) -> Tensor:
    """uint8 [..., k] -> fp32 [..., 8k] of +-1."""
    bits = (packed[..., None] & _BITS.to(packed.device)) != 0
    return bits.reshape(*packed.shape[:-1], -1).to(torch.float32) * 2 - 1


def mask_pack(mask: Tensor, bits: Tensor) -> None:
    """`mask` (any dtype, any layout) as bits into `bits` (uint8, ceil(numel / 8)): bit i % 8 of byte i // 8 is
    element i != 0, in the mask's logical order. Each 8 bytes of 0/1 read as one int64 are gathered into its top
    byte by one multiply."""
    b = (mask.reshape(-1) != 0).to(torch.uint8)
    pad = -b.numel() % 8
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    bits.copy_(((b.view(torch.int64) * 0x0102040810204080) >> 56) & 255)


_TABLES: dict[tuple, Tensor] = {}


def mask_unpack(bits: Tensor, out: Tensor) -> None:
    """The 0/1 values of `bits` into `out` (its shape and dtype, in its logical order): a contiguous float output
    of a multiple of 8 values by one gather of 8-value rows from a 256-row table."""
    if out.is_contiguous() and out.numel() % 8 == 0 and out.dtype.is_floating_point:
        key = (out.dtype, out.device)
        table = _TABLES.get(key)
        if table is None:
            rows = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
            table = _TABLES[key] = rows.to(dtype=out.dtype, device=out.device)
        torch.index_select(table, 0, bits.int(), out=out.view(-1, 8))
        return
    values = (bits.unsqueeze(-1) & _BITS.to(bits.device)) != 0
    out.copy_(values.view(-1)[: out.numel()].view(out.shape))


def compress(x: Tensor, error: Tensor, chunks: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """(packed signs uint8 [numel / 8], scales fp32 [chunks], new error) for
    fp32 `x` and `error` whose numel is a multiple of 8 * chunks."""
    y = (x.float() + error.float()).reshape(chunks, -1)
    scales = torch.linalg.vector_norm(y, dim=1) / y.shape[1] ** 0.5
    signs = torch.where(y >= 0, 1.0, -1.0)
    new_error = (y - scales[:, None] * signs).reshape(x.shape)
    return pack_signs(y).reshape(-1), scales, new_error


def decompress(packed: Tensor, scales: Tensor) -> Tensor:
    """fp32 [numel]: each chunk's signs times its scale."""
    signs = unpack_signs(packed.reshape(scales.numel(), -1))
    return (signs * scales[:, None]).reshape(-1)


def onebit_pack(x: Tensor, error: Tensor, bits: Tensor, scales: Tensor, chunks: int) -> None:
    """:func:`compress` into the given outputs, as every backend's pack does."""
    b, s, e = compress(x.reshape(-1), error.reshape(-1), chunks)
    bits.copy_(b)
    scales.copy_(s)
    error.copy_(e.reshape(error.shape))


def onebit_unpack(bits: Tensor, scales: Tensor, out: Tensor, average: bool) -> None:
    """:func:`decompress` into `out`: each row, or the mean of the rows."""
    values = decompress(bits, scales)
    out.copy_(values.reshape(scales.numel(), -1).mean(0) if average else values)
