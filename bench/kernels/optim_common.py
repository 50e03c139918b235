"""Pieces the optimizer benchmarks share: fresh inputs with the reference's
result of one step, checks against it, and the bandwidth probes."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from fastzero import native
from fastzero.ops.tolerances import assert_close

from ..harness import Runner, Unavailable


def split_sizes(total: int, count: int) -> list[int]:
    """`count` tensor sizes of mixed magnitude (1x to 20x) that sum to `total`."""
    weights = [1 + (i * 7919) % 20 for i in range(count)]
    sizes = [total * w // sum(weights) for w in weights]
    sizes[-1] += total - sum(sizes)
    return sizes


class OptimData:
    """Fresh random inputs for one case, and the reference's result of one
    step from zero optimizer state (fp32 states); every provider starts from
    clones. `copy_dtype`: the low-precision param copy an offload step writes."""

    def __init__(self, sizes, reference_step: Callable, hyper: dict, *, param_dtype=torch.float32,
                 grad_dtype=torch.float32, copy_dtype=None, device="cpu", seed: int = 0):  # fmt: skip
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
        hyper = dict(self.hyper)
        beta1, beta2 = hyper.pop("betas")
        self.reference_step(p, self.grads, m, v, step=1, beta1=beta1, beta2=beta2, param_copies=c, **hyper)
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


def stream_roofline(sizes: list[int]) -> Runner:
    """The CPU bandwidth probe over tensors of the case's sizes: the bytes of
    an Adam step per element (read 4 arrays, write 3) and the same layout."""
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


STREAM_OUT_BYTES = 8 << 20  # csrc/cpu/onebit.cpp's kStreamOutBytes: larger outputs bypass the cache


def write_roofline(sizes: list[int]) -> Runner:
    """The CPU write-bandwidth probe: every element of tensors of the case's
    sizes set, nothing read (4 B per element), as the 1-bit unpack writes:
    plain stores while the output fits in the caches, cache-bypassing ones
    from STREAM_OUT_BYTES. The ceiling of a kernel that mostly writes, where
    the in-place probe, whose writes follow its reads of the same lines,
    overstates it."""
    ops = native.cpu_ops()
    if ops is None:
        raise Unavailable(f"native kernels unavailable: {native.cpu_ops_error()}")
    isa = native.ISA_NAMES.index(native.cpu_isa())
    arrays = [torch.empty(n) for n in sizes]
    ptrs = [t.data_ptr() for t in arrays]
    nt = 4 * sum(sizes) >= STREAM_OUT_BYTES

    def step():
        ops.stream_fill(isa, ptrs, sizes, 0.5, nt, torch.get_num_threads())

    def check():
        step()
        for t in arrays:
            assert bool((t == 0.5).all()), "the write probe left other values"

    return Runner(step=step, check=check)


def cuda_copy_roofline(numel: int) -> Runner:
    """The GPU's copy bandwidth: dst.copy_(src) over `numel` fp32 elements
    (bytes read plus written = 8 per element)."""
    if not torch.cuda.is_available():
        raise Unavailable("no CUDA device")
    src = torch.empty(numel, device="cuda").uniform_(-1, 1)
    dst = torch.empty_like(src)

    def check():
        dst.copy_(src)
        assert torch.equal(dst, src)

    return Runner(step=lambda: dst.copy_(src), check=check, cuda=True)
