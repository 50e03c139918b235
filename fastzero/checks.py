"""Input checks shared by the ops and the kernel backends (below both in the
layering, so Triton kernels and CUDA wrappers use them too): every problem is a Python
exception that names it and the fix, raised before a pointer reaches native
code (DESIGN.md rule 6)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


STATE_FORMATS = ("fp32", "bf16", "param_dtype", "int8")
INT8_BLOCK_SIZES = tuple(1 << k for k in range(6, 13))  # 64 .. 4096 (fastzero/ops/adam/int8_codes.py)


def check_state_format(
    op: str,
    state_format: str | None,
    seed: int | None,
    block_size: int | None = None,
    bf16_stochastic_round: bool | None = None,
) -> None:
    """``state_format`` one of :data:`STATE_FORMATS` or None (the states as
    given); ``seed`` (stochastic rounding's) an int in [0, 2^32), and only
    with ``state_format="bf16"``, ``"int8"`` or ``bf16_stochastic_round``
    (bf16 params written with stochastic rounding), which round stochastically;
    ``block_size`` only with ``"int8"``, a power of two from 64 to 4096."""
    if bf16_stochastic_round is not None and not isinstance(bf16_stochastic_round, bool):
        raise TypeError(f"{op}: bf16_stochastic_round must be True or False, got {bf16_stochastic_round!r}")
    if state_format is not None and state_format not in STATE_FORMATS:
        raise ValueError(f"{op}: state_format={state_format!r}; known: {', '.join(map(repr, STATE_FORMATS))}")
    if block_size is not None:
        if state_format != "int8":
            raise ValueError(
                f"{op}: block_size={block_size!r} is the block of int8 states' scales, which only "
                f"state_format='int8' has (state_format={state_format!r})"
            )
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size not in INT8_BLOCK_SIZES:
            raise ValueError(
                f"{op}: block_size={block_size!r}; int8 states take a power of two from 64 to 4096 "
                f"({', '.join(map(str, INT8_BLOCK_SIZES))}; default 256)"
            )
    if seed is None:
        return
    if state_format not in ("bf16", "int8") and not bf16_stochastic_round:
        raise ValueError(
            f"{op}: seed={seed!r} is the seed of stochastic rounding, which only state_format='bf16', 'int8' "
            f"and bf16_stochastic_round=True do (state_format={state_format!r} rounds to nearest)"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"{op}: seed must be an int in [0, 2**32), got {seed!r}")


def check_int8_scales(
    scales: list[Tensor] | None,
    params: list[Tensor],
    what: str,
    block_size: int,
    *,
    device_type: str = "cpu",
) -> None:
    """The block scales of int8 states: one fp32 list entry per param, each
    contiguous, on the params' device, with ceil(numel / block_size) elements."""
    if scales is None:
        raise ValueError(f"state_format='int8' needs {what}: one fp32 tensor of block scales per param")
    if len(scales) != len(params):
        raise ValueError(f"{len(params)} params but {len(scales)} {what}")
    for i, (s, p) in enumerate(zip(scales, params)):
        name = f"{what}[{i}]"
        if not isinstance(s, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(s).__name__}")
        if s.device.type != device_type or (device_type != "cpu" and s.device != p.device):
            raise ValueError(f"{name} is on {s.device}; it must be on the param's device ({p.device})")
        if s.dtype != torch.float32:
            raise TypeError(f"{name} has dtype {s.dtype}; int8 states' block scales are float32")
        blocks = -(-p.numel() // block_size)
        if s.numel() != blocks:
            raise ValueError(
                f"{name} has {s.numel()} elements; params[{i}] ({p.numel()} elements) has {blocks} blocks of "
                f"{block_size}: one scale per block"
            )
        check_contiguous(s, name)


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
    state_format: str | None = None,
    exp_avg_absmax: list[Tensor] | None = None,
    exp_avg_sq_absmax: list[Tensor] | None = None,
    block_size: int | None = None,
) -> None:
    """The tensor lists of a functional optimizer step: equal lengths; params
    fp32/bf16/fp16 and grads of any of these, of the param's size; states
    fp32 or the param's dtype (``state_format``: ``"fp32"`` fp32 only,
    ``"param_dtype"`` the param's only, ``"bf16"`` bf16 whatever the param's,
    ``"int8"`` uint8 codes with their block scales in ``exp_avg_absmax`` and
    ``exp_avg_sq_absmax``); copies bf16/fp16 of fp32 params; all dense,
    contiguous and on `device_type`."""
    n = len(params)
    if state_format != "int8" and (exp_avg_absmax is not None or exp_avg_sq_absmax is not None):
        raise ValueError(
            f"{op}: exp_avg_absmax / exp_avg_sq_absmax are the block scales of int8 states; "
            f"pass them with state_format='int8' (state_format={state_format!r})"
        )
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
            if state_format == "int8":
                _check_codes(s, p, f"{name}[{i}]", f"params[{i}]", device_type, hint)
                continue
            check_tensor(s, f"{name}[{i}]", device_type=device_type, hint=hint)
            check_same_size(s, p, f"{name}[{i}]", f"params[{i}]")
            allowed = {
                None: (torch.float32, p.dtype),
                "fp32": (torch.float32,),
                "param_dtype": (p.dtype,),
                "bf16": (torch.bfloat16,),
            }[state_format]
            if s.dtype not in allowed:
                if state_format == "bf16":
                    want = "bfloat16 (state_format='bf16')"
                elif state_format is None:
                    want = f"float32 or the param's dtype ({p.dtype})"
                    if s.dtype == torch.bfloat16:
                        want += "; bf16 states of other params are state_format='bf16' (stochastic rounding)"
                else:
                    want = f"{allowed[0]} (state_format={state_format!r})"
                raise TypeError(f"{name}[{i}] is {s.dtype}; optimizer states must be {want}")
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
    if state_format == "int8":
        block = 256 if block_size is None else block_size
        check_int8_scales(exp_avg_absmax, params, "exp_avg_absmax", block, device_type=device_type)
        check_int8_scales(exp_avg_sq_absmax, params, "exp_avg_sq_absmax", block, device_type=device_type)


def _check_codes(s: Tensor, p: Tensor, what: str, p_what: str, device_type: str, hint: str) -> None:
    """An int8 state's codes: uint8, of the param's size, contiguous, on its device."""
    if not isinstance(s, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(s).__name__}")
    if s.device.type != device_type:
        raise ValueError(f"{what} is on {s.device}; this op updates {device_type} tensors{hint}")
    if s.dtype != torch.uint8:
        raise TypeError(f"{what} is {s.dtype}; int8 states (state_format='int8') are uint8 codes")
    check_same_size(s, p, what, p_what)
    check_contiguous(s, what)


def check_step(op: str, step: int) -> None:
    if int(step) < 1:
        raise ValueError(f"{op}: step must be >= 1 (the first step is 1), got {step}")


def check_device_scalar(t, what: str, device: torch.device | None, *, required: bool = False) -> None:
    """``step``, ``grad_scale`` or ``found_inf`` of a device kernel: one
    float32 value in a tensor on the params' device (read there, so a step
    never waits for the GPU), or None where optional."""
    if t is None:
        if required:
            raise TypeError(f"{what} is required: a 0-d float32 tensor on the params' device")
        return
    if not isinstance(t, Tensor):
        raise TypeError(
            f"{what} must be a 0-d float32 tensor on the params' device (the kernels read it there, so a step "
            f"never waits for the GPU), got {type(t).__name__}"
        )
    if t.dtype != torch.float32 or t.numel() != 1:
        raise TypeError(f"{what} must be one float32 value (0-d tensor), got {t.dtype} of shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{what} is on {t.device} but the params are on {device}; keep it on their device")


def check_device_step(
    op: str,
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    param_copies: list[Tensor] | None,
    scalars: dict[str, Tensor | None],
    *,
    device_types: tuple[str, ...] = ("cuda",),
    hint: str = "",
    state_format: str | None = None,
    exp_avg_absmax: list[Tensor] | None = None,
    exp_avg_sq_absmax: list[Tensor] | None = None,
    block_size: int | None = None,
) -> torch.device | None:
    """The inputs of a device kernel's optimizer step: the lists as
    :func:`check_optimizer_lists` wants them (int8 states: with their block
    scales), all on one device of `device_types`, and its scalars (``step``
    required) on that device. Returns the device (None for empty lists)."""
    for name, t in scalars.items():
        check_device_scalar(t, name, None, required=name == "step")
    device_type = params[0].device.type if params and isinstance(params[0], Tensor) else device_types[0]
    if device_type not in device_types:
        device_type = device_types[0]  # the error below names the device it wants
    check_optimizer_lists(
        op,
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        param_copies,
        device_type=device_type,
        hint=hint,
        state_format=state_format,
        exp_avg_absmax=exp_avg_absmax,
        exp_avg_sq_absmax=exp_avg_sq_absmax,
        block_size=block_size,
    )
    if not params:
        return None
    device = params[0].device
    lists = {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    scales = {"exp_avg_absmax": exp_avg_absmax or [], "exp_avg_sq_absmax": exp_avg_sq_absmax or []}
    for name, seq in (*lists.items(), ("param_copies", param_copies or []), *scales.items()):
        for i, t in enumerate(seq):
            if t.device != device:
                raise ValueError(f"{name}[{i}] is on {t.device} but params[0] is on {device}; one call, one device")
    for name, t in scalars.items():
        check_device_scalar(t, name, device)
    return device
