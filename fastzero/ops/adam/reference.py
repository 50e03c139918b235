r"""Adam/AdamW in plain PyTorch: the math every Adam backend is tested
against, and the fallback where no faster backend runs.

Two state formats (``state_format``):

- **as given** (``None``, ``"fp32"``, ``"param_dtype"``): exp_avg and
  exp_avg_sq are fp32 or the param's dtype and are written rounded to
  nearest; the math is :func:`adam_step`'s formula in fp32, and backends
  agree with it to fp32 rounding (they may fuse multiply-adds).
- **bf16 stochastic** (``"bf16"``): exp_avg and exp_avg_sq are bf16 whatever
  the param dtype, and are written with :func:`round_bf16_stochastic`, the
  random bits drawn by :func:`sr_bits` from (seed, step, element index,
  which state).
- **int8 block-wise** (``"int8"``): exp_avg and exp_avg_sq are one byte per
  element plus one fp32 scale per block of ``block_size`` elements
  (:mod:`fastzero.ops.adam.int8_codes`): decoded, updated and encoded again
  in the one pass, rounded stochastically with the bf16 format's bits.

So that every backend gives the same bits, the fp32 update of the bf16 and
int8 formats is pinned to one order of operations, each rounded on its own
(no fused multiply-add): :func:`_pinned_update`. Every backend reproduces it
bit for bit given the same fp32 constants.
"""

from __future__ import annotations

import math
import struct

import torch
from torch import Tensor

from fastzero.ops.adam import int8_codes
from fastzero.ops.adam.hyperparams import AdamHyperparams
from fastzero.ops.quant.reference import _fmix32, _mul32

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
BF16_NAN = 0x7FC0  # the quiet NaN every bf16 write gives a NaN (as torch's .to(torch.bfloat16))
PARAM_SALT = 0x6A09E667  # tells a param's random bits from its states' (sr_param_bits)


# -- the bf16 stochastic-rounding rule ------------------------------------------------------------


def sr_stream(seed: int, step: int) -> int:
    """The key of one step's random bits: ``fmix32(fmix32(seed) ^ (step mod 2^32))``
    (``fmix32``: MurmurHash3's finalizer, all arithmetic mod 2^32)."""
    return _fmix32(_fmix32(seed & _M32) ^ (step & _M32))


def _sr_hash(seed: int, step: int, index: Tensor) -> Tensor:
    i = index.to(torch.int64)
    key = _fmix32((sr_stream(seed, step) + _mul32(i >> 32, _GOLDEN)) & _M32)
    return _fmix32((i & _M32) ^ key)


def sr_bits(seed: int, step: int, index: Tensor) -> tuple[Tensor, Tensor]:
    """The 16-bit random integers (int64 tensors in [0, 2^16)) that round
    exp_avg and exp_avg_sq of the elements ``index`` (int64) at ``step``.

    For element ``i`` (its flat index in its tensor, so that the bits depend
    on neither threads nor chunking), the counter hash of
    :func:`fastzero.ops.quant.reference.uniform` keyed by :func:`sr_stream`::

        key = fmix32(sr_stream(seed, step) + 0x9E3779B9 * (i >> 32))
        h   = fmix32((i mod 2^32) ^ key)

    exp_avg takes the low half of ``h`` (``h & 0xFFFF``), exp_avg_sq the high
    half (``h >> 16``): one hash per element for both states."""
    h = _sr_hash(seed, step, index)
    return h & 0xFFFF, h >> 16


def sr_param_bits(seed: int, step: int, index: Tensor) -> Tensor:
    """The 16-bit random integers that round bf16 params written with
    stochastic rounding (``bf16_stochastic_round``): the low half of a second
    hash of the states' ``h``, ``fmix32(h ^ 0x6A09E667) & 0xFFFF``, so a
    param's rounding is independent of its states'."""
    return _fmix32(_sr_hash(seed, step, index) ^ PARAM_SALT) & 0xFFFF


_UNMIX = (pow(0x85EBCA6B, -1, 1 << 32), pow(0xC2B2AE35, -1, 1 << 32))  # fmix32's multipliers, inverted


def _unfmix32(h: int) -> int:
    """The inverse of ``fmix32`` (each of its steps is a bijection of 32-bit words)."""
    h ^= h >> 16
    h = (h * _UNMIX[1]) & _M32
    h ^= (h >> 13) ^ (h >> 26)
    h = (h * _UNMIX[0]) & _M32
    return h ^ (h >> 16)


def sr_seed_at(seed: int, step: int, offset: int) -> int:
    """The seed under which element ``j`` of a tensor draws, at `step`, the
    bits that element ``offset + j`` of a larger tensor draws under `seed`
    (:func:`sr_bits`), for every ``j < 2^k`` where ``2^k`` (at most 2^32)
    divides `offset`. So a step over an aligned slice ``[offset, offset + n)``,
    ``n <= 2^k``, rounds exactly as the step over the whole tensor (ZeRO-Offload
    steps its shards in such pieces).

    Why: there ``i mod 2^32 = (offset mod 2^32) ^ j`` and ``i >> 32 = offset >> 32``,
    so the whole tensor's ``h = fmix32(j ^ key ^ (offset mod 2^32))``: the
    slice needs the key ``key ^ (offset mod 2^32)``, and fmix32 is invertible."""
    if offset == 0:
        return seed
    key = _fmix32((sr_stream(seed, step) + _GOLDEN * (offset >> 32)) & _M32)
    stream = _unfmix32(key ^ (offset & _M32))
    return _unfmix32(_unfmix32(stream) ^ (step & _M32))


def round_bf16_stochastic(x: Tensor, r: Tensor) -> Tensor:
    """fp32 ``x`` to bf16 by stochastic rounding with the 16-bit integers ``r``:
    add ``r`` to x's bit pattern and keep its top 16 bits (truncate). x rounds
    away from zero with probability (its low 16 bits) / 2^16, so the result's
    mean is exactly x. A NaN becomes the quiet NaN 0x7FC0 (no carry from its
    payload into the sign); inf, zeros (with their sign), subnormals and
    exactly representable values are unchanged or rounded by the same rule.
    No saturation: a finite x beyond bf16's largest finite value (3.39e38,
    within fp32's top 0.4%) rounds to inf with that probability, as the carry
    into the exponent gives."""
    b = x.float().contiguous().view(torch.int32).to(torch.int64) & _M32
    y = torch.where(torch.isnan(x), BF16_NAN, (b + r) >> 16)
    return torch.where(y >= 0x8000, y - 0x10000, y).to(torch.int16).view(torch.bfloat16)


# -- the step ---------------------------------------------------------------------------------------


def _f32(x: float) -> float:
    """`x` rounded to fp32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _pinned_update(p: Tensor, g: Tensor, m: Tensor, v: Tensor, h: AdamHyperparams, step: int, grad_scale):
    """The bf16 format's fp32 update, in the order every backend follows, each
    op rounded to fp32 on its own. The constants are computed in double (as
    Python floats are) and rounded to fp32 once. Returns (p, m, v) in fp32."""
    bc1 = 1.0 - h.beta1**step if h.bias_correction else 1.0
    bc2 = 1.0 - h.beta2**step if h.bias_correction else 1.0
    c = lambda x: torch.tensor(_f32(x), dtype=torch.float32)  # noqa: E731
    inv_scale = 1.0 if grad_scale is None else 1.0 / grad_scale
    decay = 1.0 - h.lr * h.weight_decay if h.adamw_mode else 1.0
    l2 = 0.0 if h.adamw_mode else h.weight_decay
    w = _f32(1.0 - h.beta1)  # torch's lerp: m + w (g - m) for w < 0.5, else g + (w - 1)(g - m)
    g = g * c(inv_scale)
    if _f32(l2) != 0.0:  # the kernels skip the no-op terms (an inf param stays inf)
        g = g + c(l2) * p
    if _f32(decay) != 1.0:
        p = p * c(decay)
    m = (m + c(w) * (g - m)) if w < 0.5 else (g + c(w - 1.0) * (g - m))
    v = c(h.beta2) * v + (c(1.0 - h.beta2) * g) * g
    # IEEE sqrt, correctly rounded: torch's fp32 sqrt on CPU is not always (Sleef's, within 1 ulp); the
    # double sqrt rounded to fp32 is (53 >= 2 * 24 + 2 bits: the double rounding is innocuous)
    denom = v.double().sqrt().float() * c(1.0 / math.sqrt(bc2)) + c(h.eps)
    p = p - c(h.lr / bc1) * (m / denom)
    return p, m, v


@torch.no_grad()
def adam_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: int,
    hp: AdamHyperparams | None = None,
    grad_scale: float | None = None,
    param_copies: list[Tensor] | None = None,
    state_format: str | None = None,
    seed: int | None = None,
    exp_avg_absmax: list[Tensor] | None = None,
    exp_avg_sq_absmax: list[Tensor] | None = None,
    block_size: int | None = None,
    bf16_stochastic_round: bool = False,
    **hyper,
) -> None:
    r"""One Adam/AdamW step, in fp32 whatever the storage dtypes, in place.
    The hyperparameters are ``hp`` or keywords (``lr=``, ``beta1=``, ...).

    .. math::
        g &\leftarrow g / s \qquad (s = \text{grad\_scale}, 1 \text{ if None}) \\
        p &\leftarrow p\,(1 - \text{lr}\cdot\text{wd}) \text{ (AdamW) } \quad\text{or}\quad
            g \leftarrow g + \text{wd}\cdot p \text{ (Adam)} \\
        m &\leftarrow m + (1-\beta_1)(g - m) \qquad
        v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        p &\leftarrow p - \text{lr}\,\frac{m / bc_1}{\sqrt{v / bc_2} + \epsilon}
            \qquad bc_i = 1 - \beta_i^{t} \text{ (1 without bias correction)}

    ``param_copies`` (optional) receive the updated params in their own dtype.
    ``state_format="bf16"``: the states are bf16 and are written with
    stochastic rounding keyed by ``seed`` (default 0) and ``step``; the fp32
    math is then :func:`_pinned_update` (``g`` multiplied by ``1/s`` rounded to
    fp32, no fused multiply-add), which every backend follows to the bit.

    ``state_format="int8"``: exp_avgs and exp_avg_sqs are uint8 codes, with
    their block scales in ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` (fp32,
    one per ``block_size`` elements, default 256): decoded, updated by
    :func:`_pinned_update` and encoded again with new block scales, rounded
    stochastically with :func:`sr_bits` of ``seed`` and ``step`` (exp_avg the
    low half, exp_avg_sq the high; :mod:`int8_codes`).

    ``bf16_stochastic_round``: bf16 params (no fp32 master) are written with
    stochastic rounding, the bits of :func:`sr_param_bits` keyed by ``seed``
    and ``step``, after :func:`_pinned_update` (any state format); params of
    other dtypes are written as without it.
    """
    h = hp if hp is not None else AdamHyperparams.from_kwargs(**hyper)
    copies = param_copies if param_copies is not None else [None] * len(params)
    seed = 0 if seed is None else seed
    sr_param = lambda p: bf16_stochastic_round and p.dtype == torch.bfloat16  # noqa: E731

    def write_param(p: Tensor, p32: Tensor) -> None:
        if sr_param(p):
            r = sr_param_bits(seed, step, torch.arange(p.numel(), device=p.device))
            p.copy_(round_bf16_stochastic(p32.reshape(-1), r).view(p.shape))
        else:
            p.copy_(p32.view(p.shape))

    if state_format == "int8":
        block = int8_codes.DEFAULT_BLOCK if block_size is None else block_size
        m_code, v_code = int8_codes.EXP_AVG, int8_codes.EXP_AVG_SQ
        states = zip(exp_avgs, exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax, strict=True)
        for p, g, (m, v, ms, vs), cp in zip(params, grads, states, copies, strict=True):
            m32 = int8_codes.dequantize(m_code, m, ms, block).reshape(-1)
            v32 = int8_codes.dequantize(v_code, v, vs, block).reshape(-1)
            p32, m32, v32 = _pinned_update(p.float().reshape(-1), g.float().reshape(-1), m32, v32, h, step, grad_scale)
            write_param(p, p32)
            r_m, r_v = sr_bits(seed, step, torch.arange(p.numel(), device=p.device))
            for codes, scales, x, code, r in ((m, ms, m32, m_code, r_m), (v, vs, v32, v_code, r_v)):
                new_codes, new_scales = int8_codes.quantize(code, x, block, r)
                codes.copy_(new_codes.view(codes.shape))
                scales.copy_(new_scales)
            if cp is not None:
                cp.copy_(p32.view(cp.shape))
        return
    pinned = [state_format == "bf16" or sr_param(p) for p in params]
    for p, g, m, v, cp, pin in zip(params, grads, exp_avgs, exp_avg_sqs, copies, pinned, strict=True):
        if not pin:
            continue
        p32, m32, v32 = _pinned_update(p.float(), g.float(), m.float(), v.float(), h, step, grad_scale)
        write_param(p, p32)
        if state_format == "bf16":
            r_m, r_v = sr_bits(seed, step, torch.arange(p.numel(), device=p.device))
            m.copy_(round_bf16_stochastic(m32.reshape(-1), r_m).view(m.shape))
            v.copy_(round_bf16_stochastic(v32.reshape(-1), r_v).view(v.shape))
        else:
            m.copy_(m32)
            v.copy_(v32)
        if cp is not None:
            cp.copy_(p32.view(cp.shape))
    if all(pinned):
        return
    params, grads, exp_avgs, exp_avg_sqs, copies = (
        [t for t, pin in zip(ts, pinned) if not pin] for ts in (params, grads, exp_avgs, exp_avg_sqs, copies)
    )
    lr, beta1, beta2, eps, weight_decay = h.lr, h.beta1, h.beta2, h.eps, h.weight_decay
    bc1 = 1.0 - beta1**step if h.bias_correction else 1.0
    bc2 = 1.0 - beta2**step if h.bias_correction else 1.0
    for p, g, m, v, c in zip(params, grads, exp_avgs, exp_avg_sqs, copies, strict=True):
        g32 = g.float() if grad_scale is None else g.float() / grad_scale
        p32 = p.float().clone()
        if h.adamw_mode:
            p32.mul_(1.0 - lr * weight_decay)
        else:
            g32 = g32 + weight_decay * p32
        m32 = m.float().lerp(g32, 1.0 - beta1)  # m + (1 - beta1)(g - m), as torch.optim.Adam(W)
        v32 = v.float() * beta2 + (1.0 - beta2) * g32 * g32
        denom = v32.sqrt() / math.sqrt(bc2) + eps
        p32.addcdiv_(m32, denom, value=-lr / bc1)
        p.copy_(p32)
        m.copy_(m32)
        v.copy_(v32)
        if c is not None:
            c.copy_(p32)
