"""CPU Adam: fastzero's CPUAdam against torch.optim.AdamW (fused and
foreach) and DeepSpeed's DeepSpeedCPUAdam where installed, plus the
mixed-precision offload step against the torch pipeline that does its job.

Bytes per param, fp32 step: read p, g, m, v and write p, m, v = 28 B.
Offload step (fp32 master, bf16 grad in, bf16 param copy out): read 4+2+4+4,
write 4+4+4+2 = 28 B in one pass; the torch pipeline (upcast the grad, fused
AdamW, downcast copy) moves 40 B in three.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from fastzero.ops import CPUAdam, cpu_adam_step, reference

from ..family import Family
from ..harness import Case, Provider, Runner, Unavailable
from ..harness import format_size as _fmt
from ..tables import bandwidth_summary
from .common import cpu_kernels, roofline
from .optim_common import OptimData, first_step_check, split_sizes, step_args

M = 1 << 20
DEFAULT_SIZES = [16 * M, 64 * M]
QUICK_SIZES = [16 * M]  # past the caches: smaller sizes would time L3, not memory
MANY_TENSORS = 400
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)  # AdamW
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def adam_data(sizes, grad_dtype=torch.float32, copy_dtype=None) -> OptimData:
    return OptimData(sizes, reference.adam_step, HYPER, grad_dtype=grad_dtype, copy_dtype=copy_dtype)


def provide_fastzero(data: OptimData) -> Runner:
    cpu_kernels()
    params = data.parameters()
    opt = CPUAdam(params, **HYPER)
    return Runner(step=opt.step, check=first_step_check(opt, params, data))


def provide_torch(data: OptimData, impl: str) -> Runner:
    params = data.parameters()
    opt = torch.optim.AdamW(params, **HYPER, **{impl: True})
    return Runner(step=opt.step, check=first_step_check(opt, params, data))


@functools.cache
def _deepspeed_cpu_adam():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        raise Unavailable(f"deepspeed not importable ({type(exc).__name__}: {exc}); pip install deepspeed") from None
    return DeepSpeedCPUAdam


def provide_deepspeed(data: OptimData) -> Runner:
    cls = _deepspeed_cpu_adam()
    params = data.parameters()
    try:
        opt = cls(params, **HYPER, adamw_mode=True)
    except Exception as exc:  # noqa: BLE001 - its JIT build can fail
        raise Unavailable(f"DeepSpeedCPUAdam failed to build: {exc}") from None
    return Runner(step=opt.step, check=first_step_check(opt, params, data))


def provide_offload_fastzero(data: OptimData) -> Runner:
    cpu_kernels()
    master = [p.clone() for p in data.params]
    m = [torch.zeros_like(p) for p in master]
    v = [torch.zeros_like(p) for p in master]
    copies = [torch.empty_like(p, dtype=data.copy_dtype) for p in master]
    step_no = [0]

    def step():
        step_no[0] += 1
        cpu_adam_step(master, data.grads, m, v, step=step_no[0], param_copies=copies, **step_args(HYPER))

    def check():
        step()
        data.check(master, m, v, copies)

    return Runner(step=step, check=check)


def provide_offload_torch(data: OptimData) -> Runner:
    """The same job in torch: upcast the low-precision grad into the fp32
    master's grad, fused AdamW, copy the master down."""
    params = data.parameters()  # fp32 masters; their grads are overwritten each step
    copies = [torch.empty_like(p, dtype=data.copy_dtype) for p in data.params]
    opt = torch.optim.AdamW(params, **HYPER, fused=True)

    @torch.no_grad()
    def step():
        torch._foreach_copy_([p.grad for p in params], data.grads)
        opt.step()
        torch._foreach_copy_(copies, params)

    def check():
        step()
        data.check(
            params, [opt.state[p]["exp_avg"] for p in params], [opt.state[p]["exp_avg_sq"] for p in params], copies
        )

    return Runner(step=step, check=check)


def cases(
    sizes: list[int] | None = None, dtypes: list[str] | None = None, quick: bool = False, device: str = "cpu"
) -> list[Case]:
    sizes = sizes or (QUICK_SIZES if quick else DEFAULT_SIZES)
    dtypes = dtypes or ["fp32", "bf16"]
    out = []

    def fp32_case(name, tensor_sizes, description):
        data = functools.cache(lambda: adam_data(tensor_sizes))  # shared by the case's providers
        total = sum(tensor_sizes)
        providers = [
            Provider("fastzero", "ours", lambda: provide_fastzero(data())),
            Provider("torch_fused", "peer", lambda: provide_torch(data(), "fused")),
            Provider("torch_foreach", "peer", lambda: provide_torch(data(), "foreach")),
            Provider("deepspeed", "peer", lambda: provide_deepspeed(data())),
            roofline("cpu", tensor_sizes),
        ]
        return Case(FAMILY.name, name, total, 28 * total, providers, description)

    if "fp32" in dtypes:
        for n in sizes:
            out.append(fp32_case(f"fp32-{_fmt(n)}", [n], f"fp32 AdamW step, {_fmt(n)} params in one tensor"))
        n = sizes[0]
        what = f"fp32 AdamW step, {_fmt(n)} params over {MANY_TENSORS} tensors of mixed sizes"
        out.append(fp32_case(f"fp32-{_fmt(n)}-x{MANY_TENSORS}", split_sizes(n, MANY_TENSORS), what))
    for name in dtypes:
        if name not in DTYPES:
            continue
        n = sizes[0]
        data = functools.cache(functools.partial(adam_data, [n], DTYPES[name], DTYPES[name]))
        providers = [
            Provider("fastzero", "ours", lambda data=data: provide_offload_fastzero(data())),
            Provider("torch_pipeline", "peer", lambda data=data: provide_offload_torch(data())),
            roofline("cpu", [n]),
        ]
        what = f"mixed-precision offload step: fp32 master, {name} grad in, {name} param copy out"
        out.append(Case(FAMILY.name, f"offload-{name}-{_fmt(n)}", n, 28 * n, providers, what))
    return out


FAMILY = Family(
    name="cpu_adam",
    description="CPUAdam (SIMD C++) vs torch.optim.AdamW fused/foreach and DeepSpeedCPUAdam",
    cases=cases,
    peers=("torch_fused", "torch_foreach", "deepspeed", "torch_pipeline"),
    roofline=roofline,
    summary=bandwidth_summary,
)
