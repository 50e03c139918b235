"""Adam's state formats as data: the tensors each format keeps per param, and
conversions between formats through fp32 (state dicts, checkpoints).

=============== ============================ ===========================================
format          ``exp_avg``, ``exp_avg_sq``  more per-param state
=============== ============================ ===========================================
``fp32``        float32                      (none)
``param_dtype`` the param's dtype (fp32      (none)
                where a master is kept)
``bf16``        bfloat16                     (none)
``int8``        uint8 codes                  ``exp_avg_absmax``, ``exp_avg_sq_absmax``:
                                             fp32, one scale per block
=============== ============================ ===========================================
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from fastzero.ops.adam import int8_codes

SCALE_KEYS = ("exp_avg_absmax", "exp_avg_sq_absmax")  # int8: the block scales of exp_avg, exp_avg_sq


def state_dtype(fmt: str, p: Tensor, master: bool) -> torch.dtype:
    """The dtype of exp_avg and exp_avg_sq for param `p` (``master``: an fp32
    master copy is kept for it)."""
    if fmt == "int8":
        return torch.uint8
    if fmt == "bf16":
        return torch.bfloat16
    return torch.float32 if fmt == "fp32" or master else p.dtype


def new_state(fmt: str, p: Tensor, *, master: bool, block: int | None) -> dict[str, Tensor]:
    """Zero states of `p` in format `fmt` (what a first step starts from)."""
    dtype = state_dtype(fmt, p, master)
    state = {"exp_avg": torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)}
    state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
    if fmt == "int8":
        blocks = int8_codes.blocks_of(p.numel(), block)
        for key in SCALE_KEYS:
            state[key] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
    return state


def to_fp32(fmt: str, state: Mapping[str, Tensor], block: int | None) -> tuple[Tensor, Tensor]:
    """(exp_avg, exp_avg_sq) of a state in format `fmt` as fp32 tensors of
    the param's shape (int8: decoded with their block scales)."""
    if fmt == "int8":
        return tuple(
            int8_codes.dequantize(code, state[key], state[scale], block)
            for code, key, scale in zip(int8_codes.CODES, ("exp_avg", "exp_avg_sq"), SCALE_KEYS)
        )
    return state["exp_avg"].float(), state["exp_avg_sq"].float()


def from_fp32(fmt: str, m: Tensor, v: Tensor, p: Tensor, *, master: bool, block: int | None) -> dict[str, Tensor]:
    """States of `p` in format `fmt` from fp32 exp_avg `m` and exp_avg_sq `v`
    (of p's size): rounded to nearest for 16-bit formats, encoded with fresh
    block scales for int8."""
    m = m.detach().reshape(p.shape).to(p.device)
    v = v.detach().reshape(p.shape).to(p.device)
    if fmt != "int8":
        dtype = state_dtype(fmt, p, master)
        return {"exp_avg": m.to(dtype).contiguous(), "exp_avg_sq": v.to(dtype).contiguous()}
    state = {}
    for code, key, scale, x in zip(int8_codes.CODES, ("exp_avg", "exp_avg_sq"), SCALE_KEYS, (m, v)):
        state[key], state[scale] = int8_codes.quantize(code, x, block)
    return state


def describe(fmt: str, block: int | None) -> str:
    return f"int8 (blocks of {block})" if fmt == "int8" else fmt
