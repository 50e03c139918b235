"""Markdown and terminal lines of a case's results: the bandwidth families'
table and summary (every family whose cases run the harness's rounds), and
the cell formatting the families' own tables share.

A table takes ``case_info`` (the results' case entry: its ``skipped``
providers) and ``provs`` (provider -> metric -> value) and returns lines."""

from __future__ import annotations


def fmt(value, spec: str, scale: float = 1.0) -> str:
    """A cell: ``value / scale`` formatted, empty where there is no value."""
    return "" if value is None else format(value / scale, spec)


def row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def skipped_lines(case_info: dict, columns: int) -> list[str]:
    """One row per skipped provider, its reason in the second cell, `columns` cells in all."""
    return [f"| {prov} | skipped: {why} |" + " |" * (columns - 2) for prov, why in case_info.get("skipped", {}).items()]


def speedups(metrics: dict[str, float]) -> list[tuple[str, float]]:
    """(peer, peer time / this time) of each ``speedup_vs_PEER`` metric."""
    return [(k.removeprefix("speedup_vs_"), v) for k, v in metrics.items() if k.startswith("speedup_vs_")]


def bandwidth_table(case_info: dict, provs: dict[str, dict[str, float]]) -> list[str]:
    """Per provider: time, spread, Gparam/s, GB/s, fraction of the roofline, speedups over the peers."""
    lines = [
        "| provider | median ms | spread | Gparam/s | GB/s | of roofline | speedups |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for prov, m in provs.items():
        lines.append(
            row(
                [
                    prov,
                    fmt(m.get("median_ms"), ".2f"),
                    fmt(m.get("spread"), ".1%"),
                    fmt(m.get("gparams_per_s"), ".3f"),
                    fmt(m.get("gb_per_s"), ".1f"),
                    fmt(m.get("frac_roofline"), ".2f"),
                    ", ".join(f"{peer} {v:.2f}x" for peer, v in speedups(m)),
                ]
            )
        )
    return lines + skipped_lines(case_info, 7)


def bandwidth_summary(case_info: dict, provs: dict[str, dict[str, float]]) -> list[str]:
    """The terminal's shorter form of bandwidth_table: one line per provider."""
    out = []
    for prov, m in provs.items():
        extra = "".join(f"  {peer} {v:.2f}x" for peer, v in speedups(m))
        frac = f"  {m['frac_roofline']:.2f} of roofline" if "frac_roofline" in m else ""
        out.append(f"  {prov:<15} {m['median_ms']:8.2f} ms ±{m['spread']:5.1%}  {m['gb_per_s']:6.1f} GB/s{frac}{extra}")
    return out + [f"  {prov:<15} skipped: {why}" for prov, why in case_info.get("skipped", {}).items()]
