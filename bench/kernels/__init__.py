"""Kernel families the suite knows: each module declares its cases (sizes,
bytes, providers: fastzero's backends, the peers, the bandwidth probe).

A family may also define ``measure(case, args, say) -> (rows, skipped)``
when it times itself (multi-process jobs: ``zero``) instead of the harness's
in-process rounds, ``table(case_info, provs)`` for its Markdown lines, and
``IN_ALL = False`` to stay out of ``--all``. "module:ATTR" names an object
in a module that has those attributes (several families in one module). A
family's cases may belong to another family (``onebit`` runs
``onebit_allreduce``'s too): each case is measured and shown by the family
its ``kernel`` names."""

from __future__ import annotations

import importlib
from types import ModuleType

KERNELS = {
    "cpu_adam": ".cpu_adam",
    "fused_adam": ".fused_adam",
    "fused_lamb": ".fused_lamb",
    "sparse_attention": ".sparse_attention",
    "zero": ".zero",
    "zero3": ".zero:ZERO3",
    "offload": ".zero:OFFLOAD",
    "onebit": ".onebit",
    "onebit_allreduce": ".onebit:ALLREDUCE",
}


def load(name: str) -> ModuleType:
    """The family's module (or the family object a "module:ATTR" entry names)."""
    if name not in KERNELS:
        raise SystemExit(f"unknown kernel {name!r}; known: {', '.join(KERNELS)} (see --list)")
    module, _, attr = KERNELS[name].partition(":")
    found = importlib.import_module(module, __package__)
    return getattr(found, attr) if attr else found
