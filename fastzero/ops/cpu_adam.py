"""CPUAdam: Adam/AdamW on CPU tensors with the SIMD kernels of csrc/cpu.

The functional :func:`cpu_adam_step` is the multi-tensor entry point (the
ZeRO-Offload step calls it); :class:`CPUAdam` is the ``torch.optim``
optimizer on top of it, with DeepSpeed's ``DeepSpeedCPUAdam`` signature.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from fastzero import native
from fastzero.checks import (
    check_adam_hyperparams,
    check_cpu_tensor,
    check_grad_scale,
    check_optimizer_lists,
    check_step,
)
from fastzero.ops import reference
from fastzero.ops.backend import cpu_backend
from fastzero.ops.optimizer import AdamFamilyOptimizer, GroupLists

_GPU_HINT = "; for GPU parameters use fastzero.ops.FusedAdam"


def cpu_adam_step(
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
    weight_decay: float = 0.0,
    bias_correction: bool = True,
    adamw_mode: bool = True,
    grad_scale: float | None = None,
    param_copies: list[Tensor] | None = None,
) -> str:
    """One Adam/AdamW step over lists of CPU tensors, in one pass over memory.

    The math is :func:`fastzero.ops.reference.adam_step`'s. Params are fp32,
    bf16 or fp16; grads any of these; exp_avg/exp_avg_sq fp32 or the param's
    dtype; all contiguous. ``grad_scale`` divides the grads inside the kernel
    (fused unscale). ``param_copies`` (fp32 params only): bf16/fp16 tensors
    that receive the updated params in the same pass. Returns the backend
    that ran: ``"cpu:<isa>"`` or ``"reference"``.
    """
    check_optimizer_lists("cpu_adam_step", params, grads, exp_avgs, exp_avg_sqs, param_copies, hint=_GPU_HINT)
    check_adam_hyperparams(lr, (beta1, beta2), eps, weight_decay)
    check_grad_scale(grad_scale)
    check_step("cpu_adam_step", step)
    return _launch(
        params, grads, exp_avgs, exp_avg_sqs, param_copies=param_copies, step=step, lr=lr, beta1=beta1, beta2=beta2,
        eps=eps, weight_decay=weight_decay, bias_correction=bias_correction, adamw_mode=adamw_mode,
        grad_scale=grad_scale,
    )  # fmt: skip


def _launch(params, grads, exp_avgs, exp_avg_sqs, *, param_copies=None, step, lr, beta1, beta2, eps, weight_decay,
            bias_correction, adamw_mode, grad_scale) -> str:  # fmt: skip
    """Runs checked lists: one native call per dtype combination, each one
    multi-tensor pass; or the reference."""
    backend = cpu_backend("CPUAdam")
    if backend == "reference":
        reference.adam_step(
            params, grads, exp_avgs, exp_avg_sqs, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, bias_correction=bias_correction, adamw_mode=adamw_mode,
            grad_scale=grad_scale, param_copies=param_copies,
        )  # fmt: skip
        return backend
    ops, isa = native.cpu_ops(), native.cpu_isa()
    codes = native.DTYPE_CODES
    batches: dict[tuple, list[int]] = defaultdict(list)
    copy_dtypes = [None] * len(params) if param_copies is None else [c.dtype for c in param_copies]
    for i, (p, g, m, c) in enumerate(zip(params, grads, exp_avgs, copy_dtypes)):
        batches[(p.dtype, g.dtype, m.dtype, c)].append(i)
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    threads = torch.get_num_threads()
    for (p_dtype, g_dtype, s_dtype, c_dtype), idx in batches.items():
        ops.adam(
            native.ISA_NAMES.index(isa),
            [params[i].data_ptr() for i in idx],
            [grads[i].data_ptr() for i in idx],
            [exp_avgs[i].data_ptr() for i in idx],
            [exp_avg_sqs[i].data_ptr() for i in idx],
            [] if c_dtype is None else [param_copies[i].data_ptr() for i in idx],
            [params[i].numel() for i in idx],
            codes[p_dtype], codes[g_dtype], codes[s_dtype], codes.get(c_dtype, native.NO_DTYPE),
            beta1, beta2, eps,
            lr / bc1,                                        # step_size
            1.0 / math.sqrt(bc2),                            # bc2_rsqrt
            1.0 - lr * weight_decay if adamw_mode else 1.0,  # decay
            0.0 if adamw_mode else weight_decay,             # l2
            1.0 if grad_scale is None else 1.0 / grad_scale,
            threads,
        )  # fmt: skip
    return f"cpu:{isa}"


class CPUAdam(AdamFamilyOptimizer):
    r"""Adam/AdamW for parameters in CPU memory, on fastzero's SIMD kernels.

    A drop-in for DeepSpeed's ``DeepSpeedCPUAdam`` (same arguments) and for
    ``torch.optim.AdamW`` / ``Adam`` (same results to fp32 rounding, same
    state keys ``step``, ``exp_avg``, ``exp_avg_sq``, so state dicts load
    across them). The math is :func:`fastzero.ops.reference.adam_step`'s, in
    fp32 whatever the storage dtype:

    .. math::
        p \leftarrow p(1-\text{lr}\cdot\text{wd}) \text{ (adamw\_mode) or } g \leftarrow g + \text{wd}\,p;\quad
        m \leftarrow \beta_1 m + (1-\beta_1) g;\quad v \leftarrow \beta_2 v + (1-\beta_2) g^2;\quad
        p \leftarrow p - \text{lr}\,\frac{m/bc_1}{\sqrt{v/bc_2}+\epsilon}

    with :math:`bc_i = 1-\beta_i^t` (1 when ``bias_correction`` is False).
    The step :math:`t` is counted per param group (``group["step"]``): it
    advances once per :meth:`step` for every group that has a gradient, as in
    DeepSpeed. Params whose ``grad`` is None are skipped; a param that skipped
    some steps then uses the group's :math:`t` (``torch.optim`` counts per
    param, so only then do the two differ). ``step(grad_scale=, found_inf=)``
    and ``torch.amp.GradScaler`` work as in :class:`AdamFamilyOptimizer`.

    Args:
        params: parameters (fp32, bf16 or fp16, on the CPU) or param groups.
        fp32_optimizer_states: keep exp_avg/exp_avg_sq in fp32 (default);
            False keeps them in the param's dtype.
        amsgrad: not supported; True raises.
    """

    _device_hint = _GPU_HINT

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if amsgrad:
            raise ValueError("CPUAdam does not implement amsgrad; use torch.optim.AdamW(amsgrad=True) for it")
        check_adam_hyperparams(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            bias_correction=bias_correction, adamw_mode=adamw_mode, amsgrad=False,
        )  # fmt: skip
        super().__init__(params, defaults, fp32_optimizer_states=fp32_optimizer_states)
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                check_cpu_tensor(p, f"param {pi} of group {gi}", gpu_hint=_GPU_HINT)

    @property
    def backend(self) -> str:
        """The backend :meth:`step` runs: ``"cpu:<isa>"`` or ``"reference"``."""
        backend = cpu_backend("CPUAdam")
        return f"cpu:{native.cpu_isa()}" if backend == "cpu" else backend

    def _check_group(self, gi: int, group: dict) -> None:
        check_adam_hyperparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        if group.get("amsgrad", False):
            raise ValueError(f"param group {gi} sets amsgrad=True; CPUAdam does not implement amsgrad")

    def _update(self, gi: int, group: dict, lists: GroupLists, step, grad_scale, found_inf) -> None:
        if lists.device.type != "cpu":
            raise ValueError(f"param group {gi} is on {lists.device}; CPUAdam updates CPU tensors{_GPU_HINT}")
        beta1, beta2 = group["betas"]
        _launch(
            lists.params, lists.grads, lists.exp_avgs, lists.exp_avg_sqs, param_copies=lists.param_copies, step=step,
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
            bias_correction=group["bias_correction"], adamw_mode=group["adamw_mode"],
            grad_scale=None if grad_scale is None else float(grad_scale),
        )  # fmt: skip
