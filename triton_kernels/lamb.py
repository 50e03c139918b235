r"""Fused multi-tensor LAMB in Triton (DeepSpeed's FusedLamb math), one launch per
dtype combination and phase (see ``_multi_tensor`` for the work list).

.. math::
    \hat g &= g / s_0 / s, \quad s_0 = \text{grad\_scale},\quad
        s = \max(1, \lVert g / s_0 \rVert / \text{max\_grad\_norm})
        \text{ if max\_grad\_norm} > 0 \text{ else } 1
        \quad(\lVert\cdot\rVert \text{ over all tensors}) \\
    m &\leftarrow \beta_1 m + (1-\beta_1)\hat g \qquad
    v \leftarrow \beta_2 v + (1-\beta_2)\hat g^2 \\
    u &= \frac{m}{\sqrt v + \epsilon} + \text{wd}\cdot p
        \quad\Big(\frac{m}{\sqrt{v + \epsilon}} \text{ with eps\_inside\_sqrt}\Big) \\
    r &= \text{clamp}\big(\lVert p\rVert / \lVert u\rVert,\ \text{min\_coeff},\ \text{max\_coeff}\big)
        \quad (r = 1 \text{ when either norm is } 0) \\
    p &\leftarrow p - \text{lr}\,\frac{\sqrt{bc_2}}{bc_1}\, r\, u
        \qquad bc_i = 1 - \beta_i^{t} \text{ (1 without bias correction)}

The launches, all asynchronous (no host sync):
  0. with max_grad_norm > 0: each item's sum of (g/s0)^2; one program reduces them to s;
  1. each item's sums of p^2 and u^2, m and v stored if fp32 (no u is stored: that would
     take memory the size of the model);
  2. one program per tensor reduces its items' sums, in a fixed order (deterministic), to r;
  3. p updated with u recomputed from p and the stored m, v. bf16/fp16 states are instead
     recomputed from g here, and only now stored: u from m, v rounded to 16 bits is not
     the reference's u, and with r * lr large the difference compounds. That costs one
     more read of g, only for those states.
The source of truth is ``fastzero.ops.lamb.reference.lamb_step``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._multi_tensor import (
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


@triton.jit
def _lamb_moments(g, m, v, beta1, one_minus_beta1, beta2, one_minus_beta2):
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    return m, v


@triton.jit
def _lamb_direction(p, m, v, eps, weight_decay, EPS_INSIDE_SQRT: tl.constexpr):
    """u, in fp32, with IEEE sqrt and division as torch rounds them."""
    if EPS_INSIDE_SQRT:
        denom = tl.sqrt_rn(v + eps)
    else:
        denom = tl.sqrt_rn(v) + eps
    return tl.div_rn(m, denom) + weight_decay * p


@triton.jit
def _unscaled_grad(g_ptr, offs, mask, grad_scale, HAS_GRAD_SCALE: tl.constexpr):
    g = _to_fp32(tl.load(g_ptr + offs, mask=mask))
    if HAS_GRAD_SCALE:
        g = tl.div_rn(g, grad_scale)
    return g


@triton.jit
def _moments_block(
    g_ptr,
    m_ptr,
    v_ptr,
    offs,
    mask,
    grad_scale,
    clip,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    STORE: tl.constexpr,
):
    """The new m and v of one block, in fp32 (stored too with ``STORE``)."""
    g = _unscaled_grad(g_ptr, offs, mask, grad_scale, HAS_GRAD_SCALE)
    if HAS_CLIP:
        g = tl.div_rn(g, clip)
    m = _to_fp32(tl.load(m_ptr + offs, mask=mask))
    v = _to_fp32(tl.load(v_ptr + offs, mask=mask))
    m, v = _lamb_moments(g, m, v, beta1, one_minus_beta1, beta2, one_minus_beta2)
    if STORE:
        tl.store(m_ptr + offs, _to_storage(m, m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offs, _to_storage(v, v_ptr.dtype.element_ty), mask=mask)
    return m, v


@triton.jit
def _grad_sq_kernel(
    addrs_ptr,
    numels_ptr,
    item_tensor_ptr,
    item_start_ptr,
    n_tensors,
    grad_scale_ptr,
    out_ptr,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCKS_PER_ITEM: tl.constexpr,
):
    """Phase 0: out[item] = sum over the item of (g / s0)^2."""
    item = tl.program_id(0)
    t, start, end, n_full = _item(item_tensor_ptr, item_start_ptr, numels_ptr, item, BLOCK_SIZE, BLOCKS_PER_ITEM)
    g_ptr = _typed_ptr(addrs_ptr, 1, n_tensors, t, G_DTYPE, ALIGNED)
    grad_scale = tl.load(grad_scale_ptr) if HAS_GRAD_SCALE else 1.0
    acc = tl.zeros([BLOCK_SIZE], tl.float32)
    for b in range(0, n_full):  # full blocks unmasked (they vectorize), then one masked tail
        g = _unscaled_grad(g_ptr, start + b * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE), None, grad_scale, HAS_GRAD_SCALE)
        acc += g * g
    tail = start + n_full * BLOCK_SIZE
    if tail < end:
        offs = tail + tl.arange(0, BLOCK_SIZE)
        g = _unscaled_grad(g_ptr, offs, offs < end, grad_scale, HAS_GRAD_SCALE)
        acc += g * g
    tl.store(out_ptr + item, tl.sum(acc, axis=0))


@triton.jit
def _clip_kernel(g_sq_ptr, n_items, clip_ptr, max_grad_norm, BLOCK_SIZE: tl.constexpr):
    """One program: s = max(1, ||g / s0|| / max_grad_norm), summing in fp64 in a fixed order."""
    acc = tl.zeros([BLOCK_SIZE], tl.float64)
    for s in range(0, n_items, BLOCK_SIZE):
        idx = s + tl.arange(0, BLOCK_SIZE)
        acc += tl.load(g_sq_ptr + idx, mask=idx < n_items, other=0.0).to(tl.float64)
    norm = tl.sqrt(tl.sum(acc, axis=0))
    tl.store(clip_ptr, tl.maximum(norm / tl.cast(max_grad_norm, tl.float64), 1.0).to(tl.float32))


@triton.jit
def _phase1_block(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    offs,
    mask,
    grad_scale,
    clip,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    weight_decay,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    FP32_STATES: tl.constexpr,
    EPS_INSIDE_SQRT: tl.constexpr,
):
    """p^2 and u^2 of one block (0 where masked off); m and v stored if fp32."""
    p = _to_fp32(tl.load(p_ptr + offs, mask=mask))
    m, v = _moments_block(
        g_ptr,
        m_ptr,
        v_ptr,
        offs,
        mask,
        grad_scale,
        clip,
        beta1,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        HAS_GRAD_SCALE,
        HAS_CLIP,
        FP32_STATES,
    )
    u = _lamb_direction(p, m, v, eps, weight_decay, EPS_INSIDE_SQRT)
    uu = u * u
    if mask is not None:
        uu = tl.where(mask, uu, 0.0)  # masked-off lanes hold 0 / eps (0 / 0 with eps = 0)
    return p * p, uu


@triton.jit
def _phase1_kernel(
    addrs_ptr,
    numels_ptr,
    item_tensor_ptr,
    item_start_ptr,
    n_tensors,
    grad_scale_ptr,
    found_inf_ptr,
    clip_ptr,
    sq_ptr,
    n_items,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    weight_decay,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    M_DTYPE: tl.constexpr,
    V_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    EPS_INSIDE_SQRT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCKS_PER_ITEM: tl.constexpr,
):
    """Phase 1: sq[item] = sum p^2 and sq[n_items + item] = sum u^2 over the item
    (``item_*_ptr`` and ``sq_ptr`` start at this launch's first item)."""
    item = tl.program_id(0)
    found_inf = tl.load(found_inf_ptr) if HAS_FOUND_INF else 0.0
    if found_inf == 0.0:
        t, start, end, n_full = _item(item_tensor_ptr, item_start_ptr, numels_ptr, item, BLOCK_SIZE, BLOCKS_PER_ITEM)
        p_ptr = _typed_ptr(addrs_ptr, 0, n_tensors, t, P_DTYPE, ALIGNED)
        g_ptr = _typed_ptr(addrs_ptr, 1, n_tensors, t, G_DTYPE, ALIGNED)
        m_ptr = _typed_ptr(addrs_ptr, 2, n_tensors, t, M_DTYPE, ALIGNED)
        v_ptr = _typed_ptr(addrs_ptr, 3, n_tensors, t, V_DTYPE, ALIGNED)
        grad_scale = tl.load(grad_scale_ptr) if HAS_GRAD_SCALE else 1.0
        clip = tl.load(clip_ptr) if HAS_CLIP else 1.0
        FP32_STATES: tl.constexpr = (M_DTYPE == tl.float32) and (V_DTYPE == tl.float32)
        acc_p = tl.zeros([BLOCK_SIZE], tl.float32)
        acc_u = tl.zeros([BLOCK_SIZE], tl.float32)
        for b in range(0, n_full):  # full blocks unmasked (they vectorize), then one masked tail
            offs = start + b * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
            pp, uu = _phase1_block(
                p_ptr,
                g_ptr,
                m_ptr,
                v_ptr,
                offs,
                None,
                grad_scale,
                clip,
                beta1,
                one_minus_beta1,
                beta2,
                one_minus_beta2,
                eps,
                weight_decay,
                HAS_GRAD_SCALE,
                HAS_CLIP,
                FP32_STATES,
                EPS_INSIDE_SQRT,
            )
            acc_p += pp
            acc_u += uu
        tail = start + n_full * BLOCK_SIZE
        if tail < end:
            offs = tail + tl.arange(0, BLOCK_SIZE)
            pp, uu = _phase1_block(
                p_ptr,
                g_ptr,
                m_ptr,
                v_ptr,
                offs,
                offs < end,
                grad_scale,
                clip,
                beta1,
                one_minus_beta1,
                beta2,
                one_minus_beta2,
                eps,
                weight_decay,
                HAS_GRAD_SCALE,
                HAS_CLIP,
                FP32_STATES,
                EPS_INSIDE_SQRT,
            )
            acc_p += pp
            acc_u += uu
        tl.store(sq_ptr + item, tl.sum(acc_p, axis=0))
        tl.store(sq_ptr + n_items + item, tl.sum(acc_u, axis=0))


@triton.jit
def _ratio_kernel(
    sq_ptr,
    n_items,
    first_item_ptr,
    n_items_of_ptr,
    coeffs_ptr,
    found_inf_ptr,
    max_coeff,
    min_coeff,
    HAS_FOUND_INF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Phase 2, one program per tensor: coeffs[t] = r from its items' sums, in fp64."""
    t = tl.program_id(0)
    found_inf = tl.load(found_inf_ptr) if HAS_FOUND_INF else 0.0
    if found_inf == 0.0:
        first = tl.load(first_item_ptr + t)
        count = tl.load(n_items_of_ptr + t)
        acc_p = tl.zeros([BLOCK_SIZE], tl.float64)
        acc_u = tl.zeros([BLOCK_SIZE], tl.float64)
        for s in range(0, count, BLOCK_SIZE):
            idx = s + tl.arange(0, BLOCK_SIZE)
            acc_p += tl.load(sq_ptr + first + idx, mask=idx < count, other=0.0).to(tl.float64)
            acc_u += tl.load(sq_ptr + n_items + first + idx, mask=idx < count, other=0.0).to(tl.float64)
        p_norm = tl.sqrt(tl.sum(acc_p, axis=0))
        u_norm = tl.sqrt(tl.sum(acc_u, axis=0))
        ratio = p_norm / tl.where(u_norm == 0.0, 1.0, u_norm)
        ratio = tl.minimum(tl.maximum(ratio, tl.cast(min_coeff, tl.float64)), tl.cast(max_coeff, tl.float64))
        ratio = tl.where((p_norm == 0.0) | (u_norm == 0.0), 1.0, ratio)
        tl.store(coeffs_ptr + t, ratio.to(tl.float32))


@triton.jit
def _phase3_block(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    c_ptr,
    offs,
    mask,
    grad_scale,
    clip,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    weight_decay,
    alpha,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    FP32_STATES: tl.constexpr,
    EPS_INSIDE_SQRT: tl.constexpr,
):
    p = _to_fp32(tl.load(p_ptr + offs, mask=mask))
    if FP32_STATES:  # stored by phase 1
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
    else:
        m, v = _moments_block(
            g_ptr,
            m_ptr,
            v_ptr,
            offs,
            mask,
            grad_scale,
            clip,
            beta1,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            HAS_GRAD_SCALE,
            HAS_CLIP,
            True,
        )
    p = p - alpha * _lamb_direction(p, m, v, eps, weight_decay, EPS_INSIDE_SQRT)
    tl.store(p_ptr + offs, _to_storage(p, p_ptr.dtype.element_ty), mask=mask)
    if c_ptr is not None:
        tl.store(c_ptr + offs, _to_storage(p, c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _phase3_kernel(
    addrs_ptr,
    numels_ptr,
    item_tensor_ptr,
    item_start_ptr,
    n_tensors,
    step_ptr,
    grad_scale_ptr,
    found_inf_ptr,
    clip_ptr,
    coeffs_ptr,
    lr,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    log_beta1,
    log_beta2,
    eps,
    weight_decay,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    M_DTYPE: tl.constexpr,
    V_DTYPE: tl.constexpr,
    C_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr,
    EPS_INSIDE_SQRT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCKS_PER_ITEM: tl.constexpr,
):
    """Phase 3: p -= lr * sqrt(bc2) / bc1 * r * u."""
    item = tl.program_id(0)
    found_inf = tl.load(found_inf_ptr) if HAS_FOUND_INF else 0.0
    if found_inf == 0.0:
        t, start, end, n_full = _item(item_tensor_ptr, item_start_ptr, numels_ptr, item, BLOCK_SIZE, BLOCKS_PER_ITEM)
        p_ptr = _typed_ptr(addrs_ptr, 0, n_tensors, t, P_DTYPE, ALIGNED)
        g_ptr = _typed_ptr(addrs_ptr, 1, n_tensors, t, G_DTYPE, ALIGNED)
        m_ptr = _typed_ptr(addrs_ptr, 2, n_tensors, t, M_DTYPE, ALIGNED)
        v_ptr = _typed_ptr(addrs_ptr, 3, n_tensors, t, V_DTYPE, ALIGNED)
        c_ptr = None
        if C_DTYPE is not None:
            c_ptr = _typed_ptr(addrs_ptr, 4, n_tensors, t, C_DTYPE, ALIGNED)
        grad_scale = tl.load(grad_scale_ptr) if HAS_GRAD_SCALE else 1.0
        clip = tl.load(clip_ptr) if HAS_CLIP else 1.0
        FP32_STATES: tl.constexpr = (M_DTYPE == tl.float32) and (V_DTYPE == tl.float32)
        bc1, bc2 = _bias_corrections(step_ptr, log_beta1, log_beta2, BIAS_CORRECTION)
        ratio = tl.load(coeffs_ptr + t).to(tl.float64)
        alpha = (tl.cast(lr, tl.float64) * tl.sqrt(bc2) / bc1 * ratio).to(tl.float32)
        for b in range(0, n_full):
            offs = start + b * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
            _phase3_block(
                p_ptr,
                g_ptr,
                m_ptr,
                v_ptr,
                c_ptr,
                offs,
                None,
                grad_scale,
                clip,
                beta1,
                one_minus_beta1,
                beta2,
                one_minus_beta2,
                eps,
                weight_decay,
                alpha,
                HAS_GRAD_SCALE,
                HAS_CLIP,
                FP32_STATES,
                EPS_INSIDE_SQRT,
            )
        tail = start + n_full * BLOCK_SIZE
        if tail < end:
            offs = tail + tl.arange(0, BLOCK_SIZE)
            _phase3_block(
                p_ptr,
                g_ptr,
                m_ptr,
                v_ptr,
                c_ptr,
                offs,
                offs < end,
                grad_scale,
                clip,
                beta1,
                one_minus_beta1,
                beta2,
                one_minus_beta2,
                eps,
                weight_decay,
                alpha,
                HAS_GRAD_SCALE,
                HAS_CLIP,
                FP32_STATES,
                EPS_INSIDE_SQRT,
            )


_REDUCE_BLOCK = 1024  # partial sums per iteration of the one-program reductions


def launch(
    params, grads, exp_avgs, exp_avg_sqs, *, step, hp, coeffs_out, grad_scale=None, found_inf=None, param_copies=None
):
    """:func:`lamb_step` on lists that were checked."""
    if not params:
        return
    floats = ("lr", "beta1", "beta2", "eps", "weight_decay", "max_grad_norm", "max_coeff", "min_coeff")
    hp = {k: float(getattr(hp, k)) for k in floats} | {  # a Python int would make Triton specialize the kernel
        "eps_inside_sqrt": bool(hp.eps_inside_sqrt),
        "bias_correction": bool(hp.bias_correction),
    }
    block, per_item, num_warps = launch_config()
    wl = work_list([params, grads, exp_avgs, exp_avg_sqs, param_copies], block * per_item)
    device, n_items = params[0].device, wl.n_items
    table = (wl.addrs, wl.numels)
    meta = dict(BLOCK_SIZE=block, BLOCKS_PER_ITEM=per_item, num_warps=num_warps)
    groups = [g for g in wl.groups if g.end > g.begin]  # a group of empty tensors has no items
    has_clip = hp["max_grad_norm"] > 0.0
    clip = torch.empty((), dtype=torch.float32, device=device) if has_clip else None
    if has_clip:
        g_sq = torch.empty(n_items, dtype=torch.float32, device=device)
        for grp in groups:
            b, e = grp.begin, grp.end
            _grad_sq_kernel[(e - b,)](
                *table,
                wl.item_tensor[b:],
                wl.item_start[b:],
                wl.n_tensors,
                grad_scale,
                g_sq[b:],
                G_DTYPE=grp.dtypes[1],
                ALIGNED=grp.aligned,
                HAS_GRAD_SCALE=grad_scale is not None,
                **meta,
            )
        _clip_kernel[(1,)](g_sq, n_items, clip, hp["max_grad_norm"], BLOCK_SIZE=_REDUCE_BLOCK)
    sq = torch.empty(2 * n_items, dtype=torch.float32, device=device)
    for grp in groups:
        b, e = grp.begin, grp.end
        p_dt, g_dt, m_dt, v_dt, _ = grp.dtypes
        _phase1_kernel[(e - b,)](
            *table,
            wl.item_tensor[b:],
            wl.item_start[b:],
            wl.n_tensors,
            grad_scale,
            found_inf,
            clip,
            sq[b:],
            n_items,
            hp["beta1"],
            1.0 - hp["beta1"],
            hp["beta2"],
            1.0 - hp["beta2"],
            hp["eps"],
            hp["weight_decay"],
            P_DTYPE=p_dt,
            G_DTYPE=g_dt,
            M_DTYPE=m_dt,
            V_DTYPE=v_dt,
            ALIGNED=grp.aligned,
            HAS_GRAD_SCALE=grad_scale is not None,
            HAS_FOUND_INF=found_inf is not None,
            HAS_CLIP=has_clip,
            EPS_INSIDE_SQRT=hp["eps_inside_sqrt"],
            **meta,
        )
    _ratio_kernel[(wl.n_tensors,)](
        sq,
        n_items,
        wl.first_item,
        wl.n_items_of,
        coeffs_out,
        found_inf,
        hp["max_coeff"],
        hp["min_coeff"],
        HAS_FOUND_INF=found_inf is not None,
        BLOCK_SIZE=_REDUCE_BLOCK,
    )
    for grp in groups:
        b, e = grp.begin, grp.end
        p_dt, g_dt, m_dt, v_dt, c_dt = grp.dtypes
        _phase3_kernel[(e - b,)](
            *table,
            wl.item_tensor[b:],
            wl.item_start[b:],
            wl.n_tensors,
            step,
            grad_scale,
            found_inf,
            clip,
            coeffs_out,
            hp["lr"],
            hp["beta1"],
            1.0 - hp["beta1"],
            hp["beta2"],
            1.0 - hp["beta2"],
            log_beta(hp["beta1"]),
            log_beta(hp["beta2"]),
            hp["eps"],
            hp["weight_decay"],
            P_DTYPE=p_dt,
            G_DTYPE=g_dt,
            M_DTYPE=m_dt,
            V_DTYPE=v_dt,
            C_DTYPE=c_dt,
            ALIGNED=grp.aligned,
            HAS_GRAD_SCALE=grad_scale is not None,
            HAS_FOUND_INF=found_inf is not None,
            HAS_CLIP=has_clip,
            BIAS_CORRECTION=hp["bias_correction"],
            EPS_INSIDE_SQRT=hp["eps_inside_sqrt"],
            **meta,
        )


@torch.no_grad()
def lamb_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: Tensor,
    hp,
    coeffs_out: Tensor,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    param_copies: list[Tensor] | None = None,
) -> None:
    """One LAMB step on every tensor of the lists, in place (formula in the module
    docstring); ``hp``: the hyperparameters (fastzero.ops.LambHyperparams);
    ``coeffs_out[i]`` receives the trust ratio r of tensor i.

    ``step`` is a 0-d float32 device tensor holding t >= 1; ``grad_scale`` (0-d
    float32) divides the grads; where ``found_inf`` (0-d float32) is nonzero nothing
    changes, ``coeffs_out`` included. All three are read on the device: no host sync.
    """
    check_inputs(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        param_copies,
        {"step": step, "grad_scale": grad_scale, "found_inf": found_inf},
    )
    if not isinstance(coeffs_out, Tensor) or coeffs_out.dtype != torch.float32 or coeffs_out.shape != (len(params),):
        raise TypeError(f"coeffs_out must be a float32 tensor of shape ({len(params)},) (one trust ratio per param)")
    if params and (coeffs_out.device != params[0].device or not coeffs_out.is_contiguous()):
        raise ValueError(f"coeffs_out must be contiguous and on {params[0].device}, like the params")
    launch(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        step=step,
        hp=hp,
        coeffs_out=coeffs_out,
        grad_scale=grad_scale,
        found_inf=found_inf,
        param_copies=param_copies,
    )
