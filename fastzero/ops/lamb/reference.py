"""LAMB (DeepSpeed's FusedLamb math) in plain PyTorch: the math every LAMB
backend is tested against, and the fallback where no faster backend runs."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fastzero.ops.lamb.hyperparams import LambHyperparams


@torch.no_grad()
def lamb_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: int,
    hp: LambHyperparams | None = None,
    grad_scale: float | None = None,
    param_copies: list[Tensor] | None = None,
    **hyper,
) -> list[float]:
    r"""One LAMB step (DeepSpeed's FusedLamb math), fp32 whatever the storage
    dtypes, in place. Returns the trust ratio used for each tensor. The
    hyperparameters are ``hp`` or keywords (``lr=``, ``max_grad_norm=``, ...).

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
    """
    h = hp if hp is not None else LambHyperparams.from_kwargs(**hyper)
    lr, beta1, beta2, eps, weight_decay = h.lr, h.beta1, h.beta2, h.eps, h.weight_decay
    max_grad_norm, max_coeff, min_coeff = h.max_grad_norm, h.max_coeff, h.min_coeff
    bc1 = 1.0 - beta1**step if h.bias_correction else 1.0
    bc2 = 1.0 - beta2**step if h.bias_correction else 1.0
    step_size = lr * math.sqrt(bc2) / bc1
    unscaled = [g.float() if grad_scale is None else g.float() / grad_scale for g in grads]
    clip = 1.0
    if max_grad_norm > 0.0:
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in unscaled))
        if norm > max_grad_norm:
            clip = norm / max_grad_norm
    copies = param_copies if param_copies is not None else [None] * len(params)
    ratios = []
    for p, g, m, v, c in zip(params, unscaled, exp_avgs, exp_avg_sqs, copies, strict=True):
        g32 = g / clip
        p32 = p.float().clone()
        m32 = m.float() * beta1 + (1.0 - beta1) * g32
        v32 = v.float() * beta2 + (1.0 - beta2) * g32 * g32
        denom = (v32 + eps).sqrt() if h.eps_inside_sqrt else v32.sqrt() + eps
        update = m32 / denom + weight_decay * p32
        p_norm, u_norm = float(p32.double().norm()), float(update.double().norm())
        ratio = 1.0 if p_norm == 0.0 or u_norm == 0.0 else min(max(p_norm / u_norm, min_coeff), max_coeff)
        ratios.append(ratio)
        p32.add_(update, alpha=-step_size * ratio)
        p.copy_(p32)
        m.copy_(m32)
        v.copy_(v32)
        if c is not None:
            c.copy_(p32)
    return ratios
