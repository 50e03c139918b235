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
def _adam_block_sr(
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
):
    """One block with bf16 states written by stochastic rounding: offs are the elements'
    flat indices in their tensor, key the item's hash key (reference.sr_bits)."""
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
    h = _fmix32((offs.to(tl.int64) & 0xFFFFFFFF) ^ key)
    tl.store(p_ptr + offs, _to_storage(p, p_ptr.dtype.element_ty), mask=mask)
    _store_bf16_sr(m_ptr, offs, m, h & 0xFFFF, mask)
    _store_bf16_sr(v_ptr, offs, v, h >> 16, mask)
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
    BLOCK_SIZE: tl.constexpr,
    BLOCKS_PER_ITEM: tl.constexpr,
):
    """One program per work item (``item_*_ptr`` start at this launch's first item).
    ``lr_bits``, ``log_beta*_bits``: doubles' bit patterns; ``seed_mix``: fmix32(seed)
    of stochastic rounding (STOCHASTIC: bf16 states, the pinned update)."""
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
        if STOCHASTIC:
            bc2_rsqrt = (1.0 / tl.sqrt(bc2)).to(tl.float32)
            inv_grad_scale = tl.div_rn(tl.full((), 1.0, tl.float32), grad_scale) if HAS_GRAD_SCALE else 1.0
            # the item's hash key: items hold whole chunks, which never cross a multiple of 2^32
            t_lo = tl.load(step_ptr).to(tl.int64) & 0xFFFFFFFF
            stream = _fmix32(seed_mix ^ t_lo)
            key = _fmix32((stream + (start.to(tl.int64) >> 32) * 0x9E3779B9) & 0xFFFFFFFF)
            for b in range(0, n_full):
                offs = start + b * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
                _adam_block_sr(
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
                )
            tail = start + n_full * BLOCK_SIZE
            if tail < end:
                offs = tail + tl.arange(0, BLOCK_SIZE)
                _adam_block_sr(
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
):
    """:func:`adam_step` on lists that were checked."""
    if not params:
        return
    stochastic = state_format == "bf16"
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
        _host_fmix32((0 if seed is None else int(seed)) & _M32) if stochastic else 0,
    )
    flags = dict(
        HAS_GRAD_SCALE=grad_scale is not None,
        HAS_FOUND_INF=found_inf is not None,
        ADAMW=bool(hp.adamw_mode),
        M_FROM_GRAD=m_from_grad,
        BIAS_CORRECTION=bool(hp.bias_correction),
        STOCHASTIC=stochastic,
    )
    if stochastic and not INTERPRET:
        flags["enable_fp_fusion"] = False  # the pinned update: no multiply-add contraction
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
            P_DTYPE=p_dt,
            G_DTYPE=g_dt,
            M_DTYPE=m_dt,
            V_DTYPE=v_dt,
            C_DTYPE=c_dt,
            ALIGNED=grp.aligned,
            **flags,
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
) -> None:
    """One Adam/AdamW step on every tensor of the lists, in place (formula in the
    module docstring); ``hp``: the hyperparameters (fastzero.ops.AdamHyperparams).

    ``step`` is a 0-d float32 device tensor holding t >= 1; ``grad_scale`` (0-d
    float32) divides the grads; where ``found_inf`` (0-d float32) is nonzero nothing
    changes. All three are read on the device: no host sync. ``state_format="bf16"``:
    bf16 states written with stochastic rounding keyed by ``seed`` (default 0).
    """
    check_state_format("the Triton kernels", state_format, seed)
    check_inputs(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        param_copies,
        {"step": step, "grad_scale": grad_scale, "found_inf": found_inf},
        state_format=state_format,
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
    )
