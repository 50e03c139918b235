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

from fastzero.ops import native, reference
from fastzero.ops.backend import cpu_backend
from fastzero.ops.checks import (
    check_adam_hyperparams,
    check_contiguous,
    check_cpu_tensor,
    check_grad_scale,
    check_same_size,
)

_GPU_HINT = "; for GPU parameters use fastzero.ops.FusedAdam"
_DTYPES = frozenset(native.DTYPE_CODES)


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
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if param_copies is not None:
        lists["param_copies"] = param_copies
    for name, seq in lists.items():
        if len(seq) != n:
            raise ValueError(f"cpu_adam_step: {len(params)} params but {len(seq)} {name}")
    check_adam_hyperparams(lr, (beta1, beta2), eps, weight_decay)
    check_grad_scale(grad_scale)
    if int(step) < 1:
        raise ValueError(f"cpu_adam_step: step must be >= 1 (the first step is 1), got {step}")
    for i in range(n):
        p, g, m, v = params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]
        check_cpu_tensor(p, f"params[{i}]", gpu_hint=_GPU_HINT)
        check_cpu_tensor(g, f"grads[{i}]", gpu_hint=_GPU_HINT)
        check_same_size(g, p, f"grads[{i}]", f"params[{i}]")
        for name, s in (("exp_avgs", m), ("exp_avg_sqs", v)):
            check_cpu_tensor(s, f"{name}[{i}]")
            check_same_size(s, p, f"{name}[{i}]", f"params[{i}]")
            if s.dtype not in (torch.float32, p.dtype):
                raise TypeError(
                    f"{name}[{i}] is {s.dtype}; optimizer states must be float32 or the param's dtype ({p.dtype})"
                )
            check_contiguous(s, f"{name}[{i}]")
        if m.dtype != v.dtype:
            raise TypeError(f"exp_avgs[{i}] is {m.dtype} but exp_avg_sqs[{i}] is {v.dtype}; use one state dtype")
        check_contiguous(p, f"params[{i}]")
        check_contiguous(g, f"grads[{i}]")
        if param_copies is not None:
            c = param_copies[i]
            check_cpu_tensor(c, f"param_copies[{i}]")
            check_same_size(c, p, f"param_copies[{i}]", f"params[{i}]")
            check_contiguous(c, f"param_copies[{i}]")
            if p.dtype != torch.float32 or c.dtype == torch.float32:
                raise TypeError(
                    f"param_copies[{i}] ({c.dtype}) for params[{i}] ({p.dtype}): copies are bf16/fp16 "
                    "copies of fp32 master params"
                )

    return _launch(
        params, grads, exp_avgs, exp_avg_sqs, param_copies, step=step, lr=lr, beta1=beta1, beta2=beta2,
        eps=eps, weight_decay=weight_decay, bias_correction=bias_correction, adamw_mode=adamw_mode,
        grad_scale=grad_scale,
    )  # fmt: skip


def _launch(params, grads, exp_avgs, exp_avg_sqs, param_copies, *, step, lr, beta1, beta2, eps, weight_decay,
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


class CPUAdam(torch.optim.Optimizer):
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
    param, so only then do the two differ).

    Args:
        params: parameters (fp32, bf16 or fp16, on the CPU) or param groups.
        fp32_optimizer_states: keep exp_avg/exp_avg_sq in fp32 (default);
            False keeps them in the param's dtype.
        amsgrad: not supported; True raises.
    """

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
        super().__init__(params, defaults)
        self.fp32_optimizer_states = fp32_optimizer_states
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                check_cpu_tensor(p, f"param {pi} of group {gi}", gpu_hint=_GPU_HINT)

    @property
    def backend(self) -> str:
        """The backend :meth:`step` runs: ``"cpu:<isa>"`` or ``"reference"``."""
        backend = cpu_backend("CPUAdam")
        return f"cpu:{native.cpu_isa()}" if backend == "cpu" else backend

    def _state_dtype(self, p: Tensor) -> torch.dtype:
        return torch.float32 if self.fp32_optimizer_states else p.dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            check_adam_hyperparams(group["lr"], (beta1, beta2), group["eps"], group["weight_decay"])
            if group.get("amsgrad", False):
                raise ValueError(f"param group {gi} sets amsgrad=True; CPUAdam does not implement amsgrad")
            params, grads, exp_avgs, exp_avg_sqs = [], [], [], []
            staged: list[tuple[Tensor, Tensor]] = []  # (param, contiguous copy) to write back
            # The per-param work here is what a step with hundreds of tensors
            # pays in Python: only what torch does not already guarantee (a
            # grad's shape and device match its param's) is checked, and any
            # doubt falls through to the full checks for a precise error.
            for pi, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                if not (p.is_cpu and p.dtype in _DTYPES and g.dtype in _DTYPES and g.layout == torch.strided):
                    what = f"param {pi} of group {gi}"
                    check_cpu_tensor(p, what, gpu_hint=_GPU_HINT)
                    check_cpu_tensor(g, f"the grad of {what}", gpu_hint=_GPU_HINT)
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(
                        p, dtype=self._state_dtype(p), memory_format=torch.contiguous_format
                    )
                    state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
                if not p.is_contiguous():
                    data = p.detach().contiguous()
                    staged.append((p, data))
                    p = data
                params.append(p)
                grads.append(g if g.is_contiguous() else g.contiguous())
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
            if not params:
                continue
            group["step"] = group.get("step", 0) + 1
            _launch(
                params, grads, exp_avgs, exp_avg_sqs, None, step=group["step"], lr=group["lr"], beta1=beta1,
                beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                bias_correction=group["bias_correction"], adamw_mode=group["adamw_mode"], grad_scale=None,
            )  # fmt: skip
            for p, data in staged:
                p.detach().copy_(data)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout: per-param ``step`` (a float32 tensor),
        ``exp_avg``, ``exp_avg_sq``, so torch.optim.AdamW can load it."""
        sd = super().state_dict()
        for group in sd["param_groups"]:
            for pid in group["params"]:
                if pid in sd["state"]:
                    sd["state"][pid] = {"step": torch.tensor(float(group.get("step", 0))), **sd["state"][pid]}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of CPUAdam, torch.optim.Adam/AdamW or FusedAdam.
        A state dict of another model is refused before anything changes."""
        saved_state = state_dict["state"]
        saved_groups = state_dict["param_groups"]
        pairs = []  # (group index, param index, param, saved state)
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            for pi, (pid, p) in enumerate(zip(saved["params"], group["params"])):
                if pid not in saved_state:
                    continue
                src = saved_state[pid]
                for key in ("exp_avg", "exp_avg_sq"):
                    if key not in src:
                        raise ValueError(
                            f"the saved state of param {pi} of group {gi} has no {key!r} (it has {sorted(src)}); "
                            "it was not saved by an Adam optimizer"
                        )
                    check_same_size(src[key], p, f"saved {key} of param {pi} of group {gi}", "the param")
                pairs.append((gi, p, src))
        super().load_state_dict(state_dict)  # checks group and param counts
        # torch.optim casts states to the param dtype; take them again from the
        # saved tensors in our state dtype (fp32 states for bf16 params stay fp32).
        steps: dict[int, list[int]] = defaultdict(list)
        for gi, p, src in pairs:
            state = self.state[p]
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = src[key].detach().to(device="cpu", dtype=self._state_dtype(p)).contiguous()
            step = state.pop("step", 0)
            steps[gi].append(int(step.item() if isinstance(step, Tensor) else step))
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            for key, value in self.defaults.items():  # torch.optim's groups lack our keys
                group.setdefault(key, value)
            if "step" in saved:
                group["step"] = int(saved["step"])
            elif steps[gi]:
                group["step"] = max(steps[gi])
