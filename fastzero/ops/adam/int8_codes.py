r"""The 8-bit codes of Adam's int8 states (``state_format="int8"``): the rule
every backend follows to the bit.

A state tensor of n elements is cut into blocks of ``block`` elements (a
power of two from 64 to 4096; the last block may be partial), each stored as
one fp32 **scale**, the block's largest magnitude ``s = max |x|``, and one
byte per element: a non-linear code of ``y = |x| / s`` in [0, 1] (bitsandbytes'
block-wise 8-bit states, with a code built from bits instead of a table, so
that it is a few integer operations on every backend).

The codes are small floating-point numbers without inf or NaN, whose largest
value used is exactly 1 (so a block's largest element is exact):

- ``exp_avg`` (signed): bit 7 is x's sign bit; bits 0-6 are ``c = 8 e + f``,
  4 exponent bits and 3 mantissa bits: ``c >= 8``: :math:`(1 + f/8)\,2^{e-15}`;
  ``c < 8``: :math:`c\,2^{-17}` (subnormal). c runs to 120 (the value 1).
  Steps of 1/16 to 1/8 relative, down to :math:`2^{-17} s` (about 7.6e-6 s).
- ``exp_avg_sq`` (unsigned): ``c = 8 e + f``, 5 exponent bits and 3 mantissa
  bits: ``c >= 8``: :math:`(1 + f/8)\,2^{e-31}`; ``c < 8``: :math:`c\,2^{-33}`.
  c runs to 248 (the value 1); steps of 1/16 to 1/8 relative down to
  :math:`2^{-33} s` (about 1.2e-10 s: 1.1e-5 in the square root the step
  takes). A value above 0 never gets code 0: below the smallest code it
  takes code 1, so an element is never treated as if its squared gradient
  were 0 (which would divide its momentum by eps alone).

**Encoding** one block, all in fp32 (IEEE, round to nearest even):

1. ``s`` = the largest ``|x|`` of the block (exact: a max). A block with
   an inf or NaN gets ``s = NaN`` and codes 0 (it decodes to NaN); a block
   whose ``s`` is below 2^-126 (zero, or subnormal values only) gets ``s = 0``
   and codes 0 (it decodes to zeros).
2. ``k = 1 / s`` (one IEEE division per block); ``y = min(|x| * k, 1)``.
3. ``y >= 2^emin`` (``emin`` = -14, -30): ``t`` = y's fp32 bit pattern
   less ``(127 - bias) << 23`` (bias 15, 31): the code with 20 more fraction
   bits (a carry moves into the exponent). **To nearest** (conversions of
   whole states: the smallest error): ``(t + 0x7FFFF + ((t >> 20) & 1)) >> 20``,
   ties to even. **Stochastically** (the optimizer step, with 16 random bits
   ``r`` per element: the bf16 format's ``sr_bits`` of (seed, step, element
   index), exp_avg the low half, exp_avg_sq the high): ``(t + (r << 4)) >> 20``,
   so a value moves to the code above with probability its fraction of the
   step (to 2^-16) and the stored moment's mean is the fp32 one.
4. ``y < 2^emin`` (the code's subnormals): to nearest,
   ``bits(y + 2^(emin + 20)) - bits(2^(emin + 20))`` (the FPU's addition
   rounds y to a multiple of the subnormal step, to nearest even, once);
   stochastically, ``(t + (r << 4)) >> 20`` with ``t = y * 2^(23 - emin)``
   (exact) truncated to an integer. Rounding to nearest would freeze a
   moment: exp_avg_sq changes by (1 - beta2) = 0.1% a step against code steps
   of 6-12%, so all but each block's largest element would stop following
   their squared gradients (measured: a median exp_avg_sq 0.63x fp32's after
   800 steps, and a run that drifts from Adam's).

**Decoding**: ``x = value(c) * s`` (one fp32 multiply), with the sign bit
put back (``exp_avg``).

Re-encoding decoded values gives the same codes and scales back (the
largest decodes to ``1 * s = s`` exactly; every other value is within a few
ulps of a code's value, far from the rounding midpoints), for scales of
2^-100 and above: so a state saved as fp32 values resumes to the bit at the
same block boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

F32_MIN_NORMAL = 2.0**-126
BLOCK_SIZES = tuple(1 << k for k in range(6, 13))  # 64 .. 4096
DEFAULT_BLOCK = 256
_NAN_BITS = 0x7FC00000


@dataclass(frozen=True)
class Code:
    """One 8-bit code: ``exp_bits`` exponent bits and 3 mantissa bits, signed
    (a sign bit on top) or not; its largest value used is 1."""

    name: str
    exp_bits: int
    signed: bool

    @property
    def bias(self) -> int:
        return (1 << self.exp_bits) - 1

    @property
    def emin(self) -> int:  # the exponent of the smallest normal value
        return 1 - self.bias

    @property
    def top(self) -> int:  # the code of 1.0
        return self.bias << 3


EXP_AVG = Code("exp_avg", exp_bits=4, signed=True)
EXP_AVG_SQ = Code("exp_avg_sq", exp_bits=5, signed=False)
CODES = (EXP_AVG, EXP_AVG_SQ)


def check_block_size(op: str, block: int) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block not in BLOCK_SIZES:
        raise ValueError(
            f"{op}: block_size={block!r}; int8 states take a power of two from 64 to 4096 "
            f"({', '.join(map(str, BLOCK_SIZES))}; default {DEFAULT_BLOCK})"
        )
    return block


def blocks_of(numel: int, block: int) -> int:
    """How many scales a state of `numel` elements has."""
    return -(-numel // block)


def _bits(x: Tensor) -> Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _f32(bits: Tensor) -> Tensor:
    b = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)
    return b.to(torch.int32).view(torch.float32)


def value(code: Code, c: Tensor) -> Tensor:
    """fp32 value in [0, 1] of magnitude codes c (int64, sign bit removed)."""
    sub = c.to(torch.float32) * 2.0 ** (code.emin - 3)
    normal = _f32((c << 20) + ((127 - code.bias) << 23))
    return torch.where(c < 8, sub, normal)


def encode(code: Code, y: Tensor, r: Tensor | None = None) -> Tensor:
    """Magnitude codes (int64) of fp32 y in [0, 1], steps 3 and 4 of the rule:
    to nearest (``r`` None) or stochastically with the 16-bit integers ``r``."""
    t = _bits(y) - ((127 - code.bias) << 23)
    small = y < 2.0**code.emin
    if r is None:
        normal = (t + 0x7FFFF + ((t >> 20) & 1)) >> 20
        magic = torch.tensor(2.0 ** (code.emin + 20), dtype=torch.float32)  # its ulp is the subnormal step
        c = torch.where(small, _bits(y + magic) - _bits(magic), normal)
    else:
        sub = (y * torch.tensor(2.0 ** (23 - code.emin), dtype=torch.float32)).to(torch.int64)  # truncated
        c = (torch.where(small, sub, t) + (r.to(torch.int64) << 4)) >> 20
    if not code.signed:
        c = torch.where((y > 0) & (c == 0), 1, c)
    return c


def _rows(x: Tensor, block: int) -> Tensor:
    x = x.reshape(-1).float()
    n = x.numel()
    padded = torch.zeros(blocks_of(n, block) * block, dtype=torch.float32, device=x.device)
    padded[:n] = x
    return padded.reshape(-1, block)


def quantize(code: Code, x: Tensor, block: int, r: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(codes uint8 of x's shape, scales fp32 [blocks]) of x (any float dtype),
    to nearest or, given 16-bit integers ``r`` (one per element), stochastically."""
    rows = _rows(x, block)
    mag = rows.abs()
    absmax = mag.amax(1) if rows.shape[0] else torch.zeros(0, device=rows.device)
    finite = rows.isfinite().all(1)
    usable = finite & (absmax >= F32_MIN_NORMAL)
    scale = torch.where(finite, torch.where(usable, absmax, 0.0), _f32(torch.tensor(_NAN_BITS)))
    k = torch.ones_like(scale) / torch.where(usable, scale, 1.0)
    y = torch.minimum(mag * k[:, None], torch.ones(()))
    if r is not None:
        r = _rows(r.reshape(-1).to(torch.float32), block).to(torch.int64)  # exact: r < 2^16
    c = encode(code, torch.where(usable[:, None], y, 0.0), r)
    if code.signed:
        c = c | ((_bits(rows) >> 24) & 0x80)
    c = torch.where(usable[:, None], c, 0)
    codes = c.reshape(-1)[: x.numel()].to(torch.uint8).reshape(x.shape)
    return codes, scale


def dequantize(code: Code, codes: Tensor, scales: Tensor, block: int) -> Tensor:
    """fp32 values of x's shape from codes (uint8) and scales (fp32 [blocks])."""
    c = codes.reshape(-1).to(torch.int64)
    n = c.numel()
    s = scales.float().repeat_interleave(block)[:n]
    magnitude = c & 0x7F if code.signed else c
    x = value(code, magnitude) * s
    if code.signed:
        x = torch.where(c >= 0x80, -x, x)
    return x.reshape(codes.shape)
