"""Adam/AdamW in plain PyTorch: the math every Adam backend is tested
against, and the fallback where no faster backend runs."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fastzero.ops.adam.hyperparams import AdamHyperparams


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
    """
    h = hp if hp is not None else AdamHyperparams.from_kwargs(**hyper)
    lr, beta1, beta2, eps, weight_decay = h.lr, h.beta1, h.beta2, h.eps, h.weight_decay
    bc1 = 1.0 - beta1**step if h.bias_correction else 1.0
    bc2 = 1.0 - beta2**step if h.bias_correction else 1.0
    copies = param_copies if param_copies is not None else [None] * len(params)
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
