"""Pieces the optimizer benchmarks share: fresh inputs with the reference's
result of one step, checks against it, and the sizes of the GPU-capable
optimizers' cases."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from fastzero.ops.tolerances import assert_close

from ..harness import Case, Provider, format_size
from .common import our_backends, roofline


def split_sizes(total: int, count: int) -> list[int]:
    """`count` tensor sizes of mixed magnitude (1x to 20x) that sum to `total`."""
    weights = [1 + (i * 7919) % 20 for i in range(count)]
    sizes = [total * w // sum(weights) for w in weights]
    sizes[-1] += total - sum(sizes)
    return sizes


def step_args(hyper: dict) -> dict:
    """Optimizer hyperparameters (torch's ``betas``) as the step functions take them (``beta1``, ``beta2``)."""
    out = dict(hyper)
    out["beta1"], out["beta2"] = out.pop("betas")
    return out


class OptimData:
    """Fresh random inputs for one case, and the reference's result of one
    step from zero optimizer state (fp32 states); every provider starts from
    clones. `copy_dtype`: the low-precision param copy an offload step writes."""

    def __init__(
        self,
        sizes,
        reference_step: Callable,
        hyper: dict,
        *,
        param_dtype=torch.float32,
        grad_dtype=torch.float32,
        copy_dtype=None,
        device="cpu",
        seed: int = 0,
    ):
        gen = torch.Generator(device=device).manual_seed(seed)
        # uniform_ is several times faster than randn at 64M elements, and as fresh
        self.params = [torch.empty(n, device=device).uniform_(-1, 1, generator=gen).to(param_dtype) for n in sizes]
        self.grads = [torch.empty(n, device=device).uniform_(-1, 1, generator=gen).to(grad_dtype) for n in sizes]
        self.reference_step, self.hyper, self.copy_dtype = reference_step, hyper, copy_dtype

    @functools.cached_property
    def expected(self):
        p = [t.clone() for t in self.params]
        m = [torch.zeros_like(t, dtype=torch.float32) for t in p]
        v = [torch.zeros_like(t, dtype=torch.float32) for t in p]
        c = None if self.copy_dtype is None else [torch.empty_like(t, dtype=self.copy_dtype) for t in p]
        self.reference_step(p, self.grads, m, v, step=1, param_copies=c, **step_args(self.hyper))
        return p, m, v, c

    def check(self, params, exp_avgs=None, exp_avg_sqs=None, copies=None):
        p, m, v, c = self.expected
        pairs = (("param", params, p), ("exp_avg", exp_avgs, m), ("exp_avg_sq", exp_avg_sqs, v), ("copy", copies, c))
        for name, got, want in pairs:
            for i, (a, b) in enumerate(zip(got or [], want or [])):
                assert_close(a.detach().reshape(-1), b, dtype=b.dtype, msg=f"{name} {i}")

    def parameters(self, grad_dtype=None):
        """nn.Parameters with .grad set (grads cast to `grad_dtype`, default
        the param's: torch.optim wants them to match)."""
        out = []
        for p, g in zip(self.params, self.grads):
            q = torch.nn.Parameter(p.clone())
            q.grad = g.to(grad_dtype or p.dtype).clone()
            out.append(q)
        return out


def first_step_check(opt, params, data: OptimData, state_keys=("exp_avg", "exp_avg_sq")):
    """A check that runs the optimizer's first step and compares it with the
    reference's (params and states)."""

    def check():
        opt.step()
        data.check(params, *[[opt.state[p][k] for p in params] for k in state_keys])

    return check


# FusedAdam's and FusedLamb's cases: sizes (params) per device, and the many-tensor case's tensors and total
M = 1 << 20
SIZES = {"cpu": [16 * M], "cuda": [1 * M, 64 * M, 512 * M]}
QUICK_SIZES = {"cpu": [16 * M], "cuda": [1 * M, 64 * M]}
MANY = {"cpu": 400, "cuda": 300}
MANY_TOTAL = {"cpu": 16 * M, "cuda": 256 * M}


def layouts(prefix: str, sizes: list[int] | None, quick: bool, device: str) -> list[tuple[str, list[int]]]:
    """(case name, tensor sizes): one tensor of each size (--sizes, else the device's), then the many-tensor case
    (MANY tensors of mixed sizes over the largest --size, else MANY_TOTAL)."""
    many_total = max(sizes) if sizes else MANY_TOTAL[device]
    out = [(f"{prefix}-{format_size(n)}", [n]) for n in sizes or (QUICK_SIZES if quick else SIZES)[device]]
    out.append((f"{prefix}-{format_size(many_total)}-x{MANY[device]}", split_sizes(many_total, MANY[device])))
    return out


def optim_case(
    kernel: str,
    name: str,
    sizes: list[int],
    bytes_per_param: int,
    data: Callable[[], OptimData],
    ours: Callable,
    peer: tuple[str, Callable],
    description: str,
    device: str,
    step_bytes: int | None = None,
) -> Case:
    """A case of an optimizer that runs on the CPU and on GPUs: fastzero's backends on `device`
    (``ours(data, backend, device)``), one peer (``(name, make(data(), device))``) and the device's bandwidth probe,
    over tensors of `sizes` from `data` (made on first use, shared). A step moves `bytes_per_param` per param, or
    `step_bytes` in all where given (what does not scale with the params: int8 states' block scales)."""
    peer_name, make_peer = peer
    n = sum(sizes)
    providers = [Provider(p, "ours", functools.partial(ours, data, b, device)) for p, b in our_backends(device)]
    providers += [Provider(peer_name, "peer", lambda: make_peer(data(), device)), roofline(device, sizes)]
    step_bytes = bytes_per_param * n if step_bytes is None else step_bytes
    return Case(kernel, name, n, step_bytes, providers, description)
