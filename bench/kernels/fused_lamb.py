"""FusedLamb against a plain-PyTorch LAMB (the reference), on the CPU (the
SIMD path) or with --device cuda (the CUDA and Triton kernels).

Bytes per param, fp32, with global-norm clipping on: 44 = the grads' norm
pass (read g: 4) + pass 1 (read p, g, m, v; write m, v: 24) + pass 2 (read
p, m, v; write p: 16). The roofline is the bandwidth probe of the device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from fastzero.ops import FusedLamb, reference

from ..family import Family
from ..harness import Case, Runner
from ..tables import bandwidth_summary
from .common import backend_ready, roofline
from .optim_common import OptimData, first_step_check, layouts, optim_case, step_args

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0)
BYTES_PER_PARAM = 44


def provide_fastzero(data: Callable[[], OptimData], backend: str | None, device: str) -> Runner:
    backend_ready(backend, device)
    data = data()
    params = data.parameters()
    opt = FusedLamb(params, **HYPER, backend=backend)
    return Runner(step=opt.step, check=first_step_check(opt, params, data), cuda=device == "cuda")


def provide_torch_lamb(data: OptimData, device: str) -> Runner:
    """LAMB in plain PyTorch ops (fastzero.ops.reference.lamb_step)."""
    params = [p.clone() for p in data.params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    hyper = step_args(HYPER)
    return Runner(step=lambda: reference.lamb_step(params, data.grads, m, v, step=1, **hyper), cuda=device == "cuda")


def cases(sizes=None, dtypes=None, quick=False, device="cpu") -> list[Case]:
    if dtypes and "fp32" not in dtypes:
        return []
    out = []
    for case_name, tensor_sizes in layouts("fp32", sizes, quick, device):
        data = functools.cache(functools.partial(OptimData, tensor_sizes, reference.lamb_step, HYPER, device=device))
        what = f"FusedLamb step with grad-norm clipping, fp32, {len(tensor_sizes)} tensor(s), {device}"
        peer = ("torch_lamb", provide_torch_lamb)
        out.append(
            optim_case(
                FAMILY.name, case_name, tensor_sizes, BYTES_PER_PARAM, data, provide_fastzero, peer, what, device
            )
        )
    return out


FAMILY = Family(
    name="fused_lamb",
    description="FusedLamb (CUDA, Triton, CPU SIMD) vs a plain-PyTorch LAMB",
    cases=cases,
    peers=("torch_lamb",),
    roofline=roofline,
    devices=("cpu", "cuda"),
    summary=bandwidth_summary,
)
