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


def check_cpu_tensor(t: Tensor, what: str, *, gpu_hint: str = "") -> None:
    """A dense, CPU, fp32/bf16/fp16 tensor."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{what} is on {t.device}; this op updates CPU tensors{gpu_hint}")
    if t.layout != torch.strided:
        raise ValueError(
            f"{what} is sparse ({t.layout}); this op needs dense tensors "
            "(convert with .to_dense(), or use torch.optim.SparseAdam)"
        )
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{what} has dtype {t.dtype}; supported: float32, bfloat16, float16")


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
