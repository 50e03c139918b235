r"""Block-wise symmetric quantization in Triton: quantize (int8, or int4 two to a
byte), dequantize, and the dequantized sum over ranks.

``quant_quantize`` runs one program per block of ``block`` elements, in two
passes over it in tiles of TILE: (1) the largest ``|x|`` as an integer max of
the fp32 bit patterns without the sign (their order is |x|'s for every
non-NaN value, and a pattern >= 0x7f800000 flags inf or NaN); (2) with
``s = absmax / qmax``, the codes ``rne(clamp(x / s, -qmax, qmax))`` (or, with
stochastic rounding, ``floor(clamp(x / s + u, -qmax, qmax))``, u from the
counter hash of the reference). Tiles are laid out as [TILE / 2, 2] pairs, so
int4 packs an even element into the low nibble and the odd one into the high
nibble of one byte. Divisions are ``div_rn`` (IEEE; on GPUs ``/`` is not).

``quant_dequantize_sum`` gives each output element ``sum_r q_r * s_r`` in
fp32 in rank order (``ranks == 1``: plain dequantization). The source of
truth is :mod:`fastzero.ops.quant.reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._multi_tensor import _to_fp32, _to_storage

TILE_MAX = 1024  # elements a program handles at once
NUM_WARPS = 4
_ROUND_MAGIC = 12582912.0  # 1.5 * 2^23: (r + M) - M rounds |r| <= 2^22 to nearest even
_M32 = 0xFFFFFFFF


@triton.jit
def _fmix32(h):
    """MurmurHash3's finalizer on int64 holding uint32 values (products wrap; the mask keeps 32 bits)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@triton.jit
def _uniform(idx, seed):
    """The reference's u(seed, i) in [0, 1), for int64 element indices."""
    key = _fmix32((seed + (idx >> 32) * 0x9E3779B9) & 0xFFFFFFFF)
    h = _fmix32((idx & 0xFFFFFFFF) ^ key)
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24


@triton.jit
def _rne(r):
    return (r + _ROUND_MAGIC) - _ROUND_MAGIC


@triton.jit
def _quantize_kernel(
    x_ptr, codes_ptr, scales_ptr, n, block, seed, BITS: tl.constexpr, STOCHASTIC: tl.constexpr, TILE: tl.constexpr
):
    b = tl.program_id(0).to(tl.int64)
    start = b * block
    end = tl.minimum(start + block, n)
    pair = tl.arange(0, TILE // 2)[:, None] * 2 + tl.arange(0, 2)[None, :]  # [TILE / 2, 2]
    m = tl.zeros((TILE // 2, 2), dtype=tl.int32)
    for t in range(0, block, TILE):
        offs = start + t + pair
        x = _to_fp32(tl.load(x_ptr + offs, mask=offs < end, other=0.0))
        m = tl.maximum(m, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    m = tl.max(tl.max(m, axis=1), axis=0)
    QMAX: tl.constexpr = 127.0 if BITS == 8 else 7.0
    finite = m < 0x7F800000
    scale = tl.where(finite, tl.div_rn(m.to(tl.float32, bitcast=True), QMAX), float("nan"))
    tl.store(scales_ptr + b, scale)
    live = finite & (scale != 0.0)  # otherwise codes 0: no division by 0 or NaN
    safe = tl.where(live, scale, 1.0)
    for t in range(0, block, TILE):
        offs = start + t + pair
        ok = offs < end
        r = tl.div_rn(_to_fp32(tl.load(x_ptr + offs, mask=ok, other=0.0)), safe)
        if STOCHASTIC:
            r = r + _uniform(offs, seed)
        r = tl.where(r < -QMAX, -QMAX, r)
        r = tl.where(r > QMAX, QMAX, r)
        f = _rne(r)
        if STOCHASTIC:
            f = tl.where(f > r, f - 1.0, f)
        q = tl.where(live, f, 0.0).to(tl.int32)
        if BITS == 8:
            tl.store(codes_ptr + offs, q.to(tl.int8), mask=ok)
        else:
            nib = tl.where(ok, q & 0xF, 0) << (tl.arange(0, 2)[None, :] * 4)
            byte = tl.sum(nib, axis=1)  # disjoint nibbles: the sum is the or
            first = start + t + tl.arange(0, TILE // 2) * 2
            tl.store(codes_ptr + first // 2, byte.to(tl.uint8), mask=first < end)


@triton.jit
def _dequantize_sum_kernel(
    codes_ptr, scales_ptr, out_ptr, n, block, blocks, code_stride, ranks, BITS: tl.constexpr, TILE: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    ok = offs < n
    blk = offs // block
    acc = tl.zeros((TILE,), dtype=tl.float32)
    code_row = codes_ptr
    scale_row = scales_ptr
    for r in range(0, ranks):
        if BITS == 8:
            q = tl.load(code_row + offs, mask=ok, other=0).to(tl.float32)
        else:
            byte = tl.load(code_row + offs // 2, mask=ok, other=0).to(tl.int32)
            nib = (byte >> ((offs % 2) * 4).to(tl.int32)) & 0xF
            q = tl.where(nib >= 8, nib - 16, nib).to(tl.float32)
        v = q * tl.load(scale_row + blk, mask=ok, other=0.0)
        acc = v if r == 0 else acc + v
        code_row += code_stride  # pointer steps: no int32 overflow of r * stride
        scale_row += blocks
    tl.store(out_ptr + offs, _to_storage(acc, out_ptr.dtype.element_ty), mask=ok)


def _tile(block: int) -> int:
    return max(2, min(TILE_MAX, triton.next_power_of_2(block)))


@torch.no_grad()
def quant_quantize(
    x: Tensor, codes: Tensor, scales: Tensor, bits: int, block: int, stochastic: bool, seed: int
) -> None:
    """codes and scales of flat x (checked by fastzero.ops.quant.quantize_blockwise)."""
    n = x.numel()
    if n == 0:
        return
    grid = (scales.numel(),)
    _quantize_kernel[grid](
        x, codes, scales, n, block, seed, BITS=bits, STOCHASTIC=bool(stochastic), TILE=_tile(block), num_warps=NUM_WARPS
    )


@torch.no_grad()
def quant_dequantize_sum(codes: Tensor, scales: Tensor, out: Tensor, block: int) -> None:
    """out = sum over the rows of codes [R, C] with scales [R, blocks] (contiguous)."""
    n = out.numel()
    if n == 0:
        return
    bits = 8 if codes.dtype == torch.int8 else 4
    ranks, stride = codes.shape
    grid = (triton.cdiv(n, TILE_MAX),)
    _dequantize_sum_kernel[grid](
        codes, scales, out, n, block, scales.shape[1], stride, ranks, BITS=bits, TILE=TILE_MAX, num_warps=NUM_WARPS
    )


def quant_dequantize(codes: Tensor, scales: Tensor, out: Tensor, block: int) -> None:
    quant_dequantize_sum(codes.view(1, -1), scales.view(1, -1), out, block)
