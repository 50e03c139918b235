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
from .family import Settings
from .harness import parse_size
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
    ap.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="PROVIDER",
        help="leave out a provider, e.g. --skip deepspeed (repeatable)",
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the tensors live (default cpu)")
    ap.add_argument("--quick", action="store_true", help="CI-sized: small sizes, fewer repeats")
    ap.add_argument("--repeats", type=int, help="timed rounds per case (default 15, quick 21)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write results here")
    ap.add_argument("--baseline", type=Path, help="compare with this results JSON; exit 1 on a regression")
    ap.add_argument("--tolerance", type=float, default=compare.DEFAULT_TOLERANCE, help="allowed drop of a gated figure")
    ap.add_argument("--report", type=Path, help="write a Markdown report (and PNG charts beside it)")
    ap.add_argument(
        "--inject-slowdown",
        type=float,
        default=1.0,
        metavar="F",
        help="really slow fastzero's kernels by F (a self-test of the regression gate)",
    )
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
    families = kernels.families(None if (args.all or args.list) else args.kernel)
    if args.all:
        families = [f for f in families if f.in_all]
    wrong = [f.name for f in families if args.device not in f.devices]
    if wrong and not (args.all or args.list):
        raise SystemExit(f"{', '.join(wrong)} does not run on --device {args.device}")
    families = [f for f in families if args.device in f.devices]
    if args.list:
        for family in families:
            print(f"{family.name}: {family.description}")
            for case in family.cases(args.sizes, args.dtype, args.quick, device=args.device):
                print(f"  {case.name:<22} {case.description}; providers: {', '.join(p.name for p in case.providers)}")
        return 0
    repeats = args.repeats or (21 if args.quick else 15)
    settings = Settings(
        warmup=args.warmup, repeats=repeats, slowdown=args.inject_slowdown, quick=args.quick, skip=tuple(args.skip)
    )
    results = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "settings": {"quick": args.quick, "repeats": repeats, "warmup": args.warmup, "slowdown": args.inject_slowdown},
        "cases": [],
        "rows": [],
    }
    progress = _progress()
    all_cases = [c for f in families for c in f.cases(args.sizes, args.dtype, args.quick, device=args.device)]
    for case in all_cases:
        case.providers = [p for p in case.providers if p.name not in args.skip]
    baseline = None
    if args.baseline:
        args.baseline, baseline = baseline_for(args.baseline, results["machine"])
        print(f"baseline: {args.baseline} (measured on {_machine_name(baseline['machine'])})", flush=True)
    with progress if progress is not None else _NullContext():
        task = progress.add_task("starting", total=len(all_cases)) if progress else None

        def say(text):
            if progress:
                progress.update(task, description=text)

        while all_cases:
            case = all_cases.pop(0)  # dropped after its run: its tensors are freed
            family = kernels.load(case.kernel)  # the family that measures and shows it (see bench.family)
            rows, skipped = family.measure(case, settings, say)
            if baseline is not None:
                rows = _confirm(family, case, rows, baseline, settings, args.tolerance, say)
            results["rows"] += rows
            case_info = case.info(skipped)
            results["cases"].append(case_info)
            _print_case(family, case_info, rows, progress)
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
            print(
                f"REGRESSION {c.kernel}/{c.case} {c.metric}: {c.baseline:.3f} -> {c.current:.3f} ({c.change:+.1%}, "
                f"tolerance -{args.tolerance:.0%})"
            )
        print(f"baseline {args.baseline}: {len(checks) - len(bad)} of {len(checks)} gated figures ok")
        return 1 if bad else 0
    return 0


def _machine_name(machine: dict) -> str:
    return f"{machine.get('cpu')}, ISA path {machine.get('isa')}, {machine.get('cores')} cores"


def baseline_for(path: Path, machine: dict) -> tuple[Path, dict]:
    """The baseline to compare with: `path`, or the baseline beside it
    measured on a machine like this one (the same CPU model, ISA path and
    core count). The fractions of the roofline move with the CPU, not only
    with the code: FusedLamb's was 0.86 on the AMD EPYC of cpu-quick.json
    and 0.64 on an Intel Xeon with the same commit (2026-12-07). With no
    such baseline, `path` (its figures may then differ by machine: said)."""
    key = lambda m: (m.get("cpu"), m.get("isa"), m.get("cores"))
    given = json.loads(path.read_text())
    if key(given["machine"]) == key(machine):
        return path, given
    for other in sorted(path.parent.glob("*.json")):
        if other == path:
            continue
        stored = json.loads(other.read_text())
        if key(stored.get("machine", {})) == key(machine) and stored.get("settings") == given.get("settings"):
            return other, stored
    print(
        f"warning: no baseline in {path.parent} was measured on a machine like this one ({_machine_name(machine)}); "
        f"comparing with {path}, whose figures may differ by machine. Measure one: python -m bench.calibrate "
        f"--runs 8 --write-baseline {path.parent}/<name>.json",
        flush=True,
    )
    return path, given


def _confirm(family, case, rows, baseline, settings, tolerance, say, attempts: int = 3):
    """A figure below the baseline's tolerance is measured again (up to
    `attempts` more runs of that case) and the best run is kept: a real
    slowdown shows in every run, a burst of noise from a neighbour does not
    (calibration saw single-run drops up to 16% on busy days)."""

    def worst(rows):
        checks = compare.compare({"rows": rows}, baseline)
        changes = [c.change for c in checks if c.status(tolerance) == "REGRESSION"]
        return min(changes, default=0.0)

    best, best_worst = rows, worst(rows)
    for attempt in range(attempts):
        if best_worst >= -tolerance:
            break
        say(f"{case.name}: below the baseline, measuring again ({attempt + 1}/{attempts})")
        again, _ = family.measure(case, settings, say)
        if worst(again) > best_worst:
            best, best_worst = again, worst(again)
    return best


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _print_case(family, case_info, rows, progress):
    """The case's heading and its family's terminal lines."""
    by = {}
    for r in rows:
        by.setdefault(r["provider"], {})[r["metric"]] = r["value"]
    heading = f"{case_info['kernel']} / {case_info['name']}: {case_info['description']}"
    _emit("\n".join([heading, *family.terminal(case_info, by)]), progress)


def _emit(text, progress):
    if progress:
        progress.console.print(text, highlight=False, soft_wrap=True)  # tables keep their rows
    else:
        print(text, flush=True)


if __name__ == "__main__":
    sys.exit(main())
