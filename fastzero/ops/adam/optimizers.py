"""The Adam optimizers: FusedAdam (every device) and CPUAdam (CPU params,
DeepSpeed's ``DeepSpeedCPUAdam``), both on the Adam family's backends; the
math is :func:`fastzero.ops.adam.reference.adam_step`'s on every backend."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from fastzero.checks import check_cpu_tensor
from fastzero.native import cpu_isa
from fastzero.ops.adam.backends import FAMILY
from fastzero.ops.adam.hyperparams import AdamHyperparams
from fastzero.ops.optimizer_base import AdamFamilyOptimizer

_GPU_HINT = "; for GPU parameters use fastzero.ops.FusedAdam"


def _adamw_mode(cls: str, adamw_mode: bool | None, adam_w_mode: bool | None) -> bool:
    """DeepSpeed spells it ``adam_w_mode`` for FusedAdam and ``adamw_mode``
    for DeepSpeedCPUAdam; both optimizers take either (one at a time)."""
    for name, value in (("adamw_mode", adamw_mode), ("adam_w_mode", adam_w_mode)):
        if value is not None and not (isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))):
            raise TypeError(f"{cls}: {name} must be True or False, got {value!r}")
    if adamw_mode is not None and adam_w_mode is not None and bool(adamw_mode) != bool(adam_w_mode):
        raise ValueError(f"{cls}: adamw_mode={adamw_mode} and adam_w_mode={adam_w_mode} disagree; pass one of them")
    given = adamw_mode if adamw_mode is not None else adam_w_mode
    return True if given is None else bool(given)


class FusedAdam(AdamFamilyOptimizer):
    r"""Adam/AdamW with fused multi-tensor kernels, wherever the params live.

    DeepSpeed's ``FusedAdam`` signature, so scripts switch without edits:
    ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode,
    weight_decay, amsgrad, set_grad_none)``, plus ``master_weights`` (keep an
    fp32 copy of bf16/fp16 params in the optimizer state so small updates are
    not lost; the kernel updates the copy and writes the param in the same
    pass) and ``fp32_optimizer_states``. Any other field of
    :class:`AdamHyperparams` is accepted as a keyword. The math is
    :func:`fastzero.ops.adam.reference.adam_step`'s, in fp32 whatever the
    storage.

    CUDA tensors run the CUDA kernel (or the Triton one), CPU tensors the SIMD
    CPU kernel. The step counter is per param group and advances once per
    step, whatever dtypes the group mixes (DeepSpeed's FusedAdam advances it
    once per dtype bucket; that bug is not copied). State keys and layout are
    ``torch.optim.AdamW``'s, so checkpoints move between FusedAdam, CPUAdam
    and torch. ``step(grad_scale=, found_inf=)`` (or ``torch.amp.GradScaler``)
    unscales inside the kernel and skips on overflow without a host sync on
    the GPU path. ``backend="cuda"|"triton"|"cpu"|"reference"`` forces a
    backend (it beats ``FASTZERO_BACKEND``, which beats the fastest
    available); ``last_backend`` says which ran.

    ``state_format``: ``"fp32"`` (default), ``"param_dtype"``
    (``fp32_optimizer_states=False``) or ``"bf16"``: exp_avg and exp_avg_sq
    in bf16 whatever the param dtype (20 bytes per fp32 param moved per step
    instead of 28), written with stochastic rounding keyed by ``seed``
    (default 0), the step and each element's index, so the results are the
    same to the bit on every backend (docs/optimizers.md, "State formats");
    or ``"int8"``: one byte per element and one fp32 scale per ``block_size``
    elements (default 256) for each of them (16 bytes moved per fp32 param),
    decoded, updated and encoded again in the one pass
    (:mod:`fastzero.ops.adam.int8_codes`).

    ``bf16_stochastic_round`` (torchao's name): bf16 params kept without an
    fp32 master are written with stochastic rounding keyed by ``seed``, so
    updates smaller than half a bf16 ulp still move them on average (2 bytes
    per param instead of a 4-byte master; refused with ``master_weights``).
    """

    family, hyperparams = FAMILY, AdamHyperparams
    state_formats = ("fp32", "bf16", "param_dtype", "int8")

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool | None = None,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        *,
        adamw_mode: bool | None = None,
        master_weights: bool = False,
        fp32_optimizer_states: bool | None = None,
        state_format: str | None = None,
        seed: int | None = None,
        block_size: int | None = None,
        bf16_stochastic_round: bool = False,
        backend: str | None = None,
        **hyper: Any,
    ) -> None:
        if amsgrad:
            raise ValueError("FusedAdam does not implement amsgrad; use torch.optim.AdamW(amsgrad=True) for it")
        hp = AdamHyperparams.from_kwargs(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            adamw_mode=_adamw_mode("FusedAdam", adamw_mode, adam_w_mode),
            **hyper,
        )
        super().__init__(
            params,
            hp,
            fp32_optimizer_states=fp32_optimizer_states,
            master_weights=master_weights,
            backend=backend,
            state_format=state_format,
            seed=seed,
            block_size=block_size,
            bf16_stochastic_round=bf16_stochastic_round,
        )
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


class CPUAdam(AdamFamilyOptimizer):
    r"""Adam/AdamW for parameters in CPU memory, on fastzero's SIMD kernels.

    A drop-in for DeepSpeed's ``DeepSpeedCPUAdam`` (same arguments) and for
    ``torch.optim.AdamW`` / ``Adam`` (same results to fp32 rounding, same
    state keys ``step``, ``exp_avg``, ``exp_avg_sq``, so state dicts load
    across them). The math is :func:`fastzero.ops.adam.reference.adam_step`'s,
    in fp32 whatever the storage dtype:

    .. math::
        p \leftarrow p(1-\text{lr}\cdot\text{wd}) \text{ (adamw\_mode) or } g \leftarrow g + \text{wd}\,p;\quad
        m \leftarrow m + (1-\beta_1)(g - m);\quad v \leftarrow \beta_2 v + (1-\beta_2) g^2;\quad
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
            False keeps them in the param's dtype (``state_format="param_dtype"``).
        adamw_mode (or ``adam_w_mode``): decoupled weight decay (default).
        amsgrad: not supported; True raises.
        state_format: ``"fp32"``, ``"param_dtype"`` or ``"bf16"`` (exp_avg and
            exp_avg_sq in bf16 whatever the param dtype, written with
            stochastic rounding keyed by ``seed``, default 0, the step and each
            element's index: the same bits on every ISA, thread count and
            backend), or ``"int8"`` (uint8 codes and one fp32 scale per
            ``block_size`` elements, default 256, for each; 16 bytes moved per
            fp32 param instead of 28). Given with ``fp32_optimizer_states``,
            the two must agree.
        bf16_stochastic_round: bf16 params written with stochastic rounding
            (keyed by ``seed``), in place of round to nearest.
        backend: ``"cpu"`` or ``"reference"``, beating ``FASTZERO_BACKEND``.
    """

    family, hyperparams = FAMILY, AdamHyperparams
    state_formats = ("fp32", "bf16", "param_dtype", "int8")
    _device_hint, _device_types = _GPU_HINT, ("cpu",)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool | None = None,
        fp32_optimizer_states: bool | None = None,
        *,
        adam_w_mode: bool | None = None,
        state_format: str | None = None,
        seed: int | None = None,
        block_size: int | None = None,
        bf16_stochastic_round: bool = False,
        backend: str | None = None,
        **hyper: Any,
    ) -> None:
        if amsgrad:
            raise ValueError("CPUAdam does not implement amsgrad; use torch.optim.AdamW(amsgrad=True) for it")
        if backend not in (None, "cpu", "reference"):
            raise ValueError(f"CPUAdam: backend={backend!r}; it runs 'cpu' or 'reference' (FusedAdam runs the others)")
        hp = AdamHyperparams.from_kwargs(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            adamw_mode=_adamw_mode("CPUAdam", adamw_mode, adam_w_mode),
            **hyper,
        )
        super().__init__(
            params,
            hp,
            fp32_optimizer_states=fp32_optimizer_states,
            backend=backend,
            state_format=state_format,
            seed=seed,
            block_size=block_size,
            bf16_stochastic_round=bf16_stochastic_round,
        )
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                check_cpu_tensor(p, f"param {pi} of group {gi}", gpu_hint=_GPU_HINT)

    @property
    def backend(self) -> str:
        """The backend :meth:`step` runs: ``"cpu:<isa>"`` or ``"reference"``."""
        which = FAMILY.choose("cpu", self.force_backend).backend
        return f"cpu:{cpu_isa()}" if which == "cpu" else which
