"""FusedAdam. On the CPU: FusedAdam (its SIMD path) against
torch.optim.AdamW(fused=True). With --device cuda: fastzero's CUDA and
Triton kernels against torch.optim.AdamW(fused=True) on the GPU, fp32 and
bf16 params (fp32 states), beside the GPU's copy bandwidth.

Bytes per param: fp32 28 (read p, g, m, v; write p, m, v); bf16 params and
grads with fp32 states 22 (2+2+4+4 read, 2+4+4 written). torch's fused AdamW
keeps a bf16 param's states in bf16 (14 B): speedups compare whole steps,
GB/s counts the bytes fastzero's step must move.
"""

from __future__ import annotations

import functools

import torch

from fastzero.ops import FusedAdam, reference
from fastzero.ops.backend import cuda_status, triton_status

from ..harness import Case, Provider, Runner, Unavailable
from ..harness import format_size as _fmt
from .optim_common import OptimData, cuda_copy_roofline, first_step_check, split_sizes, stream_roofline

NAME = "fused_adam"
DESCRIPTION = "FusedAdam (CUDA, Triton, CPU SIMD) vs torch.optim.AdamW(fused=True)"
DEVICES = ("cpu", "cuda")
M = 1 << 20
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
SIZES = {"cpu": [16 * M], "cuda": [1 * M, 64 * M, 512 * M]}
QUICK_SIZES = {"cpu": [16 * M], "cuda": [1 * M, 64 * M]}
MANY = {"cpu": 400, "cuda": 300}  # tensors in the many-tensor case
MANY_TOTAL = {"cpu": 16 * M, "cuda": 256 * M}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BYTES_PER_PARAM = {torch.float32: 28, torch.bfloat16: 22}


def gpu_backend_ready(backend: str) -> None:
    ok, why = (cuda_status if backend == "cuda" else triton_status)()
    if not ok:
        raise Unavailable(why)


def provide_fastzero(data: OptimData, backend: str | None, device: str) -> Runner:
    if device == "cuda":
        gpu_backend_ready(backend)
    params = data.parameters(grad_dtype=data.grads[0].dtype)
    opt = FusedAdam(params, **HYPER, backend=backend)
    return Runner(step=opt.step, check=first_step_check(opt, params, data), cuda=device == "cuda")


def provide_torch(data: OptimData, device: str) -> Runner:
    params = data.parameters()
    opt = torch.optim.AdamW(params, **HYPER, fused=True)
    check = first_step_check(opt, params, data)
    if data.params[0].dtype != torch.float32:
        check = None  # its states are bf16: not the reference's fp32 states
    return Runner(step=opt.step, check=check, cuda=device == "cuda")


def cases(sizes=None, dtypes=None, quick=False, device="cpu") -> list[Case]:
    many_total = max(sizes) if sizes else MANY_TOTAL[device]
    sizes = sizes or (QUICK_SIZES if quick else SIZES)[device]
    dtypes = dtypes or (["fp32"] if device == "cpu" else ["fp32", "bf16"])
    ours = [("fastzero", None)] if device == "cpu" else [("fastzero_cuda", "cuda"), ("fastzero_triton", "triton")]
    out = []
    for name in dtypes:
        if name not in DTYPES:
            continue
        dtype = DTYPES[name]
        layouts = [(f"{name}-{_fmt(n)}", [n]) for n in sizes]
        layouts.append((f"{name}-{_fmt(many_total)}-x{MANY[device]}", split_sizes(many_total, MANY[device])))
        for case_name, tensor_sizes in layouts:
            data = functools.cache(
                functools.partial(
                    OptimData,
                    tensor_sizes,
                    reference.adam_step,
                    HYPER,
                    param_dtype=dtype,
                    grad_dtype=dtype,
                    device=device,
                )  # fmt: skip
            )
            n = sum(tensor_sizes)
            providers = [
                Provider(prov, "ours", lambda data=data, b=b: provide_fastzero(data(), b, device)) for prov, b in ours
            ]
            providers.append(Provider("torch_fused", "peer", lambda data=data: provide_torch(data(), device)))
            if device == "cpu":
                roof = Provider("roofline", "roofline", lambda s=tensor_sizes: stream_roofline(s), bytes=28 * n)
                providers.append(roof)
            else:
                providers.append(Provider("roofline", "roofline", lambda n=n: cuda_copy_roofline(n), bytes=8 * n))
            out.append(Case(NAME, case_name, n, BYTES_PER_PARAM[dtype] * n, providers,
                            f"FusedAdam step, {name} params, {len(tensor_sizes)} tensor(s), {device}"))  # fmt: skip
    return out
