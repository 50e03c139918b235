"""The kernel families the suite knows, by name: each a :class:`bench.family.Family`
(its cases, peers, roofline, measurement and tables), the object "module:ATTR"
names. A module may hold several (``zero``: zero, zero3, offload); modules are
imported when a family is first asked for."""

from __future__ import annotations

import importlib

from ..family import Family

KERNELS = {
    "act_ckpt": ".act_ckpt:FAMILY",
    "cpu_adam": ".cpu_adam:FAMILY",
    "fused_adam": ".fused_adam:FAMILY",
    "fused_lamb": ".fused_lamb:FAMILY",
    "sparse_attention": ".sparse_attention:FAMILY",
    "zero": ".zero:ZERO",
    "zero3": ".zero:ZERO3",
    "offload": ".zero:OFFLOAD",
    "onebit": ".onebit:ONEBIT",
    "onebit_allreduce": ".onebit_allreduce:FAMILY",
    "quant": ".quant:QUANT",
    "tp": ".tp:FAMILY",
    "pipeline": ".pipeline:FAMILY",
    "zeropp": ".zeropp:FAMILY",
}


def load(name: str) -> Family:
    """The family called `name`."""
    if name not in KERNELS:
        raise SystemExit(f"unknown kernel {name!r}; known: {', '.join(KERNELS)} (see --list)")
    module, _, attr = KERNELS[name].partition(":")
    family = getattr(importlib.import_module(module, __package__), attr)
    assert isinstance(family, Family) and family.name == name, f"{KERNELS[name]} is not the family {name!r}"
    return family


def families(names: list[str] | None = None) -> list[Family]:
    """The families called `names` (None: every one, sorted by name)."""
    return [load(n) for n in (sorted(KERNELS) if names is None else names)]
