r"""Block-wise symmetric quantization (ZeRO++'s qwZ / qgZ), the reference.

Over x flattened to fp32 and cut into blocks of ``block`` elements (the last
may be partial), with ``qmax = 2**(bits - 1) - 1`` (127 for int8, 7 for int4):

.. math::
    s_b = \max_{i \in b} |x_i| / q_{max};\quad
    q_i = \mathrm{rne}(\mathrm{clamp}(x_i / s_b, -q_{max}, q_{max}))

all in fp32 (IEEE division, round to nearest even). With stochastic
rounding, :math:`q_i = \lfloor \mathrm{clamp}(x_i / s_b + u_i, -q_{max}, q_{max}) \rfloor`
where :math:`u_i` = :func:`uniform` (seed, i), i the element's flat index.
A block whose scale is 0 (all zeros, or |x| so tiny that absmax / qmax
underflows) has codes 0. A block holding NaN or inf gets scale NaN and
codes 0: it dequantizes to NaN, and ``scales.isfinite()`` reports it.

int8 codes are int8; int4 codes are uint8, two per byte: element 2k in the
low nibble of byte k, element 2k+1 in the high one, each a two's-complement
nibble; an odd count leaves the last high nibble 0. Dequantization is
``q * s`` in fp32; a sum over ranks adds each rank's ``q * s`` into an fp32
accumulator in rank order (a multiply, then an add: no fused multiply-add).
"""

from __future__ import annotations

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def _mul32(a: Tensor, c: int) -> Tensor:
    """(a * c) mod 2^32 for int64 a in [0, 2^32): in 16-bit halves, so the
    int64 products never overflow."""
    lo = a * (c & 0xFFFF)
    hi = ((a * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finalizer, on int64 tensors holding uint32 values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniform(seed: int, index: Tensor) -> Tensor:
    """fp32 in [0, 1) for element indices (int64) under a seed in [0, 2^32):
    ``key = fmix32(seed + 0x9E3779B9 * (i >> 32))``,
    ``h = fmix32((i mod 2^32) ^ key)``, ``u = (h >> 8) * 2^-24`` (exact)."""
    hi = index >> 32
    key = _fmix32((seed + _mul32(hi, _GOLDEN)) & _M32)
    h = _fmix32((index & _M32) ^ key)
    return (h >> 8).to(torch.float32) * 2.0**-24


def scales_of(x: Tensor, block: int, bits: int) -> Tensor:
    """fp32 [ceil(n / block)]: absmax / qmax per block, NaN where a block is not finite."""
    x = x.reshape(-1).float()
    n = x.numel()
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:n] = x
    rows = padded.reshape(blocks, block)
    absmax = rows.abs().amax(1) if blocks else torch.zeros(0, device=x.device)
    finite = rows.isfinite().all(1)
    return torch.where(finite, absmax / qmax(bits), torch.nan)


def quantize(
    x: Tensor, bits: int = 8, block: int = 256, stochastic: bool = False, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """(codes, scales) of x as the module docstring says."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    q = qmax(bits)
    scales = scales_of(flat, block, bits)
    s = scales.repeat_interleave(block)[:n] if n else scales[:0]
    r = flat / s
    if stochastic:
        u = uniform(seed, torch.arange(n, dtype=torch.int64, device=x.device))
        v = (r + u).clamp(-q, q).floor()
    else:
        v = r.clamp(-q, q).round()  # half to even
    v = torch.where((s != 0) & s.isfinite(), v, 0.0).to(torch.int8)
    if bits == 8:
        return v, scales
    return pack_int4(v), scales


def pack_int4(q: Tensor) -> Tensor:
    """int8 values in [-8, 7] -> uint8 [ceil(n / 2)]: even elements in the low nibble."""
    nib = (q.to(torch.int16) & 0xF).to(torch.uint8)
    if nib.numel() % 2:
        nib = torch.cat([nib, nib.new_zeros(1)])
    pairs = nib.reshape(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_int4(codes: Tensor, n: int) -> Tensor:
    """uint8 [ceil(n / 2)] -> int8 [n] (sign-extended nibbles)."""
    c = codes.reshape(-1).to(torch.int16)
    nib = torch.stack([c & 0xF, c >> 4], 1).reshape(-1)[:n]
    return torch.where(nib >= 8, nib - 16, nib).to(torch.int8)


def values(codes: Tensor, scales: Tensor, n: int, block: int) -> Tensor:
    """fp32 [n]: q * s."""
    q = unpack_int4(codes, n) if codes.dtype == torch.uint8 else codes.reshape(-1)
    s = scales.reshape(-1).float().repeat_interleave(block)[:n]
    return q.float() * s


def dequantize(codes: Tensor, scales: Tensor, n: int, block: int) -> Tensor:
    return values(codes, scales, n, block)


def dequantize_sum(chunks: list[Tensor], scales: list[Tensor], n: int, block: int) -> Tensor:
    """fp32 [n]: sum over ranks of q * s, added in rank order."""
    acc = torch.zeros(n, dtype=torch.float32, device=scales[0].device)
    for c, s in zip(chunks, scales):
        acc = acc + values(c, s, n, block)
    return acc


# The backend interface (fastzero.ops.quant.backends), over checked buffers.


def quant_quantize(
    x: Tensor, codes: Tensor, scales: Tensor, bits: int, block: int, stochastic: bool, seed: int
) -> None:
    c, s = quantize(x, bits, block, stochastic, seed)
    codes.copy_(c)
    scales.copy_(s)


def quant_dequantize(codes: Tensor, scales: Tensor, out: Tensor, block: int) -> None:
    out.copy_(dequantize(codes, scales, out.numel(), block))


def quant_dequantize_sum(codes: Tensor, scales: Tensor, out: Tensor, block: int) -> None:
    """codes [R, C] and scales [R, blocks]: the R ranks' rows."""
    out.copy_(dequantize_sum(list(codes), list(scales), out.numel(), block))
