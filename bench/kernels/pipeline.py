"""Pipeline-parallel training on 4 processes over Gloo (one thread each): a
GPT-like stack (token + position embedding, pre-norm causal attention
blocks, a norm + vocabulary head; 8 layers: hidden 128, 4 heads, 6 blocks,
sequence 64, vocabulary 512, micro-batch 2, fp32 AdamW) at pipe=4 and at
pipe=2 x data=2, with m = 4, 8, 16 micro-batches. ``--quick``: hidden 32,
2 heads, sequence 16, vocabulary 64, m = 4 only.

One 4-process job per (layout, m) (bench/pipeline_worker.py), its
providers timed in interleaved rounds of one ``train_batch`` each:

* ``fastzero-1f1b``, ``fastzero-interleaved`` (2 virtual stages per rank),
  ``fastzero-zb-h1``: ``fastzero.initialize`` on a ``PipelineModule``;
* ``deepspeed-1f1b``: DeepSpeed's ``PipelineEngine`` (where it imports: run
  the bench with a Python that has DeepSpeed and ``DS_ACCELERATOR=cpu``);
* ``torch-gpipe``, ``torch-1f1b``, ``torch-interleaved``, ``torch-zb``:
  ``torch.distributed.pipelining`` (ScheduleGPipe, Schedule1F1B,
  ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble), the data axis's
  gradient all-reduce done by hand.

Each provider's first-step loss must equal the single-process model's on
the same global batch (rtol 1e-5) before anything is timed.

Reported per provider: ms/step (median over rounds of the slowest rank's
step), spread, the measured bubble (each rank's time waiting for a
neighbour / its step time; mean and max over ranks, medians over rounds),
the schedule's theory (fastzero's simulator, forward 1 / backward 2, for
the schedule of the same name; none for torch's zero-bubble, which
fastzero does not simulate), peak saved-activation bytes per stage (the
tensors autograd keeps for backward, params left out, max over a stage's
data ranks), and each fastzero schedule's speedup over the faster peer of
the same schedule.

Not in ``--all``: 4 processes on a 2-core machine for minutes.
"""

from __future__ import annotations

import statistics

from ..family import Family, Settings
from ..harness import Case, Provider, Rows, Timing, paired, self_timed
from ..jobs import run_ranks
from ..tables import fmt, row, skipped_lines

WORKER = "pipeline_worker"
WORLD = 4
LAYOUTS = {"pipe4": (4, 1), "pipe2xdata2": (2, 2)}
MICRO_BATCHES = (4, 8, 16)
FULL = dict(hidden=128, heads=4, blocks=6, seq=64, vocab=512, micro=2)
QUICK = dict(hidden=32, heads=2, blocks=6, seq=16, vocab=64, micro=2)
PROVIDERS = (
    "fastzero-1f1b",
    "fastzero-interleaved",
    "fastzero-zb-h1",
    "deepspeed-1f1b",
    "torch-gpipe",
    "torch-1f1b",
    "torch-interleaved",
    "torch-zb",
)
# the fastzero schedule each peer schedule is held against (targets: at least as fast as the faster peer)
SAME = {"1f1b": ("deepspeed-1f1b", "torch-1f1b"), "interleaved": ("torch-interleaved",), "zb-h1": ("torch-zb",)}
# the simulated schedule of each provider's (torch's interleaved zero-bubble is not one fastzero simulates)
THEORY = {p: p.split("-", 1)[1] for p in PROVIDERS if p != "torch-zb"} | {"torch-gpipe": "1f1b"}
BUBBLE_TOL = 0.10  # measured bubble within 10% of theory (relative)
MiB = 1 << 20


def theory(provider: str, m: int, pipe: int) -> float | None:
    """The simulated bubble fraction of `provider`'s schedule (GPipe's equals 1F1B's: (p-1)/(m+p-1))."""
    from fastzero.pipe.simulate import simulate_schedule

    name = THEORY.get(provider)
    if name is None:
        return None
    return float(simulate_schedule(name, m, pipe, 2 if name == "interleaved" else 1).bubble_fraction)


def cases(sizes=None, dtypes=None, quick=False, device="cpu") -> list[Case]:
    """One case per layout and micro-batch count (``--sizes``: micro-batch counts)."""
    timed_here = self_timed("a multi-process job: timed by python -m bench.run --kernel pipeline, not per call")
    shape = QUICK if quick else FULL
    out = []
    for layout, (pipe, data) in LAYOUTS.items():
        for m in sizes or ((4,) if quick else MICRO_BATCHES):
            if m % pipe:
                raise SystemExit(f"--sizes {m}: the interleaved schedules need a multiple of the {pipe} stages")
            provs = [Provider(p, "ours" if p.startswith("fastzero") else "peer", timed_here) for p in PROVIDERS]
            desc = (
                f"GPT-like {shape['blocks']} blocks + embedding + head, hidden {shape['hidden']}, {shape['heads']} "
                f"heads, seq {shape['seq']}, vocab {shape['vocab']}, micro-batch {shape['micro']}, fp32 AdamW; "
                f"pipe={pipe} x data={data} (4 ranks, Gloo), m={m}"
            )
            out.append(Case("pipeline", f"{layout}-m{m}-h{shape['hidden']}", 0, 0, provs, desc))
    return out


def _spec(case: Case, settings: Settings) -> dict:
    layout, m, _ = case.name.split("-")
    pipe, data = LAYOUTS[layout]
    base = QUICK if settings.quick else FULL
    return dict(
        base,
        pipe=pipe,
        data=data,
        m=int(m[1:]),
        warmup=settings.warmup,
        steps=settings.repeats,
        slowdown=settings.slowdown,
    )


def measure(case: Case, settings: Settings, say) -> tuple[list[dict], dict]:
    spec = _spec(case, settings)
    spec["providers"] = [p.name for p in case.providers if p.name not in settings.skip]
    say(f"{case.name}: {', '.join(spec['providers'])} ({WORLD} processes)")
    res = run_ranks(WORKER, spec, WORLD, timeout=600 if settings.quick else 3600)
    return rows(case, spec, res), res["skipped"]


def rows(case: Case, spec: dict, res: dict) -> list[dict]:
    out = Rows(case, gated=False)  # nothing gated: 4 processes on 2 shared cores are too noisy for a baseline
    times = {}
    for name, got in res["providers"].items():
        t = Timing(name, "ours" if name.startswith("fastzero") else "peer", got["times"])
        times[name] = got["times"]
        idle = got["idle"]  # per timed round: each rank's waited / step time
        mean = statistics.median(statistics.mean(r) for r in idle)
        worst = statistics.median(max(r) for r in idle)
        out.add(name, "median_ms", t.median * 1e3)
        out.add(name, "spread", t.spread)
        out.add(name, "timed_steps", len(got["times"]))
        out.add(name, "bubble_mean", mean)
        out.add(name, "bubble_max", worst)
        want = theory(name, spec["m"], spec["pipe"])
        out.add(name, "bubble_theory", want)
        if want is not None:
            out.add(name, "bubble_of_theory", mean / want)
            out.add(name, "bubble_target_met", float(abs(mean - want) <= BUBBLE_TOL * want))
        peak = got["peak_saved_bytes"]  # per rank; rank = stage x data + data rank
        for stage in range(spec["pipe"]):
            out.add(name, f"peak_act_bytes_stage{stage}", max(peak[stage * spec["data"] : (stage + 1) * spec["data"]]))
    for sched, peers in SAME.items():
        ours = f"fastzero-{sched}"
        ran = [p for p in peers if p in times]
        if ours not in times or not ran:
            continue
        fastest = min(ran, key=lambda p: statistics.median(times[p]))
        ratio = paired(times[fastest], times[ours])
        out.add(ours, "speedup_vs_faster_peer", ratio, peer=fastest)
        out.add(ours, "speed_target_met", float(ratio >= 1.0))
    if "fastzero-zb-h1" in times and "fastzero-1f1b" in times:
        zb = statistics.median(statistics.mean(r) for r in res["providers"]["fastzero-zb-h1"]["idle"])
        one = statistics.median(statistics.mean(r) for r in res["providers"]["fastzero-1f1b"]["idle"])
        out.add("fastzero-zb-h1", "bubble_below_1f1b", float(zb < one))
    return out


def table(case_info: dict, provs: dict[str, dict[str, float]]) -> list[str]:
    stages = sorted({k for m in provs.values() for k in m if k.startswith("peak_act_bytes_stage")})
    cols = [
        ("ms/step", "median_ms", ".1f", 1.0),
        ("spread", "spread", ".1%", 1.0),
        ("bubble mean", "bubble_mean", ".3f", 1.0),
        ("bubble max", "bubble_max", ".3f", 1.0),
        ("theory", "bubble_theory", ".3f", 1.0),
        ("mean / theory", "bubble_of_theory", ".2f", 1.0),
        *[(f"act MiB s{k.removeprefix('peak_act_bytes_stage')}", k, ".2f", MiB) for k in stages],
        ("vs faster peer", "speedup_vs_faster_peer", ".2f", 1.0),
    ]
    lines = [row(["provider", *(c[0] for c in cols)]), "|---|" + "---:|" * len(cols)]
    for prov, m in provs.items():
        lines.append(row([prov, *(fmt(m.get(key), spec, scale) for _, key, spec, scale in cols)]))
    lines += skipped_lines(case_info, len(cols) + 1)
    verdicts = []
    for sched in SAME:
        met = provs.get(f"fastzero-{sched}", {}).get("speed_target_met")
        if met is not None:
            verdicts.append(f"{sched} speed {'met' if met else 'MISSED'}")
    for prov, m in provs.items():
        if "bubble_target_met" in m and prov.startswith("fastzero"):
            met = "met" if m["bubble_target_met"] else "MISSED"
            verdicts.append(f"{prov.removeprefix('fastzero-')} bubble within 10% of theory: {met}")
    below = provs.get("fastzero-zb-h1", {}).get("bubble_below_1f1b")
    if below is not None:
        verdicts.append(f"zb-h1 bubble below 1f1b's: {'met' if below else 'MISSED'}")
    if verdicts:
        lines += ["", "Targets: " + "; ".join(verdicts) + "."]
    return lines + ["", LEGEND]


LEGEND = (
    "ms/step: median over rounds of the slowest rank's train_batch (forward, backward, the data axis's gradient "
    "reduction, AdamW step), the providers stepping in turn, one step each per round; spread: IQR / median. "
    "Bubble: each rank's time waiting for a neighbour over its step time (fastzero: engine.bubble['measured'], its "
    "receives; DeepSpeed: its RecvActivation/RecvGrad instructions; torch: every point-to-point wait of its "
    "schedule, sends too), mean and max over the 4 ranks, median over rounds; theory: fastzero's simulator of the "
    "same-named schedule (forward 1, backward 2, no communication cost; GPipe's equals 1F1B's); mean / theory "
    "target: within 10%. act MiB sK: stage K's peak bytes of tensors saved for backward during one train_batch "
    "(saved-tensor hooks; storages counted once, params left out; the larger of a stage's data ranks). vs faster "
    "peer: the faster (by median) peer of the same schedule's time over fastzero's, median of per-round ratios "
    "(1f1b: deepspeed-1f1b, torch-1f1b; interleaved: torch-interleaved; zb-h1: torch-zb, torch's interleaved "
    "zero-bubble schedule, the nearest it has)."
)

FAMILY = Family(
    "pipeline",
    "pipeline-parallel GPT-like training on 4 ranks (pipe=4, pipe=2 x data=2; m=4,8,16): fastzero's 1f1b, "
    "interleaved, zb-h1 vs DeepSpeed's PipelineEngine and torch.distributed.pipelining; not in --all (4 processes)",
    cases,
    tuple(p for p in PROVIDERS if not p.startswith("fastzero")),
    None,
    in_all=False,
    measure=measure,
    table=table,
)
