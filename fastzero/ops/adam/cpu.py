"""The CPU backend of Adam: the SIMD kernels of csrc/cpu (adam.cpp), one
multi-tensor pass over memory per dtype combination."""

from __future__ import annotations

import torch
from torch import Tensor

from fastzero.native import DTYPE_CODES, ISA_NAMES, NO_DTYPE, cpu_isa, cpu_ops
from fastzero.ops.adam.backends import FAMILY
from fastzero.ops.adam.hyperparams import AdamHyperparams
from fastzero.ops.adam.int8_codes import DEFAULT_BLOCK
from fastzero.ops.host_step import host_step
from fastzero.ops.marshal import dtype_groups

_GPU_HINT = "; for GPU parameters use fastzero.ops.FusedAdam"


def launch(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: int,
    hp: AdamHyperparams,
    grad_scale: float | None = None,
    param_copies: list[Tensor] | None = None,
    state_format: str | None = None,
    seed: int | None = None,
    exp_avg_absmax: list[Tensor] | None = None,
    exp_avg_sq_absmax: list[Tensor] | None = None,
    block_size: int | None = None,
    bf16_stochastic_round: bool = False,
) -> str:
    """Runs lists that were checked (fastzero.checks.check_optimizer_lists):
    one native call per dtype combination. Returns ``"cpu:<isa>"``. The
    hyperparameters cross whole, as the bytes of their C struct; the kernel
    derives its constants from them (csrc/cpu/adam.cpp). ``state_format="bf16"``:
    the (bf16) states are written with stochastic rounding keyed by ``seed``;
    ``"int8"``: uint8 codes with fp32 block scales (csrc/cpu/adam_int8_kernel.inc).
    ``bf16_stochastic_round``: bf16 params are written with stochastic rounding."""
    ops, isa = cpu_ops(), cpu_isa()
    hyper = bytes(hp.c_struct())
    inv_grad_scale = 1.0 if grad_scale is None else 1.0 / grad_scale
    seed = 0 if seed is None else int(seed)
    sr_params = lambda p_dtype: bool(bf16_stochastic_round) and p_dtype == torch.bfloat16  # noqa: E731
    threads = torch.get_num_threads()
    groups = dtype_groups(params, grads, exp_avgs, param_copies)
    ptrs = lambda ts, idx: [] if ts is None else [ts[i].data_ptr() for i in idx]  # noqa: E731
    if state_format == "int8":
        block = DEFAULT_BLOCK if block_size is None else block_size
        for (p_dtype, g_dtype, _, c_dtype), idx in groups.items():
            ops.adam_int8(
                ISA_NAMES.index(isa),
                ptrs(params, idx),
                ptrs(grads, idx),
                ptrs(exp_avgs, idx),
                ptrs(exp_avg_sqs, idx),
                ptrs(param_copies, idx),
                ptrs(exp_avg_absmax, idx),
                ptrs(exp_avg_sq_absmax, idx),
                [params[i].numel() for i in idx],
                DTYPE_CODES[p_dtype],
                DTYPE_CODES[g_dtype],
                DTYPE_CODES.get(c_dtype, NO_DTYPE),
                hyper,
                step,
                inv_grad_scale,
                block,
                seed,
                sr_params(p_dtype),
                threads,
            )
        return f"cpu:{isa}"
    for (p_dtype, g_dtype, s_dtype, c_dtype), idx in groups.items():
        ops.adam(
            ISA_NAMES.index(isa),
            ptrs(params, idx),
            ptrs(grads, idx),
            ptrs(exp_avgs, idx),
            ptrs(exp_avg_sqs, idx),
            ptrs(param_copies, idx),
            [params[i].numel() for i in idx],
            DTYPE_CODES[p_dtype],
            DTYPE_CODES[g_dtype],
            DTYPE_CODES[s_dtype],
            DTYPE_CODES.get(c_dtype, NO_DTYPE),
            hyper,
            step,
            inv_grad_scale,
            seed,
            state_format == "bf16",
            sr_params(p_dtype),
            threads,
        )
    return f"cpu:{isa}"


def cpu_adam_step(
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
    bf16_stochastic_round: bool | None = None,
    backend: str | None = None,
    **hyper,
) -> str:
    """One Adam/AdamW step over lists of CPU tensors, in one pass over memory.

    The math is :func:`fastzero.ops.adam.reference.adam_step`'s; the
    hyperparameters are ``hp`` (an :class:`AdamHyperparams`) or its fields as
    keywords (``lr=``, ``beta1=``, ...). Params are fp32, bf16 or fp16; grads
    any of these; exp_avg/exp_avg_sq fp32 or the param's dtype; all
    contiguous. ``grad_scale`` divides the grads inside the kernel (fused
    unscale). ``param_copies`` (fp32 params only): bf16/fp16 tensors that
    receive the updated params in the same pass. Returns the backend that
    ran: ``"cpu:<isa>"`` or ``"reference"``.

    ``state_format``: None (the states as given, fp32 or the param's dtype,
    rounded to nearest), ``"fp32"`` or ``"param_dtype"`` (the same, checked to
    be that dtype), or ``"bf16"``: exp_avg/exp_avg_sq are bf16 whatever the
    param dtype and are written with stochastic rounding keyed by ``seed``
    (an int in [0, 2^32), default 0), ``step`` and each element's index in its
    tensor; the results are then the same to the bit on every backend and
    thread count (the rule: :mod:`fastzero.ops.adam.reference`). ``"int8"``:
    exp_avg/exp_avg_sq are uint8 codes, one byte per element, and
    ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` their fp32 block scales (one per
    ``block_size`` elements, default 256, a power of two from 64 to 4096),
    decoded, updated and encoded again in the one pass, to the bit of the
    reference on every backend (:mod:`fastzero.ops.adam.int8_codes`).

    ``bf16_stochastic_round``: bf16 params (kept without an fp32 master) are
    written with stochastic rounding keyed by ``seed``, the step and each
    element's index, after the pinned update (any state format); params of
    other dtypes as without it.
    """
    hp = hp if hp is not None else AdamHyperparams.from_kwargs(**hyper)
    which, result = host_step(
        FAMILY,
        "cpu_adam_step",
        (params, grads, exp_avgs, exp_avg_sqs),
        step=step,
        hp=hp,
        grad_scale=grad_scale,
        param_copies=param_copies,
        backend=backend,
        hint=_GPU_HINT,
        state_format=state_format,
        seed=seed,
        exp_avg_absmax=exp_avg_absmax,
        exp_avg_sq_absmax=exp_avg_sq_absmax,
        block_size=block_size,
        bf16_stochastic_round=bf16_stochastic_round or None,
    )
    return result if which == "cpu" else "reference"
