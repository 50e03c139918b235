"""Loads fastzero's native code, once, on first use.

- The CPU kernels: the pybind11 extension ``fastzero._cpu_ops`` built at
  install time, else a just-in-time build with ninja into a cache
  (:func:`fastzero.native.build.build_cpu`; ``FASTZERO_JIT=0`` forbids it).
  The instruction set is the best this CPU has, or ``FASTZERO_CPU_ISA``.
- The CUDA kernels: ``libfastzero_cuda.so`` through ctypes, taken from
  ``$FASTZERO_CUDA_LIB`` or an install-time build beside the package, else
  built just in time with nvcc (:func:`fastzero.native.build.build_cuda`,
  for ``$FASTZERO_CUDA_ARCHS`` or sm_80, sm_90 and any other visible GPU).

Never raises at import, and never while loading: when a library cannot be
had, :func:`cpu_ops` returns None and :func:`cpu_ops_error` says why;
:func:`cuda_available` returns (False, why) and :func:`cuda_lib` raises that
reason when an op needs the library. The exception is a bad setting
(``FASTZERO_JIT`` not 0/1, ``FASTZERO_CUDA_LIB`` naming no file, a malformed
``FASTZERO_CUDA_ARCHS`` or ``FASTZERO_CACHE_DIR``, an unknown
``FASTZERO_CPU_ISA``): ValueError naming it, when it is consulted, not a
silent fallback.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.machinery
import importlib.util
import os
from pathlib import Path
from types import ModuleType

import torch

from fastzero.native import build
from fastzero.native.abi import CPU_ABI_VERSION, CUDA_ABI_VERSION, CUDA_SIGNATURES, ISA_NAMES
from fastzero.native.envvars import env_flag, env_path

# ---------------------------------------------------------------------------
# CPU

_CPU_MODULE = f"fastzero.{build.CPU_MODULE}"


def jit_allowed() -> bool:
    """FASTZERO_JIT: 1 (default) builds missing kernels on first use, 0
    forbids it; anything else raises ValueError (a setting that names
    nothing is an error, not a reason to fall back)."""
    return env_flag("FASTZERO_JIT", True)


def _cpu_abi_version(path: str) -> int:
    """The FZ_CPU_ABI_VERSION an extension file was built with, read without
    importing it (1: built before the extension said)."""
    try:
        return int(ctypes.CDLL(path).fz_cpu_abi_version())
    except (OSError, AttributeError):
        return 1


@functools.cache
def _load_cpu() -> tuple[ModuleType | None, str | None]:
    """The CPU extension and None, or None and why not. Builds it if needed
    (once): when there is no prebuilt extension, or it is stale (built from
    sources whose bindings have changed since)."""
    spec = importlib.util.find_spec(_CPU_MODULE)
    if spec is None:
        prebuilt_error = "no prebuilt extension"
    elif (version := _cpu_abi_version(spec.origin)) != CPU_ABI_VERSION:
        prebuilt_error = (
            f"the prebuilt extension {spec.origin} is stale (CPU ABI version {version}, this fastzero needs "
            f"{CPU_ABI_VERSION}; reinstall fastzero to rebuild it)"
        )
    else:
        try:
            return importlib.import_module(_CPU_MODULE), None
        except ImportError as exc:
            prebuilt_error = f"the prebuilt extension does not load ({exc})"
    if not jit_allowed():
        return None, f"{prebuilt_error}, and FASTZERO_JIT=0 forbids building it"
    try:
        path = build.build_cpu()
        if _cpu_abi_version(str(path)) != CPU_ABI_VERSION:
            return None, f"{prebuilt_error}; the just-in-time build {path} is not CPU ABI version {CPU_ABI_VERSION}"
        loader = importlib.machinery.ExtensionFileLoader(_CPU_MODULE, str(path))
        spec = importlib.util.spec_from_file_location(_CPU_MODULE, path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module, None
    except (build.BuildError, ImportError, OSError) as exc:
        return None, f"{prebuilt_error}; the just-in-time build failed: {exc}"


def cpu_ops() -> ModuleType | None:
    """The native CPU kernel module, or None (see :func:`cpu_ops_error`)."""
    return _load_cpu()[0]


def cpu_ops_error() -> str | None:
    """Why the native CPU kernels are unavailable, or None if they loaded."""
    return _load_cpu()[1]


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


# ---------------------------------------------------------------------------
# CUDA


def _prebuilt_cuda_library() -> Path | None:
    """$FASTZERO_CUDA_LIB (an existing file, else ValueError), else an
    install-time build beside the package, else None."""
    explicit = env_path("FASTZERO_CUDA_LIB", must_exist="file")
    if explicit is not None:
        return Path(explicit)
    beside = Path(__file__).resolve().parent.parent / build.CUDA_LIBRARY  # an install-time build
    return beside if beside.is_file() else None


def _cuda_archs() -> tuple[str, ...]:
    """The architectures to build: $FASTZERO_CUDA_ARCHS ("80;90;100"), else
    sm_80 and sm_90 (whose code also runs on sm_86/sm_89) plus that of any
    other visible GPU."""
    forced = build.parse_cuda_archs(os.environ.get("FASTZERO_CUDA_ARCHS", ""))
    if forced:
        return forced
    archs = list(build.CUDA_ARCHS)
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            if major not in (8, 9):
                archs.append(f"{major}{minor}")
    return tuple(dict.fromkeys(archs))


def bind_cuda(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declares the C ABI's signatures on a loaded library (ctypes then
    converts and checks every argument). Raises AttributeError if one is missing."""
    for name, (restype, argtypes) in CUDA_SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@functools.cache
def _load_cuda() -> tuple[ctypes.CDLL | None, str]:
    """The loaded library and "", or None and why not. Builds it if needed (once)."""
    path = _prebuilt_cuda_library()
    if path is None:
        if not jit_allowed():
            return None, "no prebuilt CUDA library, and FASTZERO_JIT=0 forbids building it"
        try:
            path = build.build_cuda(_cuda_archs())
        except build.BuildError as exc:
            return None, f"the just-in-time build of the CUDA kernels failed: {exc}"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"cannot load {path}: {exc}"
    try:
        bind_cuda(lib)
    except AttributeError as exc:
        return None, f"{path} is not fastzero's CUDA library ({exc}); rebuild it"
    if lib.fz_cuda_abi_version() != CUDA_ABI_VERSION:
        return None, (
            f"{path} speaks C ABI version {lib.fz_cuda_abi_version()}, this fastzero needs {CUDA_ABI_VERSION}; "
            "rebuild it (or unset FASTZERO_CUDA_LIB)"
        )
    return lib, ""


def _no_device_reason() -> str | None:
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    return None


def cuda_available() -> tuple[bool, str]:
    """(True, "") when the CUDA kernels can run on the current device, else
    (False, why): no CUDA device, no nvcc, a failed build or load, or a
    driver or GPU the library cannot run on. Builds the library on first
    call if needed (under a minute), never raises."""
    why = _no_device_reason()
    if why is not None:
        return False, why
    lib, why = _load_cuda()
    if lib is None:
        return False, why
    return _device_check(torch.cuda.current_device())


@functools.cache
def _device_check(index: int) -> tuple[bool, str]:
    lib = _load_cuda()[0]
    with torch.cuda.device(index):
        if lib.fz_cuda_check_device() != 0:
            return False, lib.fz_cuda_last_error().decode(errors="replace")
    return True, ""


def cuda_lib(op: str) -> ctypes.CDLL:
    """The loaded CUDA library, for the op named ``op``; raises RuntimeError
    saying why it is unavailable."""
    lib, why = _load_cuda()
    if lib is None:
        raise RuntimeError(f"{op}: the CUDA kernels are unavailable: {why}")
    return lib


def check_rc(lib: ctypes.CDLL, rc: int, op: str) -> None:
    """Raises RuntimeError with the library's message if a call of ``op``
    returned a nonzero code."""
    if rc != 0:
        message = (lib.fz_cuda_last_error() or b"").decode(errors="replace")
        raise RuntimeError(f"{op}: the CUDA kernel call failed (code {rc}): {message}")
