"""Kernel families the suite knows: each module declares its cases (sizes,
bytes, providers: fastzero's backends, the peers, the bandwidth probe)."""

from __future__ import annotations

import importlib
from types import ModuleType

KERNELS = {
    "cpu_adam": "bench.kernels.cpu_adam",
    "fused_adam": "bench.kernels.fused_adam",
    "fused_lamb": "bench.kernels.fused_lamb",
}


def load(name: str) -> ModuleType:
    if name not in KERNELS:
        raise SystemExit(f"unknown kernel {name!r}; known: {', '.join(KERNELS)} (see --list)")
    return importlib.import_module(KERNELS[name])
