"""FusedLamb against a plain-PyTorch LAMB (the reference), on the CPU (the
SIMD path) or with --device cuda (the CUDA and Triton kernels).

Bytes per param, fp32, with global-norm clipping on: 44 = the grads' norm
pass (read g: 4) + pass 1 (read p, g, m, v; write m, v: 24) + pass 2 (read
p, m, v; write p: 16). The roofline is the bandwidth probe of the device.
"""

from __future__ import annotations

import functools

import torch

from fastzero.ops import FusedLamb, reference

from ..harness import Case, Provider, Runner
from ..harness import format_size as _fmt
from .fused_adam import gpu_backend_ready
from .optim_common import OptimData, cuda_copy_roofline, first_step_check, split_sizes, stream_roofline

NAME = "fused_lamb"
DESCRIPTION = "FusedLamb (CUDA, Triton, CPU SIMD) vs a plain-PyTorch LAMB"
DEVICES = ("cpu", "cuda")
M = 1 << 20
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0)
SIZES = {"cpu": [16 * M], "cuda": [1 * M, 64 * M, 512 * M]}
QUICK_SIZES = {"cpu": [16 * M], "cuda": [1 * M, 64 * M]}
MANY = {"cpu": 400, "cuda": 300}
MANY_TOTAL = {"cpu": 16 * M, "cuda": 256 * M}
BYTES_PER_PARAM = 44


def provide_fastzero(data: OptimData, backend: str | None, device: str) -> Runner:
    if device == "cuda":
        gpu_backend_ready(backend)
    params = data.parameters()
    opt = FusedLamb(params, **HYPER, backend=backend)
    return Runner(step=opt.step, check=first_step_check(opt, params, data), cuda=device == "cuda")


def provide_torch_lamb(data: OptimData, device: str) -> Runner:
    """LAMB in plain PyTorch ops (fastzero.ops.reference.lamb_step)."""
    params = [p.clone() for p in data.params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    hyper = dict(HYPER)
    beta1, beta2 = hyper.pop("betas")
    return Runner(
        step=lambda: reference.lamb_step(params, data.grads, m, v, step=1, beta1=beta1, beta2=beta2, **hyper),
        cuda=device == "cuda",
    )


def cases(sizes=None, dtypes=None, quick=False, device="cpu") -> list[Case]:
    many_total = max(sizes) if sizes else MANY_TOTAL[device]
    sizes = sizes or (QUICK_SIZES if quick else SIZES)[device]
    if dtypes and "fp32" not in dtypes:
        return []
    ours = [("fastzero", None)] if device == "cpu" else [("fastzero_cuda", "cuda"), ("fastzero_triton", "triton")]
    layouts = [(f"fp32-{_fmt(n)}", [n]) for n in sizes]
    layouts.append((f"fp32-{_fmt(many_total)}-x{MANY[device]}", split_sizes(many_total, MANY[device])))
    out = []
    for case_name, tensor_sizes in layouts:
        data = functools.cache(functools.partial(OptimData, tensor_sizes, reference.lamb_step, HYPER, device=device))
        n = sum(tensor_sizes)
        providers = [Provider(p, "ours", lambda data=data, b=b: provide_fastzero(data(), b, device)) for p, b in ours]
        providers.append(Provider("torch_lamb", "peer", lambda data=data: provide_torch_lamb(data(), device)))
        if device == "cpu":
            providers.append(Provider("roofline", "roofline", lambda s=tensor_sizes: stream_roofline(s), bytes=28 * n))
        else:
            providers.append(Provider("roofline", "roofline", lambda n=n: cuda_copy_roofline(n), bytes=8 * n))
        what = f"FusedLamb step with grad-norm clipping, fp32, {len(tensor_sizes)} tensor(s), {device}"
        out.append(Case(NAME, case_name, n, BYTES_PER_PARAM * n, providers, what))
    return out
