"""python -m bench.calibrate: how much the gated figures move from noise
alone, to set the regression tolerance (bench/compare.py).

Runs the quick suite N times in one process and reports, for every gated
figure, its median over the runs and the largest drop of a single run below
that median. The tolerance must sit above the largest drop (noise must never
fail CI) and below 20% (a 25% slowdown lowers every gated figure to 0.8x).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from collections import defaultdict
from pathlib import Path

from . import compare, kernels
from .family import Settings
from .machine import machine_info
from .run import SCHEMA


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {__package__}.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--json", type=Path, help="write every run's gated figures here")
    ap.add_argument(
        "--write-baseline",
        type=Path,
        metavar="PATH",
        help="write a baseline whose gated figures are the medians over the runs",
    )
    args = ap.parse_args(argv)
    settings = Settings(warmup=3, repeats=args.repeats, quick=True)
    values: dict[tuple, list[float]] = defaultdict(list)
    last_rows, last_cases = [], []
    for run in range(args.runs):
        last_rows, last_cases = [], []
        for family in kernels.families():
            if not family.in_all:  # what CI's `--all --quick` runs, and only that, is calibrated
                continue
            for case in family.cases(quick=True):
                rows, skipped = kernels.load(case.kernel).measure(case, settings, lambda _: None)
                last_cases.append(case.info(skipped))
                for row in rows:
                    last_rows.append(row)
                    if compare.gated(row):
                        values[(row["kernel"], row["case"], row["metric"])].append(row["value"])
        print(f"run {run + 1}/{args.runs} done", flush=True)
    worst = 0.0
    print(f"{'figure':<62} {'median':>8} {'max drop':>9} {'max rise':>9}")
    for key, vals in sorted(values.items()):
        med = statistics.median(vals)
        drop, rise = 1 - min(vals) / med, max(vals) / med - 1
        worst = max(worst, drop)
        print(f"{'/'.join(key):<62} {med:8.3f} {drop:9.1%} {rise:9.1%}")
    print(f"largest drop from noise: {worst:.1%}; tolerance in use: {compare.DEFAULT_TOLERANCE:.0%}")
    if args.json:
        args.json.write_text(json.dumps({"/".join(k): v for k, v in values.items()}, indent=1))
    if args.write_baseline:
        for row in last_rows:  # the last run's rows, gated figures replaced by the medians
            key = (row["kernel"], row["case"], row["metric"])
            if compare.gated(row):
                row["value"] = statistics.median(values[key])
        created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        stored = {"quick": True, "repeats": args.repeats, "runs": args.runs, "gated": "medians over the runs"}
        baseline = {
            "schema": SCHEMA,
            "created": created,
            "machine": machine_info(),
            "settings": stored,
            "cases": last_cases,
            "rows": last_rows,
        }
        args.write_baseline.write_text(json.dumps(baseline, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
