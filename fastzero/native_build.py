"""How the native CPU kernels are built: one list of sources and flags, used by
``setup.py`` at install time and by the just-in-time build with ninja.

Standard library only: ``setup.py`` runs this file without importing
fastzero (torch is not in the build environment; the native code does not
need it, DESIGN.md rule 2).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

MODULE = "_cpu_ops"
SOURCES = ("adam.cpp", "lamb.cpp", "onebit.cpp", "stream.cpp", "cpu_features.cpp", "bindings.cpp")
# No -march=native: the kernels pick their instruction set at run time.
CXXFLAGS = (
    "-O3",
    "-std=c++17",
    "-fPIC",
    "-fvisibility=hidden",
    "-fno-math-errno",
    "-fopenmp",  # shares torch's libgomp (csrc/cpu/parallel.h says why)
    "-Wall",
    "-Wno-maybe-uninitialized",  # GCC 12 false positive inside avx512fintrin.h
)
LDFLAGS = ("-shared", "-pthread", "-fopenmp")


class BuildError(RuntimeError):
    """The native kernels could not be built; the message says why and what to do."""


def source_dir() -> Path:
    """csrc/cpu of a source checkout, else the copy installed as fastzero/_csrc/cpu."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "csrc" / "cpu", here / "_csrc" / "cpu"):
        if (candidate / SOURCES[0]).is_file():
            return candidate
    raise BuildError(
        f"the C++ sources of fastzero's CPU kernels are missing (looked in {here.parent / 'csrc' / 'cpu'} "
        f"and {here / '_csrc' / 'cpu'}); reinstall fastzero"
    )


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx) or shutil.which("g++") or shutil.which("clang++")
    if path is None:
        raise BuildError(
            f"no C++ compiler found (looked for $CXX={cxx!r}, g++ and clang++); install one "
            "(apt-get install g++) or set CXX"
        )
    return path


def _ninja() -> str:
    path = shutil.which("ninja")
    if path is None:
        try:
            import ninja  # the PyPI package ships the binary

            path = str(Path(ninja.BIN_DIR) / "ninja")
        except ImportError:
            pass
    if path is None or not Path(path).exists():
        raise BuildError("ninja was not found; install it (pip install ninja)")
    return path


def _includes() -> list[str]:
    try:
        import pybind11
    except ImportError as exc:
        raise BuildError("pybind11 is not installed; install it (pip install pybind11)") from exc
    return [pybind11.get_include(), sysconfig.get_paths()["include"]]


def cache_dir() -> Path:
    root = os.environ.get("FASTZERO_CACHE_DIR") or Path.home() / ".cache" / "fastzero"
    return Path(root)


def jit_build() -> Path:
    """Builds the extension with ninja into the cache (once per source version)
    and returns the path of the shared library."""
    src = source_dir()
    cxx = _compiler()
    includes = _includes()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    digest = hashlib.sha256()
    for name in sorted(p.name for p in src.iterdir() if p.suffix in (".cpp", ".h", ".inc")):
        digest.update(name.encode() + (src / name).read_bytes())
    digest.update(" ".join((cxx, *CXXFLAGS, *includes, sys.version)).encode())
    out_dir = cache_dir() / f"cpu_ops-{digest.hexdigest()[:16]}"
    target = out_dir / f"{MODULE}{suffix}"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Build in a private folder, then rename: ranks that start together never
    # load a half-written library.
    work = Path(tempfile.mkdtemp(prefix="build-", dir=out_dir))
    inc = " ".join(f"-I{i}" for i in (*includes, str(src)))
    lines = [
        f"cxx = {cxx}",
        f"cflags = {' '.join(CXXFLAGS)} {inc}",
        f"ldflags = {' '.join(LDFLAGS)}",
        "rule cc",
        "  command = $cxx $cflags -MMD -MF $out.d -c $in -o $out",
        "  depfile = $out.d",
        "rule link",
        "  command = $cxx $in $ldflags -o $out",
    ]
    objects = []
    for name in SOURCES:
        obj = f"{Path(name).stem}.o"
        objects.append(obj)
        lines.append(f"build {obj}: cc {src / name}")
    lines.append(f"build {target.name}: link {' '.join(objects)}")
    (work / "build.ninja").write_text("\n".join(lines) + "\n")
    proc = subprocess.run([_ninja(), "-C", str(work)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"building the CPU kernels failed:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    os.replace(work / target.name, target)
    shutil.rmtree(work, ignore_errors=True)
    return target
