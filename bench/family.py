"""The one interface of a kernel family: what bench.run, bench.report,
bench.calibrate and the pytest-benchmark wrapper know of it.

Every family is a :class:`Family` (bench/kernels/__init__.py lists them by
name). Its cases carry their providers (fastzero's backends, the peers, the
bandwidth probe); a family measures a case either with the harness's checked,
interleaved rounds in this process (the default, :func:`measure_rounds`) or
with its own ``measure`` (multi-process jobs, several modes per case), and
shows a case's figures with its ``table`` (Markdown: the report) and
``summary`` (the terminal; its table where it has none)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .harness import Case, Provider, run_case
from .tables import bandwidth_table

Say = Callable[[str], None]  # progress: what is being done now
Table = Callable[[dict, dict], list[str]]  # (case_info, provider -> metric -> value) -> lines


@dataclass(frozen=True)
class Settings:
    """How to measure: bench.run's options that a family's measure reads."""

    warmup: int = 3
    repeats: int = 15
    slowdown: float = 1.0  # > 1 really slows fastzero's providers (the regression gate's self-test)
    quick: bool = False
    skip: tuple[str, ...] = ()  # providers, or a family's named variants, left out


class Cases(Protocol):
    def __call__(
        self, sizes: list[int] | None = None, dtypes: list[str] | None = None, quick: bool = False, device: str = "cpu"
    ) -> list[Case]:
        """The family's cases: `sizes` and `dtypes` as bench.run's --sizes and --dtype (None: the family's
        defaults, or its CI sizes when `quick`), on `device`."""


Measure = Callable[[Case, Settings, Say], tuple[list[dict], dict[str, str]]]  # -> (result rows, provider -> why)


def measure_rounds(case: Case, settings: Settings, say: Say) -> tuple[list[dict], dict[str, str]]:
    """The harness's measurement: every provider checked against the reference, then timed in interleaved rounds;
    rows with each provider's GB/s, fraction of the roofline and speedups over the peers."""
    res = run_case(case, warmup=settings.warmup, repeats=settings.repeats, on_progress=say, slowdown=settings.slowdown)
    return res.rows(), res.skipped


@dataclass(frozen=True)
class Family:
    """A kernel family. ``peers`` names the providers it runs beside fastzero's; ``roofline`` makes the bandwidth
    probe its cases carry (``roofline(device, sizes)``), None for a family that measures no bandwidth. A case
    whose ``kernel`` names another family is measured and shown by that one (``onebit`` lists
    ``onebit_allreduce``'s cases too)."""

    name: str
    description: str
    cases: Cases
    peers: tuple[str, ...]
    roofline: Callable[..., Provider] | None
    devices: tuple[str, ...] = ("cpu",)
    in_all: bool = True  # run by --all (CI's quick gate: only what is quick and steady enough to gate)
    measure: Measure = measure_rounds
    table: Table = bandwidth_table
    summary: Table | None = None  # the terminal's lines; None: the table's

    def terminal(self, case_info: dict, provs: dict[str, dict[str, float]]) -> list[str]:
        return (self.summary or self.table)(case_info, provs)
