"""Input checks shared by the optimizer ops: every problem is a Python
exception that names it and the fix, raised before a pointer reaches native
code (DESIGN.md rule 6)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_adam_hyperparams(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if isinstance(lr, Tensor):
        raise TypeError("lr must be a Python float, not a tensor")
    if not math.isfinite(lr) or lr < 0.0:
        raise ValueError(f"invalid learning rate {lr}: it must be a finite number >= 0")
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"invalid beta{i + 1} {beta}: it must be in [0, 1)")
    if not math.isfinite(eps) or eps < 0.0:
        raise ValueError(f"invalid eps {eps}: it must be a finite number >= 0")
    if not math.isfinite(weight_decay) or weight_decay < 0.0:
        raise ValueError(f"invalid weight_decay {weight_decay}: it must be a finite number >= 0")


def check_grad_scale(grad_scale: float | None) -> None:
    if grad_scale is not None and (not math.isfinite(grad_scale) or grad_scale <= 0.0):
        raise ValueError(f"invalid grad_scale {grad_scale}: it must be a finite number > 0 (or None)")


def check_tensor(t: Tensor, what: str, *, device_type: str = "cpu", hint: str = "") -> None:
    """A dense fp32/bf16/fp16 tensor on a device of `device_type`."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != device_type:
        raise ValueError(f"{what} is on {t.device}; this op updates {device_type} tensors{hint}")
    if t.layout != torch.strided:
        raise ValueError(
            f"{what} is sparse ({t.layout}); this op needs dense tensors "
            "(convert with .to_dense(), or use torch.optim.SparseAdam)"
        )
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{what} has dtype {t.dtype}; supported: float32, bfloat16, float16")


def check_cpu_tensor(t: Tensor, what: str, *, gpu_hint: str = "") -> None:
    check_tensor(t, what, device_type="cpu", hint=gpu_hint)


def check_same_size(t: Tensor, ref: Tensor, what: str, ref_what: str) -> None:
    if t.shape != ref.shape:
        if t.numel() != ref.numel():
            raise ValueError(
                f"{what} has shape {tuple(t.shape)} ({t.numel()} elements) but {ref_what} has "
                f"shape {tuple(ref.shape)} ({ref.numel()} elements)"
            )
        raise ValueError(f"{what} has shape {tuple(t.shape)} but {ref_what} has shape {tuple(ref.shape)}")


def check_contiguous(t: Tensor, what: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{what} is not contiguous; pass t.contiguous() (the kernel updates memory in place)")


def check_optimizer_lists(
    op: str,
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    param_copies: list[Tensor] | None,
    *,
    device_type: str = "cpu",
    hint: str = "",
) -> None:
    """The tensor lists of a functional optimizer step: equal lengths; params
    fp32/bf16/fp16 and grads of any of these, of the param's size; states
    fp32 or the param's dtype; copies bf16/fp16 of fp32 params; all dense,
    contiguous and on `device_type`."""
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if param_copies is not None:
        lists["param_copies"] = param_copies
    for name, seq in lists.items():
        if len(seq) != n:
            raise ValueError(f"{op}: {n} params but {len(seq)} {name}")
    for i in range(n):
        p, g, m, v = params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]
        check_tensor(p, f"params[{i}]", device_type=device_type, hint=hint)
        check_tensor(g, f"grads[{i}]", device_type=device_type, hint=hint)
        check_same_size(g, p, f"grads[{i}]", f"params[{i}]")
        for name, s in (("exp_avgs", m), ("exp_avg_sqs", v)):
            check_tensor(s, f"{name}[{i}]", device_type=device_type, hint=hint)
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
            check_tensor(c, f"param_copies[{i}]", device_type=device_type, hint=hint)
            check_same_size(c, p, f"param_copies[{i}]", f"params[{i}]")
            check_contiguous(c, f"param_copies[{i}]")
            if p.dtype != torch.float32 or c.dtype == torch.float32:
                raise TypeError(
                    f"param_copies[{i}] ({c.dtype}) for params[{i}] ({p.dtype}): copies are bf16/fp16 "
                    "copies of fp32 master params"
                )


def check_step(op: str, step: int) -> None:
    if int(step) < 1:
        raise ValueError(f"{op}: step must be >= 1 (the first step is 1), got {step}")
