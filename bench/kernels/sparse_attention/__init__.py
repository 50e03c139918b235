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

Here: the cases and their measurement; layouts.py the layouts and
FlexAttention's block masks, providers.py one job (inputs, each provider's
attention, the check, the timed step), memory.py peak memory and the
memory-budget search (worker.py its subprocess), tables.py the Markdown.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastzero.ops.sparse_attention import attention as sa

from ...family import Family, Settings
from ...harness import Case, Provider, Rows, paired, run_case, self_timed
from ...harness import format_size as _fmt
from .layouts import kept_fraction, window_extent
from .memory import FIT_BUDGET, FIT_TIME_CAP, GiB, fit_rows, fit_search, measure_cpu_memory, measure_cuda_memory
from .providers import (
    CPU_WINDOW,
    DTYPES,
    FLOPS_FACTOR,
    Inputs,
    Spec,
    fwd_flops,
    make_inputs,
    make_runner,
    provider_layout,
)
from .tables import table

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
CPU_PROVIDERS = [("fastzero_cpu", "ours"), ("fastzero_cpu_window", "ours"), ("dense", "peer"), ("sdpa", "peer")]
# dense_attention's forward + backward held 28 bytes per score at its peak (measured at seq 1K-4K, fp32);
# it is left out where that estimate passes DENSE_CPU_LIMIT
DENSE_BYTES_PER_SCORE = 28
DENSE_CPU_LIMIT = 3 * GiB


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
        search = self_timed("a search over subprocesses: run by python -m bench.run --kernel sparse_attention")
        provs = [Provider(p, kind, search) for p, kind in providers]
    else:  # harness users (pytest-benchmark, calibrate) get the forward + backward
        provs = [Provider(p, kind, functools.partial(make_runner, spec, p, data, "fwdbwd")) for p, kind in providers]
    return AttnCase(FAMILY.name, name, numel, 4 * numel * itemsize, provs, description, spec=spec, data=data)


def _describe_layout(spec: Spec, layout: torch.Tensor) -> str:
    left, right = window_extent(spec.nb, spec.density, spec.causal)
    kept = kept_fraction(layout, spec.causal)
    return f"window {left}+{right} blocks of {spec.layout_block} + first column, {kept:.1%} kept"


def gpu_cases(
    seqs,
    dims,
    densities,
    dtype="bf16",
    device="cuda",
    heads=GPU_HEADS,
    layout_block=GPU_LAYOUT_BLOCK,
    kernel_block=GPU_KERNEL_BLOCK,
    causal=False,
) -> list[AttnCase]:
    """The GPU family's cases (device="cpu" runs the same jobs on small shapes in the tests: Triton in its
    interpreter, SDPA's math, FlexAttention eager and forward only)."""
    out = []
    for seq in seqs:
        for dim in dims:
            for density in densities:
                spec = Spec("gpu", device, seq, heads, dim, dtype, density, layout_block, kernel_block, causal=causal)
                lay = provider_layout(spec, "fastzero")
                desc = (
                    f"{'causal' if causal else 'bidirectional'} {dtype}, batch 1, {heads} heads, seq {seq}, "
                    f"head_dim {dim}, {_describe_layout(spec, lay)}; fwd and fwd+bwd"
                )
                out.append(_case(spec, f"s{_fmt(seq)}-d{dim}-p{_pct(density)}", GPU_PROVIDERS, desc))
    return out


def cpu_cases(seqs, dtype="fp32", fit: bool = True) -> list[AttnCase]:
    out = []
    for seq in seqs:
        spec = Spec("cpu", "cpu", seq, CPU_HEADS, CPU_DIM, dtype, CPU_DENSITY, CPU_BLOCK, CPU_BLOCK, CPU_WINDOW)
        lay = provider_layout(spec, "fastzero_cpu")
        win = provider_layout(spec, "fastzero_cpu_window")
        path = "dense masked" if seq <= sa.DENSE_CPU_MAX_SEQ else "blocked"
        desc = (
            f"fp32 fwd+bwd, batch 1, {CPU_HEADS} heads, seq {seq}, head_dim {CPU_DIM}; fastzero_cpu: "
            f"{_describe_layout(spec, lay)}; fastzero_cpu_window: +-{CPU_WINDOW} block + first column, "
            f"{kept_fraction(win, False):.1%} kept; the op's {path} CPU path"
        )
        out.append(_case(spec, f"cpu-s{_fmt(seq)}-p{_pct(CPU_DENSITY)}", CPU_PROVIDERS, desc))
    if fit:
        spec = Spec("fit", "cpu", min(seqs), CPU_HEADS, CPU_DIM, dtype, CPU_DENSITY, CPU_BLOCK, CPU_BLOCK)
        desc = (
            f"the longest seq (doublings from {min(seqs)}) whose fwd+bwd fits {FIT_BUDGET / GiB:g} GiB, inputs "
            f"included (fp32, batch 1, {CPU_HEADS} heads, head_dim {CPU_DIM}); a doubling estimated over "
            f"{FIT_TIME_CAP:g} s is not run"
        )
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


def _rounds(spec: Spec, settings: Settings) -> tuple[int, int]:
    """(warm-up, timed rounds): fewer for the long jobs (a round of the 4K CPU case takes ~2 s, dense 1.6 of it)."""
    warmup, repeats = settings.warmup, settings.repeats
    if spec.kind == "cpu" and spec.seq >= 4096:
        return min(warmup, 1), min(repeats, 7 if spec.seq < 8192 else 5)
    if spec.kind == "gpu" and spec.seq >= 65536:
        return warmup, min(repeats, 10)
    return warmup, repeats


def dense_cpu_estimate(spec: Spec) -> int:
    return DENSE_BYTES_PER_SCORE * spec.batch * spec.heads * spec.seq * spec.seq


def _unavailable_here(spec: Spec, provider: str) -> str | None:
    if provider == "dense" and spec.device == "cpu" and dense_cpu_estimate(spec) > DENSE_CPU_LIMIT:
        return (
            f"would hold ~{dense_cpu_estimate(spec) / GiB:.1f} GiB ({DENSE_BYTES_PER_SCORE} B per score), over "
            f"the {DENSE_CPU_LIMIT / GiB:g} GiB this benchmark allows dense attention on the CPU"
        )
    return None


def measure(case: AttnCase, settings: Settings, say) -> tuple[list[dict], dict]:
    """The harness's checked, interleaved rounds per mode, then peak memory per provider
    (CUDA: in process; CPU: a subprocess), then rows with speedups of the same rounds."""
    spec = case.spec
    if spec.kind == "fit":
        return fit_rows(case, fit_search(case, say)), {}
    modes = ("fwd", "fwdbwd") if spec.kind == "gpu" else ("fwdbwd",)
    warmup, repeats = _rounds(spec, settings)
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
        runners = [
            Provider(p.name, p.kind, functools.partial(make_runner, spec, p.name, case.data, mode)) for p in providers
        ]
        sub = Case(case.kernel, f"{case.name} {mode}", case.numel, case.bytes, runners)
        res = run_case(sub, warmup=warmup, repeats=repeats, on_progress=say, slowdown=settings.slowdown)
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


def rows(case: AttnCase, timings: dict[str, dict], memory: dict[str, dict[str, int]]) -> list[dict]:
    """Result rows; per provider and mode (fwd, fwdbwd): ms, spread, TFLOP/s of the kept blocks (of the
    provider's own layout for fastzero_cpu_window; dense providers: also of the blocks they compute),
    peak bytes, and for fastzero's providers the speedup (and memory ratio) over each peer, round by round."""
    spec, out = case.spec, Rows(case, gated=False)
    row = out.add

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
                    row(name, f"{mode}_speedup_vs_{peer}", paired(pt.times, t.times))
                    peer_peak = memory.get(peer, {}).get(mode)
                    if peak and peer_peak:
                        row(name, f"{mode}_mem_vs_{peer}", peer_peak / peak)
    return out


FAMILY = Family(
    name="sparse_attention",
    description=(
        "block-sparse attention (Triton on CUDA, the reference path on the CPU) vs dense SDPA, FlexAttention and "
        "materialised dense attention; time, TFLOP/s of the kept blocks, peak memory, longest seq in a memory budget; "
        "not in --all (the CPU run takes minutes)"
    ),
    cases=cases,
    peers=("dense", "sdpa", "flex"),
    roofline=None,  # compute-bound: TFLOP/s of the kept blocks, no bandwidth probe
    devices=("cpu", "cuda"),
    in_all=False,
    measure=measure,
    table=table,
)
