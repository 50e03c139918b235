"""The sparse-attention family's Markdown: the timed cases' table (GPU: fwd and
fwd+bwd; CPU: fwd+bwd) and the memory-budget search's."""

from __future__ import annotations

from ...harness import format_size
from ...tables import fmt, row, skipped_lines
from .memory import FIT_TIME_CAP, MiB

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
    lines = [row(head), "|---|" + "---:|" * (len(head) - 1)]
    for prov, m in provs.items():
        cells = [prov, fmt(m.get("density"), ".1%")]
        for key, _ in modes:
            cells += [
                fmt(m.get(f"{key}_ms"), ".3f" if gpu else ".1f"),
                fmt(m.get(f"{key}_spread"), ".1%"),
                fmt(m.get(f"{key}_tflops"), ".1f" if gpu else ".2f", scale),
                fmt(m.get(f"{key}_peak_bytes"), ".1f", MiB),
            ]
        lines.append(row(cells))
    lines += skipped_lines(case_info, len(head))
    ours = [p for p in provs if p.startswith("fastzero")]
    peers = [p for p in provs if not p.startswith("fastzero")]
    if ours and peers:
        cols = [(f"{key}_speedup_vs_{q}", f"vs {q} {label}") for q in peers for key, label in modes]
        cols += [(f"{key}_mem_vs_{q}", f"memory: {q} / ours {label}") for q in peers for key, label in modes]
        cols = [(k, label) for k, label in cols if any(k in provs[p] for p in ours)]
        lines += [
            "",
            "fastzero against each peer (same rounds; memory: the peer's peak over fastzero's):",
            "",
            "| " + row([label for _, label in cols]),
            "|---|" + "---:|" * len(cols),
        ]
        for p in ours:
            lines.append(row([p, *(fmt(provs[p].get(k), ".2f") + ("x" if k in provs[p] else "") for k, _ in cols)]))
    return lines + ["", _LEGEND_GPU if gpu else _LEGEND_CPU]


def _fit_table(case_info: dict, provs: dict[str, dict]) -> list[str]:
    seqs = sorted(
        {int(k.removeprefix("peak_bytes_s")) for m in provs.values() for k in m if k.startswith("peak_bytes_s")}
    )
    head = ["provider", "longest seq that fits", "stopped by", "vs dense"] + [format_size(s) for s in seqs]
    lines = [row(head), "|---|" + "---:|" * 3 + "---:|" * len(seqs)]
    for prov, m in provs.items():
        cells = [
            prov,
            format_size(int(m["max_seq_fit"])) if m.get("max_seq_fit") else "none",
            str(m.get("limited_by", "")),
            fmt(m.get("fit_vs_dense"), ".0f") + ("x" if "fit_vs_dense" in m else ""),
        ]
        for s in seqs:
            if f"peak_bytes_s{s}" not in m:
                cells.append("")
                continue
            ms = m.get(f"fwdbwd_ms_s{s}")
            cell = f"{m[f'peak_bytes_s{s}'] / MiB:.0f} MiB" + (f", {ms / 1e3:.1f} s" if ms is not None else "")
            cells.append(cell if m.get(f"fits_s{s}") else f"over: {cell}")
        lines.append(row(cells))
    legend = (
        "Each provider searches in its own subprocess: seq doubles while one forward + backward (inputs "
        "included) stays within the budget, measured as in the timed cases (peak resident set over the "
        "process's before the inputs), under RLIMIT_DATA = budget + 64 MiB so a job past it fails its "
        f"allocation at once. 'time': the next doubling was estimated (4x the last) over {FIT_TIME_CAP:g} s and "
        "not run, so the true limit is at least the figure shown. Cells: peak memory and time (one thread) per seq "
        "tried; 'over': past the budget (or its allocation failed)."
    )
    return lines + ["", legend]
