"""1-bit Adam's compressed all-reduce against ``dist.all_reduce`` in fp32 and
fp16 over Gloo (``--kernel onebit`` runs these cases too, after its kernels).

CPU only, each case its own job of `world` processes over Gloo
(bench/onebit_worker.py, one thread each): ``fastzero.comm.compressed_allreduce``
beside ``dist.all_reduce`` of the fp32 tensor and of an fp16 copy (cast
untimed), checked first. Per provider: median ms per call (the slowest rank's
time, each call started together after a barrier, interleaved rounds after a
warm-up), bytes sent per rank per call (the comm layer's ``wire_bytes``), the
compressed call's own pack + unpack time, and a model: wire bytes / link rate
at 10 and 100 Gb/s (no latency, no compute; the ``+compute`` figure adds the
compressed call's pack + unpack time measured here). World 4 runs 4 processes
on however many cores the machine has: on 2 cores they are oversubscribed.

Sizes: 1M, 4M, 16M, 64M elements at world 2 and 4; ``--quick``: 1M at world
2; ``--sizes`` as given.

Not gated (every row carries ``gated: False``): loopback times of several
processes on shared cores are too noisy, and the bytes are exact.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

from ..family import Family, Settings
from ..harness import Case, Provider, Rows, Timing, paired, self_timed
from ..harness import format_size as _fmt
from ..jobs import JobFailed, run_ranks
from ..tables import fmt, row, skipped_lines

M = 1 << 20
SIZES, QUICK_SIZES = [1 * M, 4 * M, 16 * M, 64 * M], [1 * M]
WORLDS, QUICK_WORLDS = [2, 4], [2]
PROVIDERS = [("compressed", "ours"), ("fp32", "peer"), ("fp16", "peer")]
LINKS = {"10gbps": 10e9 / 8, "100gbps": 100e9 / 8}  # bytes per second
WORKER = "onebit_worker"  # a module of the bench package, run as each rank


def run_job(spec: dict, world: int, timeout: float) -> dict:
    """Runs bench/onebit_worker.py as `world` ranks; rank 0's result (JobFailed with the failing rank's log, or
    the check's message)."""
    result = run_ranks(WORKER, spec, world, timeout)
    if "error" in result:
        raise JobFailed(f"the check before timing failed: {result['error']}")
    return result


@dataclass
class AllReduceCase(Case):
    world: int = 2


def cases(sizes=None, dtypes=None, quick=False, device="cpu") -> list[Case]:
    """One case per world size and tensor size (fp32 elements)."""
    out = []
    timed_here = self_timed("a multi-process job: timed by python -m bench.run --kernel onebit (or onebit_allreduce)")
    for world in QUICK_WORLDS if quick else WORLDS:
        for n in sizes or (QUICK_SIZES if quick else SIZES):
            provs = [Provider(p, kind, timed_here) for p, kind in PROVIDERS]
            cores = os.cpu_count() or 1
            desc = (
                f"all-reduce of {_fmt(n)} fp32 elements at world {world} over Gloo on this machine's loopback "
                f"({world} processes, one thread each, on {cores} cores"
                f"{': oversubscribed' if world > cores else ''}); compressed: 1-bit both ways with error "
                f"feedback; fp32 and fp16: dist.all_reduce"
            )
            out.append(AllReduceCase(FAMILY.name, f"w{world}-{_fmt(n)}", n, 4 * n, provs, desc, world=world))
    return out


def _calls(numel: int, repeats: int) -> tuple[int, int]:
    """(warm-up, timed calls) per provider: fewer for the big tensors (a round of the 64M case takes about a
    second at world 4 on 2 cores; loopback times spread 10-50% there, so no fewer than 9)."""
    if numel >= 64 * M:
        return 1, min(repeats, 9)
    if numel >= 16 * M:
        return 2, min(repeats, 11)
    return 3, repeats


def measure(case: AllReduceCase, settings: Settings, say) -> tuple[list[dict], dict]:
    """The all-reduce cases: one job of case.world processes."""
    providers = [p.name for p in case.providers]
    if not providers:
        return [], {}
    warmup, calls = _calls(case.numel, settings.repeats)
    unit = 8 * case.world  # the check's tensor: at most 1M elements, whole bytes of bits per rank (no padding)
    spec = dict(
        sizes=[case.numel],
        providers=providers,
        warmup=min(settings.warmup, warmup),
        calls={case.numel: calls},
        slowdown=settings.slowdown,
        check_numel=max(unit, min(case.numel, M) // unit * unit),
    )
    say(f"{case.name}: {case.world} processes over Gloo")
    res = run_job(spec, case.world, timeout=300 if settings.quick else 900)
    return rows(case, res["sizes"][str(case.numel)]), {}


def rows(case: AllReduceCase, res: dict) -> list[dict]:
    """Per provider: median ms, spread, bytes sent per rank per call, the link models; compressed: its pack +
    unpack ms, its bytes and speed relative to fp32 and fp16 (same rounds), and the modelled speedups."""
    out = Rows(case, gated=False)
    timings = {p: Timing(p, "ours" if p == "compressed" else "peer", r["times"]) for p, r in res.items()}
    compute = statistics.median(res["compressed"]["compute_times"]) if "compressed" in res else 0.0
    for p, r in res.items():
        t = timings[p]
        out.add(p, "median_ms", t.median * 1e3)
        out.add(p, "spread", t.spread)
        out.add(p, "timed_calls", len(t.times))
        out.add(p, "wire_bytes", r["wire_bytes"])
        out.add(p, "collectives", r["collectives"])
        for link, rate in LINKS.items():
            out.add(p, f"model_ms_{link}", r["wire_bytes"] / rate * 1e3)
        if p == "compressed":
            out.add(p, "compute_ms", compute * 1e3)
            out.add(p, "scale_bytes", r["scale_bytes"])
            for link, rate in LINKS.items():
                out.add(p, f"model_ms_{link}_with_compute", (r["wire_bytes"] / rate + compute) * 1e3)
    if "compressed" in res:
        ours, sent = timings["compressed"], res["compressed"]["wire_bytes"]
        for peer in [p for p in res if p != "compressed"]:
            out.add("compressed", f"speedup_vs_{peer}", paired(timings[peer].times, ours.times))
            out.add("compressed", f"bytes_vs_{peer}", res[peer]["wire_bytes"] / sent)
            for link, rate in LINKS.items():  # the bytes alone: bytes_vs_{peer} at any rate
                modelled = res[peer]["wire_bytes"] / rate / (sent / rate + compute)
                out.add("compressed", f"model_speedup_vs_{peer}_{link}_with_compute", modelled)
    return out


def _mib(v) -> str:
    return "" if v is None else f"{v / M:.3f} MiB" if v < 10 * M else f"{v / M:.1f} MiB"


def table(case_info: dict, provs: dict[str, dict[str, float]]) -> list[str]:
    head = [
        "provider",
        "bytes sent/rank",
        "ms/call",
        "spread",
        "pack+unpack ms",
        "model 10 Gb/s ms",
        "model 100 Gb/s ms",
    ]
    lines = [row(head), "|---|" + "---:|" * (len(head) - 1)]
    for prov, m in provs.items():
        cells = [
            prov,
            _mib(m.get("wire_bytes")),
            fmt(m.get("median_ms"), ".2f"),
            fmt(m.get("spread"), ".1%"),
            fmt(m.get("compute_ms"), ".2f"),
            fmt(m.get("model_ms_10gbps"), ".2f"),
            fmt(m.get("model_ms_100gbps"), ".3f"),
        ]
        lines.append(row(cells))
    lines += skipped_lines(case_info, len(head))
    c = provs.get("compressed", {})
    peers = [p for p in provs if p != "compressed" and f"speedup_vs_{p}" in c]
    if peers:
        lines += [
            "",
            "compressed against each peer (peer / compressed). Model + compute: the peer's modelled time "
            "over the compressed call's modelled time plus its pack + unpack time measured here (the bytes "
            "alone give the 'fewer bytes' ratio at any link rate):",
            "",
            "| vs | fewer bytes | loopback speed | model + compute, 10 Gb/s | model + compute, 100 Gb/s |",
            "|---|---:|---:|---:|---:|",
        ]
        for p in peers:
            cells = [f"{c[f'bytes_vs_{p}']:.1f}x", f"{c[f'speedup_vs_{p}']:.2f}x"]
            cells += [f"{c[f'model_speedup_vs_{p}_{link}_with_compute']:.2f}x" for link in LINKS]
            lines.append(row([p, *cells]))
    legend = (
        "ms/call: median over the timed calls of the slowest rank's time, every call started on all ranks together "
        "(a barrier) in interleaved rounds after a warm-up. Bytes sent per rank per call: the comm layer's "
        "wire_bytes (what a bandwidth-optimal ring algorithm sends; Gloo's own algorithm may send otherwise). "
        "compressed: fastzero.comm.compressed_allreduce (fp32 in, the average out, error buffers updated); fp32 / "
        "fp16: dist.all_reduce of the tensor (fp16: a copy cast before the call, not timed). Model ms: bytes sent / "
        "link rate (10 Gb/s = 1.25 GB/s, 100 Gb/s = 12.5 GB/s), a model that ignores latency and compute."
    )
    return lines + ["", legend]


FAMILY = Family(
    name="onebit_allreduce",
    description=(
        "1-bit Adam's compressed all-reduce vs dist.all_reduce fp32/fp16 over Gloo at world 2 and 4 (also run by "
        "--kernel onebit); bytes sent per rank, time per call, 10/100 Gb/s link model; not in --all"
    ),
    cases=cases,
    peers=("fp32", "fp16"),
    roofline=None,
    in_all=False,
    measure=measure,
    table=table,
)
