"""The backend registry: which backend runs an op, decided in one place.

Each kernel family registers its backends here (:class:`Family`), fastest
first. :meth:`Family.choose` applies one rule for every op:

1. an explicit argument (``backend=`` on the op or optimizer) wins;
2. else the ``FASTZERO_BACKEND`` environment variable;
3. else the fastest backend available for the tensors' device.

A backend named by 1 or 2 that cannot run is an error that says why (never a
silent substitute). Falling back to the plain-PyTorch reference because a
faster backend is missing warns once per family, with the reason. The choice
comes back with its reason (:class:`Choice`), so ops can say which backend
ran and why; ``python -m fastzero.ops`` prints the whole table.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastzero.native import loader
from fastzero.native.envvars import env_choice

BACKENDS = ("cuda", "triton", "cpu", "reference")
DEVICES = ("cpu", "cuda")
_NAMES = {"cpu": "CPU", "cuda": "CUDA"}


# -- availability of each kind of backend --------------------------------------------------
def cpu_status(device_type: str = "cpu") -> tuple[bool, str]:
    """Whether the native CPU kernels loaded (and why not). A bad
    FASTZERO_CPU_ISA raises: a setting that names nothing is an error, not a
    reason to fall back."""
    error = loader.cpu_ops_error()
    if error is not None:
        return False, error
    return True, f"ISA {loader.cpu_isa()} (this CPU supports: {', '.join(loader.supported_isas())})"


def cuda_status(device_type: str = "cuda") -> tuple[bool, str]:
    """Whether fastzero's CUDA kernels can run here, and why not."""
    return loader.cuda_available()


def triton_status(device_type: str = "cuda") -> tuple[bool, str]:
    """Whether the Triton kernels can run on `device_type` tensors here."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return False, f"triton is not installed ({exc}); pip install triton"
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return False, "Triton runs CPU tensors only in its interpreter (TRITON_INTERPRET=1, for tests)"
    if device_type == "cuda":
        import torch

        if not torch.cuda.is_available():
            return False, "no CUDA device"
    return True, "CUDA tensors" if device_type == "cuda" else "CPU tensors, in Triton's interpreter"


def always(device_type: str = "") -> tuple[bool, str]:
    return True, "plain PyTorch, always available"


# -- the registry ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Backend:
    """One implementation of a family's op. ``auto``: the device types it is
    chosen for automatically; ``devices``: those it runs when named (the
    Triton backend runs CPU tensors only in its interpreter, for tests).
    ``target``: "module:attribute" of the implementation (or "module"), imported
    on first use so that a missing optional dependency costs nothing until then."""

    name: str
    auto: tuple[str, ...]
    devices: tuple[str, ...]
    status: Callable[[str], tuple[bool, str]]
    target: str


@dataclass(frozen=True)
class Choice:
    backend: str
    reason: str  # "backend= argument", "FASTZERO_BACKEND", "fastest available", or why it fell back


_FAMILIES: dict[str, Family] = {}
_warned: set[str] = set()


def forced_backend() -> str | None:
    """The backend named by FASTZERO_BACKEND, or None when it is unset."""
    return env_choice("FASTZERO_BACKEND", BACKENDS)


class Family:
    """A kernel family's backends, fastest first; the reference last."""

    def __init__(self, name: str, op: str, backends: list[Backend]) -> None:
        self.name, self.op = name, op
        self.backends = {b.name: b for b in backends}
        _FAMILIES[name] = self

    def choose(self, device_type: str, explicit: str | None = None) -> Choice:
        """The backend for tensors on `device_type`: `explicit` > FASTZERO_BACKEND > the fastest available."""
        if device_type not in DEVICES:
            raise ValueError(f"{self.op} does not support {device_type} tensors (CPU and CUDA only)")
        if explicit is not None:
            if explicit not in BACKENDS:
                raise ValueError(f"{self.op}: backend={explicit!r} is not one of {', '.join(BACKENDS)}")
            return Choice(self._named(explicit, device_type, "backend="), "backend= argument")
        env = forced_backend()
        if env is not None:
            return Choice(self._named(env, device_type, "FASTZERO_BACKEND="), "FASTZERO_BACKEND")
        reasons = []
        for b in self.backends.values():
            if device_type not in b.auto:
                continue
            ok, why = b.status(device_type)
            if ok:
                if b.name == "reference" and reasons:
                    self._warn_fallback(device_type, "; ".join(reasons))
                    return Choice("reference", "fallback: " + "; ".join(reasons))
                return Choice(b.name, "fastest available")
            reasons.append(f"{b.name}: {why}")
        raise RuntimeError(f"{self.op}: no backend can run {_NAMES[device_type]} tensors here ({'; '.join(reasons)})")

    def _named(self, name: str, device_type: str, how: str) -> str:
        b = self.backends.get(name)
        if b is None:
            raise ValueError(
                f"{how}{name!r}, but {self.op} has no {name!r} backend (it has: {', '.join(self.backends)}); "
                f"pass one of those, or unset FASTZERO_BACKEND"
            )
        if device_type not in b.devices:
            runs = [n for n, x in self.backends.items() if device_type in x.devices]
            raise ValueError(
                f"{how}{name!r}, but {self.op} got {_NAMES[device_type]} tensors, which that backend does not run; "
                f"use one of: {', '.join(runs)}"
            )
        ok, why = b.status(device_type)
        if not ok:
            raise RuntimeError(f"{how}{name!r}, but {self.op}'s {name} backend cannot run here: {why}")
        return name

    def _warn_fallback(self, device_type: str, reason: str) -> None:
        key = f"{self.name}:{device_type}"
        if key not in _warned:
            _warned.add(key)
            warnings.warn(
                f"fastzero: {self.op} runs the plain-PyTorch reference (slow) on {_NAMES[device_type]} tensors because "
                f"{reason}",
                RuntimeWarning,
                stacklevel=4,
            )

    def impl(self, backend: str) -> Any:
        """The implementation the backend registered (imported now if it was not)."""
        module, _, attr = self.backends[backend].target.partition(":")
        found = importlib.import_module(module)
        return getattr(found, attr) if attr else found


def families() -> dict[str, Family]:
    """Every registered family, by name (importing fastzero.ops registers them all)."""
    import fastzero.ops  # noqa: F401  (each family registers itself on import)

    return dict(_FAMILIES)


# -- the report -------------------------------------------------------------------------------
@dataclass(frozen=True)
class BackendStatus:
    op: str
    backend: str
    device: str
    available: bool
    detail: str


def backends() -> list[BackendStatus]:
    """Every op, each backend and device, and whether it can run here (and why not)."""
    rows = []
    for family in families().values():
        for b in family.backends.values():
            for device in b.devices:
                try:
                    status = b.status(device)
                except ValueError as exc:  # a bad setting (FASTZERO_CPU_ISA): shown, not raised, in the report
                    status = (False, str(exc))
                rows.append(BackendStatus(family.op, b.name, device, *status))
    return rows


def report() -> str:
    """A text table of :func:`backends`, in the spirit of DeepSpeed's ds_report."""
    import torch

    rows = backends()
    width = max(len(r.op) for r in rows)
    forced = forced_backend()
    lines = [
        f"fastzero backends (torch {torch.__version__}, {torch.get_num_threads()} threads"
        + (f", FASTZERO_BACKEND={forced}" if forced else "")
        + "); rule: backend= argument > FASTZERO_BACKEND > the fastest available",
    ]
    for r in rows:
        mark = "yes" if r.available else "NO "
        lines.append(f"  {r.op:<{width}}  {r.device:<4}  {r.backend:<9}  {mark}  {r.detail}")
    return "\n".join(lines)
