"""CPU Adam: fastzero's CPUAdam against torch.optim.AdamW (fused and
foreach) and DeepSpeed's DeepSpeedCPUAdam where installed, plus the
mixed-precision offload step against the torch pipeline that does its job.

Bytes per param, fp32 step: read p, g, m, v and write p, m, v = 28 B.
Offload step (fp32 master, bf16 grad in, bf16 param copy out): read 4+2+4+4,
write 4+4+4+2 = 28 B in one pass; the torch pipeline (upcast the grad, fused
AdamW, downcast copy) moves 40 B in three.

bf16 optimizer states (``--dtype bf16states``: state_format="bf16", written
with stochastic rounding), fp32 params and grads: read 4+4+2+2, write 4+2+2 =
20 B; the offload step with bf16 states: read 4+2+2+2, write 4+2+2+2 = 20 B.
Each such case runs fastzero's fp32-state step beside it as the peer
``fastzero_fp32_states`` (the same-round speedup of the format; its GB/s
counts the case's 20 B) and checks its first step against the reference to
the bit.
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


def sr_check(data: OptimData, params, exp_avgs, exp_avg_sqs, copies=None) -> None:
    """The first step from zero bf16 states equals the reference's to the bit
    (state_format="bf16", seed 0)."""
    p = [t.clone() for t in data.params]
    m = [torch.zeros_like(t, dtype=torch.bfloat16) for t in p]
    v = [torch.zeros_like(t, dtype=torch.bfloat16) for t in p]
    c = None if copies is None else [torch.empty_like(t) for t in copies]
    reference.adam_step(p, data.grads, m, v, step=1, param_copies=c, state_format="bf16", **step_args(data.hyper))
    for name, got, want in (
        ("param", params, p),
        ("exp_avg", exp_avgs, m),
        ("exp_avg_sq", exp_avg_sqs, v),
        ("copy", copies, c),
    ):
        for i, (a, b) in enumerate(zip(got or [], want or [])):
            if not torch.equal(a.detach().reshape(-1), b.reshape(-1)):
                raise AssertionError(f"{name} {i}: not the reference's bits (state_format='bf16')")


def provide_fastzero_sr(data: OptimData) -> Runner:
    """CPUAdam with bf16 states written by stochastic rounding."""
    cpu_kernels()
    params = data.parameters()
    opt = CPUAdam(params, **HYPER, state_format="bf16")

    def check():
        opt.step()
        sr_check(data, params, *[[opt.state[p][k] for p in params] for k in ("exp_avg", "exp_avg_sq")])

    return Runner(step=opt.step, check=check)


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


def provide_offload_fastzero(data: OptimData, state_format: str | None = None) -> Runner:
    cpu_kernels()
    master = [p.clone() for p in data.params]
    state_dtype = torch.bfloat16 if state_format == "bf16" else torch.float32
    m = [torch.zeros_like(p, dtype=state_dtype) for p in master]
    v = [torch.zeros_like(p, dtype=state_dtype) for p in master]
    copies = [torch.empty_like(p, dtype=data.copy_dtype) for p in master]
    step_no = [0]
    formats = {} if state_format is None else {"state_format": state_format}

    def step():
        step_no[0] += 1
        cpu_adam_step(master, data.grads, m, v, step=step_no[0], param_copies=copies, **formats, **step_args(HYPER))

    def check():
        step()
        if state_format == "bf16":
            sr_check(data, master, m, v, copies)
        else:
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
    if "bf16states" in dtypes:  # bf16 optimizer states, stochastic rounding: 20 B per param
        for n in sizes:
            data = functools.cache(functools.partial(adam_data, [n]))
            providers = [
                Provider("fastzero", "ours", lambda data=data: provide_fastzero_sr(data())),
                Provider("fastzero_fp32_states", "peer", lambda data=data: provide_fastzero(data())),
                Provider("torch_fused", "peer", lambda data=data: provide_torch(data(), "fused")),
                roofline("cpu", [n]),
            ]
            what = f"fp32 AdamW step with bf16 states (stochastic rounding), {_fmt(n)} params in one tensor"
            out.append(Case(FAMILY.name, f"bf16states-{_fmt(n)}", n, 20 * n, providers, what))
        n = sizes[0]
        data = functools.cache(functools.partial(adam_data, [n], torch.bfloat16, torch.bfloat16))
        providers = [
            Provider("fastzero", "ours", lambda: provide_offload_fastzero(data(), "bf16")),
            Provider("fastzero_fp32_states", "peer", lambda: provide_offload_fastzero(data())),
            roofline("cpu", [n]),
        ]
        what = "mixed-precision offload step with bf16 states: fp32 master, bf16 grad in, bf16 copy out"
        out.append(Case(FAMILY.name, f"offload-bf16-bf16states-{_fmt(n)}", n, 20 * n, providers, what))
    return out


FAMILY = Family(
    name="cpu_adam",
    description="CPUAdam (SIMD C++) vs torch.optim.AdamW fused/foreach and DeepSpeedCPUAdam",
    cases=cases,
    peers=("torch_fused", "torch_foreach", "deepspeed", "torch_pipeline", "fastzero_fp32_states"),
    roofline=roofline,
    summary=bandwidth_summary,
)
