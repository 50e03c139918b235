"""FusedAdam. On the CPU: FusedAdam (its SIMD path) against
torch.optim.AdamW(fused=True). With --device cuda: fastzero's CUDA and
Triton kernels against torch.optim.AdamW(fused=True) on the GPU, fp32 and
bf16 params (fp32 states), beside the GPU's copy bandwidth.

Bytes per param: fp32 28 (read p, g, m, v; write p, m, v); bf16 params and
grads with fp32 states 22 (2+2+4+4 read, 2+4+4 written). torch's fused AdamW
keeps a bf16 param's states in bf16 (14 B): speedups compare whole steps,
GB/s counts the bytes fastzero's step must move. ``--dtype bf16states`` (CPU):
fp32 params and grads with bf16 states written by stochastic rounding, 20 B
(4+4+2+2 read, 4+2+2 written), its first step checked to the bit.
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
from .optim_common import OptimData, first_step_check, layouts, optim_case

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BYTES_PER_PARAM = {torch.float32: 28, torch.bfloat16: 22}


def provide_fastzero(data: Callable[[], OptimData], backend: str | None, device: str) -> Runner:
    backend_ready(backend, device)
    data = data()
    params = data.parameters(grad_dtype=data.grads[0].dtype)
    opt = FusedAdam(params, **HYPER, backend=backend)
    return Runner(step=opt.step, check=first_step_check(opt, params, data), cuda=device == "cuda")


def provide_fastzero_sr(data: Callable[[], OptimData], backend: str | None, device: str) -> Runner:
    """FusedAdam with bf16 states written by stochastic rounding."""
    from .cpu_adam import sr_check

    backend_ready(backend, device)
    data = data()
    params = data.parameters()
    opt = FusedAdam(params, **HYPER, backend=backend, state_format="bf16")

    def check():
        opt.step()
        sr_check(data, params, *[[opt.state[p][k] for p in params] for k in ("exp_avg", "exp_avg_sq")])

    return Runner(step=opt.step, check=check, cuda=device == "cuda")


def provide_torch(data: OptimData, device: str) -> Runner:
    params = data.parameters()
    opt = torch.optim.AdamW(params, **HYPER, fused=True)
    check = first_step_check(opt, params, data)
    if data.params[0].dtype != torch.float32:
        check = None  # its states are bf16: not the reference's fp32 states
    return Runner(step=opt.step, check=check, cuda=device == "cuda")


def cases(sizes=None, dtypes=None, quick=False, device="cpu") -> list[Case]:
    out = []
    for name in dtypes or (["fp32"] if device == "cpu" else ["fp32", "bf16"]):
        if name == "bf16states" and device == "cpu":
            for case_name, tensor_sizes in layouts("fp32-bf16states", sizes, quick, device)[:-1]:
                data = functools.cache(functools.partial(OptimData, tensor_sizes, reference.adam_step, HYPER))
                what = f"FusedAdam step, fp32 params, bf16 states (stochastic rounding), {device}"
                peer = ("torch_fused", provide_torch)
                out.append(
                    optim_case(FAMILY.name, case_name, tensor_sizes, 20, data, provide_fastzero_sr, peer, what, device)
                )
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
            peer = ("torch_fused", provide_torch)
            per_param = BYTES_PER_PARAM[dtype]
            out.append(
                optim_case(FAMILY.name, case_name, tensor_sizes, per_param, data, provide_fastzero, peer, what, device)
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
