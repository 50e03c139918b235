"""How fastzero's native code is built: the sources and flags of the CPU
kernels (csrc/cpu, one pybind11 extension) and of the CUDA kernels
(csrc/cuda, one shared library with a C ABI), and the plumbing both builds
share: where the sources are, the cache they build into, the hash of every
input that names a build there, compiler lookup, and the install of a built
file by one rename.

Used by ``setup.py`` at install time, by the just-in-time builds of
:mod:`fastzero.native.loader` on first use, and by the compile checks that
run in CI without a GPU. Standard library only: ``setup.py`` runs this file
with runpy without importing fastzero (torch is not in the build
environment, and the native code does not need it: DESIGN.md rule 2).
``python fastzero/native/build.py cpu|cuda`` builds into the cache and
prints the path.

The CUDA library is one ``libfastzero_cuda.so`` with an ``extern "C"`` ABI
(csrc/cuda/fastzero_cuda.h), loaded with ctypes. It links the CUDA runtime
statically and exports only the ``fz_cuda_*`` symbols, so it neither needs a
``libcudart`` at load time nor clashes with the one torch loads; it needs the
driver (``libcuda.so.1``) only when a kernel is launched. Each CUDA source is
compiled by one nvcc process for every architecture (nvcc's ``--threads``
compiles the architectures in parallel) and the sources run in parallel too;
no ninja there: there are five sources, and the cache key covers every input.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


class BuildError(RuntimeError):
    """Native code could not be built; the message says why and what to do."""


# ---------------------------------------------------------------------------
# Shared plumbing


def source_dir(kind: str, first_source: str) -> Path:
    """csrc/<kind> of a source checkout, else the copy installed as
    fastzero/_csrc/<kind>; the one holding ``first_source``."""
    package = Path(__file__).resolve().parent.parent  # fastzero/
    candidates = (package.parent / "csrc" / kind, package / "_csrc" / kind)
    for candidate in candidates:
        if (candidate / first_source).is_file():
            return candidate
    what = {
        "cpu": "C++ sources of fastzero's CPU kernels",
        "cuda": "CUDA sources of fastzero",
        "common": "C headers shared by fastzero's CPU and CUDA kernels",
    }[kind]
    raise BuildError(f"the {what} are missing (looked in {candidates[0]} and {candidates[1]}); reinstall fastzero")


# csrc/common: plain C headers both builds include (the hyperparameter structs
# of the optimizer families, csrc/common/hyperparams.h).
COMMON_HEADERS = ("hyperparams.h",)


def common_source_dir() -> Path:
    """csrc/common of a source checkout, else the copy installed with fastzero."""
    return source_dir("common", COMMON_HEADERS[0])


def cache_dir() -> Path:
    """Where just-in-time builds go: $FASTZERO_CACHE_DIR (``~`` expanded;
    made if missing), else ~/.cache/fastzero. A setting that names an existing
    file raises ValueError. (fastzero.native.envvars does this for the other
    variables; this file stays importable without fastzero, for setup.py.)"""
    raw = os.environ.get("FASTZERO_CACHE_DIR", "").strip()
    if not raw:
        return Path.home() / ".cache" / "fastzero"
    root = Path(raw).expanduser()
    if root.exists() and not root.is_dir():
        raise ValueError(
            f"FASTZERO_CACHE_DIR={raw!r} is not a directory; name a directory (made if missing) or unset it"
        )
    return root


def input_hash(srcs: Iterable[Path], suffixes: Iterable[str], settings: Iterable[str]) -> str:
    """A hash of every file of the folders ``srcs`` with one of ``suffixes``
    (folder and file name, and contents) and of ``settings`` (compiler,
    flags, versions): the name of one build in the cache."""
    digest = hashlib.sha256()
    suffixes = tuple(suffixes)
    for src in srcs:
        for name in sorted(p.name for p in src.iterdir() if p.suffix in suffixes):
            digest.update(f"{src.name}/{name}".encode() + b"\0" + (src / name).read_bytes() + b"\0")
    digest.update("\0".join(settings).encode())
    return digest.hexdigest()[:16]


def first_executable(candidates: Iterable[str]) -> str | None:
    """The full path of the first of ``candidates`` (names or paths) that is
    an executable, or None."""
    for candidate in candidates:
        path = shutil.which(candidate)
        if path is not None:
            return path
    return None


def run_tool(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    """Runs a compiler or linker; raises BuildError with its output if it fails."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise BuildError(f"{what}: cannot run {cmd[0]}: {exc}") from exc
    if proc.returncode != 0:
        raise BuildError(f"{what} failed:\n$ {' '.join(cmd)}\n{proc.stdout[-6000:]}{proc.stderr[-6000:]}")
    return proc


def build_into_cache(name: str, filename: str, make: Callable[[Path], Path]) -> Path:
    """``cache_dir()/name/filename``, built by ``make(work_dir)`` (which
    returns the built file) unless it exists. The build runs in a private
    folder and its result is installed by one rename, so ranks that start
    together never load a half-written library; the folder is removed after."""
    out_dir = cache_dir() / name
    target = out_dir / filename
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=out_dir))
    try:
        os.replace(make(work), target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------
# The CPU kernels: one pybind11 extension, fastzero._cpu_ops

CPU_MODULE = "_cpu_ops"
CPU_SOURCES = ("adam.cpp", "lamb.cpp", "onebit.cpp", "quant.cpp", "stream.cpp", "cpu_features.cpp", "bindings.cpp")
CPU_HEADER_SUFFIXES = (".h", ".inc")
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
CPU_LDFLAGS = ("-shared", "-pthread", "-fopenmp")


def cpu_source_dir() -> Path:
    """csrc/cpu of a source checkout, else the copy installed with fastzero."""
    return source_dir("cpu", CPU_SOURCES[0])


def find_cxx() -> str:
    """The C++ compiler: $CXX (default c++), else g++, else clang++."""
    cxx = os.environ.get("CXX", "c++")
    path = first_executable((cxx, "g++", "clang++"))
    if path is None:
        raise BuildError(
            f"no C++ compiler found (looked for $CXX={cxx!r}, g++ and clang++); install one "
            "(apt-get install g++) or set CXX"
        )
    return path


def find_ninja() -> str:
    """ninja from PATH, else the one the ninja PyPI package ships."""
    path = first_executable(("ninja",))
    if path is None:
        try:
            import ninja

            path = str(Path(ninja.BIN_DIR) / "ninja")
        except ImportError:
            pass
    if path is None or not Path(path).exists():
        raise BuildError("ninja was not found; install it (pip install ninja)")
    return path


def cpu_includes() -> list[str]:
    """pybind11's and Python's include directories, and csrc/common."""
    try:
        import pybind11
    except ImportError as exc:
        raise BuildError("pybind11 is not installed; install it (pip install pybind11)") from exc
    return [pybind11.get_include(), sysconfig.get_paths()["include"], str(common_source_dir())]


def _ninja_file(src: Path, cxx: str, includes: list[str], target: str) -> str:
    inc = " ".join(f"-I{i}" for i in (*includes, str(src)))
    lines = [
        f"cxx = {cxx}",
        f"cflags = {' '.join(CXXFLAGS)} {inc}",
        f"ldflags = {' '.join(CPU_LDFLAGS)}",
        "rule cc",
        "  command = $cxx $cflags -MMD -MF $out.d -c $in -o $out",
        "  depfile = $out.d",
        "rule link",
        "  command = $cxx $in $ldflags -o $out",
    ]
    objects = [f"{Path(name).stem}.o" for name in CPU_SOURCES]
    lines += [f"build {obj}: cc {src / name}" for obj, name in zip(objects, CPU_SOURCES)]
    lines.append(f"build {target}: link {' '.join(objects)}")
    return "\n".join(lines) + "\n"


def cpu_build_key(cxx: str, includes: list[str]) -> str:
    """A hash of every source and header (csrc/cpu and csrc/common), the
    flags, the compiler and Python."""
    settings = (cxx, *CXXFLAGS, *CPU_LDFLAGS, *includes, sys.version)
    return input_hash((cpu_source_dir(), common_source_dir()), (".cpp", *CPU_HEADER_SUFFIXES), settings)


def build_cpu() -> Path:
    """Builds the CPU extension with ninja into the cache (once per version of
    the sources, flags, compiler and Python) and returns its path. Raises
    BuildError naming the missing compiler or tool, or the compiler's output."""
    src = cpu_source_dir()
    cxx = find_cxx()
    includes = cpu_includes()
    filename = f"{CPU_MODULE}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    key = cpu_build_key(cxx, includes)

    def make(work: Path) -> Path:
        (work / "build.ninja").write_text(_ninja_file(src, cxx, includes, filename))
        proc = subprocess.run([find_ninja(), "-C", str(work)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"building the CPU kernels failed:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
        return work / filename

    return build_into_cache(f"cpu_ops-{key}", filename, make)


# ---------------------------------------------------------------------------
# The CUDA kernels: one shared library with a C ABI, libfastzero_cuda.so

CUDA_LIBRARY = "libfastzero_cuda.so"
CUDA_SOURCES = (
    "common.cu",
    "multi_tensor_adam.cu",
    "multi_tensor_l2norm.cu",
    "multi_tensor_lamb.cu",
    "onebit.cu",
    "quant.cu",
)
CUDA_HEADER_SUFFIXES = (".cuh", ".h")
# A100 and H100/H200: SASS for each (Ampere's also runs on sm_86/sm_89).
CUDA_ARCHS = ("80", "90")


def parse_cuda_archs(text: str, name: str = "FASTZERO_CUDA_ARCHS") -> tuple[str, ...]:
    """CUDA architectures from "80;90", "80,90a" or "sm_80 sm_90": compute
    capabilities as nvcc's sm_XX takes them (two or three digits, then an
    optional a or f); () for an empty setting. ValueError names a bad entry."""
    archs = []
    for entry in re.split(r"[;,\s]+", text.strip()):
        if not entry:
            continue
        arch = entry.removeprefix("sm_").removeprefix("compute_")
        if re.fullmatch(r"[1-9][0-9]{1,2}[af]?", arch) is None:
            raise ValueError(
                f"{name}={text!r}: {entry!r} is not a CUDA architecture; use compute capabilities "
                "such as 80;90 or 90a (separated by ; or ,)"
            )
        archs.append(arch)
    return tuple(dict.fromkeys(archs))


NVCCFLAGS = (
    "-O3",
    "-std=c++17",
    # No --use_fast_math: the update math keeps IEEE division and sqrt, and
    # fp32 results stay within a few ulps of the PyTorch reference.
    "-Xcompiler=-fPIC,-fvisibility=hidden,-Wall,-Wextra",
    "--threads=0",
)
# Warnings of nvcc's front end, ptxas and the host compiler fail the compile
# check (CI, tests). Not the just-in-time build: a user's newer host compiler
# may warn about something new, and that must not cost them the kernels.
WERROR_FLAGS = ("-Werror=all-warnings", "-Xptxas=-Werror", "-Xcompiler=-Werror")
CUDA_LDFLAGS = (
    "-shared",
    "-cudart=static",
    # cudart's symbols stay inside the library: calls bind to our copy, and
    # torch's libcudart is neither used nor shadowed.
    "-Xlinker=--exclude-libs,ALL",
    "-Xlinker=--no-undefined",
)
# The linker version script: only the C ABI is exported (not the C++
# library templates it instantiates).
CUDA_EXPORTS = "{ global: fz_cuda_*; local: *; };\n"


def cuda_source_dir() -> Path:
    """csrc/cuda of a source checkout, else the copy installed with fastzero."""
    return source_dir("cuda", CUDA_SOURCES[0])


def cuda_includes() -> list[str]:
    """The include directories of the CUDA sources (and of a program that
    includes fastzero_cuda.h): csrc/cuda and csrc/common."""
    return [str(cuda_source_dir()), str(common_source_dir())]


def find_nvcc() -> str:
    """The nvcc to use: $NVCC, else $CUDA_HOME/$CUDA_PATH's, else the PATH's,
    else /usr/local/cuda's. Raises BuildError naming where it looked."""
    if os.environ.get("NVCC"):
        path = shutil.which(os.environ["NVCC"])
        if path is None:
            raise BuildError(f"$NVCC={os.environ['NVCC']!r} is not an executable; fix or unset it")
        return path
    homes = [os.environ[var] for var in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(var)]
    path = first_executable([str(Path(home) / "bin" / "nvcc") for home in homes] + ["nvcc", "/usr/local/cuda/bin/nvcc"])
    if path is None:
        raise BuildError(
            "nvcc (the CUDA compiler) was not found (looked at $NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH and "
            "/usr/local/cuda/bin); install the CUDA toolkit (12.x or 13.x) or set CUDA_HOME"
        )
    return path


def nvcc_version(nvcc: str) -> str:
    """The toolkit release, such as '13.0'."""
    out = run_tool([nvcc, "--version"], "querying nvcc's version").stdout
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else out.strip().splitlines()[-1]


def gencode_flags(archs: Iterable[str]) -> list[str]:
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]


def compile_source(
    src: Path | str, obj: Path | str, archs=CUDA_ARCHS, nvcc: str | None = None, werror: bool = True
) -> Path:
    """Compiles one .cu to an object with SASS for every arch in ``archs``,
    with the library's flags (and warnings as errors unless ``werror`` is False)."""
    nvcc = nvcc or find_nvcc()
    src = Path(src)
    flags = (*NVCCFLAGS, *(WERROR_FLAGS if werror else ()))
    includes = [f"-I{d}" for d in cuda_includes()]
    cmd = [nvcc, *flags, *gencode_flags(archs), *includes, "-c", str(src), "-o", str(obj)]
    run_tool(cmd, f"compiling {src.name} for sm_{', sm_'.join(archs)}")
    return Path(obj)


def _compile_parallel(jobs: list[tuple], nvcc: str, werror: bool) -> list[Path]:
    """Runs compile_source over (src, obj, archs) jobs, as many at once as CPUs."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda job: compile_source(*job, nvcc=nvcc, werror=werror), jobs))


def compile_objects(out_dir: Path | str, archs=CUDA_ARCHS, nvcc: str | None = None, werror: bool = False) -> list[Path]:
    """Compiles every source to one object holding code for every arch in
    ``archs``, in parallel; returns the objects (the library's build)."""
    nvcc = nvcc or find_nvcc()
    src, out = cuda_source_dir(), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(src / name, out / f"{Path(name).stem}.o", tuple(archs)) for name in CUDA_SOURCES]
    return _compile_parallel(jobs, nvcc, werror)


def compile_check(arch_list=CUDA_ARCHS, out_dir: Path | str | None = None) -> dict[str, list[Path]]:
    """Compiles every .cu of csrc/cuda once per arch of ``arch_list`` (one
    object per source and arch), warnings as errors, in parallel, without a
    GPU: what CI runs so that the sources cannot rot. Every .cu must be listed
    in CUDA_SOURCES, so none escapes the build. Returns {arch: objects}, each
    list linkable on its own; raises BuildError with nvcc's output on failure."""
    nvcc = find_nvcc()
    src = cuda_source_dir()
    found = sorted(p.name for p in src.glob("*.cu"))
    if found != sorted(CUDA_SOURCES):
        raise BuildError(f"csrc/cuda holds {found} but build.CUDA_SOURCES lists {sorted(CUDA_SOURCES)}; update it")
    out = Path(out_dir if out_dir is not None else tempfile.mkdtemp(prefix="fastzero-cuda-check-"))
    out.mkdir(parents=True, exist_ok=True)
    jobs = [
        (src / name, out / f"{Path(name).stem}.sm_{arch}.o", (arch,)) for arch in arch_list for name in CUDA_SOURCES
    ]
    objects = _compile_parallel(jobs, nvcc, werror=True)
    n = len(CUDA_SOURCES)
    return {arch: objects[i * n : (i + 1) * n] for i, arch in enumerate(arch_list)}


def link(objects: list[Path], target: Path | str, nvcc: str | None = None) -> Path:
    """Links compiled objects into the shared library (no GPU needed). The
    version script lives in a temporary folder, never beside the target
    (which may be the source tree, for an in-place install)."""
    nvcc = nvcc or find_nvcc()
    target = Path(target)
    with tempfile.TemporaryDirectory(prefix="fastzero-link-") as tmp:
        script = Path(tmp) / f"{CUDA_LIBRARY}.exports"
        script.write_text(CUDA_EXPORTS)
        cmd = [nvcc, *CUDA_LDFLAGS, f"-Xlinker=--version-script={script}", *map(str, objects), "-o", str(target)]
        run_tool(cmd, "linking the CUDA kernels")
    return target


def cuda_build_key(nvcc: str, archs=CUDA_ARCHS) -> str:
    """A hash of every source and header (csrc/cuda and csrc/common), the
    flags and the toolkit version."""
    settings = (*NVCCFLAGS, *CUDA_LDFLAGS, CUDA_EXPORTS, *gencode_flags(archs), nvcc_version(nvcc))
    return input_hash((cuda_source_dir(), common_source_dir()), (".cu", *CUDA_HEADER_SUFFIXES), settings)


def build_cuda(archs=CUDA_ARCHS) -> Path:
    """Builds the library for ``archs`` into the cache (once per version of
    the sources, flags, archs and toolkit) and returns its path. Raises
    BuildError naming the missing compiler or the failing step."""
    nvcc = find_nvcc()
    archs = tuple(archs)

    def make(work: Path) -> Path:
        return link(compile_objects(work, archs, nvcc), work / CUDA_LIBRARY, nvcc)

    return build_into_cache(f"cuda_ops-{cuda_build_key(nvcc, archs)}", CUDA_LIBRARY, make)


if __name__ == "__main__":  # python fastzero/native/build.py cpu|cuda: build into the cache, print the path
    if sys.argv[1:] not in (["cpu"], ["cuda"]):
        sys.exit(f"usage: python {sys.argv[0]} cpu|cuda")
    print(build_cpu() if sys.argv[1] == "cpu" else build_cuda())
