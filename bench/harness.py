"""The shared benchmark harness: cases, providers, interleaved timing,
checks against the reference, and result rows.

Machines here are shared and noisy, so every figure that a verdict uses is a
ratio measured in one run: providers of a case are timed in interleaved
rounds (noise hits all of them alike), and each case carries its own
bandwidth probe (the ``roofline`` provider) timed in the same rounds.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class Unavailable(Exception):
    """A provider cannot run here (a peer not installed, say); it is skipped."""


@dataclass
class Runner:
    """One provider set up for one case: ``step()`` is what is timed;
    ``check()`` compares one step's result with the reference (run before
    any timing) and raises AssertionError on a mismatch."""

    step: Callable[[], None]
    check: Callable[[], None] | None = None
    cuda: bool = False  # time with CUDA events (the step only enqueues work)


@dataclass
class Provider:
    name: str
    kind: str  # "ours", "peer" or "roofline"
    make: Callable[[], Runner]  # allocates; may raise Unavailable
    bytes: int | None = None  # bytes it moves, when not the case's own (the roofline probe)


@dataclass
class Case:
    kernel: str
    name: str
    numel: int
    bytes: int  # bytes one step must move (read + written), the basis of GB/s
    providers: list[Provider]
    description: str = ""

    def info(self, skipped: dict[str, str]) -> dict:
        """The case's entry in the results (its providers skipped here, and why)."""
        return dict(
            kernel=self.kernel,
            name=self.name,
            numel=self.numel,
            bytes=self.bytes,
            description=self.description,
            skipped=skipped,
        )


@dataclass
class Timing:
    provider: str
    kind: str
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        """Interquartile range over the median."""
        if len(self.times) < 4:
            return (max(self.times) - min(self.times)) / self.median
        q = statistics.quantiles(self.times, n=4)
        return (q[2] - q[0]) / self.median


@dataclass
class CaseResult:
    case: Case
    timings: dict[str, Timing]
    skipped: dict[str, str]  # provider -> why

    def rows(self) -> list[dict]:
        """Result rows (kernel, case, provider, metric, value). Normalized
        metrics (fraction of the roofline, speedup over each peer) are what a
        baseline comparison uses; times are for people. Each ratio is the
        median of per-round ratios: the two calls of a round ran back to
        back, so drifts of the machine's speed cancel."""
        case = self.case
        out = Rows(case)
        roof = self.timings.get("roofline")
        roof_bytes = next((p.bytes for p in case.providers if p.name == "roofline"), None) or case.bytes
        peers = {n: t for n, t in self.timings.items() if t.kind == "peer"}
        for name, t in self.timings.items():
            out.add(name, "median_ms", t.median * 1e3)
            out.add(name, "spread", t.spread)
            if name == "roofline":
                out.add(name, "gb_per_s", roof_bytes / t.median / 1e9)
                continue
            out.add(name, "gparams_per_s", case.numel / t.median / 1e9)
            out.add(name, "gb_per_s", case.bytes / t.median / 1e9)
            if roof is not None:
                # (bytes/t) / (roof_bytes/t_roof), round by round
                out.add(name, "frac_roofline", case.bytes / roof_bytes * paired(roof.times, t.times))
            if t.kind == "ours":
                for peer, pt in peers.items():
                    out.add(name, f"speedup_vs_{peer}", paired(pt.times, t.times))
        return out


class Rows(list):
    """A case's result rows: add() appends (kernel, case, provider, metric, value) and the `fixed` keys (a
    family's ``gated``), and leaves out a figure whose value is None. It keeps the case's names, not the case
    (whose providers hold its tensors)."""

    def __init__(self, case: Case, **fixed) -> None:
        super().__init__()
        self.kernel, self.case_name, self.fixed = case.kernel, case.name, fixed

    def add(self, provider: str, metric: str, value, **more) -> None:
        if value is not None:
            names = dict(kernel=self.kernel, case=self.case_name, provider=provider, metric=metric)
            self.append(dict(names, value=value, **self.fixed) | more)


def paired(num: list[float], den: list[float]) -> float:
    """The median of per-round ratios num[i] / den[i] (of times taken in the same rounds)."""
    return statistics.median(a / b for a, b in zip(num, den))


def self_timed(why: str) -> Callable[[], Runner]:
    """A provider's ``make`` for a family that times the case itself (multi-process jobs, searches):
    the harness's users (calibrate, pytest-benchmark) skip it, saying `why`."""

    def make() -> Runner:
        raise Unavailable(why)

    return make


def stretch(t0: float, factor: float) -> float:
    """Busy-waits until (now - t0) * factor has passed since t0 (a call begun at t0 made `factor` times longer: the
    regression gate's self-test); returns the seconds since t0."""
    if factor != 1.0:
        until = t0 + (time.perf_counter() - t0) * factor
        while time.perf_counter() < until:
            pass
    return time.perf_counter() - t0


def run_case(
    case: Case,
    *,
    warmup: int,
    repeats: int,
    on_progress: Callable[[str], None] = lambda _: None,
    slowdown: float = 1.0,
) -> CaseResult:
    """Sets up every provider, checks each against the reference, then times
    them in interleaved rounds. ``slowdown`` > 1 really slows fastzero's own
    providers by that factor (a busy wait after each call): it exists to
    prove that the regression gate catches a slowdown of that size."""
    runners: dict[str, Runner] = {}
    skipped: dict[str, str] = {}
    kinds = {}
    for provider in case.providers:
        on_progress(f"{case.name}: set up {provider.name}")
        try:
            runner = provider.make()
        except Unavailable as exc:
            skipped[provider.name] = str(exc)
            continue
        if runner.check is not None:
            on_progress(f"{case.name}: check {provider.name} against the reference")
            try:
                runner.check()
            except AssertionError as exc:
                raise AssertionError(
                    f"{case.kernel}/{case.name}: {provider.name} disagrees with the reference: {exc}"
                ) from exc
        if provider.kind == "ours" and slowdown != 1.0:
            runner = Runner(step=_slowed(runner.step, slowdown), cuda=runner.cuda)
        runners[provider.name] = runner
        kinds[provider.name] = provider.kind
    timings = {name: Timing(name, kinds[name]) for name in runners}
    names = list(runners)
    for _ in range(warmup):
        for name in names:
            runners[name].step()
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection inside one timed call is noise
    try:
        for r in range(repeats):
            on_progress(f"{case.name}: round {r + 1}/{repeats}")
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no provider always first
            for name in order:
                timings[name].times.append(_time_one(runners[name]))
    finally:
        if gc_was_enabled:
            gc.enable()
    runners.clear()
    gc.collect()
    return CaseResult(case, timings, skipped)


def _time_one(runner: Runner) -> float:
    """Seconds one step takes: wall time on the CPU, CUDA events on a GPU."""
    if not runner.cuda:
        t0 = time.perf_counter()
        runner.step()
        return time.perf_counter() - t0
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    runner.step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _slowed(step: Callable[[], None], factor: float) -> Callable[[], None]:
    def slowed():
        t0 = time.perf_counter()
        step()
        stretch(t0, factor)

    return slowed


_UNITS = {"G": 1 << 30, "M": 1 << 20, "K": 1 << 10}


def parse_size(text: str) -> int:
    """'16M' -> 16777216 (binary units K, M, G; a plain number is a count)."""
    text = text.strip().upper()
    scale = _UNITS.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def format_size(n: int) -> str:
    """16777216 -> '16M', 262144 -> '256K', 1000 -> '1000'."""
    for unit, scale in _UNITS.items():
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)
