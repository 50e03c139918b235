"""How the CUDA kernels are built: one list of sources and flags, used by the
just-in-time build (into a cache, on first use), by the compile check that
runs in CI without a GPU, and by an install-time build.

Standard library only, like :mod:`fastzero.native_build`: the CUDA code
includes no PyTorch header (DESIGN.md rule 2), so neither does its build.

The library is one ``libfastzero_cuda.so`` with an ``extern "C"`` ABI
(csrc/cuda/fastzero_cuda.h), loaded with ctypes. It links the CUDA runtime
statically and exports only the ``fz_cuda_*`` symbols, so it neither needs a
``libcudart`` at load time nor clashes with the one torch loads; it needs the
driver (``libcuda.so.1``) only when a kernel is launched.

Each source is compiled by one nvcc process for every architecture (nvcc's
``--threads`` compiles the architectures in parallel) and the sources run in
parallel too; no ninja: there are five sources, and the cache key already
covers every input.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

LIBRARY = "libfastzero_cuda.so"
SOURCES = ("common.cu", "multi_tensor_adam.cu", "multi_tensor_l2norm.cu", "multi_tensor_lamb.cu", "onebit.cu")
HEADER_SUFFIXES = (".cuh", ".h")
# A100 and H100/H200: SASS for each (Ampere's also runs on sm_86/sm_89).
ARCHS = ("80", "90")
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
LDFLAGS = (
    "-shared",
    "-cudart=static",
    # cudart's symbols stay inside the library: calls bind to our copy, and
    # torch's libcudart is neither used nor shadowed.
    "-Xlinker=--exclude-libs,ALL",
    "-Xlinker=--no-undefined",
)


class BuildError(RuntimeError):
    """The CUDA kernels could not be built; the message says why and what to do."""


def source_dir() -> Path:
    """csrc/cuda of a source checkout, else the copy installed as fastzero/_csrc/cuda."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "csrc" / "cuda", here / "_csrc" / "cuda"):
        if (candidate / SOURCES[0]).is_file():
            return candidate
    raise BuildError(
        f"the CUDA sources of fastzero are missing (looked in {here.parent / 'csrc' / 'cuda'} "
        f"and {here / '_csrc' / 'cuda'}); reinstall fastzero"
    )


def find_nvcc() -> str:
    """The nvcc to use: $NVCC, else $CUDA_HOME/$CUDA_PATH's, else the PATH's,
    else /usr/local/cuda's. Raises BuildError naming where it looked."""
    candidates = []
    if os.environ.get("NVCC"):
        path = shutil.which(os.environ["NVCC"])
        if path is None:
            raise BuildError(f"$NVCC={os.environ['NVCC']!r} is not an executable; fix or unset it")
        return path
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(str(Path(os.environ[var]) / "bin" / "nvcc"))
    candidates += ["nvcc", "/usr/local/cuda/bin/nvcc"]
    for candidate in candidates:
        path = shutil.which(candidate)
        if path is not None:
            return path
    raise BuildError(
        "nvcc (the CUDA compiler) was not found (looked at $NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH and "
        "/usr/local/cuda/bin); install the CUDA toolkit (12.x or 13.x) or set CUDA_HOME"
    )


def nvcc_version(nvcc: str) -> str:
    """The toolkit release, such as '13.0'."""
    out = _run([nvcc, "--version"], "querying nvcc's version").stdout
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else out.strip().splitlines()[-1]


def gencode_flags(archs: tuple[str, ...] | list[str]) -> list[str]:
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]


def _run(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise BuildError(f"{what}: cannot run {cmd[0]}: {exc}") from exc
    if proc.returncode != 0:
        raise BuildError(f"{what} failed:\n$ {' '.join(cmd)}\n{proc.stdout[-6000:]}{proc.stderr[-6000:]}")
    return proc


def compile_source(src: Path | str, obj: Path | str, archs=ARCHS, nvcc: str | None = None, werror: bool = True) -> Path:
    """Compiles one .cu to an object with SASS for every arch in ``archs``,
    with the library's flags (and warnings as errors unless ``werror`` is False)."""
    nvcc = nvcc or find_nvcc()
    src = Path(src)
    flags = (*NVCCFLAGS, *(WERROR_FLAGS if werror else ()))
    cmd = [nvcc, *flags, *gencode_flags(archs), f"-I{source_dir()}", "-c", str(src), "-o", str(obj)]
    _run(cmd, f"compiling {src.name} for sm_{', sm_'.join(archs)}")
    return Path(obj)


def _parallel(jobs: list[tuple], nvcc: str, werror: bool) -> list[Path]:
    """Runs compile_source over (src, obj, archs) jobs, as many at once as CPUs."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda job: compile_source(*job, nvcc=nvcc, werror=werror), jobs))


def compile_objects(out_dir: Path | str, archs=ARCHS, nvcc: str | None = None, werror: bool = False) -> list[Path]:
    """Compiles every source to one object holding code for every arch in
    ``archs``, in parallel; returns the objects (the library's build)."""
    nvcc = nvcc or find_nvcc()
    src, out = source_dir(), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return _parallel([(src / name, out / f"{Path(name).stem}.o", tuple(archs)) for name in SOURCES], nvcc, werror)


def compile_check(arch_list=ARCHS, out_dir: Path | str | None = None) -> dict[str, list[Path]]:
    """Compiles every .cu of csrc/cuda once per arch of ``arch_list`` (one
    object per source and arch), warnings as errors, in parallel, without a
    GPU: what CI runs so that the sources cannot rot. Every .cu must be listed
    in SOURCES, so none escapes the build. Returns {arch: objects}, each list
    linkable on its own; raises BuildError with nvcc's output on failure."""
    nvcc = find_nvcc()
    src = source_dir()
    found = sorted(p.name for p in src.glob("*.cu"))
    if found != sorted(SOURCES):
        raise BuildError(f"csrc/cuda holds {found} but cuda_build.SOURCES lists {sorted(SOURCES)}; update SOURCES")
    out = Path(out_dir if out_dir is not None else tempfile.mkdtemp(prefix="fastzero-cuda-check-"))
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(src / name, out / f"{Path(name).stem}.sm_{arch}.o", (arch,)) for arch in arch_list for name in SOURCES]
    objects = _parallel(jobs, nvcc, werror=True)
    return {arch: objects[i * len(SOURCES) : (i + 1) * len(SOURCES)] for i, arch in enumerate(arch_list)}


def link(objects: list[Path], target: Path | str, nvcc: str | None = None) -> Path:
    """Links compiled objects into the shared library (no GPU needed)."""
    nvcc = nvcc or find_nvcc()
    target = Path(target)
    # Only the C ABI is exported (not the C++ library templates it instantiates).
    script = target.parent / f"{target.name}.exports"
    script.write_text("{ global: fz_cuda_*; local: *; };\n")
    cmd = [nvcc, *LDFLAGS, f"-Xlinker=--version-script={script}", *map(str, objects), "-o", str(target)]
    _run(cmd, "linking the CUDA kernels")
    return target


def cache_dir() -> Path:
    root = os.environ.get("FASTZERO_CACHE_DIR") or Path.home() / ".cache" / "fastzero"
    return Path(root)


def build_key(nvcc: str, archs=ARCHS) -> str:
    """A hash of every source and header, the flags and the toolkit version."""
    src = source_dir()
    digest = hashlib.sha256()
    for name in sorted(p.name for p in src.iterdir() if p.suffix in (".cu", *HEADER_SUFFIXES)):
        digest.update(name.encode() + b"\0" + (src / name).read_bytes())
    flags = (*NVCCFLAGS, *LDFLAGS, *gencode_flags(archs), nvcc_version(nvcc))
    digest.update("\0".join(flags).encode())
    return digest.hexdigest()[:16]


def jit_build(archs=ARCHS) -> Path:
    """Builds the library for ``archs`` into the cache (once per version of
    the sources, flags, archs and toolkit) and returns its path. Raises
    BuildError naming the missing compiler or the failing step."""
    nvcc = find_nvcc()
    archs = tuple(archs)
    out_dir = cache_dir() / f"cuda_ops-{build_key(nvcc, archs)}"
    target = out_dir / LIBRARY
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Build in a private folder, then rename: ranks that start together never
    # load a half-written library.
    work = Path(tempfile.mkdtemp(prefix="build-", dir=out_dir))
    try:
        objects = compile_objects(work, archs, nvcc)
        link(objects, work / LIBRARY, nvcc)
        os.replace(work / LIBRARY, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


if __name__ == "__main__":  # python fastzero/cuda_build.py: build into the cache, print the path
    print(jit_build())
