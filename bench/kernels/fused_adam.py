"""FusedAdam. On the CPU: FusedAdam (its SIMD path) against
torch.optim.AdamW(fused=True). With --device cuda: fastzero's CUDA and
Triton kernels against torch.optim.AdamW(fused=True) on the GPU, fp32 and
bf16 params (fp32 states), beside the GPU's copy bandwidth.

Bytes per param: fp32 28 (read p, g, m, v; write p, m, v); bf16 params and
grads with fp32 states 22 (2+2+4+4 read, 2+4+4 written). torch's fused AdamW
keeps a bf16 param's states in bf16 (14 B): speedups compare whole steps,
GB/s counts the bytes fastzero's step must move. ``--dtype bf16states``:
fp32 params and grads with bf16 states written by stochastic rounding, 20 B
(4+4+2+2 read, 4+2+2 written); ``--dtype int8states``: int8 block-wise
states, 16 B (4+4+1+1 read, 4+1+1 written) and the fp32 block scales (16 B
per block of 256); each case's first step checked to the bit (on a GPU: the
CUDA and Triton kernels, against the reference run on the GPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from fastzero.ops import FusedAdam, reference

from ..family import Family
from ..harness import Case, Runner
from ..tables import bandwidth_summary
from .common import backend_ready, roofline
from .cpu_adam import lowbit_check, optimizer_states, state_bytes
from .optim_common import OptimData, first_step_check, layouts, optim_case

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BYTES_PER_PARAM = {torch.float32: 28, torch.bfloat16: 22}
LOWBIT = {  # --dtype: (state_format, what it is)
    "bf16states": ("bf16", "bf16 states (stochastic rounding)"),
    "int8states": ("int8", "int8 block-wise states (blocks of 256)"),
}


def provide_fastzero(data: Callable[[], OptimData], backend: str | None, device: str) -> Runner:
    backend_ready(backend, device)
    data = data()
    params = data.parameters(grad_dtype=data.grads[0].dtype)
    opt = FusedAdam(params, **HYPER, backend=backend)
    return Runner(step=opt.step, check=first_step_check(opt, params, data), cuda=device == "cuda")


def provide_fastzero_lowbit(data: Callable[[], OptimData], backend: str | None, device: str, fmt: str) -> Runner:
    """FusedAdam with states in `fmt`: "bf16" (stochastic rounding) or "int8" (block-wise)."""
    backend_ready(backend, device)
    data = data()
    params = data.parameters()
    opt = FusedAdam(params, **HYPER, backend=backend, state_format=fmt)

    def check():
        opt.step()
        lowbit_check(data, fmt, params, optimizer_states(opt, params))

    return Runner(step=opt.step, check=check, cuda=device == "cuda")


def provide_torch(data: OptimData, device: str) -> Runner:
    params = data.parameters()
    opt = torch.optim.AdamW(params, **HYPER, fused=True)
    check = first_step_check(opt, params, data)
    if data.params[0].dtype != torch.float32:
        check = None  # its states are bf16: not the reference's fp32 states
    return Runner(step=opt.step, check=check, cuda=device == "cuda")


PEER = ("torch_fused", provide_torch)


def cases(sizes=None, dtypes=None, quick=False, device="cpu") -> list[Case]:
    out = []
    for name in dtypes or (["fp32"] if device == "cpu" else ["fp32", "bf16"]):
        if name in LOWBIT:  # low-bit optimizer states, fp32 params and grads
            fmt, states = LOWBIT[name]
            for case_name, tensor_sizes in layouts(f"fp32-{name}", sizes, quick, device)[:-1]:
                data = functools.cache(
                    functools.partial(OptimData, tensor_sizes, reference.adam_step, HYPER, device=device)
                )
                what = f"FusedAdam step, fp32 params, {states}, {device}"
                ours = functools.partial(provide_fastzero_lowbit, fmt=fmt)
                step_bytes = state_bytes(fmt, sum(tensor_sizes))  # int8: the block scales too
                case = optim_case(FAMILY.name, case_name, tensor_sizes, 0, data, ours, PEER, what, device, step_bytes)
                out.append(case)
        if name not in DTYPES:
            continue
        dtype = DTYPES[name]
        for case_name, tensor_sizes in layouts(name, sizes, quick, device):
            data = functools.cache(
                functools.partial(
                    OptimData,
                    tensor_sizes,
                    reference.adam_step,
                    HYPER,
                    param_dtype=dtype,
                    grad_dtype=dtype,
                    device=device,
                )
            )
            what = f"FusedAdam step, {name} params, {len(tensor_sizes)} tensor(s), {device}"
            per_param = BYTES_PER_PARAM[dtype]
            out.append(
                optim_case(FAMILY.name, case_name, tensor_sizes, per_param, data, provide_fastzero, PEER, what, device)
            )
    return out


FAMILY = Family(
    name="fused_adam",
    description="FusedAdam (CUDA, Triton, CPU SIMD) vs torch.optim.AdamW(fused=True)",
    cases=cases,
    peers=("torch_fused",),
    roofline=roofline,
    devices=("cpu", "cuda"),
    summary=bandwidth_summary,
)
