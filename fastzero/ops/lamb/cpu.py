"""The CPU backend of LAMB: the SIMD kernels of csrc/cpu (lamb.cpp). Three
passes over memory: the grads' norm (only when ``max_grad_norm`` > 0), m/v
update with the per-tensor norms of p and of the update, then the update."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from fastzero.native import DTYPE_CODES, ISA_NAMES, NO_DTYPE, cpu_isa, cpu_ops
from fastzero.ops.host_step import host_step
from fastzero.ops.lamb.backends import FAMILY
from fastzero.ops.lamb.hyperparams import LambHyperparams
from fastzero.ops.marshal import dtype_groups


def launch(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: int,
    hp: LambHyperparams,
    grad_scale: float | None = None,
    param_copies: list[Tensor] | None = None,
) -> list[float]:
    """Runs lists that were checked; returns the trust ratio of each tensor.
    The hyperparameters cross whole, as the bytes of their C struct; the
    clip, trust ratios and step size are derived from them natively
    (csrc/cpu/lamb.cpp)."""
    ops, isa = cpu_ops(), ISA_NAMES.index(cpu_isa())
    hyper = bytes(hp.c_struct())
    threads = torch.get_num_threads()
    inv_scale = 1.0 if grad_scale is None else 1.0 / grad_scale
    grad_sumsq = 0.0  # of the unscaled grads, over every tensor: the global norm's square
    if hp.clips_grad_norm:
        by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
        for i, g in enumerate(grads):
            by_dtype[g.dtype].append(i)
        grad_sumsq = sum(
            ops.lamb_grad_sumsq(
                isa,
                [grads[i].data_ptr() for i in idx],
                [grads[i].numel() for i in idx],
                DTYPE_CODES[dtype],
                inv_scale,
                threads,
            )
            for dtype, idx in by_dtype.items()
        )
    ratios = [1.0] * len(params)
    for (p_dtype, g_dtype, s_dtype, c_dtype), idx in dtype_groups(params, grads, exp_avgs, param_copies).items():
        ptrs = {
            name: [seq[i].data_ptr() for i in idx]
            for name, seq in (("p", params), ("g", grads), ("m", exp_avgs), ("v", exp_avg_sqs))
        }
        numel = [params[i].numel() for i in idx]
        group_ratios = ops.lamb_norms(
            isa,
            hyper,
            ptrs["p"],
            ptrs["g"],
            ptrs["m"],
            ptrs["v"],
            numel,
            DTYPE_CODES[p_dtype],
            DTYPE_CODES[g_dtype],
            DTYPE_CODES[s_dtype],
            inv_scale,
            grad_sumsq,
            threads,
        )
        for k, i in enumerate(idx):
            ratios[i] = group_ratios[k]
        copies = [] if c_dtype is None else [param_copies[i].data_ptr() for i in idx]
        ops.lamb_apply(
            isa,
            hyper,
            step,
            ptrs["p"],
            ptrs["m"],
            ptrs["v"],
            copies,
            numel,
            DTYPE_CODES[p_dtype],
            DTYPE_CODES[s_dtype],
            DTYPE_CODES.get(c_dtype, NO_DTYPE),
            group_ratios,
            threads,
        )
    return ratios


def cpu_lamb_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: int,
    hp: LambHyperparams | None = None,
    grad_scale: float | None = None,
    param_copies: list[Tensor] | None = None,
    backend: str | None = None,
    **hyper,
) -> list[float]:
    """One LAMB step over lists of CPU tensors; the math is
    :func:`fastzero.ops.lamb.reference.lamb_step`'s, the hyperparameters
    ``hp`` (a :class:`LambHyperparams`) or its fields as keywords. Returns the
    trust ratio of each tensor.
    """
    hp = hp if hp is not None else LambHyperparams.from_kwargs(**hyper)
    which, result = host_step(
        FAMILY,
        "cpu_lamb_step",
        (params, grads, exp_avgs, exp_avg_sqs),
        step=step,
        hp=hp,
        grad_scale=grad_scale,
        param_copies=param_copies,
        backend=backend,
    )
    return result
