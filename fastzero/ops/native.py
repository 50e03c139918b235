"""Loads the native CPU kernels: the extension built at install time, else a
just-in-time build with ninja into a cache. Never raises at import: when both
fail, :func:`cpu_ops` returns None and :func:`cpu_ops_error` says why."""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import os
from types import ModuleType

import torch

from fastzero import native_build

# Dtype codes shared with csrc/cpu/common.h.
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
NO_DTYPE = -1
ISA_NAMES = ("scalar", "avx2", "avx512")  # index = csrc code, best last


@functools.cache
def _load() -> tuple[ModuleType | None, str | None]:
    try:
        return importlib.import_module("fastzero._cpu_ops"), None
    except ImportError as exc:
        prebuilt_error = f"no prebuilt extension ({exc})"
    if os.environ.get("FASTZERO_JIT", "1") == "0":
        return None, f"{prebuilt_error}, and FASTZERO_JIT=0 forbids building it"
    try:
        path = native_build.jit_build()
        loader = importlib.machinery.ExtensionFileLoader("fastzero._cpu_ops", str(path))
        spec = importlib.util.spec_from_file_location("fastzero._cpu_ops", path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module, None
    except (native_build.BuildError, ImportError, OSError) as exc:
        return None, f"{prebuilt_error}; the just-in-time build failed: {exc}"


def cpu_ops() -> ModuleType | None:
    """The native CPU kernel module, or None (see :func:`cpu_ops_error`)."""
    return _load()[0]


def cpu_ops_error() -> str | None:
    """Why the native CPU kernels are unavailable, or None if they loaded."""
    return _load()[1]


def best_isa() -> str | None:
    """The best instruction set this CPU supports, or None without native kernels."""
    ops = cpu_ops()
    return None if ops is None else ISA_NAMES[ops.best_isa()]


def cpu_isa() -> str:
    """The instruction set the CPU kernels use: the best one, or FASTZERO_CPU_ISA."""
    best = best_isa()
    if best is None:
        raise RuntimeError(f"fastzero's CPU kernels are unavailable: {cpu_ops_error()}")
    wanted = os.environ.get("FASTZERO_CPU_ISA", "").strip().lower()
    if not wanted:
        return best
    if wanted not in ISA_NAMES:
        raise ValueError(f"FASTZERO_CPU_ISA={wanted!r} is not one of {', '.join(ISA_NAMES)}")
    if ISA_NAMES.index(wanted) > ISA_NAMES.index(best):
        raise ValueError(
            f"FASTZERO_CPU_ISA={wanted!r}, but this CPU supports at most {best!r}; unset it or choose a lower one"
        )
    return wanted


def supported_isas() -> list[str]:
    """Every instruction set path this machine can run, scalar first."""
    best = best_isa()
    return [] if best is None else list(ISA_NAMES[: ISA_NAMES.index(best) + 1])
