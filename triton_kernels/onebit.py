r"""1-bit Adam's compression in Triton: pack (signs, scales, error feedback) and unpack.

``onebit_pack`` takes, per chunk of L elements, ``y = x + e``, the scale
``s = ||y||_2 / sqrt(L)``, the sign bits ``y >= 0`` eight to a byte (element i of
the chunk in bit ``i % 8`` of byte ``i // 8``) and the new error ``y - s (2b - 1)``.
It runs in two passes over x and e, because no error can be written before the
whole chunk's scale is known: (1) each program sums ``y^2`` over one block of one
chunk into a buffer of partials, which torch reduces per chunk (deterministic, no
atomics); (2) each program reads its block again, packs the bits and writes the
error. Programs never straddle a chunk: the grid is (block in chunk, chunk), and
the last block of a chunk is masked (L is only a multiple of 8).

``onebit_unpack`` gives each row's signs times its scale, or the mean of the rows.
The source of truth is :mod:`fastzero.ops.reference.onebit`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._multi_tensor import _to_fp32

BLOCK = 1024  # elements a program (BLOCK // 8 bytes)
NUM_WARPS = 4


@triton.jit
def _chunk_block(n, BLOCK: tl.constexpr):
    """(first element of this program's block, bytes of the block's rows that lie in the chunk)
    for a chunk of ``n`` elements; int64 so that huge buffers do not overflow."""
    b = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    start = chunk * n + b * BLOCK
    rows = tl.arange(0, BLOCK // 8)
    return start, rows, b * BLOCK + rows * 8 < n  # n is a multiple of 8: a byte is all in or all out


@triton.jit
def _sum_squares_kernel(x_ptr, e_ptr, partial_ptr, n, n_blocks, BLOCK: tl.constexpr):
    """partial[chunk, b] = sum of (x + e)^2 over block b of the chunk."""
    start, rows, row_ok = _chunk_block(n, BLOCK)
    offs = start + rows[:, None] * 8 + tl.arange(0, 8)[None, :]
    mask = row_ok[:, None]
    y = _to_fp32(tl.load(x_ptr + offs, mask=mask, other=0.0)) + tl.load(e_ptr + offs, mask=mask, other=0.0)
    total = tl.sum(tl.sum(y * y, axis=1), axis=0)
    tl.store(partial_ptr + tl.program_id(1).to(tl.int64) * n_blocks + tl.program_id(0), total)


@triton.jit
def _pack_kernel(x_ptr, e_ptr, bits_ptr, scales_ptr, n, BLOCK: tl.constexpr):
    """Sign bits and new error of one block of one chunk, with the chunk's scale."""
    start, rows, row_ok = _chunk_block(n, BLOCK)
    offs = start + rows[:, None] * 8 + tl.arange(0, 8)[None, :]
    mask = row_ok[:, None]
    y = _to_fp32(tl.load(x_ptr + offs, mask=mask)) + tl.load(e_ptr + offs, mask=mask)
    s = tl.load(scales_ptr + tl.program_id(1))
    sign = y >= 0  # as torch's `y >= 0`: -0.0 -> 1, NaN -> 0
    byte = tl.sum(sign.to(tl.int32) << tl.arange(0, 8)[None, :], axis=1)
    tl.store(bits_ptr + start // 8 + rows, byte.to(tl.uint8), mask=row_ok)
    # y - s and y + s, as the reference's y - s * (+-1) rounds them
    tl.store(e_ptr + offs, y - tl.where(sign, s, -s), mask=mask)


@triton.jit
def _unpack_kernel(
    bits_ptr, scales_ptr, out_ptr, n_bytes, row_bytes, rows, rows_f, AVERAGE: tl.constexpr, BYTES: tl.constexpr
):
    """Values of BYTES consecutive bytes: of the flat bits (each byte with its row's scale),
    or with AVERAGE of one row's columns, averaged over the rows in row order."""
    k = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    ok = k < n_bytes
    shift = tl.arange(0, 8)[None, :]
    if AVERAGE:
        acc = tl.zeros((BYTES, 8), dtype=tl.float32)
        row_ptr = bits_ptr + k
        for r in range(0, rows):
            byte = tl.load(row_ptr, mask=ok, other=0).to(tl.int32)
            s = tl.load(scales_ptr + r)
            acc += tl.where(((byte[:, None] >> shift) & 1) != 0, s, -s)
            row_ptr += row_bytes  # a pointer step, not r * row_bytes: no int32 overflow on huge rows
        vals = tl.div_rn(acc, rows_f)  # IEEE division, as torch's mean (on GPUs `/` is approximate)
    else:
        byte = tl.load(bits_ptr + k, mask=ok, other=0).to(tl.int32)
        s = tl.load(scales_ptr + k // row_bytes, mask=ok, other=0.0)[:, None]
        vals = tl.where(((byte[:, None] >> shift) & 1) != 0, s, -s)
    tl.store(out_ptr + k[:, None] * 8 + shift, vals, mask=ok[:, None])


@torch.no_grad()
def onebit_pack(x: Tensor, error: Tensor, bits: Tensor, scales: Tensor, chunks: int) -> None:
    """Sign bits (uint8 [N/8]) and scales (fp32 [chunks]) of ``x + error``; the new error
    in place. Inputs checked by :func:`fastzero.ops.onebit.pack` (1-D, contiguous,
    N a multiple of 8 * chunks)."""
    n = x.numel() // chunks
    n_blocks = triton.cdiv(n, BLOCK)
    partials = torch.empty((chunks, n_blocks), dtype=torch.float32, device=x.device)
    if n_blocks:
        grid = (n_blocks, chunks)
        _sum_squares_kernel[grid](x, error, partials, n, n_blocks, BLOCK=BLOCK, num_warps=NUM_WARPS)
    # ||y||_2 / sqrt(n), as the reference rounds it (n = 0 gives NaN there too); on the device, no sync
    torch.div(partials.sum(dim=1).sqrt_(), n**0.5, out=scales)
    if n_blocks:
        _pack_kernel[grid](x, error, bits, scales, n, BLOCK=BLOCK, num_warps=NUM_WARPS)


@torch.no_grad()
def onebit_unpack(bits: Tensor, scales: Tensor, out: Tensor, average: bool) -> None:
    """fp32 ``out`` of ``bits`` (uint8, one row of K bytes per scale): [R*K*8], each row's
    signs times its scale, or with ``average`` [K*8], the mean over the rows."""
    rows = scales.numel()
    row_bytes = bits.numel() // rows
    n_bytes = row_bytes if average else bits.numel()
    if n_bytes == 0:
        return
    grid = (triton.cdiv(n_bytes, BLOCK // 8),)
    _unpack_kernel[grid](
        bits,
        scales,
        out,
        n_bytes,
        row_bytes,
        rows,
        float(rows),
        AVERAGE=bool(average),
        BYTES=BLOCK // 8,
        num_warps=NUM_WARPS,
    )
