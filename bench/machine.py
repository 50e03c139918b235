"""What machine a result came from: CPU, cores, the ISA path the kernels
used, library versions and the git commit."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from fastzero import native


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def machine_info() -> dict:
    isa = None
    if native.cpu_ops() is not None:
        try:
            isa = native.cpu_isa()
        except ValueError:
            pass
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "isa": isa,
        "isas_supported": native.supported_isas(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "deepspeed": _version("deepspeed"),
        "torchao": _version("torchao"),  # the optional peers with low-bit optimizer states
        "bitsandbytes": _version("bitsandbytes"),
        "fastzero": _version("fastzero"),
        "git_sha": git_sha(),
    }
