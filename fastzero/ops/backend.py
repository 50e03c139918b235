"""Which backend runs an op: the fastest available, or the one that
FASTZERO_BACKEND forces, and a report of what is available and why not."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from fastzero import native

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


def cuda_status() -> tuple[bool, str]:
    """Whether fastzero's CUDA kernels can run here, and why not."""
    return native.cuda_available()


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
    return True, ""


def device_backend(op: str, device_type: str, force: str | None = None) -> str:
    """'cuda', 'triton', 'cpu' or 'reference' for an op on `device_type`
    tensors: the fastest available, or the one `force` (else
    FASTZERO_BACKEND) names."""
    if force is not None and force not in BACKENDS:
        raise ValueError(f"backend={force!r} is not one of {', '.join(BACKENDS)}")
    forced = force or forced_backend()
    if device_type == "cpu":
        if forced == "triton":
            ok, why = triton_status("cpu")
            if not ok:
                raise RuntimeError(f"the triton backend with CPU tensors: {why}")
            return "triton"
        if forced in ("cuda",):
            raise ValueError(f"backend {forced!r}, but {op} runs on CPU tensors: use 'cpu' or 'reference'")
        if forced == "reference":
            return "reference"
        return cpu_backend(op)
    if device_type != "cuda":
        raise ValueError(f"{op} does not support {device_type} tensors (CPU and CUDA only)")
    if forced == "cpu":
        raise ValueError(f"FASTZERO_BACKEND=cpu, but {op} got CUDA tensors: use cuda, triton or reference")
    if forced == "reference":
        return "reference"
    reasons = []
    for name, status in (("cuda", cuda_status), ("triton", triton_status)):
        if forced in (None, name):
            ok, why = status()
            if ok:
                return name
            if forced == name:
                raise RuntimeError(f"FASTZERO_BACKEND={name}, but it cannot run here: {why}")
            reasons.append(f"{name}: {why}")
    warn_fallback(op, "; ".join(reasons))
    return "reference"


def backends() -> list[BackendStatus]:
    """Every op, each backend, and whether it is available here (and why not)."""
    error = native.cpu_ops_error()
    if error is None:
        try:
            cpu = (True, f"ISA {native.cpu_isa()} (this CPU supports: {', '.join(native.supported_isas())})")
        except ValueError as exc:
            cpu = (False, str(exc))
    else:
        cpu = (False, error)
    reference = (True, "plain PyTorch, always available")
    rows = [BackendStatus("CPUAdam", "cpu", *cpu), BackendStatus("CPUAdam", "reference", *reference)]
    gpu = {"cuda": cuda_status(), "triton": triton_status()}
    for op in ("FusedAdam", "FusedLamb", "OneBitAdam"):  # OneBitAdam: FusedAdam's kernels and the 1-bit pack/unpack
        rows.append(BackendStatus(op, "cpu", *cpu))
        for name, (ok, why) in gpu.items():
            rows.append(BackendStatus(op, name, ok, "CUDA tensors" if ok else why))
        rows.append(BackendStatus(op, "reference", *reference))
    return rows


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
