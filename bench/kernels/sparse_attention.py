"""Block-sparse attention: fastzero's ``block_sparse_attention`` against dense
attention and FlexAttention, on layouts of a local sliding window plus a
global first block column (made here, at a target density).

With ``--device cuda`` (bf16, batch 1, 16 heads, seq 4K, 16K, 64K, head_dim 64
and 128, densities 100, 50, 20, 10 and 5%): fastzero's Triton kernel, forward
and forward + backward, beside ``F.scaled_dot_product_attention`` (dense,
flash backend) and ``torch.compile(flex_attention)`` with a ``BlockMask``
made from the same layout. The layout's granularity is 128 (FlexAttention's
BlockMask block); fastzero runs it refined to its 64 x 64 tiles, the same
element mask. Reported: ms, TFLOP/s of the kept blocks (4 B H kept block^2 D
flops forward; forward + backward 3.5x that: the backward is 2.5x the
forward), speedups over SDPA and Flex measured in the same rounds, and the
peak memory one call allocates beyond its inputs (torch.cuda.max_memory_allocated).

On the CPU (default; fp32, batch 1, 4 heads, head_dim 64, seq 1K-8K): the op's
CPU path (dense masked attention up to ``DENSE_CPU_MAX_SEQ``, a loop over
query blocks gathering only the kept key blocks beyond) at 10% density and
with a fixed window (kept blocks per row constant, so density falls as
1/seq), forward + backward, beside the materialised dense attention
(``dense_attention``, every seq x seq score in memory) and torch's CPU SDPA
(a flash kernel: dense flops, memory linear in seq). Memory is the peak
resident set of a subprocess that runs the case's jobs one at a time, each
from its own baseline (see ``measure_cpu_memory``). A last case searches, by
seq doublings, the longest sequence whose forward + backward fits a 2 GiB
budget, per provider. Beyond the four sizes only the fixed window keeps the
op's memory linear in seq: at a fixed density the kept blocks, and the
probabilities autograd saves for them, grow as seq^2 (a tenth of dense's).

With --quick: CPU seq 1K and 2K without the search; GPU seq 4K, densities
100% and 10%.

Every job is first checked against fp64 dense attention on a slice: two
query row blocks, all keys, with an upstream gradient on those rows only,
so dq on those rows and the whole dk and dv are checked too.

Nothing is gated (every row carries ``gated: False``): the CPU figures are the
reference path's, and the GPU figures have no calibrated noise yet.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import gc
import inspect
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..harness import Case, Provider, Runner, Unavailable, run_case
from ..harness import format_size as _fmt
from ..jobs import ROOT, worker_command, worker_env

NAME = "sparse_attention"
DESCRIPTION = (
    "block-sparse attention (Triton on CUDA, the reference path on the CPU) vs dense SDPA, FlexAttention and "
    "materialised dense attention; time, TFLOP/s of the kept blocks, peak memory, longest seq in a memory budget; "
    "not in --all (the CPU run takes minutes)"
)
DEVICES = ("cpu", "cuda")
IN_ALL = False

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DENSE_PROVIDERS = ("dense", "sdpa")  # compute every block

# the GPU cases
GPU_SEQS, GPU_QUICK_SEQS = [4096, 16384, 65536], [4096]
GPU_DIMS = [64, 128]
GPU_DENSITIES, GPU_QUICK_DENSITIES = [1.0, 0.5, 0.2, 0.1, 0.05], [1.0, 0.1]
GPU_HEADS = 16  # at 64K too: q, k, v, dO in bf16 are 1 GiB, every provider's memory is linear in seq
GPU_LAYOUT_BLOCK = 128  # FlexAttention's BlockMask granularity (its kernels' tiles must divide it)
GPU_KERNEL_BLOCK = 64  # fastzero's Triton tile; the layout refined 2x, the same element mask
GPU_PROVIDERS = [("fastzero", "ours"), ("sdpa", "peer"), ("flex", "peer")]

# the CPU cases
CPU_SEQS, CPU_QUICK_SEQS = [1024, 2048, 4096, 8192], [1024, 2048]
CPU_HEADS, CPU_DIM, CPU_BLOCK, CPU_DENSITY = 4, 64, 64, 0.10
CPU_WINDOW = 1  # fastzero_cpu_window: +-1 block around the diagonal and the first column, at every seq
CPU_PROVIDERS = [("fastzero_cpu", "ours"), ("fastzero_cpu_window", "ours"), ("dense", "peer"), ("sdpa", "peer")]
# dense_attention's forward + backward held 28 bytes per score at its peak (measured at seq 1K-4K, fp32);
# it is left out where that estimate passes DENSE_CPU_LIMIT
DENSE_BYTES_PER_SCORE = 28
DENSE_CPU_LIMIT = 3 * GiB
FIT_BUDGET = 2 * GiB  # the longest seq whose forward + backward (inputs included) fits this
FIT_MAX_SEQ = 128 * KiB
FIT_TIME_CAP = 120.0  # s: no doubling whose forward + backward is estimated (4x the last: O(seq^2)) to take longer
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # every tensor over 64 KiB is its own mapping, unmapped when freed
# the memory subprocesses run one thread: on 2 shared cores a neighbour's burst stalls OpenMP's barriers (a 30 ms
# job took 10 s), which would stop the search's doublings early; their times only cap the search
WORKER_THREADS = 1

# normwise relative error per head against fp64, by input dtype
CHECK_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}
_MARK = "@@sparse_attention@@"


# --------------------------------------------------------------------------------------------------- layouts


def _band_count(nb: int, left: int, right: int) -> int:
    """Blocks in the band -left <= j - i <= right of an nb x nb grid, plus the first column's outside it."""
    band = sum(nb - abs(d) for d in range(-left, right + 1) if abs(d) < nb)
    return band + max(0, nb - left - 1)


def window_extent(nb: int, density: float, causal: bool = False) -> tuple[int, int]:
    """(left, right): the window whose layout's kept fraction is nearest `density` (of the nb^2 blocks, or of
    the nb (nb + 1) / 2 a causal attention computes); left and right differ by at most one block."""
    total = nb * (nb + 1) // 2 if causal else nb * nb
    options = [(w, 0) for w in range(nb)] if causal else [(w + e, w) for w in range(nb) for e in (0, 1)]
    options = [(a, b) for a, b in options if a < nb and b < nb]
    return min(options, key=lambda o: (abs(_band_count(nb, *o) / total - density), o))


def window_layout(heads: int, nb: int, left: int, right: int, causal: bool = False) -> torch.Tensor:
    """[heads, nb, nb] bool: a local window (key blocks i - left .. i + right of query block i) and the global
    first block column; block-causal (j <= i) when `causal`."""
    i = torch.arange(nb)
    d = i[None, :] - i[:, None]  # j - i
    keep = ((d >= -left) & (d <= right)) | (i[None, :] == 0)
    if causal:
        keep &= d <= 0
    return keep.expand(heads, nb, nb).contiguous()


def density_layout(heads: int, nb: int, density: float, causal: bool = False) -> torch.Tensor:
    """The window + global column layout nearest `density`."""
    return window_layout(heads, nb, *window_extent(nb, density, causal), causal=causal)


def refine(layout: torch.Tensor, factor: int) -> torch.Tensor:
    """The same element mask in blocks `factor` times smaller."""
    return layout.repeat_interleave(factor, 1).repeat_interleave(factor, 2) if factor > 1 else layout


def kept_fraction(layout: torch.Tensor, causal: bool) -> float:
    nb = layout.shape[-1]
    total = nb * (nb + 1) // 2 if causal else nb * nb
    return float(layout.sum()) / (layout.shape[0] * total)


def _causal_mask(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def flex_block_mask(layout: torch.Tensor, block: int, seq: int, causal: bool = False, compiled: bool = True):
    """FlexAttention's BlockMask for `layout` [H, nb, nb] (bool, on the tensors' device): kept off-diagonal
    blocks are full blocks (no mask_mod evaluated in them), kept diagonal blocks of a causal layout partial
    (mask_mod: causal). The compiled kernels visit only the listed blocks, so that mask_mod is exact there and,
    being one function for every layout, costs no recompile per layout. FlexAttention's eager path (the tests'
    CPU runs) applies only the mask_mod, so ``compiled=False`` gives one that looks the layout up."""
    from torch.nn.attention.flex_attention import BlockMask, noop_mask

    lay = layout.to(torch.bool)
    diag = torch.eye(lay.shape[-1], dtype=torch.bool, device=lay.device)
    partial = lay & diag if causal else torch.zeros_like(lay)
    full = lay & ~partial

    def lists(m):
        counts = m.sum(-1).to(torch.int32)[None]
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)[None]
        return counts, order

    def lookup(b, h, q_idx, kv_idx):
        keep = lay[h, q_idx // block, kv_idx // block]
        return keep & (kv_idx <= q_idx) if causal else keep

    mask_mod = (_causal_mask if causal else noop_mask) if compiled else lookup
    return BlockMask.from_kv_blocks(*lists(partial), *lists(full), BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(seq, seq))  # fmt: skip


# --------------------------------------------------------------------------------------------------- jobs


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


def _fastzero_op():
    """The op (``block_sparse_attention``; ``sparse_attention`` in older trees) and whether it takes `lists`."""
    from fastzero.ops.sparse_attention import attention as sa

    op = getattr(sa, "block_sparse_attention", None) or sa.sparse_attention
    return op, "lists" in inspect.signature(op).parameters


@functools.cache
def _compiled_flex(device_type: str):
    """flex_attention under torch.compile on a GPU, as its docs require (eager elsewhere: the tests' CPU
    runs). Static shapes: each (seq, head_dim) and grad mode compiles once, so the recompile limit is raised
    past the GPU cases' 12 graphs."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention
    import torch._dynamo

    for name, least in (("recompile_limit", 64), ("cache_size_limit", 64), ("accumulated_recompile_limit", 512),
                        ("accumulated_cache_size_limit", 512)):  # fmt: skip
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
        from fastzero.ops.backend import triton_status

        op, takes_lists = _fastzero_op()
        layout = refine(provider_layout(spec, provider), spec.layout_block // spec.kernel_block).to(device)
        backend = "triton" if spec.kind == "gpu" else "reference"
        more = {}
        if backend == "triton":
            ok, why = triton_status(device)
            if not ok:
                raise Unavailable(why)
            if takes_lists:  # made once, as SparseAttention caches them (FlexAttention's BlockMask is made once too)
                from fastzero.triton_kernels import sparse_attention as kernels

                more["lists"] = kernels.csr(layout)
        block, causal = spec.kernel_block, spec.causal
        return lambda q, k, v: op(q, k, v, layout, block, causal=causal, backend=backend, **more)
    if provider == "dense":
        from fastzero.ops.sparse_attention.reference import dense_attention

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
    """The element mask [H, len(rows), seq] those rows keep (None: everything)."""
    cols = torch.arange(spec.seq, device=rows.device)
    keep = None
    if layout is not None:
        keep = layout.to(rows.device)[:, rows // spec.layout_block, :].repeat_interleave(spec.layout_block, -1)
    if spec.causal:
        tri = (cols[None, :] <= rows[:, None])[None]
        keep = tri if keep is None else keep & tri
    return keep


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Normwise relative error per head at most CHECK_TOL[dtype]."""
    got, want = got.detach().double(), want.detach().double()
    assert torch.isfinite(got).all(), f"{what}: not finite"
    err = (got - want).flatten(2).norm(dim=-1) / want.flatten(2).norm(dim=-1).clamp_min(1e-30)
    worst = float(err.max())
    assert worst <= CHECK_TOL[dtype], f"{what}: normwise relative error {worst:.2e} > {CHECK_TOL[dtype]:.0e}"


def check_slice(spec: Spec, provider: str, fn: Callable, inp: Inputs, grads: bool) -> None:
    """fn against fp64 dense attention with the provider's element mask on the rows of check_rows(): the
    output there, and with an upstream gradient on those rows only, dq there and all of dk, dv."""
    from fastzero.ops.sparse_attention.reference import dense_attention

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


# --------------------------------------------------------------------------------------------------- cases


@dataclass
class AttnCase(Case):
    spec: Spec | None = None
    data: Callable[[], Inputs] | None = None  # the case's inputs, made on first use, shared by its providers


def _pct(density: float) -> str:
    return f"{density * 100:g}"


def _case(spec: Spec, name: str, providers: list[tuple[str, str]], description: str) -> AttnCase:
    data = functools.cache(lambda: make_inputs(spec))
    numel = spec.batch * spec.heads * spec.seq * spec.dim
    itemsize = torch.empty(0, dtype=spec.torch_dtype).element_size()
    if spec.kind == "fit":
        provs = [Provider(p, kind, _self_timed) for p, kind in providers]
    else:  # harness users (pytest-benchmark, calibrate) get the forward + backward
        provs = [Provider(p, kind, functools.partial(make_runner, spec, p, data, "fwdbwd")) for p, kind in providers]
    return AttnCase(NAME, name, numel, 4 * numel * itemsize, provs, description, spec=spec, data=data)


def _self_timed() -> Runner:
    raise Unavailable("a search over subprocesses: run by python -m bench.run --kernel sparse_attention")


def _describe_layout(spec: Spec, layout: torch.Tensor) -> str:
    left, right = window_extent(spec.nb, spec.density, spec.causal)
    return (f"window {left}+{right} blocks of {spec.layout_block} + first column, "
            f"{kept_fraction(layout, spec.causal):.1%} kept")  # fmt: skip


def gpu_cases(seqs, dims, densities, dtype="bf16", device="cuda", heads=GPU_HEADS, layout_block=GPU_LAYOUT_BLOCK,
              kernel_block=GPU_KERNEL_BLOCK, causal=False) -> list[AttnCase]:  # fmt: skip
    """The GPU family's cases (device="cpu" runs the same jobs on small shapes in the tests: Triton in its
    interpreter, SDPA's math, FlexAttention eager and forward only)."""
    out = []
    for seq in seqs:
        for dim in dims:
            for density in densities:
                spec = Spec("gpu", device, seq, heads, dim, dtype, density, layout_block, kernel_block, causal=causal)
                lay = provider_layout(spec, "fastzero")
                desc = (f"{'causal' if causal else 'bidirectional'} {dtype}, batch 1, {heads} heads, seq {seq}, "
                        f"head_dim {dim}, {_describe_layout(spec, lay)}; fwd and fwd+bwd")  # fmt: skip
                out.append(_case(spec, f"s{_fmt(seq)}-d{dim}-p{_pct(density)}", GPU_PROVIDERS, desc))
    return out


def cpu_cases(seqs, dtype="fp32", fit: bool = True) -> list[AttnCase]:
    from fastzero.ops.sparse_attention import attention as sa

    out = []
    for seq in seqs:
        spec = Spec("cpu", "cpu", seq, CPU_HEADS, CPU_DIM, dtype, CPU_DENSITY, CPU_BLOCK, CPU_BLOCK)
        lay = provider_layout(spec, "fastzero_cpu")
        win = provider_layout(spec, "fastzero_cpu_window")
        path = "dense masked" if seq <= sa.DENSE_CPU_MAX_SEQ else "blocked"
        desc = (f"fp32 fwd+bwd, batch 1, {CPU_HEADS} heads, seq {seq}, head_dim {CPU_DIM}; fastzero_cpu: "
                f"{_describe_layout(spec, lay)}; fastzero_cpu_window: +-{CPU_WINDOW} block + first column, "
                f"{kept_fraction(win, False):.1%} kept; the op's {path} CPU path")  # fmt: skip
        out.append(_case(spec, f"cpu-s{_fmt(seq)}-p{_pct(CPU_DENSITY)}", CPU_PROVIDERS, desc))
    if fit:
        spec = Spec("fit", "cpu", min(seqs), CPU_HEADS, CPU_DIM, dtype, CPU_DENSITY, CPU_BLOCK, CPU_BLOCK)
        desc = (f"the longest seq (doublings from {min(seqs)}) whose fwd+bwd fits {FIT_BUDGET / GiB:g} GiB, inputs "
                f"included (fp32, batch 1, {CPU_HEADS} heads, head_dim {CPU_DIM}); a doubling estimated over "
                f"{FIT_TIME_CAP:g} s is not run")  # fmt: skip
        out.append(_case(spec, f"fit-{_fmt(FIT_BUDGET)}", CPU_PROVIDERS, desc))
    return out


def cases(sizes=None, dtypes=None, quick=False, device="cpu") -> list[Case]:
    """``--sizes`` are sequence lengths; ``--dtype`` picks the dtype (default fp32 on the CPU, bf16 on a GPU)."""
    if device == "cuda":
        dtype = next((d for d in (dtypes or ["bf16"]) if d in DTYPES), "bf16")
        seqs = sizes or (GPU_QUICK_SEQS if quick else GPU_SEQS)
        return gpu_cases(seqs, GPU_DIMS, GPU_QUICK_DENSITIES if quick else GPU_DENSITIES, dtype)
    dtype = next((d for d in (dtypes or ["fp32"]) if d in DTYPES), "fp32")
    return cpu_cases(sizes or (CPU_QUICK_SEQS if quick else CPU_SEQS), dtype, fit=not quick)


# --------------------------------------------------------------------------------------------------- measuring


def _rounds(spec: Spec, args) -> tuple[int, int]:
    """(warm-up, timed rounds): fewer for the long jobs (a round of the 4K CPU case takes ~2 s, dense 1.6 of it)."""
    warmup, repeats = args.warmup, args.repeats
    if spec.kind == "cpu" and spec.seq >= 4096:
        return min(warmup, 1), min(repeats, 7 if spec.seq < 8192 else 5)
    if spec.kind == "gpu" and spec.seq >= 65536:
        return warmup, min(repeats, 10)
    return warmup, repeats


def dense_cpu_estimate(spec: Spec) -> int:
    return DENSE_BYTES_PER_SCORE * spec.batch * spec.heads * spec.seq * spec.seq


def _unavailable_here(spec: Spec, provider: str) -> str | None:
    if provider == "dense" and spec.device == "cpu" and dense_cpu_estimate(spec) > DENSE_CPU_LIMIT:
        return (f"would hold ~{dense_cpu_estimate(spec) / GiB:.1f} GiB ({DENSE_BYTES_PER_SCORE} B per score), over "
                f"the {DENSE_CPU_LIMIT / GiB:g} GiB this benchmark allows dense attention on the CPU")  # fmt: skip
    return None


def measure(case: AttnCase, args, say) -> tuple[list[dict], dict]:
    """bench.run's hook: the harness's checked, interleaved rounds per mode, then peak memory per provider
    (CUDA: in process; CPU: a subprocess), then rows with speedups of the same rounds."""
    spec = case.spec
    if spec.kind == "fit":
        return fit_rows(case, fit_search(case, say)), {}
    modes = ("fwd", "fwdbwd") if spec.kind == "gpu" else ("fwdbwd",)
    warmup, repeats = _rounds(spec, args)
    skipped: dict[str, str] = {}
    providers = []
    for p in case.providers:
        why = _unavailable_here(spec, p.name)
        if why:
            skipped[p.name] = why
        else:
            providers.append(p)
    timings, missing = {}, {}
    for mode in modes:
        sub = Case(NAME, f"{case.name} {mode}", case.numel, case.bytes, [
            Provider(p.name, p.kind, functools.partial(make_runner, spec, p.name, case.data, mode)) for p in providers
        ])  # fmt: skip
        res = run_case(sub, warmup=warmup, repeats=repeats, on_progress=say, slowdown=args.inject_slowdown)
        timings[mode] = res.timings
        for name, why in res.skipped.items():
            missing.setdefault(name, []).append((mode, why))
    for name, whys in missing.items():  # a provider missing in one mode only says which
        skipped[name] = whys[0][1] if len(whys) == len(modes) else "; ".join(f"{m}: {w}" for m, w in whys)
    ran = [p.name for p in providers if any(p.name in timings[m] for m in modes)]
    if spec.device == "cuda":
        memory = measure_cuda_memory(case, ran, modes, say)
    elif spec.kind == "cpu" and ran:
        say(f"{case.name}: peak memory (a subprocess)")
        memory = {p: {"fwdbwd": r["peak_bytes"]} for p, r in measure_cpu_memory(spec, ran).items()}
    else:
        memory = {}
    return rows(case, timings, memory), skipped


def measure_cuda_memory(case: AttnCase, providers: list[str], modes, say) -> dict[str, dict[str, int]]:
    """Per provider and mode: torch.cuda.max_memory_allocated over one call (after a warm one), less what was
    allocated before it (the inputs, the provider's layout state)."""
    out: dict[str, dict[str, int]] = {}
    for provider in providers:
        for mode in modes:
            try:
                step, _ = make_step(case.spec, provider, case.data(), mode)
            except Unavailable:
                continue
            say(f"{case.name}: peak memory of {provider} {mode}")
            step()
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            out.setdefault(provider, {})[mode] = torch.cuda.max_memory_allocated() - base
            del step
    return out


def _paired(num, den) -> float:
    return statistics.median(a / b for a, b in zip(num.times, den.times))


def rows(case: AttnCase, timings: dict[str, dict], memory: dict[str, dict[str, int]]) -> list[dict]:
    """Result rows; per provider and mode (fwd, fwdbwd): ms, spread, TFLOP/s of the kept blocks (of the
    provider's own layout for fastzero_cpu_window; dense providers: also of the blocks they compute),
    peak bytes, and for fastzero's providers the speedup (and memory ratio) over each peer, round by round."""
    spec, out = case.spec, []

    def row(provider, metric, value):
        if value is not None:
            out.append(dict(kernel=case.kernel, case=case.name, provider=provider, metric=metric, value=value,
                            gated=False))  # fmt: skip

    main = provider_layout(spec, "fastzero" if spec.kind == "gpu" else "fastzero_cpu")
    seen = []
    for mode, ts in timings.items():
        for name, t in ts.items():
            lay = provider_layout(spec, name)
            if name not in seen:
                seen.append(name)
                row(name, "density", 1.0 if lay is None else kept_fraction(lay, spec.causal))
            useful = fwd_flops(spec, lay if lay is not None else main) * FLOPS_FACTOR[mode]
            row(name, f"{mode}_ms", t.median * 1e3)
            row(name, f"{mode}_spread", t.spread)
            row(name, f"{mode}_tflops", useful / t.median / 1e12)
            if lay is None:
                row(name, f"{mode}_tflops_done", fwd_flops(spec, None) * FLOPS_FACTOR[mode] / t.median / 1e12)
            peak = memory.get(name, {}).get(mode)
            row(name, f"{mode}_peak_bytes", peak)
            if t.kind != "ours":
                continue
            for peer, pt in ts.items():
                if pt.kind == "peer":
                    row(name, f"{mode}_speedup_vs_{peer}", _paired(pt, t))
                    peer_peak = memory.get(peer, {}).get(mode)
                    if peak and peer_peak:
                        row(name, f"{mode}_mem_vs_{peer}", peer_peak / peak)
    return out


# --------------------------------------------------------------------------------------------------- CPU memory


def _status(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM: peak RSS since the last reset, VmData)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)


def _release() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _run_worker(request: dict, timeout: float) -> dict:
    """Runs this module as a subprocess (python -m <bench>.kernels.sparse_attention REQUEST) with glibc's mmap
    threshold fixed at 64 KiB and WORKER_THREADS threads; returns its result."""
    from fastzero.ops.sparse_attention import attention as sa

    request = dict(request, threads=WORKER_THREADS, dense_max_seq=sa.DENSE_CPU_MAX_SEQ)
    proc = subprocess.run(worker_command("kernels.sparse_attention", json.dumps(request)), cwd=ROOT,
                          env=worker_env(**MALLOC_ENV), capture_output=True, text=True, timeout=timeout)  # fmt: skip
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith(_MARK)), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"memory worker exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}")
    return json.loads(line[len(_MARK) :])


def measure_cpu_memory(spec: Spec, providers: list[str]) -> dict[str, dict]:
    """Peak memory of one forward + backward per provider, measured in a subprocess that runs only these
    jobs, one after another: with every tensor over 64 KiB its own mapping (MALLOC_MMAP_THRESHOLD_), freed
    memory leaves the resident set, so the peak resident set (VmHWM, reset after a warm call and malloc_trim)
    less the resident set before the job's inputs were made is the peak of the tensors the job holds at once,
    inputs (q, k, v, dO) included, plus what the ops allocate outside torch (oneDNN scratch). Python's
    tracemalloc cannot see tensor memory; torch keeps no CPU allocator statistics."""
    return _run_worker({"job": "peak", "spec": dataclasses.asdict(spec), "providers": providers}, timeout=1800)


def _warm(spec: Spec, provider: str) -> None:
    """One small forward + backward on each CPU path (dense masked, blocked): the one-time set-up (thread
    pools, autograd's, oneDNN's) is paid before a baseline is taken, so it is not counted as the job's."""
    from fastzero.ops.sparse_attention import attention as sa

    b = spec.layout_block
    for seq in sorted({min(spec.seq, 2 * b), (sa.DENSE_CPU_MAX_SEQ // b + 1) * b}):
        inp = make_inputs(dataclasses.replace(spec, seq=seq))
        make_step(dataclasses.replace(spec, seq=seq), provider, inp, "fwdbwd")[0]()
        del inp
    _release()


def _peak_one(spec: Spec, provider: str) -> dict:
    _warm(spec, provider)
    base = _status("VmRSS")
    inp = make_inputs(spec)
    step, _ = make_step(spec, provider, inp, "fwdbwd")
    step()  # a warm call at this size, then the measured one
    _release()
    _reset_peak()
    t0 = time.perf_counter()
    step()
    ms = (time.perf_counter() - t0) * 1e3
    peak = _status("VmHWM") - base
    del step, inp
    _release()
    return {"peak_bytes": peak, "ms": ms}


def _out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or "alloc" in str(exc).lower() or "memory" in str(exc).lower()


def _fit_search_one(spec: Spec, provider: str, budget: int, max_seq: int, time_cap: float) -> dict:
    """In a worker: seq doublings from spec.seq while forward + backward fits `budget` (inputs included) under
    RLIMIT_DATA = what is mapped now + budget + 64 MiB (an allocation past it fails at once instead of taking
    the machine's memory), and the next doubling is estimated (4x: O(seq^2) time) under `time_cap`."""
    _warm(spec, provider)
    points, limited, seq = [], "max_seq", spec.seq
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    while seq <= max_seq:
        _release()
        base = _status("VmRSS")
        resource.setrlimit(resource.RLIMIT_DATA, (_status("VmData") + budget + 64 * MiB, hard))
        _reset_peak()
        point, inp, step = {"seq": seq}, None, None
        try:
            inp = make_inputs(dataclasses.replace(spec, seq=seq))
            step, _ = make_step(dataclasses.replace(spec, seq=seq), provider, inp, "fwdbwd")
            t0 = time.perf_counter()
            step()
            point["ms"] = (time.perf_counter() - t0) * 1e3
        except (RuntimeError, MemoryError) as exc:
            if not _out_of_memory(exc):
                raise
            point["error"] = str(exc).splitlines()[0][:200]
        finally:
            del inp, step  # freed before the limit is lifted
            _release()
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        point["peak_bytes"] = _status("VmHWM") - base
        point["fits"] = "error" not in point and point["peak_bytes"] <= budget
        points.append(point)
        if not point["fits"]:
            limited = "memory"
            break
        if point["ms"] / 1e3 * 4 > time_cap:
            limited = "time"
            break
        seq *= 2
    return {"points": points, "limited_by": limited}


def fit_search(case: AttnCase, say, budget: int | None = None, max_seq: int | None = None,
               time_cap: float | None = None) -> dict[str, dict]:  # fmt: skip
    """Per provider (its own subprocess), the seq-doubling search of _fit_search_one."""
    out = {}
    for p in case.providers:
        say(f"{case.name}: longest seq within {(budget or FIT_BUDGET) / MiB:g} MiB, {p.name} (a subprocess)")
        out[p.name] = _run_worker({"job": "fit", "spec": dataclasses.asdict(case.spec), "provider": p.name,
                                   "budget": budget or FIT_BUDGET, "max_seq": max_seq or FIT_MAX_SEQ,
                                   "time_cap": time_cap or FIT_TIME_CAP}, timeout=3600)  # fmt: skip
    return out


def fit_rows(case: AttnCase, found: dict[str, dict]) -> list[dict]:
    """Per provider: max_seq_fit (0: not even the first), limited_by (memory, time or max_seq), and per seq
    tried: peak bytes, ms, whether it fit; fastzero's providers: max_seq_fit over dense's."""
    out = []

    def row(provider, metric, value):
        out.append(dict(kernel=case.kernel, case=case.name, provider=provider, metric=metric, value=value,
                        gated=False))  # fmt: skip

    best = {}
    for name, res in found.items():
        fits = [p["seq"] for p in res["points"] if p["fits"]]
        best[name] = max(fits, default=0)
        row(name, "max_seq_fit", best[name])
        row(name, "limited_by", res["limited_by"])
        for p in res["points"]:
            row(name, f"peak_bytes_s{p['seq']}", p["peak_bytes"])
            row(name, f"fits_s{p['seq']}", bool(p["fits"]))
            if "ms" in p:
                row(name, f"fwdbwd_ms_s{p['seq']}", p["ms"])
    for name in found:
        if name.startswith("fastzero") and best.get("dense"):
            row(name, "fit_vs_dense", best[name] / best["dense"])
    return out


# --------------------------------------------------------------------------------------------------- tables


def _f(v, spec, scale=1.0) -> str:
    return "" if v is None else format(v / scale, spec)


_LEGEND_GPU = (
    "ms: median of interleaved rounds (CUDA events); fwd runs without autograd, fwd+bwd is a forward and "
    "torch.autograd.grad. TFLOP/s: 4 B H kept blocks block^2 D (x3.5 for fwd+bwd) over the time, the same useful "
    "work for every provider (SDPA's own rate over the dense flops it does is the row's tflops_done in the JSON). "
    "Peak MiB: torch.cuda.max_memory_allocated over one call less what was allocated before it (inputs, layout "
    "state). Speedup: peer time / fastzero time, median of per-round ratios."
)
_LEGEND_CPU = (
    "ms: median of interleaved rounds of one forward + torch.autograd.grad (wall time). GFLOP/s: 4 B H kept "
    "blocks block^2 D x3.5 over the time (the 10% layout's work for dense and SDPA, which compute every block). "
    "Peak MiB: peak resident set of a subprocess running the job (one thread) from its own baseline (tensors over "
    "64 KiB are their own mappings, so freed memory leaves the resident set), inputs q, k, v, dO included. "
    "dense: every seq x seq score materialised (quadratic memory); sdpa: torch's CPU flash kernel (dense flops, "
    "linear memory)."
)


def table(case_info: dict, provs: dict[str, dict[str, float]]) -> list[str]:
    """Markdown for bench.run's terminal output and report."""
    if any("max_seq_fit" in m for m in provs.values()):
        return _fit_table(case_info, provs)
    gpu = any("fwd_ms" in m for m in provs.values())
    modes = [("fwd", "fwd"), ("fwdbwd", "fwd+bwd")] if gpu else [("fwdbwd", "fwd+bwd")]
    unit, scale = ("TFLOP/s", 1.0) if gpu else ("GFLOP/s", 1e-3)
    head = ["provider", "kept"]
    for _, label in modes:
        head += [f"{label} ms", "spread", f"{label} {unit}", f"{label} peak MiB"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for prov, m in provs.items():
        cells = [prov, _f(m.get("density"), ".1%")]
        for key, _ in modes:
            cells += [_f(m.get(f"{key}_ms"), ".3f" if gpu else ".1f"), _f(m.get(f"{key}_spread"), ".1%"),
                      _f(m.get(f"{key}_tflops"), ".1f" if gpu else ".2f", scale),
                      _f(m.get(f"{key}_peak_bytes"), ".1f", MiB)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    for prov, why in case_info.get("skipped", {}).items():
        lines.append(f"| {prov} | skipped: {why} |" + " |" * (len(head) - 2))
    ours = [p for p in provs if p.startswith("fastzero")]
    peers = [p for p in provs if not p.startswith("fastzero")]
    if ours and peers:
        cols = [(f"{key}_speedup_vs_{q}", f"vs {q} {label}") for q in peers for key, label in modes]
        cols += [(f"{key}_mem_vs_{q}", f"memory: {q} / ours {label}") for q in peers for key, label in modes]
        cols = [(k, label) for k, label in cols if any(k in provs[p] for p in ours)]
        lines += ["", "fastzero against each peer (same rounds; memory: the peer's peak over fastzero's):", "",
                  "| | " + " | ".join(label for _, label in cols) + " |", "|---|" + "---:|" * len(cols)]  # fmt: skip
        for p in ours:
            lines.append(f"| {p} | " + " | ".join(_f(provs[p].get(k), ".2f") + ("x" if k in provs[p] else "")
                                                   for k, _ in cols) + " |")  # fmt: skip
    return lines + ["", _LEGEND_GPU if gpu else _LEGEND_CPU]


def _fit_table(case_info: dict, provs: dict[str, dict]) -> list[str]:
    seqs = sorted(
        {int(k.removeprefix("peak_bytes_s")) for m in provs.values() for k in m if k.startswith("peak_bytes_s")}
    )
    head = ["provider", "longest seq that fits", "stopped by", "vs dense"] + [_fmt(s) for s in seqs]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * 3 + "---:|" * len(seqs)]
    for prov, m in provs.items():
        cells = [prov, _fmt(int(m["max_seq_fit"])) if m.get("max_seq_fit") else "none", str(m.get("limited_by", "")),
                 _f(m.get("fit_vs_dense"), ".0f") + ("x" if "fit_vs_dense" in m else "")]  # fmt: skip
        for s in seqs:
            if f"peak_bytes_s{s}" not in m:
                cells.append("")
                continue
            ms = m.get(f"fwdbwd_ms_s{s}")
            cell = f"{m[f'peak_bytes_s{s}'] / MiB:.0f} MiB" + (f", {ms / 1e3:.1f} s" if ms is not None else "")
            cells.append(cell if m.get(f"fits_s{s}") else f"over: {cell}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines + ["", (
        "Each provider searches in its own subprocess: seq doubles while one forward + backward (inputs "
        "included) stays within the budget, measured as in the timed cases (peak resident set over the "
        "process's before the inputs), under RLIMIT_DATA = budget + 64 MiB so a job past it fails its "
        f"allocation at once. 'time': the next doubling was estimated (4x the last) over {FIT_TIME_CAP:g} s and "
        "not run, so the true limit is at least the figure shown. Cells: peak memory and time (one thread) per seq "
        "tried; 'over': past the budget (or its allocation failed)."
    )]  # fmt: skip


# --------------------------------------------------------------------------------------------------- worker


def _worker(argv: list[str]) -> None:
    request = json.loads(argv[0])
    torch.set_num_threads(request["threads"])
    from fastzero.ops.sparse_attention import attention as sa

    sa.DENSE_CPU_MAX_SEQ = request["dense_max_seq"]  # the parent's (the tests lower it)
    spec = Spec(**request["spec"])
    if request["job"] == "peak":
        result = {p: _peak_one(spec, p) for p in request["providers"]}
    else:
        result = _fit_search_one(spec, request["provider"], request["budget"], request["max_seq"],
                                 request["time_cap"])  # fmt: skip
    print(_MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1:])
