"""The wheel holds every package of the source tree: a regular install (not
only the editable one the tests use) ships the ZeRO runtime, comm, the Triton
kernels, the C++/CUDA sources for the just-in-time build and the bench.
(.ci/wheel_smoke.sh installs a built wheel into a fresh environment and runs
it; this is the fast check of its contents.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folders installed inside fastzero's namespace (setup.py says why).
MAPPED = {"triton_kernels": "fastzero/triton_kernels", "bench": "fastzero/bench", "csrc": "fastzero/_csrc"}


def source_packages() -> set[str]:
    """Every folder with an __init__.py, as its path inside the wheel."""
    out = set()
    for init in ROOT.glob("**/__init__.py"):
        rel = init.parent.relative_to(ROOT).as_posix()
        top, _, rest = rel.partition("/")
        if top == "fastzero":
            out.add(rel)
        elif top in MAPPED:
            out.add(f"{MAPPED[top]}/{rest}".rstrip("/"))
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # A clean copy: setuptools reuses a build/ folder, which would hide a package left out of setup.py.
    src = out / "src"
    shutil.copytree(
        ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "*.so")
    )
    env = dict(os.environ, FASTZERO_BUILD_NATIVE="0")  # contents only: the native build is CI's wheel smoke test
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("fastzero-*.whl")
    return zipfile.ZipFile(path)


def test_every_source_package_is_in_the_wheel(wheel):
    names = set(wheel.namelist())
    missing = sorted(p for p in source_packages() if f"{p}/__init__.py" not in names)
    assert not missing, f"packages missing from the wheel: {missing}"
    for required in ("fastzero/runtime/engine.py", "fastzero/comm/__init__.py", "fastzero/bench/run.py"):
        assert required in names


def test_native_sources_and_bench_data_ship(wheel):
    names = set(wheel.namelist())
    for folder, suffixes in (
        ("csrc/cpu", (".cpp", ".h", ".inc")),
        ("csrc/cuda", (".cu", ".cuh", ".h")),
        ("csrc/common", (".h",)),
    ):
        for src in (ROOT / folder).iterdir():
            if src.suffix in suffixes:
                assert f"fastzero/_{folder}/{src.name}" in names, f"{folder}/{src.name} is not shipped"
    for baseline in (ROOT / "bench" / "baselines").glob("*.json"):
        assert f"fastzero/bench/baselines/{baseline.name}" in names


def test_console_script(wheel):
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    assert "fastzero = fastzero.launcher:main" in wheel.read(entry_points).decode()


def test_no_top_level_package_but_fastzero(wheel):
    tops = {n.split("/")[0] for n in wheel.namelist() if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"fastzero"}, f"the wheel installs top-level names {sorted(tops)}; only fastzero is ours"
