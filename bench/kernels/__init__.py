"""Kernel families the suite knows: each module declares its cases (sizes,
bytes, providers: fastzero's backends, the peers, the bandwidth probe).

A family may also define ``measure(case, args, say) -> (rows, skipped)``
when it times itself (multi-process jobs: ``zero``) instead of the harness's
in-process rounds, ``table(case_info, provs)`` for its Markdown lines, and
``IN_ALL = False`` to stay out of ``--all``."""

from __future__ import annotations

import importlib
from types import ModuleType

KERNELS = {
    "cpu_adam": "bench.kernels.cpu_adam",
    "fused_adam": "bench.kernels.fused_adam",
    "fused_lamb": "bench.kernels.fused_lamb",
    "zero": "bench.kernels.zero",
}


def load(name: str) -> ModuleType:
    if name not in KERNELS:
        raise SystemExit(f"unknown kernel {name!r}; known: {', '.join(KERNELS)} (see --list)")
    return importlib.import_module(KERNELS[name])
