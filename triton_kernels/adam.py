r"""Fused multi-tensor Adam/AdamW in Triton: one pass over memory per step, one
launch per dtype combination (see ``_multi_tensor`` for the work list).

.. math::
    g &\leftarrow g / s \qquad (s = \text{grad\_scale}, 1 \text{ if None}) \\
    p &\leftarrow p\,(1 - \text{lr}\cdot\text{wd}) \text{ (AdamW) } \quad\text{or}\quad
        g \leftarrow g + \text{wd}\cdot p \text{ (Adam)} \\
    m &\leftarrow m + (1-\beta_1)(g - m) \qquad
    v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
    p &\leftarrow p - \frac{\text{lr}}{bc_1}\,\frac{m}{\sqrt{v} / \sqrt{bc_2} + \epsilon}
        \qquad bc_i = 1 - \beta_i^{t} \text{ (1 without bias correction)}

Math in fp32 whatever the storage dtypes (fp32/bf16/fp16 params and grads,
fp32 or param-dtype states, optional bf16/fp16 copies of fp32 params written in
the same pass). The source of truth is ``fastzero.ops.adam.reference.adam_step``.

bf16 states written with stochastic rounding (``state_format="bf16"``, for
params of any dtype) take the reference's pinned update (every op rounded on
its own: the launch turns off fp contraction) and its random bits, so the
results are the reference's to the bit. The host scalars that enter the
fp64 bias corrections (lr, log beta) cross as the bit patterns of their
doubles (int64), since Triton passes a Python float as fp32.

bf16 params without an fp32 master written with stochastic rounding
(``bf16_stochastic_round``, SR_PARAMS) take the same pinned update whatever
the state format (fp32 or bf16 states rounded to nearest, bf16 states by
stochastic rounding, int8) and the reference's ``sr_param_bits``: a second
hash of the element's ``h``, so the params are the reference's to the bit.

int8 block-wise states (``state_format="int8"``: uint8 codes, one fp32 scale
per ``block_size`` elements; the rule of ``fastzero.ops.adam.int8_codes``) take
the same pinned update in their own kernel: one program per tile of ROWS whole
blocks of one tensor, one block a row, which it decodes with the old scales,
updates, and encodes with the new ones (each row's largest magnitude), in one
pass, the codes rounded stochastically with the bf16 format's random bits (exp_avg
the low half of each element's hash, exp_avg_sq the high); the results are the
reference's to the bit, codes and scales included.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastzero.checks import check_state_format

from ._multi_tensor import (
    INTERPRET,
    _bias_corrections,
    _item,
    _to_fp32,
    _to_storage,
    _typed_ptr,
    check_inputs,
    launch_config,
    log_beta,
    work_list,
)
from .quant import _fmix32

_M32 = 0xFFFFFFFF
_PARAM_SALT = tl.constexpr(0x6A09E667)  # reference.PARAM_SALT: a param's random bits apart from its states'


def _fp32(x: float) -> float:
    """`x` rounded to fp32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _f64_bits(x: float) -> int:
    """The bit pattern of the double `x`, as a signed int64 (read back in the kernel by a bitcast)."""
    return struct.unpack("q", struct.pack("d", x))[0]


def _host_fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


@triton.jit
def _adam_math(
    p,
    g,
    m,
    v,
    decay,
    weight_decay,
    m_coeff,
    beta2,
    one_minus_beta2,
    eps,
    step_size,
    sqrt_bc2,
    ADAMW: tl.constexpr,
    M_FROM_GRAD: tl.constexpr,
):
    """The update, in fp32, in the reference's order of operations."""
    if ADAMW:
        p = p * decay
    else:
        g = g + weight_decay * p
    # torch's lerp, m + (1 - beta1)(g - m) (fz_lerp_coeff in csrc/common/hyperparams.h)
    m = tl.fma(m_coeff, g - m, g if M_FROM_GRAD else m)
    v = beta2 * v + one_minus_beta2 * g * g
    # IEEE sqrt and division, as torch rounds them (on GPUs tl.sqrt and `/` are approximate)
    denom = tl.div_rn(tl.sqrt_rn(v), sqrt_bc2) + eps
    p = p - tl.div_rn(step_size * m, denom)
    return p, m, v


@triton.jit
def _adam_math_pinned(
    p,
    g,
    m,
    v,
    inv_grad_scale,
    decay,
    weight_decay,
    m_coeff,
    beta2,
    one_minus_beta2,
    eps,
    step_size,
    bc2_rsqrt,
    HAS_GRAD_SCALE: tl.constexpr,
    ADAMW: tl.constexpr,
    M_FROM_GRAD: tl.constexpr,
):
    """The bf16 format's update (reference._pinned_update): each op rounded on its own, in its order."""
    if HAS_GRAD_SCALE:
        g = g * inv_grad_scale
    if ADAMW:
        p = p * decay  # by 1.0 (no decay): exact
    else:
        if weight_decay != 0.0:  # skipped when 0, as the reference: an inf param stays inf
            g = g + weight_decay * p
    if M_FROM_GRAD:
        m = g + m_coeff * (g - m)
    else:
        m = m + m_coeff * (g - m)
    v = beta2 * v + (one_minus_beta2 * g) * g
    denom = tl.sqrt_rn(v) * bc2_rsqrt + eps
    p = p - step_size * tl.div_rn(m, denom)
    return p, m, v


@triton.jit
def _store_bf16_sr(ptr, offs, x, r, mask):
    """x (fp32) to bf16 by stochastic rounding with the 16-bit integers r (int64):
    the top 16 bits of x's pattern plus r; NaN -> 0x7FC0 (reference.round_bf16_stochastic)."""
    b = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    y = tl.where(x != x, 0x7FC0, (b + r) >> 16)
    tl.store(ptr + offs, y.to(tl.int32).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)


@triton.jit
def _sr_key(step_ptr, seed_mix, start):
    """The hash key of a work item's elements (reference._sr_hash), from fmix32(seed) and the
    device step: items hold whole chunks, which never cross a multiple of 2^32."""
    t_lo = tl.load(step_ptr).to(tl.int64) & 0xFFFFFFFF
    stream = _fmix32(seed_mix ^ t_lo)
    return _fmix32((stream + (start.to(tl.int64) >> 32) * 0x9E3779B9) & 0xFFFFFFFF)


@triton.jit
def _sr_hash(offs, key):
    """Each element's h from its flat index in its tensor: the states round with its halves."""
    return _fmix32((offs.to(tl.int64) & 0xFFFFFFFF) ^ key)


@triton.jit
def _store_param(p_ptr, offs, p, h, mask, SR_PARAMS: tl.constexpr):
    """The updated param: bf16 by stochastic rounding with a second hash of h (reference.sr_param_bits),
    else the dtype's rounding to nearest."""
    if SR_PARAMS:
        _store_bf16_sr(p_ptr, offs, p, _fmix32(h ^ _PARAM_SALT) & 0xFFFF, mask)
    else:
        tl.store(p_ptr + offs, _to_storage(p, p_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adam_block_pinned(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    c_ptr,
    offs,
    mask,
    key,
    inv_grad_scale,
    decay,
    weight_decay,
    m_coeff,
    beta2,
    one_minus_beta2,
    eps,
    step_size,
    bc2_rsqrt,
    HAS_GRAD_SCALE: tl.constexpr,
    ADAMW: tl.constexpr,
    M_FROM_GRAD: tl.constexpr,
    SR_STATES: tl.constexpr,
    SR_PARAMS: tl.constexpr,
):
    """One block of the pinned update, with bf16 states (SR_STATES) and/or bf16 params (SR_PARAMS)
    written by stochastic rounding, the others rounded to nearest: offs are the elements' flat
    indices in their tensor, key the item's hash key (reference.sr_bits, sr_param_bits)."""
    p = _to_fp32(tl.load(p_ptr + offs, mask=mask))
    g = _to_fp32(tl.load(g_ptr + offs, mask=mask))
    m = _to_fp32(tl.load(m_ptr + offs, mask=mask))
    v = _to_fp32(tl.load(v_ptr + offs, mask=mask))
    p, m, v = _adam_math_pinned(
        p,
        g,
        m,
        v,
        inv_grad_scale,
        decay,
        weight_decay,
        m_coeff,
        beta2,
        one_minus_beta2,
        eps,
        step_size,
        bc2_rsqrt,
        HAS_GRAD_SCALE,
        ADAMW,
        M_FROM_GRAD,
    )
    h = _sr_hash(offs, key)
    _store_param(p_ptr, offs, p, h, mask, SR_PARAMS)
    if SR_STATES:
        _store_bf16_sr(m_ptr, offs, m, h & 0xFFFF, mask)
        _store_bf16_sr(v_ptr, offs, v, h >> 16, mask)
    else:
        tl.store(m_ptr + offs, _to_storage(m, m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offs, _to_storage(v, v_ptr.dtype.element_ty), mask=mask)
    if c_ptr is not None:
        tl.store(c_ptr + offs, _to_storage(p, c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adam_block(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    c_ptr,
    offs,
    mask,
    grad_scale,
    decay,
    weight_decay,
    m_coeff,
    beta2,
    one_minus_beta2,
    eps,
    step_size,
    sqrt_bc2,
    HAS_GRAD_SCALE: tl.constexpr,
    ADAMW: tl.constexpr,
    M_FROM_GRAD: tl.constexpr,
):
    """Load, update and store one block (``mask`` None: a full block, unmasked so that it vectorizes)."""
    p = _to_fp32(tl.load(p_ptr + offs, mask=mask))
    g = _to_fp32(tl.load(g_ptr + offs, mask=mask))
    m = _to_fp32(tl.load(m_ptr + offs, mask=mask))
    v = _to_fp32(tl.load(v_ptr + offs, mask=mask))
    if HAS_GRAD_SCALE:
        g = tl.div_rn(g, grad_scale)
    p, m, v = _adam_math(
        p, g, m, v, decay, weight_decay, m_coeff, beta2, one_minus_beta2, eps, step_size, sqrt_bc2, ADAMW, M_FROM_GRAD
    )
    tl.store(p_ptr + offs, _to_storage(p, p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, _to_storage(m, m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, _to_storage(v, v_ptr.dtype.element_ty), mask=mask)
    if c_ptr is not None:
        tl.store(c_ptr + offs, _to_storage(p, c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adam_kernel(
    addrs_ptr,
    numels_ptr,
    item_tensor_ptr,
    item_start_ptr,
    n_tensors,
    step_ptr,
    grad_scale_ptr,
    found_inf_ptr,
    lr_bits,
    decay,
    weight_decay,
    m_coeff,
    beta2,
    one_minus_beta2,
    log_beta1_bits,
    log_beta2_bits,
    eps,
    seed_mix,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    M_DTYPE: tl.constexpr,
    V_DTYPE: tl.constexpr,
    C_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ADAMW: tl.constexpr,
    M_FROM_GRAD: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    SR_PARAMS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCKS_PER_ITEM: tl.constexpr,
):
    """One program per work item (``item_*_ptr`` start at this launch's first item).
    ``lr_bits``, ``log_beta*_bits``: doubles' bit patterns; ``seed_mix``: fmix32(seed)
    of stochastic rounding (STOCHASTIC: bf16 states; SR_PARAMS: bf16 params; either: the
    pinned update)."""
    item = tl.program_id(0)
    found_inf = tl.load(found_inf_ptr) if HAS_FOUND_INF else 0.0
    if found_inf == 0.0:  # decided on the device: no host sync
        t, start, end, n_full = _item(item_tensor_ptr, item_start_ptr, numels_ptr, item, BLOCK_SIZE, BLOCKS_PER_ITEM)
        p_ptr = _typed_ptr(addrs_ptr, 0, n_tensors, t, P_DTYPE, ALIGNED)
        g_ptr = _typed_ptr(addrs_ptr, 1, n_tensors, t, G_DTYPE, ALIGNED)
        m_ptr = _typed_ptr(addrs_ptr, 2, n_tensors, t, M_DTYPE, ALIGNED)
        v_ptr = _typed_ptr(addrs_ptr, 3, n_tensors, t, V_DTYPE, ALIGNED)
        c_ptr = None
        if C_DTYPE is not None:
            c_ptr = _typed_ptr(addrs_ptr, 4, n_tensors, t, C_DTYPE, ALIGNED)
        grad_scale = tl.load(grad_scale_ptr) if HAS_GRAD_SCALE else 1.0
        # (a small bit pattern, lr = 0 say, arrives as an int32: widen it first)
        lr = tl.cast(tl.cast(lr_bits, tl.int64), tl.float64, bitcast=True)
        log_beta1 = tl.cast(tl.cast(log_beta1_bits, tl.int64), tl.float64, bitcast=True)
        log_beta2 = tl.cast(tl.cast(log_beta2_bits, tl.int64), tl.float64, bitcast=True)
        bc1, bc2 = _bias_corrections(step_ptr, log_beta1, log_beta2, BIAS_CORRECTION)
        step_size = (lr / bc1).to(tl.float32)
        if STOCHASTIC or SR_PARAMS:
            bc2_rsqrt = (1.0 / tl.sqrt(bc2)).to(tl.float32)
            inv_grad_scale = tl.div_rn(tl.full((), 1.0, tl.float32), grad_scale) if HAS_GRAD_SCALE else 1.0
            key = _sr_key(step_ptr, seed_mix, start)
            for b in range(0, n_full):
                offs = start + b * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
                _adam_block_pinned(
                    p_ptr,
                    g_ptr,
                    m_ptr,
                    v_ptr,
                    c_ptr,
                    offs,
                    None,
                    key,
                    inv_grad_scale,
                    decay,
                    weight_decay,
                    m_coeff,
                    beta2,
                    one_minus_beta2,
                    eps,
                    step_size,
                    bc2_rsqrt,
                    HAS_GRAD_SCALE,
                    ADAMW,
                    M_FROM_GRAD,
                    STOCHASTIC,
                    SR_PARAMS,
                )
            tail = start + n_full * BLOCK_SIZE
            if tail < end:
                offs = tail + tl.arange(0, BLOCK_SIZE)
                _adam_block_pinned(
                    p_ptr,
                    g_ptr,
                    m_ptr,
                    v_ptr,
                    c_ptr,
                    offs,
                    offs < end,
                    key,
                    inv_grad_scale,
                    decay,
                    weight_decay,
                    m_coeff,
                    beta2,
                    one_minus_beta2,
                    eps,
                    step_size,
                    bc2_rsqrt,
                    HAS_GRAD_SCALE,
                    ADAMW,
                    M_FROM_GRAD,
                    STOCHASTIC,
                    SR_PARAMS,
                )
        else:
            sqrt_bc2 = tl.sqrt(bc2).to(tl.float32)

            # Full blocks without a mask (the numel loaded here is unknown to the compiler, and a
            # mask on it would keep loads scalar), then at most one masked tail.
            for b in range(0, n_full):
                offs = start + b * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
                _adam_block(
                    p_ptr,
                    g_ptr,
                    m_ptr,
                    v_ptr,
                    c_ptr,
                    offs,
                    None,
                    grad_scale,
                    decay,
                    weight_decay,
                    m_coeff,
                    beta2,
                    one_minus_beta2,
                    eps,
                    step_size,
                    sqrt_bc2,
                    HAS_GRAD_SCALE,
                    ADAMW,
                    M_FROM_GRAD,
                )
            tail = start + n_full * BLOCK_SIZE
            if tail < end:
                offs = tail + tl.arange(0, BLOCK_SIZE)
                _adam_block(
                    p_ptr,
                    g_ptr,
                    m_ptr,
                    v_ptr,
                    c_ptr,
                    offs,
                    offs < end,
                    grad_scale,
                    decay,
                    weight_decay,
                    m_coeff,
                    beta2,
                    one_minus_beta2,
                    eps,
                    step_size,
                    sqrt_bc2,
                    HAS_GRAD_SCALE,
                    ADAMW,
                    M_FROM_GRAD,
                )


# -- int8 block-wise states (state_format="int8") ---------------------------------------------------
#
# The rule is fastzero/ops/adam/int8_codes.py's. Both codes are small floats of y = |x| / scale
# (BIAS 15: exp_avg, signed; BIAS 31: exp_avg_sq). The step's encoding rounds stochastically, in the
# rule's integer form: y as the code with 20 more fraction bits (normal y: its bit pattern rebased;
# subnormal y: y * 2^(23 - emin), exact, truncated), plus 16 random bits at bit 4, shifted down by
# 20. The random bits are the bf16 format's (exp_avg the low half of each element's hash, exp_avg_sq
# the high). The decoding is the rule's too: a code's value from its bits (or c 2^(emin - 3),
# exact), times the scale. The fp32 arithmetic that the update and the rule state meets subnormals
# (a product such as y or a decoded x may be one): Triton emits it for NVIDIA GPUs without .ftz
# (add/mul/div.rn/sqrt.rn/min.f32 in sm_90 PTX, checked by tests/ops/test_triton_kernels.py), so
# GPUs keep subnormals as torch does on the CPU, and so does the interpreter (numpy).


@triton.jit
def _int8_decode(c, scale, BIAS: tl.constexpr, SIGNED: tl.constexpr):
    """fp32 values of codes c (int32) in blocks of scale `scale` (int8_codes.dequantize)."""
    mag = c & 0x7F if SIGNED else c
    sub = mag.to(tl.float32) * (2.0 ** (-2 - BIAS))  # c 2^(emin - 3): exact
    normal = ((mag << 20) + ((127 - BIAS) << 23)).to(tl.float32, bitcast=True)
    x = tl.where(mag < 8, sub, normal) * scale
    if SIGNED:
        x = tl.where(c >= 0x80, -x, x)
    return x


@triton.jit
def _int8_scale(absmax_bits):
    """(scale, 1 / scale, whether the block encodes) from the bit pattern of a block's largest |x|:
    NaN for an inf or NaN in the block, 0 below 2^-126 (both encode to codes 0), else the max."""
    finite = absmax_bits < 0x7F800000
    encodes = finite & (absmax_bits >= 0x00800000)
    scale = tl.where(encodes, absmax_bits, tl.where(finite, 0, 0x7FC00000)).to(tl.float32, bitcast=True)
    inv = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), tl.where(encodes, scale, 1.0))
    return scale, inv, encodes


@triton.jit
def _int8_encode(x, inv, r, BIAS: tl.constexpr, SIGNED: tl.constexpr):
    """Codes (int32) of fp32 x given inv = 1 / its block's scale, rounded stochastically with the
    16-bit integers r (int8_codes.encode with r, its integer form)."""
    xb = x.to(tl.int32, bitcast=True)
    y = tl.minimum((xb & 0x7FFFFFFF).to(tl.float32, bitcast=True) * inv, 1.0)
    yb = y.to(tl.int32, bitcast=True)
    small = yb < ((128 - BIAS) << 23)  # y < 2^emin: a subnormal code
    # y with 20 more fraction bits than the code: normal y, its bits rebased (a carry moves into the
    # exponent); subnormal y, scaled by 2^(23 - emin) (exact) and truncated (0 elsewhere: no overflow)
    sub = (tl.where(small, y, 0.0) * 2.0 ** (22 + BIAS)).to(tl.int32)
    t = tl.where(small, sub, yb - ((127 - BIAS) << 23))
    c = (t + (r << 4)) >> 20  # up with probability the fraction of a step: the mean is y
    if SIGNED:
        c = c | ((xb >> 24) & 0x80)
    else:
        c = tl.where((yb > 0) & (c == 0), 1, c)  # a v above 0 never decodes to 0
    return c


@triton.jit
def _int8_store(x, r, mask, row_mask, codes_ptr, scales_ptr, offs, blocks, BIAS: tl.constexpr, SIGNED: tl.constexpr):
    """Encodes a tile (one block a row) with its new scales, the blocks' largest |x|, rounded
    stochastically with the 16-bit integers r."""
    absx = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # ordered as |x|; >= 0x7F800000: inf or NaN
    if mask is not None:
        absx = tl.where(mask, absx, 0)  # lanes past the tensor's end are not the block's
    scale, inv, encodes = _int8_scale(tl.max(absx, axis=1))
    codes = tl.where(encodes[:, None], _int8_encode(x, inv[:, None], r, BIAS, SIGNED), 0)
    tl.store(codes_ptr + offs, codes.to(tl.uint8), mask=mask)
    tl.store(scales_ptr + blocks, scale, mask=row_mask)


@triton.jit
def _adam_tile_int8(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    c_ptr,
    ms_ptr,
    vs_ptr,
    start,
    n,
    key,
    inv_grad_scale,
    decay,
    weight_decay,
    m_coeff,
    beta2,
    one_minus_beta2,
    eps,
    step_size,
    bc2_rsqrt,
    HAS_GRAD_SCALE: tl.constexpr,
    ADAMW: tl.constexpr,
    M_FROM_GRAD: tl.constexpr,
    SR_PARAMS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    MASKED: tl.constexpr,
):
    """ROWS blocks of one tensor from element `start`, one a row: decode with the old scales,
    the pinned update, encode with the new ones, rounded stochastically with the bits keyed by
    `key`. MASKED: the tensor ends inside the tile. SR_PARAMS: bf16 params written with
    stochastic rounding, keyed by `key` too."""
    blocks = start // BLOCK + tl.arange(0, ROWS)
    offs = start + tl.arange(0, ROWS)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask, row_mask, zero = None, None, None
    if MASKED:
        mask, row_mask, zero = offs < n, blocks * BLOCK < n, 0
    m_scale = tl.load(ms_ptr + blocks, mask=row_mask, other=zero)[:, None]
    v_scale = tl.load(vs_ptr + blocks, mask=row_mask, other=zero)[:, None]
    p = _to_fp32(tl.load(p_ptr + offs, mask=mask, other=zero))
    g = _to_fp32(tl.load(g_ptr + offs, mask=mask, other=zero))
    m = _int8_decode(tl.load(m_ptr + offs, mask=mask, other=zero).to(tl.int32), m_scale, 15, True)
    v = _int8_decode(tl.load(v_ptr + offs, mask=mask, other=zero).to(tl.int32), v_scale, 31, False)
    p, m, v = _adam_math_pinned(
        p,
        g,
        m,
        v,
        inv_grad_scale,
        decay,
        weight_decay,
        m_coeff,
        beta2,
        one_minus_beta2,
        eps,
        step_size,
        bc2_rsqrt,
        HAS_GRAD_SCALE,
        ADAMW,
        M_FROM_GRAD,
    )
    h = _sr_hash(offs, key)  # the codes' random bits: exp_avg the low half, exp_avg_sq the high
    _store_param(p_ptr, offs, p, h, mask, SR_PARAMS)
    if c_ptr is not None:
        tl.store(c_ptr + offs, _to_storage(p, c_ptr.dtype.element_ty), mask=mask)
    _int8_store(m, (h & 0xFFFF).to(tl.int32), mask, row_mask, m_ptr, ms_ptr, offs, blocks, 15, True)
    _int8_store(v, (h >> 16).to(tl.int32), mask, row_mask, v_ptr, vs_ptr, offs, blocks, 31, False)


@triton.jit
def _adam_int8_kernel(
    addrs_ptr,
    numels_ptr,
    item_tensor_ptr,
    item_start_ptr,
    n_tensors,
    step_ptr,
    grad_scale_ptr,
    found_inf_ptr,
    lr_bits,
    decay,
    weight_decay,
    m_coeff,
    beta2,
    one_minus_beta2,
    log_beta1_bits,
    log_beta2_bits,
    eps,
    seed_mix,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    C_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ADAMW: tl.constexpr,
    M_FROM_GRAD: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr,
    SR_PARAMS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """One program per work item: ROWS blocks of BLOCK elements of one tensor (the address table
    holds the roles of INT8_ROLES: exp_avg, exp_avg_sq are uint8 codes, then their fp32 scales),
    the codes rounded stochastically keyed by ``seed_mix`` (fmix32(seed)). SR_PARAMS: bf16 params
    written with stochastic rounding, keyed the same way."""
    item = tl.program_id(0)
    found_inf = tl.load(found_inf_ptr) if HAS_FOUND_INF else 0.0
    if found_inf == 0.0:  # decided on the device: no host sync
        t = tl.load(item_tensor_ptr + item)
        start = tl.multiple_of(tl.load(item_start_ptr + item), ROWS * BLOCK)
        n = tl.load(numels_ptr + t)
        p_ptr = _typed_ptr(addrs_ptr, 0, n_tensors, t, P_DTYPE, ALIGNED)
        g_ptr = _typed_ptr(addrs_ptr, 1, n_tensors, t, G_DTYPE, ALIGNED)
        m_ptr = _typed_ptr(addrs_ptr, 2, n_tensors, t, tl.uint8, ALIGNED)
        v_ptr = _typed_ptr(addrs_ptr, 3, n_tensors, t, tl.uint8, ALIGNED)
        c_ptr = None
        if C_DTYPE is not None:
            c_ptr = _typed_ptr(addrs_ptr, 4, n_tensors, t, C_DTYPE, ALIGNED)
        ms_ptr = _typed_ptr(addrs_ptr, 5, n_tensors, t, tl.float32, ALIGNED)
        vs_ptr = _typed_ptr(addrs_ptr, 6, n_tensors, t, tl.float32, ALIGNED)
        grad_scale = tl.load(grad_scale_ptr) if HAS_GRAD_SCALE else 1.0
        inv_grad_scale = tl.div_rn(tl.full((), 1.0, tl.float32), grad_scale) if HAS_GRAD_SCALE else 1.0
        lr = tl.cast(tl.cast(lr_bits, tl.int64), tl.float64, bitcast=True)
        log_beta1 = tl.cast(tl.cast(log_beta1_bits, tl.int64), tl.float64, bitcast=True)
        log_beta2 = tl.cast(tl.cast(log_beta2_bits, tl.int64), tl.float64, bitcast=True)
        bc1, bc2 = _bias_corrections(step_ptr, log_beta1, log_beta2, BIAS_CORRECTION)
        step_size = (lr / bc1).to(tl.float32)
        bc2_rsqrt = (1.0 / tl.sqrt(bc2)).to(tl.float32)
        key = _sr_key(step_ptr, seed_mix, start)  # tiles never cross a multiple of 2^32
        # a full tile without masks (so that its loads vectorize), else the tensor's last tile
        if start + ROWS * BLOCK <= n:
            _adam_tile_int8(
                p_ptr,
                g_ptr,
                m_ptr,
                v_ptr,
                c_ptr,
                ms_ptr,
                vs_ptr,
                start,
                n,
                key,
                inv_grad_scale,
                decay,
                weight_decay,
                m_coeff,
                beta2,
                one_minus_beta2,
                eps,
                step_size,
                bc2_rsqrt,
                HAS_GRAD_SCALE,
                ADAMW,
                M_FROM_GRAD,
                SR_PARAMS,
                BLOCK,
                ROWS,
                False,
            )
        else:
            _adam_tile_int8(
                p_ptr,
                g_ptr,
                m_ptr,
                v_ptr,
                c_ptr,
                ms_ptr,
                vs_ptr,
                start,
                n,
                key,
                inv_grad_scale,
                decay,
                weight_decay,
                m_coeff,
                beta2,
                one_minus_beta2,
                eps,
                step_size,
                bc2_rsqrt,
                HAS_GRAD_SCALE,
                ADAMW,
                M_FROM_GRAD,
                SR_PARAMS,
                BLOCK,
                ROWS,
                True,
            )


_INT8_DEFAULT_BLOCK = 256  # fastzero.ops.adam.int8_codes.DEFAULT_BLOCK (ops is a layer above this one)
_INT8_TILE = 2048  # elements a program updates at least: ROWS blocks of up to 2048, or one of 4096


def int8_launch_config(block: int) -> tuple[int, int]:
    """(ROWS, num_warps) of int8 states in blocks of `block` elements: a tile of
    max(block, 2048) elements per program (the interpreter pays per program, a GPU
    wants a few thousand bytes in flight per program), 8 warps for 4096 elements
    (16 fp32 moments per thread, held from the update to the encoding)."""
    return max(1, _INT8_TILE // block), 8 if block > _INT8_TILE else 4


def _pinned_options(pinned: bool) -> dict:
    """Launch options: the pinned update is compiled without multiply-add contraction."""
    return {"enable_fp_fusion": False} if pinned and not INTERPRET else {}


def launch(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    *,
    step,
    hp,
    grad_scale=None,
    found_inf=None,
    param_copies=None,
    state_format=None,
    seed=None,
    exp_avg_absmax=None,
    exp_avg_sq_absmax=None,
    block_size=None,
    bf16_stochastic_round=False,
):
    """:func:`adam_step` on lists that were checked."""
    if not params:
        return
    stochastic = state_format == "bf16"
    sr_params = lambda p_dt: bool(bf16_stochastic_round) and p_dt == tl.bfloat16  # noqa: E731
    # The first moment is torch's lerp with w = 1 - beta1 in fp32 (fz_lerp_coeff in csrc/common/hyperparams.h):
    # m + w (g - m) for w < 0.5, else g + (w - 1)(g - m), exact in fp32.
    w = _fp32(1.0 - hp.beta1)
    m_from_grad = not w < 0.5
    m_coeff = w - 1.0 if m_from_grad else w
    # Host scalars in fp64, rounded once to fp32 as the reference's torch ops round them.
    # (a Python int would make Triton specialize the kernel: floats, except the doubles' bit patterns)
    scalars = (
        _f64_bits(float(hp.lr)),
        float(1.0 - hp.lr * hp.weight_decay),
        float(hp.weight_decay),
        float(m_coeff),
        float(hp.beta2),
        float(1.0 - hp.beta2),
        _f64_bits(log_beta(hp.beta1)),
        _f64_bits(log_beta(hp.beta2)),
        float(hp.eps),
    )
    flags = dict(
        HAS_GRAD_SCALE=grad_scale is not None,
        HAS_FOUND_INF=found_inf is not None,
        ADAMW=bool(hp.adamw_mode),
        M_FROM_GRAD=m_from_grad,
        BIAS_CORRECTION=bool(hp.bias_correction),
    )
    seed_mix = _host_fmix32((0 if seed is None else int(seed)) & _M32)  # fmix32(seed), of the stochastic roundings

    if state_format == "int8":
        block = _INT8_DEFAULT_BLOCK if block_size is None else block_size
        rows, num_warps = int8_launch_config(block)
        lists = [params, grads, exp_avgs, exp_avg_sqs, param_copies, exp_avg_absmax, exp_avg_sq_absmax]
        wl = work_list(lists, rows * block)
        for grp in wl.groups:
            if grp.end == grp.begin:
                continue  # only empty tensors
            p_dt, g_dt, _, _, c_dt, _, _ = grp.dtypes
            _adam_int8_kernel[(grp.end - grp.begin,)](
                wl.addrs,
                wl.numels,
                wl.item_tensor[grp.begin :],
                wl.item_start[grp.begin :],
                wl.n_tensors,
                step,
                grad_scale,
                found_inf,
                *scalars,
                seed_mix,
                P_DTYPE=p_dt,
                G_DTYPE=g_dt,
                C_DTYPE=c_dt,
                ALIGNED=grp.aligned,
                **flags,
                **_pinned_options(True),
                SR_PARAMS=sr_params(p_dt),
                BLOCK=block,
                ROWS=rows,
                num_warps=num_warps,
            )
        return
    block, per_item, num_warps = launch_config()
    wl = work_list([params, grads, exp_avgs, exp_avg_sqs, param_copies], block * per_item)
    for grp in wl.groups:
        if grp.end == grp.begin:
            continue  # only empty tensors
        p_dt, g_dt, m_dt, v_dt, c_dt = grp.dtypes
        _adam_kernel[(grp.end - grp.begin,)](
            wl.addrs,
            wl.numels,
            wl.item_tensor[grp.begin :],
            wl.item_start[grp.begin :],
            wl.n_tensors,
            step,
            grad_scale,
            found_inf,
            *scalars,
            seed_mix,
            P_DTYPE=p_dt,
            G_DTYPE=g_dt,
            M_DTYPE=m_dt,
            V_DTYPE=v_dt,
            C_DTYPE=c_dt,
            ALIGNED=grp.aligned,
            **flags,
            **_pinned_options(stochastic or sr_params(p_dt)),
            STOCHASTIC=stochastic,
            SR_PARAMS=sr_params(p_dt),
            BLOCK_SIZE=block,
            BLOCKS_PER_ITEM=per_item,
            num_warps=num_warps,
        )


@torch.no_grad()
def adam_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: Tensor,
    hp,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    param_copies: list[Tensor] | None = None,
    state_format: str | None = None,
    seed: int | None = None,
    exp_avg_absmax: list[Tensor] | None = None,
    exp_avg_sq_absmax: list[Tensor] | None = None,
    block_size: int | None = None,
    bf16_stochastic_round: bool = False,
) -> None:
    """One Adam/AdamW step on every tensor of the lists, in place (formula in the
    module docstring); ``hp``: the hyperparameters (fastzero.ops.AdamHyperparams).

    ``step`` is a 0-d float32 device tensor holding t >= 1; ``grad_scale`` (0-d
    float32) divides the grads; where ``found_inf`` (0-d float32) is nonzero nothing
    changes. All three are read on the device: no host sync. ``state_format="bf16"``:
    bf16 states written with stochastic rounding keyed by ``seed`` (default 0).
    ``state_format="int8"``: exp_avgs/exp_avg_sqs are uint8 codes and
    ``exp_avg_absmax``/``exp_avg_sq_absmax`` their fp32 scales, one per
    ``block_size`` elements (default 256; fastzero.ops.adam.int8_codes), decoded,
    updated and encoded again in the one pass, rounded stochastically keyed by ``seed``
    (default 0) as bf16 states are. ``bf16_stochastic_round``: bf16 params
    (kept without an fp32 master) written with stochastic rounding keyed by ``seed``,
    after the pinned update (any state format); params of other dtypes as without it.
    """
    check_state_format("the Triton kernels", state_format, seed, block_size, bf16_stochastic_round)
    check_inputs(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        param_copies,
        {"step": step, "grad_scale": grad_scale, "found_inf": found_inf},
        state_format=state_format,
        exp_avg_absmax=exp_avg_absmax,
        exp_avg_sq_absmax=exp_avg_sq_absmax,
        block_size=block_size,
    )
    launch(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        step=step,
        hp=hp,
        grad_scale=grad_scale,
        found_inf=found_inf,
        param_copies=param_copies,
        state_format=state_format,
        seed=seed,
        exp_avg_absmax=exp_avg_absmax,
        exp_avg_sq_absmax=exp_avg_sq_absmax,
        block_size=block_size,
        bf16_stochastic_round=bf16_stochastic_round,
    )
