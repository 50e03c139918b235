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

from bench.harness import Case, Provider, Runner, Unavailable
from bench.harness import format_size as _fmt
from fastzero.ops import CPUAdam, cpu_adam_step, native, reference
from fastzero.ops.reference.tolerances import assert_close

NAME = "cpu_adam"
DESCRIPTION = "CPUAdam (SIMD C++) vs torch.optim.AdamW fused/foreach and DeepSpeedCPUAdam"
M = 1 << 20
DEFAULT_SIZES = [16 * M, 64 * M]
QUICK_SIZES = [16 * M]  # past the caches: smaller sizes would time L3, not memory
MANY_TENSORS = 400
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)  # AdamW
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def split_sizes(total: int, count: int) -> list[int]:
    """`count` tensor sizes of mixed magnitude (1x to 20x) that sum to `total`."""
    weights = [1 + (i * 7919) % 20 for i in range(count)]
    sizes = [total * w // sum(weights) for w in weights]
    sizes[-1] += total - sum(sizes)
    return sizes


class Data:
    """Fresh random inputs for one case and the reference's result of one
    step from zero optimizer state; every provider starts from clones."""

    def __init__(self, sizes: list[int], grad_dtype=torch.float32, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        # uniform_ is several times faster than randn at 64M elements, and as fresh
        self.params = [torch.empty(n).uniform_(-1, 1, generator=gen) for n in sizes]
        self.grads = [torch.empty(n).uniform_(-1, 1, generator=gen).to(grad_dtype) for n in sizes]
        self.grad_dtype = grad_dtype

    @functools.cached_property
    def expected(self):
        p = [t.clone() for t in self.params]
        m = [torch.zeros_like(t) for t in p]
        v = [torch.zeros_like(t) for t in p]
        c = None if self.grad_dtype == torch.float32 else [torch.empty_like(t, dtype=self.grad_dtype) for t in p]
        beta1, beta2 = HYPER["betas"]
        reference.adam_step(
            p, self.grads, m, v, step=1, lr=HYPER["lr"], beta1=beta1, beta2=beta2, eps=HYPER["eps"],
            weight_decay=HYPER["weight_decay"], param_copies=c,
        )  # fmt: skip
        return p, m, v, c

    def check(self, params, exp_avgs=None, exp_avg_sqs=None, copies=None):
        p, m, v, c = self.expected
        for name, got, want in (
            ("param", params, p),
            ("exp_avg", exp_avgs, m),
            ("exp_avg_sq", exp_avg_sqs, v),
            ("copy", copies, c),
        ):
            for i, (a, b) in enumerate(zip(got or [], want or [])):
                assert_close(a.detach().reshape(-1), b, msg=f"{name} {i}")

    def parameters(self):
        out = []
        for p, g in zip(self.params, self.grads):
            q = torch.nn.Parameter(p.clone())
            q.grad = g.float().clone()
            out.append(q)
        return out


def _first_step_check(opt, params, data: Data, state_keys=("exp_avg", "exp_avg_sq")):
    def check():
        opt.step()
        states = [[opt.state[p][k] for p in params] for k in state_keys] if state_keys else [None, None]
        data.check(params, *states)

    return check


def provide_fastzero(data: Data) -> Runner:
    if native.cpu_ops() is None:
        raise Unavailable(f"native kernels unavailable: {native.cpu_ops_error()}")
    params = data.parameters()
    opt = CPUAdam(params, **HYPER)
    return Runner(step=opt.step, check=_first_step_check(opt, params, data))


def provide_torch(data: Data, impl: str) -> Runner:
    params = data.parameters()
    opt = torch.optim.AdamW(params, **HYPER, **{impl: True})
    return Runner(step=opt.step, check=_first_step_check(opt, params, data))


@functools.cache
def _deepspeed_cpu_adam():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        raise Unavailable(f"deepspeed not importable ({type(exc).__name__}: {exc}); pip install deepspeed") from None
    return DeepSpeedCPUAdam


def provide_deepspeed(data: Data) -> Runner:
    cls = _deepspeed_cpu_adam()
    params = data.parameters()
    try:
        opt = cls(params, lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                  weight_decay=HYPER["weight_decay"], adamw_mode=True)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - its JIT build can fail
        raise Unavailable(f"DeepSpeedCPUAdam failed to build: {exc}") from None
    return Runner(step=opt.step, check=_first_step_check(opt, params, data))


def provide_roofline(sizes: list[int]) -> Runner:
    """The bandwidth probe over tensors of the case's sizes: the same bytes
    per element as Adam (read 4 arrays, write 3) and the same memory layout."""
    ops = native.cpu_ops()
    if ops is None:
        raise Unavailable(f"native kernels unavailable: {native.cpu_ops_error()}")
    isa = native.ISA_NAMES.index(native.cpu_isa())
    arrays = [[torch.empty(n).uniform_(-1, 1) for n in sizes] for _ in range(4)]
    ptrs = [[t.data_ptr() for t in ts] for ts in arrays]

    def step():
        ops.stream_update(isa, *ptrs, sizes, 1e-7, torch.get_num_threads())

    def check():
        a, b, c, d = arrays
        want = [[t + 1e-7 * bt for t, bt in zip(ts, b)] for ts in (a, c, d)]
        step()
        for got, exp in zip((a, c, d), want):
            for g, e in zip(got, exp):
                assert_close(g, e)

    return Runner(step=step, check=check)


def provide_offload_fastzero(data: Data) -> Runner:
    if native.cpu_ops() is None:
        raise Unavailable(f"native kernels unavailable: {native.cpu_ops_error()}")
    master = [p.clone() for p in data.params]
    m = [torch.zeros_like(p) for p in master]
    v = [torch.zeros_like(p) for p in master]
    copies = [torch.empty_like(p, dtype=data.grad_dtype) for p in master]
    beta1, beta2 = HYPER["betas"]
    step_no = [0]

    def step():
        step_no[0] += 1
        cpu_adam_step(
            master, data.grads, m, v, step=step_no[0], lr=HYPER["lr"], beta1=beta1, beta2=beta2,
            eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], param_copies=copies,
        )  # fmt: skip

    def check():
        step()
        data.check(master, m, v, copies)

    return Runner(step=step, check=check)


def provide_offload_torch(data: Data) -> Runner:
    """The same job in torch: upcast the low-precision grad into the fp32
    master's grad, fused AdamW, copy the master down."""
    params = [torch.nn.Parameter(p.clone()) for p in data.params]
    for p in params:
        p.grad = torch.empty_like(p)
    copies = [torch.empty_like(p, dtype=data.grad_dtype) for p in data.params]
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


def _lazy(factory, *args):
    """Providers build their data on first use, so a skipped case costs nothing."""
    return lambda: factory(*args)


def cases(sizes: list[int] | None = None, dtypes: list[str] | None = None, quick: bool = False) -> list[Case]:
    sizes = sizes or (QUICK_SIZES if quick else DEFAULT_SIZES)
    dtypes = dtypes or ["fp32", "bf16"]
    out = []

    def fp32_case(name, tensor_sizes, description):
        data = functools.cache(lambda: Data(tensor_sizes))  # shared by the case's providers
        total = sum(tensor_sizes)
        return Case(
            NAME, name, total, 28 * total,
            [
                Provider("fastzero", "ours", lambda: provide_fastzero(data())),
                Provider("torch_fused", "peer", lambda: provide_torch(data(), "fused")),
                Provider("torch_foreach", "peer", lambda: provide_torch(data(), "foreach")),
                Provider("deepspeed", "peer", lambda: provide_deepspeed(data())),
                Provider("roofline", "roofline", _lazy(provide_roofline, tensor_sizes)),
            ],
            description,
        )  # fmt: skip

    if "fp32" in dtypes:
        for n in sizes:
            out.append(fp32_case(f"fp32-{_fmt(n)}", [n], f"fp32 AdamW step, {_fmt(n)} params in one tensor"))
        n = sizes[0]
        out.append(fp32_case(f"fp32-{_fmt(n)}-x{MANY_TENSORS}", split_sizes(n, MANY_TENSORS),
                             f"fp32 AdamW step, {_fmt(n)} params over {MANY_TENSORS} tensors of mixed sizes"))  # noqa: E501  # fmt: skip
    for name in dtypes:
        if name not in DTYPES:
            continue
        n = sizes[0]
        data = functools.cache(functools.partial(Data, [n], DTYPES[name]))
        out.append(Case(
            NAME, f"offload-{name}-{_fmt(n)}", n, 28 * n,
            [
                Provider("fastzero", "ours", lambda data=data: provide_offload_fastzero(data())),
                Provider("torch_pipeline", "peer", lambda data=data: provide_offload_torch(data())),
                Provider("roofline", "roofline", _lazy(provide_roofline, [n])),
            ],
            f"mixed-precision offload step: fp32 master, {name} grad in, {name} param copy out",
        ))  # fmt: skip
    return out
