"""FusedAdam: one Adam/AdamW optimizer for every device. CUDA tensors run the
CUDA kernel (or the Triton one), CPU tensors the SIMD CPU kernel; the math is
:func:`fastzero.ops.reference.adam_step`'s on every backend."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from fastzero.checks import check_adam_hyperparams
from fastzero.ops import cpu_adam, reference
from fastzero.ops.fused import FusedOptimizer


class FusedAdam(FusedOptimizer):
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

    _op_name, _kernel_name = "FusedAdam", "adam_step"

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
        super().__init__(
            params,
            defaults,
            fp32_optimizer_states=fp32_optimizer_states,
            master_weights=master_weights,
            backend=backend,
        )
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    def _check_group(self, gi: int, group: dict) -> None:
        check_adam_hyperparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        if group.get("amsgrad", False):
            raise ValueError(f"param group {gi} sets amsgrad=True; FusedAdam does not implement amsgrad")

    def _hyper(self, group: dict) -> dict:
        beta1, beta2 = group["betas"]
        return dict(
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
            bias_correction=group["bias_correction"], adamw_mode=group["adamw_mode"],
        )  # fmt: skip

    def _host_step(self, backend: str):
        return cpu_adam._launch if backend == "cpu" else reference.adam_step
