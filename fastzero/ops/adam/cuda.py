"""The CUDA backend of Adam (csrc/cuda/multi_tensor_adam.cu): one pass over
memory per dtype combination, per-step scalars read on the device; int8
block-wise states through their own entry (fz_cuda_adam_int8, its codes
rounded stochastically keyed by the seed); bf16 params written with
stochastic rounding (bf16_stochastic_round) through either."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from fastzero.checks import check_device_step, check_state_format
from fastzero.native import DTYPE_CODES, NO_DTYPE, check_rc, cuda_lib
from fastzero.ops.adam.hyperparams import AdamHyperparams
from fastzero.ops.adam.int8_codes import DEFAULT_BLOCK
from fastzero.ops.marshal import dtype_codes, dtype_groups, numels, pointers, ptr, stream

_CPU_HINT = "; for CPU tensors use fastzero.ops.CPUAdam (or cpu_adam_step), or FusedAdam, which takes its CPU path"


def adam_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: Tensor,
    hp: AdamHyperparams | None = None,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    param_copies: list[Tensor] | None = None,
    state_format: str | None = None,
    seed: int | None = None,
    exp_avg_absmax: list[Tensor] | None = None,
    exp_avg_sq_absmax: list[Tensor] | None = None,
    block_size: int | None = None,
    bf16_stochastic_round: bool = False,
    **hyper,
) -> None:
    r"""One Adam/AdamW step over lists of CUDA tensors:
    :func:`fastzero.ops.adam.reference.adam_step`'s math in fp32 whatever the
    storage dtypes. Params fp32/bf16/fp16; grads any of these; states fp32 or
    the param's dtype; ``param_copies`` (fp32 params only) bf16/fp16 tensors
    written in the same pass. ``step`` is a 0-d float32 tensor on the params'
    device holding t >= 1; ``grad_scale`` (grads are divided by it) and
    ``found_inf`` (nonzero: nothing changes) likewise, or None. The work is
    enqueued on the current CUDA stream; nothing waits for it.
    ``state_format="bf16"``: bf16 states (for params of any dtype) written with
    stochastic rounding keyed by ``seed`` (default 0), the step and each
    element's index, the reference's bits (fastzero.ops.adam.reference).
    ``state_format="int8"``: exp_avgs and exp_avg_sqs are uint8 codes and
    ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` their fp32 block scales (one
    per ``block_size`` elements, default 256, a power of two from 64 to
    4096), decoded, updated and encoded again in one pass, the codes rounded
    stochastically keyed by ``seed`` (default 0) as bf16 states are, the
    reference's bits (fastzero.ops.adam.int8_codes). ``bf16_stochastic_round``: bf16
    params (kept without an fp32 master) written with stochastic rounding
    keyed by ``seed``, after the pinned update (any state format), the
    reference's bits; params of other dtypes as without it.
    """
    hp = hp if hp is not None else AdamHyperparams.from_kwargs(**hyper)
    check_state_format("adam_step", state_format, seed, block_size, bf16_stochastic_round)
    scalars = {"step": step, "grad_scale": grad_scale, "found_inf": found_inf}
    check_device_step(
        "adam_step",
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        param_copies,
        scalars,
        hint=_CPU_HINT,
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
    """:func:`adam_step` on lists that were checked. The hyperparameters
    cross whole, as one fz_adam_hyper; the kernel derives its constants."""
    if not params:
        return
    seed = 0 if seed is None else int(seed)
    sr_params = lambda p_dtype: bool(bf16_stochastic_round) and p_dtype == torch.bfloat16  # noqa: E731
    if state_format == "int8":
        _launch_int8(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            exp_avg_absmax,
            exp_avg_sq_absmax,
            step=step,
            hp=hp,
            grad_scale=grad_scale,
            found_inf=found_inf,
            param_copies=param_copies,
            block=DEFAULT_BLOCK if block_size is None else block_size,
            seed=seed,
            sr_params=sr_params,
        )
        return
    device = params[0].device
    lib = cuda_lib("adam_step")
    hyper = hp.c_struct()  # host memory, copied into the kernels' parameters during each call
    with torch.cuda.device(device):
        for key, idx in dtype_groups(params, grads, exp_avgs, param_copies).items():
            rc = lib.fz_cuda_adam(
                pointers(params, idx),
                pointers(grads, idx),
                pointers(exp_avgs, idx),
                pointers(exp_avg_sqs, idx),
                None if param_copies is None else pointers(param_copies, idx),
                numels(params, idx),
                len(idx),
                *dtype_codes(key),
                ctypes.byref(hyper),
                step.data_ptr(),
                ptr(grad_scale),
                ptr(found_inf),
                seed,
                state_format == "bf16",
                sr_params(key[0]),
                stream(device),
            )
            check_rc(lib, rc, "adam_step")


def _launch_int8(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    m_scales,
    v_scales,
    *,
    step,
    hp,
    grad_scale,
    found_inf,
    param_copies,
    block,
    seed,
    sr_params,
):
    """int8 states: one fz_cuda_adam_int8 call per (param, grad, copy) dtype combination, the
    codes rounded stochastically keyed by ``seed``; ``sr_params(p_dtype)``: whether params of
    that dtype are written with stochastic rounding too."""
    device = params[0].device
    lib = cuda_lib("adam_step")
    hyper = hp.c_struct()
    with torch.cuda.device(device):
        for (p_dtype, g_dtype, _, c_dtype), idx in dtype_groups(params, grads, exp_avgs, param_copies).items():
            rc = lib.fz_cuda_adam_int8(
                pointers(params, idx),
                pointers(grads, idx),
                pointers(exp_avgs, idx),
                pointers(exp_avg_sqs, idx),
                None if param_copies is None else pointers(param_copies, idx),
                pointers(m_scales, idx),
                pointers(v_scales, idx),
                numels(params, idx),
                len(idx),
                DTYPE_CODES[p_dtype],
                DTYPE_CODES[g_dtype],
                NO_DTYPE if c_dtype is None else DTYPE_CODES[c_dtype],
                block,
                ctypes.byref(hyper),
                step.data_ptr(),
                ptr(grad_scale),
                ptr(found_inf),
                seed,
                sr_params(p_dtype),
                stream(device),
            )
            check_rc(lib, rc, "adam_step")
