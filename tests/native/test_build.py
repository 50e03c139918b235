"""How the native kernels are found: the install-time build, the
just-in-time build, and the reference fallback with one warning."""

import ast
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fastzero import native
from fastzero.native import build, loader
from fastzero.ops import CPUAdam, backend, backends, report
from tests import paths

REPO = str(paths.REPO)


def test_native_code_includes_no_pytorch_header():
    src = build.cpu_source_dir()
    for path in src.iterdir():
        text = path.read_text()
        assert "torch/" not in text and "ATen" not in text and "c10/" not in text, path


def test_native_layer_imports_nothing_above_it():
    """fastzero.native is the lowest layer: of fastzero, it imports only itself."""
    for path in (Path(REPO) / "fastzero" / "native").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else ["fastzero.native"]
            for name in names:
                if name == "fastzero" or name.startswith("fastzero."):
                    assert name.startswith("fastzero.native"), f"{path.name} imports {name}"


def test_build_script_needs_neither_fastzero_nor_torch():
    """setup.py runs fastzero/native/build.py by path where fastzero and torch
    cannot be imported."""
    code = (
        "import runpy, sys\n"
        "sys.modules['torch'] = sys.modules['fastzero'] = None  # any import of them fails\n"
        "ns = runpy.run_path('fastzero/native/build.py')\n"
        "print(ns['CPU_MODULE'], ns['CUDA_LIBRARY'], ns['cpu_source_dir']().name, ns['cuda_source_dir']().name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["_cpu_ops", "libfastzero_cuda.so", "cpu", "cuda"]


def test_report_lists_every_backend():
    rows = {(r.op, r.backend, r.device) for r in backends()}
    for family in backend.families().values():
        for b in family.backends.values():
            for device in b.devices:
                assert (family.op, b.name, device) in rows
    assert ("Adam (FusedAdam, CPUAdam)", "cpu", "cpu") in rows
    text = report()
    assert "CPUAdam" in text and "reference" in text
    out = subprocess.run([sys.executable, "-m", "fastzero.ops"], capture_output=True, text=True, check=True)
    assert "CPUAdam" in out.stdout and "SparseAttention" in out.stdout


def test_fallback_to_reference_warns_once_and_names_the_cause(monkeypatch):
    monkeypatch.setattr(loader, "_load_cpu", lambda: (None, "no C++ compiler found"))
    monkeypatch.setattr(backend, "_warned", set())
    p = torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    opt = CPUAdam([p])
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler found"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # no second warning
    assert opt.backend == "reference"
    assert not next(r for r in backends() if r.backend == "cpu").available


def test_forcing_cpu_without_kernels_is_an_error(monkeypatch):
    monkeypatch.setattr(loader, "_load_cpu", lambda: (None, "no C++ compiler found"))
    monkeypatch.setenv("FASTZERO_BACKEND", "cpu")
    p = torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler found"):
        CPUAdam([p]).step()


def test_just_in_time_build_into_a_cache(tmp_path):
    """Without the prebuilt extension, the first use builds it with ninja."""
    code = (
        "import sys, torch\n"
        "sys.modules['fastzero._cpu_ops'] = None  # hide the install-time build\n"
        "from fastzero import native\n"
        "from fastzero.ops import CPUAdam\n"
        "p = torch.nn.Parameter(torch.randn(100)); p.grad = torch.randn(100)\n"
        "opt = CPUAdam([p]); opt.step()\n"
        "print(opt.backend, native.cpu_ops().__file__)\n"
    )
    env = dict(os.environ, FASTZERO_CACHE_DIR=str(tmp_path), PYTHONWARNINGS="error::RuntimeWarning")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("cpu:") and str(tmp_path) in out.stdout


def test_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing to find
    monkeypatch.setenv("FASTZERO_CACHE_DIR", str(tmp_path))
    with pytest.raises(build.BuildError, match="no C\\+\\+ compiler"):
        build.build_cpu()


def test_triton_kernels_live_inside_fastzero(tmp_path):
    """Installed, our Triton kernels are fastzero.triton_kernels; a top-level
    `triton_kernels` (the Triton project's) is never ours. Checked from
    another folder, so that the source tree is not on sys.path."""
    code = (
        "import importlib.util, fastzero.triton_kernels as t\n"
        "spec = importlib.util.find_spec('triton_kernels')\n"
        "print(t.__name__, spec.origin if spec else None)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, check=True
    )
    name, origin = out.stdout.split()
    assert name == "fastzero.triton_kernels"
    assert origin == "None" or not origin.startswith(REPO), origin


def test_a_stale_prebuilt_extension_is_passed_over(monkeypatch):
    """An extension built from older bindings is never imported (it would fail
    with a pybind TypeError at the first call): the loader says why and builds."""
    from fastzero.native.abi import CPU_ABI_VERSION

    assert loader._cpu_abi_version(native.cpu_ops().__file__) == CPU_ABI_VERSION
    assert loader._cpu_abi_version("libc.so.6") == 1  # no version symbol: built before versioning
    monkeypatch.setattr(loader, "_cpu_abi_version", lambda path: 1)
    monkeypatch.setenv("FASTZERO_JIT", "0")
    loader._load_cpu.cache_clear()
    try:
        assert loader.cpu_ops() is None
        assert "is stale (CPU ABI version 1" in loader.cpu_ops_error()
    finally:
        loader._load_cpu.cache_clear()
