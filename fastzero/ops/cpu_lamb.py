"""LAMB on CPU tensors with the SIMD kernels of csrc/cpu (lamb.cpp): the
functional multi-tensor step that FusedLamb calls for CPU params."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import Tensor

from fastzero import native
from fastzero.checks import (
    check_adam_hyperparams,
    check_grad_scale,
    check_lamb_hyperparams,
    check_optimizer_lists,
    check_step,
)
from fastzero.ops import reference
from fastzero.ops.backend import cpu_backend


def cpu_lamb_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    eps_inside_sqrt: bool = False,
    weight_decay: float = 0.0,
    bias_correction: bool = True,
    max_grad_norm: float = 0.0,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    grad_scale: float | None = None,
    param_copies: list[Tensor] | None = None,
) -> list[float]:
    """One LAMB step over lists of CPU tensors; the math is
    :func:`fastzero.ops.reference.lamb_step`'s. Three passes over memory: the
    grads' norm (only when ``max_grad_norm`` > 0), m/v update with the
    per-tensor norms of p and of the update, then the update. Returns the
    trust ratio of each tensor."""
    check_optimizer_lists("cpu_lamb_step", params, grads, exp_avgs, exp_avg_sqs, param_copies)
    check_adam_hyperparams(lr, (beta1, beta2), eps, weight_decay)
    check_lamb_hyperparams(max_grad_norm, max_coeff, min_coeff)
    check_grad_scale(grad_scale)
    check_step("cpu_lamb_step", step)
    hyper = dict(
        step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, eps_inside_sqrt=eps_inside_sqrt,
        weight_decay=weight_decay, bias_correction=bias_correction, max_grad_norm=max_grad_norm,
        max_coeff=max_coeff, min_coeff=min_coeff, grad_scale=grad_scale,
    )  # fmt: skip
    if cpu_backend("FusedLamb") == "reference":
        return reference.lamb_step(params, grads, exp_avgs, exp_avg_sqs, param_copies=param_copies, **hyper)
    return _launch(params, grads, exp_avgs, exp_avg_sqs, param_copies=param_copies, **hyper)


def _launch(params, grads, exp_avgs, exp_avg_sqs, *, param_copies=None, step, lr, beta1, beta2, eps,
            eps_inside_sqrt, weight_decay, bias_correction, max_grad_norm, max_coeff, min_coeff,
            grad_scale) -> list[float]:  # fmt: skip
    ops, isa = native.cpu_ops(), native.ISA_NAMES.index(native.cpu_isa())
    codes, threads = native.DTYPE_CODES, torch.get_num_threads()
    inv_scale = 1.0 if grad_scale is None else 1.0 / grad_scale
    clip = 1.0
    if max_grad_norm > 0.0:
        by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
        for i, g in enumerate(grads):
            by_dtype[g.dtype].append(i)
        sumsq = sum(
            ops.lamb_grad_sumsq(
                isa,
                [grads[i].data_ptr() for i in idx],
                [grads[i].numel() for i in idx],
                codes[dtype],
                inv_scale,
                threads,
            )  # fmt: skip
            for dtype, idx in by_dtype.items()
        )
        norm = math.sqrt(sumsq)
        if norm > max_grad_norm:
            clip = norm / max_grad_norm
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    step_size = lr * math.sqrt(bc2) / bc1
    batches: dict[tuple, list[int]] = defaultdict(list)
    for i, (p, g, m) in enumerate(zip(params, grads, exp_avgs)):
        batches[(p.dtype, g.dtype, m.dtype, None if param_copies is None else param_copies[i].dtype)].append(i)
    ratios = [1.0] * len(params)
    for (p_dtype, g_dtype, s_dtype, c_dtype), idx in batches.items():
        ptrs = {
            name: [seq[i].data_ptr() for i in idx]
            for name, seq in (("p", params), ("g", grads), ("m", exp_avgs), ("v", exp_avg_sqs))
        }
        numel = [params[i].numel() for i in idx]
        sums = ops.lamb_norms(
            isa, ptrs["p"], ptrs["g"], ptrs["m"], ptrs["v"], numel, codes[p_dtype], codes[g_dtype], codes[s_dtype],
            beta1, beta2, eps, eps_inside_sqrt, weight_decay, inv_scale / clip, threads,
        )  # fmt: skip
        scales = []
        for k, i in enumerate(idx):
            p_norm, u_norm = math.sqrt(sums[2 * k]), math.sqrt(sums[2 * k + 1])
            ratio = 1.0 if p_norm == 0.0 or u_norm == 0.0 else min(max(p_norm / u_norm, min_coeff), max_coeff)
            ratios[i] = ratio
            scales.append(-step_size * ratio)
        copies = [] if c_dtype is None else [param_copies[i].data_ptr() for i in idx]
        ops.lamb_apply(
            isa, ptrs["p"], ptrs["m"], ptrs["v"], copies, numel, codes[p_dtype], codes[s_dtype],
            codes.get(c_dtype, native.NO_DTYPE), eps, eps_inside_sqrt, weight_decay, scales, threads,
        )  # fmt: skip
    return ratios
