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
int8 block-wise states (``--dtype int8states``: state_format="int8", blocks
of 256): one byte per state and element, 16 B per param (read 4+4+1+1,
write 4+1+1; the offload step 4+2+1+1 and 4+1+1+2), plus the two states'
fp32 block scales, read and written: 16 B per block, 1/16 B per param.

Each low-bit case runs fastzero's fp32-state step beside it as the peer
``fastzero_fp32_states`` (the same-round speedup of the format; every
provider's GB/s counts the case's bytes) and checks its first step against
the reference to the bit. Peers with low-bit states run where they import
(``pip install torchao bitsandbytes``; skipped with the reason elsewhere):
torchao's ``AdamW8bit`` and bitsandbytes' ``AdamW8bit`` on the int8 step,
torchao's AdamW with bf16 stochastic rounding (bf16 params, bf16 states, no
fp32 master: 14 B) on the bf16-state offload step. Their codes differ from
fastzero's, so their check is loose (``lowbit_peer_check``). The offload
cases also run DeepSpeedCPUAdam, which has fp32 states only and takes grads
of its params' dtype: ``deepspeed`` does the case's job its way (upcast the
grad into the fp32 grad, its step, downcast the copy: 40 B in three passes,
as ZeRO-Offload feeds it), ``deepspeed_step`` is its step alone on fp32
grads with no copy out (28 B, less than the job).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from fastzero.ops import CPUAdam, cpu_adam_step, reference
from fastzero.ops.adam import int8_codes

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


def state_bytes(fmt: str, n: int) -> int:
    """Bytes one step over n fp32 params must move with states in `fmt` (the
    offload step's bf16 grad in and bf16 copy out move as many as its fp32 grad in)."""
    if fmt == "int8":  # 16 B, and the two states' fp32 scales read and written: 16 B per block
        return 16 * n + 16 * int8_codes.blocks_of(n, int8_codes.DEFAULT_BLOCK)
    return {"fp32": 28, "bf16": 20}[fmt] * n


def zero_states(fmt: str, params) -> dict[str, list]:
    """Zero exp_avg, exp_avg_sq (and int8's block scales) of `params` in format `fmt`, as keyword
    lists of cpu_adam_step."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}[fmt]
    out = {k: [torch.zeros_like(p, dtype=dtype) for p in params] for k in ("exp_avgs", "exp_avg_sqs")}
    if fmt == "int8":
        blocks = [int8_codes.blocks_of(p.numel(), int8_codes.DEFAULT_BLOCK) for p in params]
        for key in ("exp_avg_absmax", "exp_avg_sq_absmax"):
            out[key] = [torch.zeros(b, device=p.device) for b, p in zip(blocks, params)]
    return out


def lowbit_check(data: OptimData, fmt: str, params, states: dict[str, list], copies=None) -> None:
    """The first step from zero states in format `fmt` ("bf16": stochastic rounding, seed 0; "int8":
    codes and scales) equals the reference's to the bit; `states` as zero_states() names them."""
    p = [t.clone() for t in data.params]
    want = zero_states(fmt, p)
    c = None if copies is None else [torch.empty_like(t) for t in copies]
    m, v = want.pop("exp_avgs"), want.pop("exp_avg_sqs")
    reference.adam_step(p, data.grads, m, v, step=1, param_copies=c, state_format=fmt, **want, **step_args(data.hyper))
    pairs = [("param", params, p), ("copy", copies, c), ("exp_avg", states["exp_avgs"], m)]
    pairs += [("exp_avg_sq", states["exp_avg_sqs"], v)] + [(k, states[k], want[k]) for k in want]
    for name, got, exp in pairs:
        for i, (a, b) in enumerate(zip(got or [], exp or [])):
            if not torch.equal(a.detach().reshape(-1), b.reshape(-1)):
                raise AssertionError(f"{name} {i}: not the reference's bits (state_format={fmt!r})")


# zero_states()'s names (cpu_adam_step's keywords) -> an optimizer's state keys
STATE_KEYS = {
    "exp_avgs": "exp_avg",
    "exp_avg_sqs": "exp_avg_sq",
    "exp_avg_absmax": "exp_avg_absmax",
    "exp_avg_sq_absmax": "exp_avg_sq_absmax",
}


def optimizer_states(opt, params) -> dict[str, list]:
    """An optimizer's per-param states as zero_states() names them."""
    return {ours: [opt.state[p][k] for p in params] for ours, k in STATE_KEYS.items() if k in opt.state[params[0]]}


def provide_fastzero_lowbit(data: OptimData, fmt: str) -> Runner:
    """CPUAdam with states in `fmt`: "bf16" (stochastic rounding) or "int8" (block-wise)."""
    cpu_kernels()
    params = data.parameters()
    opt = CPUAdam(params, **HYPER, state_format=fmt)

    def check():
        opt.step()
        lowbit_check(data, fmt, params, optimizer_states(opt, params))

    return Runner(step=opt.step, check=check)


def lowbit_peer_check(step, data: OptimData, params, *, within: float = 0.25, share: float = 0.999):
    """A peer whose states are not fastzero's codes (its own 8-bit map, bf16 rounded to nearest)
    cannot match the reference to the bit, so its first step is checked to do the same job: from
    zero states each param moves by about lr (m/sqrt(v) = g/|g|), and at least `share` of the
    params must land within `within` * lr of the reference's step from the same start; bf16 params
    (written by stochastic rounding) within one bf16 ulp more. How many do not is in the message."""
    start = [p.detach().float() for p in params]  # the peer's own start: its params may be bf16
    grads = [p.grad.float() for p in params]
    want = [t.clone() for t in start]
    states = [[torch.zeros_like(t) for t in start] for _ in range(2)]
    reference.adam_step(want, grads, *states, step=1, **step_args(data.hyper))
    step()
    for i, (a, b) in enumerate(zip(params, want)):
        ulp = b.abs() * 2.0**-7 if a.dtype == torch.bfloat16 else 0.0
        a = a.detach().float()
        off = (a - b).abs() > within * data.hyper["lr"] + ulp
        if off.float().mean() > 1 - share or not torch.isfinite(a).all():
            raise AssertionError(f"tensor {i}: {int(off.sum())} of {a.numel()} params off the reference's step")


@functools.cache
def _torchao_optim():
    try:
        import torchao.optim
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        raise Unavailable(f"torchao not importable ({type(exc).__name__}: {exc}); pip install torchao") from None
    return torchao.optim


@functools.cache
def _bnb_optim():
    try:
        import bitsandbytes.optim
    except Exception as exc:  # noqa: BLE001
        raise Unavailable(f"bitsandbytes not importable ({type(exc).__name__}: {exc})") from None
    return bitsandbytes.optim


def _made(make):
    """An optimizer from `make()`, or Unavailable with the peer's error (a CPU path it lacks)."""
    try:
        return make()
    except Exception as exc:  # noqa: BLE001
        raise Unavailable(f"{type(exc).__name__}: {exc}") from None


def _holds_8bit_codes(state: dict) -> bool:
    """Whether a peer's state has 8-bit codes (bitsandbytes: uint8 tensors; torchao: a tensor subclass
    that keeps them in ``.codes``)."""
    return any(getattr(t, "codes", t).dtype == torch.uint8 for t in state.values() if torch.is_tensor(t))


def provide_8bit_peer(data: OptimData, which: str) -> Runner:
    """torchao's or bitsandbytes' AdamW8bit (blocks of 256, as fastzero's default) on fp32 params."""
    params = data.parameters()
    if which == "torchao":  # torch.compile'd: its first step (the check) compiles, ~20 s here
        optim = _torchao_optim()
        opt = _made(lambda: optim.AdamW8bit(params, **HYPER, block_size=256))
    else:  # bitsandbytes: blockwise, 256 per block on the CPU
        optim = _bnb_optim()
        opt = _made(lambda: optim.AdamW8bit(params, **HYPER))

    def check():
        lowbit_peer_check(opt.step, data, params)
        if not _holds_8bit_codes(opt.state[params[0]]):
            raise AssertionError("its states are not 8-bit here")

    return Runner(step=opt.step, check=check)


def provide_torchao_bf16(data: OptimData) -> Runner:
    """torchao's AdamW with bf16 stochastic rounding: bf16 params (no fp32 master), the bf16 grad,
    bf16 states rounded to nearest; the updated param is the bf16 copy the offload step writes."""
    params = [torch.nn.Parameter(p.to(torch.bfloat16)) for p in data.params]
    for p, g in zip(params, data.grads):
        p.grad = g.to(torch.bfloat16)
    optim = _torchao_optim()
    opt = _made(lambda: optim._AdamW(params, **HYPER, bf16_stochastic_round=True))
    return Runner(step=opt.step, check=lambda: lowbit_peer_check(opt.step, data, params))


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


def provide_offload_deepspeed(data: OptimData, job: bool = True) -> Runner:
    """DeepSpeedCPUAdam on the offload case. `job`: the case's job its way (the low-precision grad
    upcast into the fp32 grad, its step, the copy cast down); else its step alone on fp32 grads."""
    cls = _deepspeed_cpu_adam()
    params = data.parameters(grad_dtype=torch.float32)
    copies = [torch.empty_like(p, dtype=data.copy_dtype) for p in data.params] if job else None
    try:
        opt = cls(params, **HYPER, adamw_mode=True)
    except Exception as exc:  # noqa: BLE001 - its JIT build can fail
        raise Unavailable(f"DeepSpeedCPUAdam failed to build: {exc}") from None

    @torch.no_grad()
    def step():
        if job:
            torch._foreach_copy_([p.grad for p in params], data.grads)
        opt.step()
        if job:
            torch._foreach_copy_(copies, params)

    def check():
        step()
        states = [[opt.state[p][k] for p in params] for k in ("exp_avg", "exp_avg_sq")]
        data.check(params, *states, copies)

    return Runner(step=step, check=check)


def provide_offload_fastzero(data: OptimData, state_format: str | None = None) -> Runner:
    cpu_kernels()
    master = [p.clone() for p in data.params]
    states = zero_states(state_format or "fp32", master)
    copies = [torch.empty_like(p, dtype=data.copy_dtype) for p in master]
    step_no = [0]
    formats = {} if state_format is None else {"state_format": state_format}

    def step():
        step_no[0] += 1
        cpu_adam_step(master, data.grads, step=step_no[0], param_copies=copies, **states, **formats, **step_args(HYPER))

    def check():
        step()
        if state_format in ("bf16", "int8"):
            lowbit_check(data, state_format, master, states, copies)
        else:
            data.check(master, states["exp_avgs"], states["exp_avg_sqs"], copies)

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
            *deepspeed_offload_peers(data),
            roofline("cpu", [n]),
        ]
        what = f"mixed-precision offload step: fp32 master, {name} grad in, {name} param copy out"
        out.append(Case(FAMILY.name, f"offload-{name}-{_fmt(n)}", n, 28 * n, providers, what))
    for fmt in ("bf16", "int8"):  # low-bit optimizer states: --dtype bf16states, int8states
        if f"{fmt}states" in dtypes:
            out += lowbit_cases(fmt, sizes)
    return out


def deepspeed_offload_peers(data) -> list[Provider]:
    return [
        Provider("deepspeed", "peer", lambda: provide_offload_deepspeed(data())),
        Provider("deepspeed_step", "peer", lambda: provide_offload_deepspeed(data(), job=False)),
    ]


def lowbit_cases(fmt: str, sizes: list[int]) -> list[Case]:
    """The plain step and the offload step (bf16 grad in, bf16 copy out) with states in `fmt`, each
    beside fastzero's fp32-state step and the peers that do the same job."""
    out = []
    what = {"bf16": "bf16 states (stochastic rounding)", "int8": "int8 block-wise states (blocks of 256)"}[fmt]
    for n in sizes:
        data = functools.cache(functools.partial(adam_data, [n]))
        providers = [
            Provider("fastzero", "ours", lambda data=data: provide_fastzero_lowbit(data(), fmt)),
            Provider("fastzero_fp32_states", "peer", lambda data=data: provide_fastzero(data())),
            Provider("torch_fused", "peer", lambda data=data: provide_torch(data(), "fused")),
        ]
        if fmt == "int8":
            providers += [
                Provider("torchao_adamw8bit", "peer", lambda data=data: provide_8bit_peer(data(), "torchao")),
                Provider("bnb_adamw8bit", "peer", lambda data=data: provide_8bit_peer(data(), "bitsandbytes")),
            ]
        providers.append(roofline("cpu", [n]))
        desc = f"fp32 AdamW step with {what}, {_fmt(n)} params in one tensor"
        out.append(Case(FAMILY.name, f"{fmt}states-{_fmt(n)}", n, state_bytes(fmt, n), providers, desc))
    n = sizes[0]
    data = functools.cache(functools.partial(adam_data, [n], torch.bfloat16, torch.bfloat16))
    providers = [
        Provider("fastzero", "ours", lambda: provide_offload_fastzero(data(), fmt)),
        Provider("fastzero_fp32_states", "peer", lambda: provide_offload_fastzero(data())),
        *deepspeed_offload_peers(data),
    ]
    if fmt == "bf16":
        providers.append(Provider("torchao_adamw_bf16sr", "peer", lambda: provide_torchao_bf16(data())))
    providers.append(roofline("cpu", [n]))
    desc = f"mixed-precision offload step with {what}: fp32 master, bf16 grad in, bf16 copy out"
    out.append(Case(FAMILY.name, f"offload-bf16-{fmt}states-{_fmt(n)}", n, state_bytes(fmt, n), providers, desc))
    return out


FAMILY = Family(
    name="cpu_adam",
    description="CPUAdam (SIMD C++) vs torch.optim.AdamW fused/foreach and DeepSpeedCPUAdam",
    cases=cases,
    peers=(
        "torch_fused",
        "torch_foreach",
        "deepspeed",
        "deepspeed_step",
        "torch_pipeline",
        "fastzero_fp32_states",
        "torchao_adamw8bit",
        "bnb_adamw8bit",
        "torchao_adamw_bf16sr",
    ),
    roofline=roofline,
    summary=bandwidth_summary,
)
