"""python -m bench.run: time fastzero's kernels beside their peers, check
each against the reference first, write JSON, compare with a baseline and
write a Markdown report.

    python -m bench.run --kernel cpu_adam
    python -m bench.run --all --quick --baseline bench/baselines/cpu-quick.json --report out/report.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from . import compare, kernels, report
from .harness import parse_size, run_case
from .machine import machine_info

SCHEMA = 1


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 1M, 16M, 65536") from None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {__package__}.run", description=__doc__.split("\n\n")[0])
    pick = ap.add_mutually_exclusive_group(required=True)
    pick.add_argument("--kernel", action="append", choices=sorted(kernels.KERNELS), help="kernel family (repeatable)")
    pick.add_argument("--all", action="store_true", help="every kernel family")
    pick.add_argument("--list", action="store_true", help="list kernel families and their cases")
    ap.add_argument("--sizes", type=lambda s: [_size(x) for x in s.split(",")], help="e.g. 1M,16M (params)")
    ap.add_argument("--dtype", type=lambda s: s.split(","), help="comma list of fp32, bf16, fp16 (default fp32,bf16)")
    ap.add_argument("--skip", action="append", default=[], metavar="PROVIDER",
                    help="leave out a provider, e.g. --skip deepspeed (repeatable)")  # fmt: skip
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the tensors live (default cpu)")
    ap.add_argument("--quick", action="store_true", help="CI-sized: small sizes, fewer repeats")
    ap.add_argument("--repeats", type=int, help="timed rounds per case (default 15, quick 21)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write results here")
    ap.add_argument("--baseline", type=Path, help="compare with this results JSON; exit 1 on a regression")
    ap.add_argument("--tolerance", type=float, default=compare.DEFAULT_TOLERANCE, help="allowed drop of a gated figure")
    ap.add_argument("--report", type=Path, help="write a Markdown report (and PNG charts beside it)")
    ap.add_argument("--inject-slowdown", type=float, default=1.0, metavar="F",
                    help="really slow fastzero's kernels by F (a self-test of the regression gate)")  # fmt: skip
    return ap.parse_args(argv)


def _progress():
    """A rich progress line where a terminal shows it, plain lines elsewhere."""
    try:
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    except ImportError:
        return None
    console = Console(stderr=True)
    return Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    names = sorted(kernels.KERNELS) if (args.all or args.list) else args.kernel
    modules = [kernels.load(n) for n in names]
    if args.all:
        modules = [m for m in modules if getattr(m, "IN_ALL", True)]
    wrong = [m.NAME for m in modules if args.device not in m.DEVICES]
    if wrong and not (args.all or args.list):
        raise SystemExit(f"{', '.join(wrong)} does not run on --device {args.device}")
    modules = [m for m in modules if args.device in m.DEVICES]
    if args.list:
        for mod in modules:
            print(f"{mod.NAME}: {mod.DESCRIPTION}")
            for case in mod.cases(args.sizes, args.dtype, args.quick, device=args.device):
                print(f"  {case.name:<22} {case.description}; providers: {', '.join(p.name for p in case.providers)}")
        return 0
    args.repeats = repeats = args.repeats or (21 if args.quick else 15)
    machine = machine_info()
    results = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "settings": {"quick": args.quick, "repeats": repeats, "warmup": args.warmup, "slowdown": args.inject_slowdown},
        "cases": [],
        "rows": [],
    }
    progress = _progress()
    all_cases = [c for mod in modules for c in mod.cases(args.sizes, args.dtype, args.quick, device=args.device)]
    for case in all_cases:
        case.providers = [p for p in case.providers if p.name not in args.skip]
    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    with progress if progress is not None else _NullContext():
        task = progress.add_task("starting", total=len(all_cases)) if progress else None

        def say(text):
            if progress:
                progress.update(task, description=text)

        while all_cases:
            case = all_cases.pop(0)  # dropped after its run: its tensors are freed
            rows, skipped = _measure(case, args, say)
            if baseline is not None:
                rows = _confirm(case, rows, baseline, args, say)
            results["rows"] += rows
            results["cases"].append(
                {
                    "kernel": case.kernel,
                    "name": case.name,
                    "numel": case.numel,
                    "bytes": case.bytes,
                    "description": case.description,
                    "skipped": skipped,
                }  # fmt: skip
            )
            _print_case(case, rows, skipped, progress)
            if progress:
                progress.advance(task)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    checks = None if baseline is None else compare.compare(results, baseline)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        report.markdown(results, checks, args.tolerance, args.report)
        print(f"report: {args.report}")
    if checks is not None:
        bad = compare.regressions(checks, args.tolerance)
        for c in bad:
            print(f"REGRESSION {c.kernel}/{c.case} {c.metric}: {c.baseline:.3f} -> {c.current:.3f} ({c.change:+.1%}, "
                  f"tolerance -{args.tolerance:.0%})")  # fmt: skip
        print(f"baseline {args.baseline}: {len(checks) - len(bad)} of {len(checks)} gated figures ok")
        return 1 if bad else 0
    return 0


def _measure(case, args, say):
    own = getattr(kernels.load(case.kernel), "measure", None)  # a family that times itself (multi-process jobs)
    if own is not None:
        return own(case, args, say)
    res = run_case(case, warmup=args.warmup, repeats=args.repeats, on_progress=say, slowdown=args.inject_slowdown)
    return res.rows(), res.skipped


def _confirm(case, rows, baseline, args, say, attempts: int = 3):
    """A figure below the baseline's tolerance is measured again (up to
    `attempts` more runs of that case) and the best run is kept: a real
    slowdown shows in every run, a burst of noise from a neighbour does not
    (calibration saw single-run drops up to 16% on busy days)."""

    def worst(rows):
        checks = compare.compare({"rows": rows}, baseline)
        changes = [c.change for c in checks if c.change is not None]
        return min(changes, default=0.0)

    best, best_worst = rows, worst(rows)
    for attempt in range(attempts):
        if best_worst >= -args.tolerance:
            break
        say(f"{case.name}: below the baseline, measuring again ({attempt + 1}/{attempts})")
        again, _ = _measure(case, args, say)
        if worst(again) > best_worst:
            best, best_worst = again, worst(again)
    return best


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _print_case(case, rows, skipped, progress):
    by = {}
    for r in rows:
        by.setdefault(r["provider"], {})[r["metric"]] = r["value"]
    out = [f"{case.kernel} / {case.name}: {case.description}"]
    own = getattr(kernels.load(case.kernel), "table", None)
    if own is not None:  # a family with its own table (zero)
        return _emit("\n".join([*out, *own({"skipped": skipped}, by)]), progress)
    for prov, m in by.items():
        extra = "".join(
            f"  {k.removeprefix('speedup_vs_')} {v:.2f}x" for k, v in m.items() if k.startswith("speedup_vs_")
        )
        frac = f"  {m['frac_roofline']:.2f} of roofline" if "frac_roofline" in m else ""
        out.append(f"  {prov:<15} {m['median_ms']:8.2f} ms ±{m['spread']:5.1%}  {m['gb_per_s']:6.1f} GB/s{frac}{extra}")
    for prov, why in skipped.items():
        out.append(f"  {prov:<15} skipped: {why}")
    _emit("\n".join(out), progress)


def _emit(text, progress):
    if progress:
        progress.console.print(text, highlight=False, soft_wrap=True)  # tables keep their rows
    else:
        print(text, flush=True)


if __name__ == "__main__":
    sys.exit(main())
