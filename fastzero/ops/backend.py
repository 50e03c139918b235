"""Which backend runs an op: the fastest available, or the one that
FASTZERO_BACKEND forces, and a report of what is available and why not."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from fastzero.ops import native

BACKENDS = ("cuda", "triton", "cpu", "reference")


@dataclass(frozen=True)
class BackendStatus:
    op: str
    backend: str
    available: bool
    detail: str


def forced_backend() -> str | None:
    """The backend named by FASTZERO_BACKEND, or None when it is unset."""
    name = os.environ.get("FASTZERO_BACKEND", "").strip().lower()
    if not name:
        return None
    if name not in BACKENDS:
        raise ValueError(f"FASTZERO_BACKEND={name!r} is not one of {', '.join(BACKENDS)}")
    return name


_warned: set[str] = set()


def warn_fallback(op: str, reason: str) -> None:
    """One warning per op when it runs the slow reference instead of a kernel."""
    if op not in _warned:
        _warned.add(op)
        warnings.warn(
            f"fastzero: {op} runs the plain-PyTorch reference (slow) because {reason}",
            RuntimeWarning,
            stacklevel=3,
        )


def cpu_backend(op: str) -> str:
    """'cpu' or 'reference' for an op that runs on CPU tensors."""
    forced = forced_backend()
    if forced == "reference":
        return "reference"
    if forced not in (None, "cpu"):
        raise ValueError(f"FASTZERO_BACKEND={forced!r}, but {op} runs on CPU tensors: use 'cpu' or 'reference'")
    if native.cpu_ops() is None:
        if forced == "cpu":
            raise RuntimeError(f"FASTZERO_BACKEND=cpu, but the CPU kernels are unavailable: {native.cpu_ops_error()}")
        warn_fallback(op, f"the CPU kernels are unavailable: {native.cpu_ops_error()}")
        return "reference"
    return "cpu"


def backends() -> list[BackendStatus]:
    """Every op, each backend, and whether it is available here (and why not)."""
    error = native.cpu_ops_error()
    cpu_detail = (
        f"ISA {native.cpu_isa()} (this CPU supports: {', '.join(native.supported_isas())})" if error is None else error
    )
    return [
        BackendStatus("CPUAdam", "cpu", error is None, cpu_detail),
        BackendStatus("CPUAdam", "reference", True, "plain PyTorch, always available"),
    ]


def report() -> str:
    """A text table of :func:`backends`, in the spirit of DeepSpeed's ds_report."""
    import torch

    rows = backends()
    width = max(len(r.op) for r in rows)
    lines = [
        f"fastzero backends (torch {torch.__version__}, {torch.get_num_threads()} threads"
        + (f", FASTZERO_BACKEND={forced_backend()}" if forced_backend() else "")
        + ")",
    ]
    for r in rows:
        mark = "yes" if r.available else "NO "
        lines.append(f"  {r.op:<{width}}  {r.backend:<9}  {mark}  {r.detail}")
    return "\n".join(lines)
