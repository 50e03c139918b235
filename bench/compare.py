"""A regression verdict: the normalized figures of a run (fraction of the
bandwidth roofline, speedup over each peer; never raw times) against a
stored baseline.

Tolerance: DEFAULT_TOLERANCE, calibrated on the 2-core development machine
with ``python -m bench.calibrate --runs 8`` (8 quick runs in one process;
bench/results/calibration-cpu.json; the baseline's gated figures are those
runs' medians). On a quiet machine the largest single-run drop of a gated
figure below its median was 2.0%; on busy days up to 8.7% for single-tensor
figures and 16% for the many-tensor fractions of the roofline. 12% sits below
the 20% drop a 25% slowdown causes, and a figure below it is measured up to
three more times and the best run counts (bench/run.py, _confirm): a real
slowdown shows in every run, a neighbour's burst does not.

The in-place bandwidth probe is itself bimodal from process to process (the
many-tensor probe took 4.3 ms in some runs and 6.6 ms in others on the same
machine, same commit): a fraction of the roofline that drops only because the
probe ran faster is no regression. So a fraction-of-roofline drop counts only
when fastzero's own median time also rose beyond the tolerance (a slower
kernel raises both; a slower machine lowers neither fraction nor speedups).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_TOLERANCE = 0.12
GATED_PREFIXES = ("frac_roofline", "speedup_vs_")
# Reported, never gated: torch's foreach AdamW and the plain-PyTorch LAMB
# allocate temporaries whose page faults make their times bimodal (one
# calibration run: -46% on the foreach ratio; torch_lamb's spread reached 88%).
UNGATED = ("speedup_vs_torch_foreach", "speedup_vs_torch_lamb")
# Speedups in the many-tensor cases ("-x400") measure Python overhead per
# tensor as much as kernels, and CPU contention moves them: up to 17.5% in a
# calibration run beside a busy neighbour. Their fraction of the roofline,
# which a slower kernel lowers too, stays gated.
MANY_TENSOR_CASE = re.compile(r"-x\d+$")


@dataclass
class Check:
    kernel: str
    case: str
    provider: str
    metric: str
    baseline: float
    current: float | None
    # fastzero's median ms in the baseline and now, for a fraction of the roofline (see the module doc)
    baseline_ms: float | None = None
    current_ms: float | None = None

    @property
    def change(self) -> float | None:
        return None if self.current is None else self.current / self.baseline - 1.0

    def status(self, tolerance: float) -> str:
        if self.current is None:
            return "missing"
        if self.change >= -tolerance:
            return "ok"
        if self.time_held(tolerance):
            return "ok (the roofline probe ran faster; fastzero's time held)"
        return "REGRESSION"

    def time_held(self, tolerance: float) -> bool:
        """fastzero's own median time is within the tolerance of the baseline's (known for fractions of the
        roofline only)."""
        if self.baseline_ms is None or self.current_ms is None:
            return False
        return self.current_ms <= self.baseline_ms * (1.0 + tolerance)


def gated(row: dict) -> bool:
    if "gated" in row:  # a family that measures itself marks its gated figures (bench/kernels/zero.py)
        return row["gated"] and bool(row["value"])
    if row["metric"].startswith("speedup_vs_") and MANY_TENSOR_CASE.search(row["case"]):
        return False
    return (
        row["provider"] == "fastzero"
        and row["metric"].startswith(GATED_PREFIXES)
        and row["metric"] not in UNGATED
        and bool(row["value"])
    )


def compare(current: dict, baseline: dict) -> list[Check]:
    """Every gated figure of the baseline, with its value in this run (None
    when this run did not measure it: a peer not installed, a case not run)."""
    now = {(r["kernel"], r["case"], r["provider"], r["metric"]): r["value"] for r in current["rows"]}
    ran = {(r["kernel"], r["case"]) for r in current["rows"]}
    base_ms = {(r["kernel"], r["case"], r["provider"], r["metric"]): r["value"] for r in baseline["rows"]}
    checks = []
    for r in baseline["rows"]:
        if not gated(r) or (r["kernel"], r["case"]) not in ran:
            continue
        key = (r["kernel"], r["case"], r["provider"], r["metric"])
        check = Check(*key, baseline=r["value"], current=now.get(key))
        if r["metric"] == "frac_roofline":
            ms_key = (*key[:3], "median_ms")
            check.baseline_ms, check.current_ms = base_ms.get(ms_key), now.get(ms_key)
        checks.append(check)
    return checks


def regressions(checks: list[Check], tolerance: float) -> list[Check]:
    return [c for c in checks if c.status(tolerance) == "REGRESSION"]
