"""Peak memory of the sparse-attention jobs: on a GPU torch's allocator
statistics in this process; on the CPU the peak resident set of a subprocess
(worker.py) that runs only the case's jobs, and the search of the longest
sequence whose forward + backward fits a budget."""

from __future__ import annotations

import dataclasses
import gc
import json
import subprocess

import torch

from fastzero.ops.sparse_attention import attention as sa

from ...harness import Rows, Unavailable
from ...jobs import ROOT, worker_command, worker_env
from .providers import Spec, make_step

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
FIT_BUDGET = 2 * GiB  # the longest seq whose forward + backward (inputs included) fits this
FIT_MAX_SEQ = 128 * KiB
FIT_TIME_CAP = 120.0  # s: no doubling whose forward + backward is estimated (4x the last: O(seq^2)) to take longer
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # every tensor over 64 KiB is its own mapping, unmapped when freed
# the memory subprocesses run one thread: on 2 shared cores a neighbour's burst stalls OpenMP's barriers (a 30 ms
# job took 10 s), which would stop the search's doublings early; their times only cap the search
WORKER_THREADS = 1
MARK = "@@sparse_attention@@"  # the worker's result line


def _run_worker(request: dict, timeout: float) -> dict:
    """Runs worker.py as a subprocess (python -m <bench>.kernels.sparse_attention.worker REQUEST) with glibc's
    mmap threshold fixed at 64 KiB and WORKER_THREADS threads; returns its result."""
    request = dict(request, threads=WORKER_THREADS, dense_max_seq=sa.DENSE_CPU_MAX_SEQ)
    proc = subprocess.run(
        worker_command("kernels.sparse_attention.worker", json.dumps(request)),
        cwd=ROOT,
        env=worker_env(**MALLOC_ENV),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith(MARK)), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"memory worker exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}")
    return json.loads(line[len(MARK) :])


def measure_cpu_memory(spec: Spec, providers: list[str]) -> dict[str, dict]:
    """Peak memory of one forward + backward per provider, measured in a subprocess that runs only these
    jobs, one after another: with every tensor over 64 KiB its own mapping (MALLOC_MMAP_THRESHOLD_), freed
    memory leaves the resident set, so the peak resident set (VmHWM, reset after a warm call and malloc_trim)
    less the resident set before the job's inputs were made is the peak of the tensors the job holds at once,
    inputs (q, k, v, dO) included, plus what the ops allocate outside torch (oneDNN scratch). Python's
    tracemalloc cannot see tensor memory; torch keeps no CPU allocator statistics."""
    return _run_worker({"job": "peak", "spec": dataclasses.asdict(spec), "providers": providers}, timeout=1800)


def measure_cuda_memory(case, providers: list[str], modes, say) -> dict[str, dict[str, int]]:
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


def fit_search(
    case, say, budget: int | None = None, max_seq: int | None = None, time_cap: float | None = None
) -> dict[str, dict]:
    """Per provider (its own subprocess), the seq-doubling search of worker.fit_search_one."""
    out = {}
    budget, max_seq, time_cap = budget or FIT_BUDGET, max_seq or FIT_MAX_SEQ, time_cap or FIT_TIME_CAP
    for p in case.providers:
        say(f"{case.name}: longest seq within {budget / MiB:g} MiB, {p.name} (a subprocess)")
        request = dict(job="fit", spec=dataclasses.asdict(case.spec), provider=p.name, budget=budget)
        out[p.name] = _run_worker(dict(request, max_seq=max_seq, time_cap=time_cap), timeout=3600)
    return out


def fit_rows(case, found: dict[str, dict]) -> list[dict]:
    """Per provider: max_seq_fit (0: not even the first), limited_by (memory, time or max_seq), and per seq
    tried: peak bytes, ms, whether it fit; fastzero's providers: max_seq_fit over dense's."""
    out = Rows(case, gated=False)
    best = {}
    for name, res in found.items():
        fits = [p["seq"] for p in res["points"] if p["fits"]]
        best[name] = max(fits, default=0)
        out.add(name, "max_seq_fit", best[name])
        out.add(name, "limited_by", res["limited_by"])
        for p in res["points"]:
            out.add(name, f"peak_bytes_s{p['seq']}", p["peak_bytes"])
            out.add(name, f"fits_s{p['seq']}", bool(p["fits"]))
            if "ms" in p:
                out.add(name, f"fwdbwd_ms_s{p['seq']}", p["ms"])
    for name in found:
        if name.startswith("fastzero") and best.get("dense"):
            out.add(name, "fit_vs_dense", best[name] / best["dense"])
    return out
