"""FusedAdam: one Adam/AdamW optimizer for every device. CUDA tensors run the
CUDA kernel (or the Triton one), CPU tensors the SIMD CPU kernel; the math is
:func:`fastzero.ops.reference.adam_step`'s on every backend."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from fastzero.checks import check_adam_hyperparams
from fastzero.ops import cpu_adam, reference
from fastzero.ops.backend import device_backend
from fastzero.ops.optimizer import AdamFamilyOptimizer, GroupLists


def device_kernel(backend: str, name: str):
    """The function `name` ('adam_step' or 'lamb_step') of a device backend:
    fastzero.ops.cuda, or fastzero.triton_kernels.adam / .lamb."""
    if backend == "cuda":
        from fastzero.ops import cuda

        return getattr(cuda, name)
    return getattr(importlib.import_module(f"fastzero.triton_kernels.{name.removesuffix('_step')}"), name)


def as_device_scalar(x: float | Tensor | None, device: torch.device) -> Tensor | None:
    """A 0-d fp32 tensor on `device` (a GradScaler's scale is one already)."""
    if x is None:
        return None
    if isinstance(x, Tensor):
        return x.to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(x), dtype=torch.float32, device=device)


class FusedAdam(AdamFamilyOptimizer):
    r"""Adam/AdamW with fused multi-tensor kernels, wherever the params live.

    DeepSpeed's ``FusedAdam`` signature, so scripts switch without edits:
    ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode,
    weight_decay, amsgrad, set_grad_none)``, plus ``master_weights`` (keep an
    fp32 copy of bf16/fp16 params in the optimizer state so small updates are
    not lost; the kernel updates the copy and writes the param in the same
    pass) and ``fp32_optimizer_states``. The math is CPUAdam's (see
    :func:`fastzero.ops.reference.adam_step`), in fp32 whatever the storage.

    The step counter is per param group and advances once per step, whatever
    dtypes the group mixes (DeepSpeed's FusedAdam advances it once per dtype
    bucket; that bug is not copied). State keys and layout are
    ``torch.optim.AdamW``'s, so checkpoints move between FusedAdam, CPUAdam
    and torch. ``step(grad_scale=, found_inf=)`` (or ``torch.amp.GradScaler``)
    unscales inside the kernel and skips on overflow without a host sync on
    the GPU path. ``backend="cuda"|"triton"|"cpu"|"reference"`` (or the
    environment's ``FASTZERO_BACKEND``) forces a backend; ``last_backend`` says
    which ran.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        *,
        master_weights: bool = False,
        fp32_optimizer_states: bool = True,
        backend: str | None = None,
    ) -> None:
        if amsgrad:
            raise ValueError("FusedAdam does not implement amsgrad; use torch.optim.AdamW(amsgrad=True) for it")
        check_adam_hyperparams(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            bias_correction=bias_correction, adamw_mode=adam_w_mode, amsgrad=False,
        )  # fmt: skip
        super().__init__(params, defaults, fp32_optimizer_states=fp32_optimizer_states, master_weights=master_weights)
        self.set_grad_none = set_grad_none
        self.force_backend = backend  # None: the fastest here, or FASTZERO_BACKEND
        self.last_backend: str | None = None

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    @property
    def backend(self) -> str:
        """The backend a step runs for the first param's device."""
        first = next((p for g in self.param_groups for p in g["params"]), None)
        return "none" if first is None else device_backend("FusedAdam", first.device.type, self.force_backend)

    def _check_group(self, gi: int, group: dict) -> None:
        check_adam_hyperparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        if group.get("amsgrad", False):
            raise ValueError(f"param group {gi} sets amsgrad=True; FusedAdam does not implement amsgrad")

    def _update(self, gi: int, group: dict, lists: GroupLists, step, grad_scale, found_inf) -> None:
        backend = device_backend("FusedAdam", lists.device.type, self.force_backend)
        self.last_backend = backend
        beta1, beta2 = group["betas"]
        hyper = dict(
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
            bias_correction=group["bias_correction"], adamw_mode=group["adamw_mode"],
        )  # fmt: skip
        tensors = (lists.params, lists.grads, lists.exp_avgs, lists.exp_avg_sqs)
        if backend in ("cpu", "reference"):
            if found_inf is not None and lists.device.type != "cpu" and bool(found_inf):
                return  # the reference on a GPU: a host sync, the fallback's price
            run = cpu_adam._launch if backend == "cpu" else reference.adam_step
            scale = None if grad_scale is None else float(grad_scale)
            run(*tensors, param_copies=lists.param_copies, step=int(step), grad_scale=scale, **hyper)
            return
        device = lists.device
        step_t = step if isinstance(step, Tensor) else torch.tensor(float(step), device=device)
        device_kernel(backend, "adam_step")(
            *tensors, step=step_t, grad_scale=as_device_scalar(grad_scale, device),
            found_inf=as_device_scalar(found_inf, device), param_copies=lists.param_copies, **hyper,
        )  # fmt: skip
