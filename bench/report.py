"""A Markdown perf-regression report with a PNG chart per kernel: each case's
providers in GB/s beside the bandwidth roofline measured in the same run."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from . import kernels
from .compare import Check
from .tables import bandwidth_table, fmt


def _table(rows: list[dict]) -> dict:
    """(kernel, case) -> provider -> metric -> value."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        out[(r["kernel"], r["case"])][r["provider"]][r["metric"]] = r["value"]
    return out


def chart(results: dict, path: Path) -> list[Path]:
    """One PNG per kernel; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = _table(results["rows"])
    written = []
    for kernel in sorted({k for k, _ in table}):
        cases = [c for k, c in table if k == kernel]
        if not any("gb_per_s" in m for c in cases for m in table[(kernel, c)].values()):
            continue  # not a bandwidth family (zero): its table says it all
        providers = [p for p in dict.fromkeys(p for c in cases for p in table[(kernel, c)]) if p != "roofline"]
        fig, ax = plt.subplots(figsize=(max(7, 2.2 * len(cases) + 2), 4))
        colors = {p: f"C{i}" for i, p in enumerate(providers)}
        width = 0.8 / max(1, len(providers))
        labelled = set()
        for x, c in enumerate(cases):
            present = [p for p in providers if "gb_per_s" in table[(kernel, c)].get(p, {})]
            left = x - width * len(present) / 2
            for j, prov in enumerate(present):
                label = None if prov in labelled else prov
                labelled.add(prov)
                ax.bar(
                    left + (j + 0.5) * width,
                    table[(kernel, c)][prov]["gb_per_s"],
                    width,
                    color=colors[prov],
                    label=label,
                )
            roof = table[(kernel, c)].get("roofline", {}).get("gb_per_s")
            if roof:
                label = "roofline (measured)" if x == 0 else None
                ax.hlines(roof, x - 0.45, x + 0.45, colors="black", linestyles="dashed", label=label)
        ax.set_xticks(range(len(cases)), cases)
        ax.set_ylabel("GB/s (bytes the job must move / time)")
        ax.set_title(f"{kernel} on {results['machine']['cpu']} ({results['machine']['torch_threads']} threads)")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        out = path.with_name(f"{path.stem}-{kernel}.png")
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)
    return written


def markdown(results: dict, checks: list[Check] | None, tolerance: float, path: Path) -> str:
    m = results["machine"]
    lines = [
        "# fastzero benchmark report",
        "",
        f"Commit `{m['git_sha']}` on {m['cpu']} ({m['cores']} cores, {m['torch_threads']} torch threads, "
        f"ISA path {m['isa']}); torch {m['torch']}, triton {m['triton']}, "
        f"deepspeed {m['deepspeed'] or 'not installed'}"
        + "".join(f", {peer} {m[peer]}" for peer in ("torchao", "bitsandbytes") if m.get(peer))
        + ".",
        "GB/s counts the bytes each case must move (read + written); the roofline is an in-place "
        "streaming kernel of Adam's shape measured in the same rounds; speedup = peer time / fastzero time.",
        "",
    ]
    table = _table(results["rows"])
    for case_info in results["cases"]:
        key = (case_info["kernel"], case_info["name"])
        provs = table[key]
        lines += [f"## {key[0]} / {key[1]}", "", case_info["description"], ""]
        # a family's own table; results of a family this checkout does not know get the bandwidth table
        render = kernels.load(key[0]).table if key[0] in kernels.KERNELS else bandwidth_table
        lines += [*render(case_info, provs), ""]
    if checks is not None:
        bad = [c for c in checks if c.status(tolerance) == "REGRESSION"]
        verdict = f"**REGRESSION** ({len(bad)} of {len(checks)} figures)" if bad else f"**ok** ({len(checks)} figures)"
        lines += [
            f"## Verdict against the baseline: {verdict}",
            "",
            f"Gated: fastzero's fraction of the roofline and speedup over each peer; tolerance {tolerance:.0%} drop.",
            "",
            "| kernel | case | metric | baseline | now | change | status |",
            "|---|---|---|---:|---:|---:|---|",
        ]
        for c in checks:
            lines.append(
                f"| {c.kernel} | {c.case} | {c.metric} | {c.baseline:.3f} | {fmt(c.current, '.3f')} | "
                f"{fmt(c.change, '+.1%')} | {c.status(tolerance)} |"
            )
        lines.append("")
    for png in chart(results, path):
        lines += [f"![{png.stem}]({png.name})", ""]
    text = "\n".join(lines)
    path.write_text(text)
    return text
