"""A ZeRO training step at world size 2 over Gloo: ``fastzero.initialize`` at
stages 0, 1 and 2 beside PyTorch DDP, FSDP2 (``fully_shard``, resharding
after forward off and on) and DeepSpeed ZeRO 1 and 2 where it imports, on one
model, data and world size: LAYERS x (Linear(w, w) + GELU), fp32, micro-batch
64 per rank, MSE loss on fixed random data, AdamW.

Each variant is its own 2-process job (bench/zero_worker.py): the processes
time their own steps, so this family does not use the harness's in-process
rounds; ``measure`` is the hook bench.run calls instead. The jobs run one
after another, so a neighbour's burst can hit one and not the others: the
only gated figure is fastzero stage 2's speed relative to the fastest torch
provider of the same run, never an absolute time.

Reported per variant: median ms/step and its spread, samples/s (global batch
/ step time), model-state bytes per rank (fastzero: its memory_breakdown();
peers: the storages of params, grads and optimizer state they hold after a
step), and for fastzero: the ZeRO formula for fp32 (stage 0: 16 psi; stage 1:
8 psi + 8 psi/N; stage 2: 4 psi + 12 psi/N; stage 2's bucket buffers come on
top and are shown apart), the fraction of gradient communication hidden
behind backward, and engine.step()'s time against the optimizer kernel alone
on the rank's shard plus the params' all-gather.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import Case, Provider, Timing, Unavailable

NAME = "zero"
DESCRIPTION = (
    "ZeRO stages 0-2 training step (2 ranks, Gloo) vs DDP, FSDP2, DeepSpeed; not in --all: 30-45 s of 2-process "
    "jobs that fill both cores, and its gated ratio moved up to 14% between quiet quick runs (CI allows 12%)"
)
DEVICES = ("cpu",)
IN_ALL = False  # see DESCRIPTION; run it with --kernel zero
WORLD = 2
LAYERS = 4
MICRO = 64
WIDTH, QUICK_WIDTH = 1024, 512
# step times of a 2-process job on 2 cores spread 10-20% (IQR/median): a job times 3 steps per --repeats
# (45 by default), more than a kernel call needs, for a steady median
STEPS_PER_REPEAT = 3
BUCKET = 2_000_000  # elements: 3 buckets at width 1024
# provider -> its variants (row names); the worker takes the variant
VARIANTS = {
    "fastzero": {"fastzero-s0": 0, "fastzero-s1": 1, "fastzero-s2": 2},
    "ddp": {"ddp": None},
    "fsdp2": {"fsdp2": "keep", "fsdp2-reshard": "reshard"},
    "deepspeed": {"deepspeed-s1": 1, "deepspeed-s2": 2},
}
TORCH = ("ddp", "fsdp2", "fsdp2-reshard")
WORKER = Path(__file__).resolve().parents[1] / "zero_worker.py"
ROOT = WORKER.parents[1]
MiB = 1 << 20


def params(width: int) -> int:
    return LAYERS * (width * width + width)


def bucket(psi: int) -> int:
    """reduce_bucket_size: BUCKET, or psi // 2 for smaller models, so there are always several buckets."""
    return min(BUCKET, psi // 2)


def formula_bytes(stage: int, psi: int, n: int = WORLD) -> float:
    """Model-state bytes per rank from the ZeRO paper, for fp32 training with
    Adam: params 4, grads 4, exp_avg + exp_avg_sq 8 bytes per param."""
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n}[stage]


def _self_timed() -> None:
    raise Unavailable("a multi-process job: timed by python -m bench.run --kernel zero, not per call")


def cases(sizes=None, dtypes=None, quick=False, device="cpu") -> list[Case]:
    """One case per hidden width (``--sizes`` are widths here; fp32 only)."""
    out = []
    for w in sizes or [QUICK_WIDTH if quick else WIDTH]:
        psi = params(w)
        provs = [Provider(p, "ours" if p == "fastzero" else "peer", _self_timed) for p in VARIANTS]
        desc = (f"{LAYERS} x (Linear({w},{w}) + GELU), {psi / 1e6:.2f}M params fp32, micro-batch {MICRO} x "
                f"{WORLD} ranks (Gloo), AdamW, reduce bucket {bucket(psi):,} elements")  # fmt: skip
        out.append(Case(NAME, f"mlp{LAYERS}x{w}", psi, 0, provs, desc))
    return out


class JobFailed(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(spec: dict, timeout: float) -> dict:
    """Runs one variant as WORLD processes with torchrun's variables, one
    thread each; returns rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(spec, out=os.path.join(tmp, "result.json"))
        port = str(_free_port())
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        logs = [Path(tmp, f"rank{rank}.log") for rank in range(WORLD)]
        procs = []
        for rank, log in enumerate(logs):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_PORT=port,
                       MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1", PYTHONPATH=path)  # fmt: skip
            with open(log, "w") as f:  # a file, not a pipe: no rank blocks on its output
                procs.append(subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], env=env, stdout=f,
                                              stderr=subprocess.STDOUT))  # fmt: skip
        deadline = time.monotonic() + timeout
        try:
            codes = [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in procs]
        except subprocess.TimeoutExpired:
            codes = None
        finally:
            for p in procs:
                p.kill()
                p.wait()
        for rank, log in enumerate(logs):
            if codes is None or codes[rank]:
                why = f"timed out after {timeout:.0f} s" if codes is None else f"exited {codes[rank]}"
                raise JobFailed(f"rank {rank} {why}: {log.read_text().strip()[-1500:]}")
        with open(spec["out"]) as f:
            return json.load(f)


def measure(case: Case, args, say) -> tuple[list[dict], dict]:
    """bench.run's hook for this family: runs every variant of the case's
    providers (those not --skip'ped), returns (rows, skipped)."""
    width = int(case.name.rsplit("x", 1)[1])
    spec = dict(width=width, layers=LAYERS, micro=MICRO, bucket=bucket(case.numel),
                warmup=args.warmup, steps=STEPS_PER_REPEAT * args.repeats, slowdown=args.inject_slowdown)  # fmt: skip
    results, skipped = {}, {}
    for prov in case.providers:
        for name, variant in VARIANTS[prov.name].items():
            if name in args.skip:  # a single variant, e.g. --skip fsdp2-reshard
                continue
            say(f"{case.name}: {name} ({WORLD} processes)")
            try:
                res = run_job(dict(spec, provider=prov.name, variant=variant), timeout=120 if args.quick else 600)
            except JobFailed as exc:
                if prov.kind == "ours":
                    raise
                skipped[name] = f"failed: {exc}"  # a peer's failure is reported, not ours to fail on
                continue
            if "skipped" in res:
                skipped[name] = res["skipped"]
            else:
                results[name] = res
    return rows(case, results), skipped


def rows(case: Case, results: dict[str, dict]) -> list[dict]:
    out = []

    def row(provider, metric, value, **more):
        out.append(dict(kernel=case.kernel, case=case.name, provider=provider, metric=metric, value=value, **more))

    psi = case.numel
    medians = {}
    for name, res in results.items():
        t = Timing(name, "ours" if name.startswith("fastzero") else "peer", res["times"])
        medians[name] = t.median
        row(name, "median_ms", t.median * 1e3)
        row(name, "spread", t.spread)
        row(name, "samples_per_s", MICRO * WORLD / t.median)
        row(name, "timed_steps", len(res["times"]))
        row(name, "model_state_bytes", res["model_state_bytes"])
        if name.startswith("fastzero"):
            stage = VARIANTS["fastzero"][name]
            ex = res["extra"]
            formula = formula_bytes(stage, psi)
            row(name, "grad_bucket_bytes", res["grad_bucket_bytes"])
            row(name, "zero_formula_bytes", formula)
            row(name, "of_zero_formula", (res["model_state_bytes"] - res["grad_bucket_bytes"]) / formula)
            row(name, "grad_comm_hidden", ex["hidden_frac"])
            row(name, "step_call_ms", ex["step_ms"])
            row(name, "kernel_ms", ex["kernel_ms"])
            row(name, "allgather_ms", ex["allgather_ms"])
            row(name, "step_over_kernel_allgather", ex["step_ms"] / (ex["kernel_ms"] + ex["allgather_ms"]))
    torch_best = min((medians[n] for n in TORCH if n in medians), default=None)
    for name in [n for n in medians if n.startswith("fastzero")]:
        for peer in [n for n in medians if not n.startswith("fastzero")]:
            row(name, f"speedup_vs_{peer}", medians[peer] / medians[name])
        if torch_best is not None:
            # the gated figure: one ratio of the same run, against whichever torch provider was fastest
            row(name, "speedup_vs_fastest_torch", torch_best / medians[name], gated=name == "fastzero-s2")
    return out


def table(case_info: dict, provs: dict[str, dict[str, float]]) -> list[str]:
    """Markdown for bench.run's terminal output and report."""

    def f(v, spec, scale=1.0):
        return "" if v is None else format(v / scale, spec)

    lines = [
        "| provider | ms/step | spread | samples/s | model states MiB/rank | ZeRO formula MiB | of formula "
        "| bucket buffers MiB | grad comm hidden | step() ms | kernel ms | all-gather ms | step / (kernel + AG) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for prov, m in provs.items():
        g = m.get
        lines.append(
            f"| {prov} | {f(g('median_ms'), '.1f')} | {f(g('spread'), '.1%')} | {f(g('samples_per_s'), '.0f')} | "
            f"{f(g('model_state_bytes'), '.1f', MiB)} | {f(g('zero_formula_bytes'), '.1f', MiB)} | "
            f"{f(g('of_zero_formula'), '.2f')} | {f(g('grad_bucket_bytes'), '.1f', MiB)} | "
            f"{f(g('grad_comm_hidden'), '.0%')} | {f(g('step_call_ms'), '.1f')} | {f(g('kernel_ms'), '.1f')} | "
            f"{f(g('allgather_ms'), '.1f')} | {f(g('step_over_kernel_allgather'), '.2f')} |"
        )
    for prov, why in case_info.get("skipped", {}).items():
        lines.append(f"| {prov} | skipped: {why} |" + " |" * 12)
    ours = [p for p in provs if p.startswith("fastzero")]
    peers = [p for p in provs if not p.startswith("fastzero")]
    if ours and peers:
        lines += ["", "Speedup of fastzero (peer time / fastzero time, same run):", "",
                  "| | " + " | ".join(peers) + " | fastest torch |", "|---|" + "---:|" * (len(peers) + 1)]  # fmt: skip
        for p in ours:
            cells = [f(provs[p].get(f"speedup_vs_{q}"), ".2f") + "x" for q in peers]
            best = provs[p].get("speedup_vs_fastest_torch")
            lines.append(f"| {p} | " + " | ".join(cells) + f" | {f(best, '.2f')}{'x' if best else ''} |")
    return lines + ["", LEGEND]


LEGEND = (
    f"ms/step: median of rank 0's timed steps (forward + backward + step); spread: IQR / median; samples/s: "
    f"{MICRO * WORLD} / step time. Model states: bytes held per rank between steps (fastzero: the sum of "
    "memory_breakdown(); peers: the distinct storages of their params, grads "
    "and optimizer state, DTensor local shards, DeepSpeed's flat buffers). ZeRO formula (fp32 Adam, N ranks): "
    "16 psi, 8 psi + 8 psi/N, 4 psi + 12 psi/N; 'of formula' leaves the bucket buffers out. Grad comm hidden: the "
    "share of the gradient collectives' time (launch to done) before backward ended. step(): engine.step(); "
    "kernel: the Adam kernel alone over the rank's shard; all-gather: the span of the params' all-gathers."
)
