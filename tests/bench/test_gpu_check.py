"""bench/gpu_check.sh must work the first time it meets a GPU: its dry run
does every step that needs no GPU (the CPU build, nvcc builds of the CUDA
sources for sm_80 and sm_90, the GPU benchmark's case list)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests import paths

REPO = paths.REPO


def test_gpu_check_dry_run(tmp_path):
    if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
        if os.environ.get("CI") == "true":
            pytest.fail("nvcc is missing in CI: the CUDA sources must be compiled there")
        pytest.skip("nvcc is not installed: the dry run cannot build the CUDA sources")
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=os.environ.get("PYTHON", "python"))
    out = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=1200,  # nvcc for two archs: minutes on 2 busy cores
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for step in ("env", "build_cpu", "compile_cuda", "bench_list", "bench_list_states"):
        assert f"ok      {step}" in out.stdout
    assert (tmp_path / "gpu_check.log").is_file()
    log = (tmp_path / "gpu_check.log").read_text()
    assert "fp32-512M" in log  # the GPU cases were listed
    assert "fp32-int8states" in log and "fp32-bf16states" in log  # and the state formats'
    assert len(list(tmp_path.iterdir())) <= 8  # what the device tool brings back
