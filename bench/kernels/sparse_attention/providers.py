"""One sparse-attention job: its spec (shapes, dtype, layouts), inputs, each
provider's attention, the check against fp64 dense attention (the library's
``dense_attention``) and the timed step (forward, or forward + backward)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastzero.ops.backend import triton_status
from fastzero.ops.sparse_attention import block_sparse_attention
from fastzero.ops.sparse_attention.reference import dense_attention, expand_layout

from ...harness import Runner, Unavailable
from .layouts import density_layout, flex_block_mask, refine, window_layout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DENSE_PROVIDERS = ("dense", "sdpa")  # compute every block
CPU_WINDOW = 1  # fastzero_cpu_window: +-1 block around the diagonal and the first column, at every seq
# The check's bound, by input dtype: the normwise relative error per head (||got - want||_2 / ||want||_2 over a
# head's checked slice) against fp64. Not fastzero.ops.tolerances' elementwise table: attention's
# outputs and gradients are sums over up to seq keys of terms of both signs, so some elements cancel to near
# zero, and an elementwise rtol (atol 1e-5 for bf16) fails there on the inputs' rounding alone, more often the
# longer the rows (the library's own attention tests set an atol per test). A normwise bound holds a whole head
# to its dtype's rounding, whatever its elements' sizes: 10x the table's rtol for fp32 and fp16, 2x for bf16
# (whose table rtol, 1.6e-2, is already twice its machine epsilon); fp64 (the tests' reference path) 1e-9.
NORMWISE_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@dataclass(frozen=True)
class Spec:
    """One case's job: shapes, dtype, where it runs and its layouts."""

    kind: str  # "gpu" (fwd and fwd+bwd vs SDPA and Flex), "cpu" (fwd+bwd vs dense and SDPA), "fit"
    device: str
    seq: int
    heads: int
    dim: int
    dtype: str
    density: float  # the target of the case's layout
    layout_block: int  # the layout's granularity
    kernel_block: int  # fastzero's block: the layout refined to it
    window: int = CPU_WINDOW
    batch: int = 1
    causal: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nb(self) -> int:
        return self.seq // self.layout_block


def provider_layout(spec: Spec, provider: str) -> torch.Tensor | None:
    """The provider's layout at spec.layout_block granularity (bool, CPU), None for the dense providers."""
    if provider in DENSE_PROVIDERS:
        return None
    if provider == "fastzero_cpu_window":
        return window_layout(spec.heads, spec.nb, spec.window, spec.window, spec.causal)
    return density_layout(spec.heads, spec.nb, spec.density, spec.causal)


def fwd_flops(spec: Spec, layout: torch.Tensor | None) -> float:
    """4 B H kept block^2 D: QK^T and PV over the kept blocks (all blocks when `layout` is None)."""
    if layout is None:
        kept = spec.heads * (spec.nb * (spec.nb + 1) // 2 if spec.causal else spec.nb * spec.nb)
    else:
        kept = int(layout.sum())
    return 4.0 * spec.batch * kept * spec.layout_block**2 * spec.dim


FLOPS_FACTOR = {"fwd": 1.0, "fwdbwd": 3.5}  # the backward does 2.5x the forward's matmul flops


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor


def make_inputs(spec: Spec, seed: int = 0) -> Inputs:
    gen = torch.Generator(device=spec.device).manual_seed(seed)
    shape = (spec.batch, spec.heads, spec.seq, spec.dim)

    def one(grad):
        t = torch.randn(shape, generator=gen, device=spec.device).to(spec.torch_dtype)
        return t.requires_grad_(grad)

    q, k, v = one(True), one(True), one(True)
    return Inputs(q, k, v, one(False))


@functools.cache
def _compiled_flex(device_type: str):
    """flex_attention under torch.compile on a GPU, as its docs require (eager elsewhere: the tests' CPU
    runs). Static shapes: each (seq, head_dim) and grad mode compiles once, so the recompile limit is raised
    past the GPU cases' 12 graphs."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention
    import torch._dynamo

    limits = {
        "recompile_limit": 64,
        "cache_size_limit": 64,
        "accumulated_recompile_limit": 512,
        "accumulated_cache_size_limit": 512,
    }
    for name, least in limits.items():  # the names differ between torch versions
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), least))
    return torch.compile(flex_attention, dynamic=False)


def attention_fn(spec: Spec, provider: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """provider's attention as fn(q, k, v) -> out, its one-time set-up done (block lists, BlockMask);
    raises Unavailable where it cannot run here."""
    device = spec.device
    if device == "cuda" and not torch.cuda.is_available():
        raise Unavailable("no CUDA device")
    scale = spec.dim**-0.5
    if provider.startswith("fastzero"):
        layout = refine(provider_layout(spec, provider), spec.layout_block // spec.kernel_block).to(device)
        backend = "triton" if spec.kind == "gpu" else "reference"
        more = {}
        if backend == "triton":
            ok, why = triton_status(device)
            if not ok:
                raise Unavailable(why)
            from fastzero.triton_kernels import sparse_attention as kernels

            # made once, as SparseAttention caches them (FlexAttention's BlockMask is made once too)
            more["lists"] = kernels.csr(layout)
        block, causal = spec.kernel_block, spec.causal
        return lambda q, k, v: block_sparse_attention(q, k, v, layout, block, causal=causal, backend=backend, **more)
    if provider == "dense":
        keep = None
        if spec.causal:
            keep = torch.ones(spec.seq, spec.seq, dtype=torch.bool, device=device).tril()
        return lambda q, k, v: dense_attention(q, k, v, keep, scale)
    if provider == "sdpa":
        import torch.nn.functional as F

        if device != "cuda":
            return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=spec.causal)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=spec.causal)

        return sdpa
    if provider == "flex":
        try:
            flex = _compiled_flex(device)
        except ImportError as exc:
            raise Unavailable(f"torch.nn.attention.flex_attention not importable: {exc}") from None
        lay = provider_layout(spec, provider).to(device)
        mask = flex_block_mask(lay, spec.layout_block, spec.seq, spec.causal, compiled=device == "cuda")
        if device != "cuda":  # its CPU path refuses inputs that require grad, even under no_grad: forward only
            return lambda q, k, v: flex(q.detach(), k.detach(), v.detach(), block_mask=mask)
        return lambda q, k, v: flex(q, k, v, block_mask=mask)
    raise ValueError(f"unknown provider {provider!r}")


def check_rows(spec: Spec) -> torch.Tensor:
    """The query rows every job is checked on: the first layout block row and the middle one."""
    g, mid = spec.layout_block, (spec.nb // 2) * spec.layout_block
    rows = torch.cat([torch.arange(0, g), torch.arange(mid, mid + g)]) if mid else torch.arange(0, g)
    return rows.to(spec.device)


def _row_mask(spec: Spec, layout: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """The element mask [H, len(rows), seq] the rows of check_rows() keep (None: everything): the library's
    expand_layout of their block rows (never the whole seq x seq mask: 64K^2 x 16 heads), causal by row index."""
    keep = None
    if layout is not None:
        keep = expand_layout(layout[:, rows[:: spec.layout_block] // spec.layout_block], spec.layout_block, False)
        keep = keep.to(rows.device)
    if spec.causal:
        tri = (torch.arange(spec.seq, device=rows.device)[None, :] <= rows[:, None])[None]
        keep = tri if keep is None else keep & tri
    return keep


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Normwise relative error per head at most NORMWISE_TOL[dtype]."""
    got, want = got.detach().double(), want.detach().double()
    assert torch.isfinite(got).all(), f"{what}: not finite"
    err = (got - want).flatten(2).norm(dim=-1) / want.flatten(2).norm(dim=-1).clamp_min(1e-30)
    worst, tol = float(err.max()), NORMWISE_TOL[dtype]
    assert worst <= tol, f"{what}: normwise relative error {worst:.2e} > {tol:.0e}"


def check_slice(spec: Spec, provider: str, fn: Callable, inp: Inputs, grads: bool) -> None:
    """fn against fp64 dense attention with the provider's element mask on the rows of check_rows(): the
    output there, and with an upstream gradient on those rows only, dq there and all of dk, dv."""
    rows = check_rows(spec)
    q, k, v = inp.q, inp.k, inp.v
    if grads:
        dout = torch.zeros_like(inp.dout)
        dout[:, :, rows] = inp.dout[:, :, rows]
        out = fn(q, k, v)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    else:
        with torch.no_grad():
            out = fn(q, k, v)
    qr = q.detach()[:, :, rows].double().requires_grad_(grads)
    kd, vd = (t.detach().double().requires_grad_(grads) for t in (k, v))
    keep = _row_mask(spec, provider_layout(spec, provider), rows)
    with torch.enable_grad():
        ref = dense_attention(qr, kd, vd, None if keep is None else keep[None], spec.dim**-0.5)
    _close(out[:, :, rows], ref, spec.torch_dtype, f"{provider} output")
    if grads:
        rq, rk, rv = torch.autograd.grad(ref, (qr, kd, vd), dout[:, :, rows].double())
        for name, a, b in (("dq", dq[:, :, rows], rq), ("dk", dk, rk), ("dv", dv, rv)):
            _close(a, b, spec.torch_dtype, f"{provider} {name}")


def make_step(spec: Spec, provider: str, inp: Inputs, mode: str) -> tuple[Callable[[], None], Callable]:
    """(step, fn): one forward (no autograd graph) or one forward + backward (torch.autograd.grad, nothing
    accumulates) over the case's inputs."""
    if mode == "fwdbwd" and provider == "flex" and spec.device != "cuda":
        raise Unavailable("FlexAttention has no backward on the CPU")
    fn = attention_fn(spec, provider)
    q, k, v, dout = inp.q, inp.k, inp.v, inp.dout
    if mode == "fwd":

        def step():
            with torch.no_grad():
                fn(q, k, v)
    else:

        def step():
            torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

    return step, fn


def make_runner(spec: Spec, provider: str, data: Callable[[], Inputs], mode: str) -> Runner:
    inp = data()
    step, fn = make_step(spec, provider, inp, mode)
    if not provider.startswith("fastzero"):  # a peer that fails here (no flash kernel, a compile error) is skipped
        try:
            step()
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            raise Unavailable(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}") from None
    check = functools.partial(check_slice, spec, provider, fn, inp, mode == "fwdbwd")
    return Runner(step=step, check=check, cuda=spec.device == "cuda")
