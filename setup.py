"""fastzero's build: the CPU kernels in csrc/cpu as one pybind11 extension.

If the build fails (no compiler, say), the install still succeeds: the first
use builds the kernels just in time with ninja (fastzero/native/build.py),
and where that is impossible too the ops fall back to the PyTorch reference
with a warning that names the cause. FASTZERO_BUILD_NATIVE=0 skips the build.
"""

import os
import runpy
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
# Standard library only, so run by path: fastzero (and torch) need not be importable here.
build = runpy.run_path(str(HERE / "fastzero" / "native" / "build.py"))
VERSION = runpy.run_path(str(HERE / "fastzero" / "version.py"))["__version__"]


def flag(name: str, default: bool) -> bool:
    """A FASTZERO_BUILD_* switch: 1 or 0 (or unset); anything else stops the
    install with the name (fastzero.native.envvars' rule; not importable here)."""
    raw = os.environ.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise SystemExit(f"fastzero setup: {name}={raw!r}: it must be 1 or 0 (or unset)")
    return default if raw == "" else raw == "1"


STRICT = flag("FASTZERO_BUILD_STRICT", False) or os.environ.get("CI") == "true"  # the switch is checked even in CI
BUILD_CUDA = flag("FASTZERO_BUILD_CUDA", False)


class OptionalBuildExt(build_ext):
    """A failed build warns and leaves the JIT build to first use, except in
    CI (CI=true) or with FASTZERO_BUILD_STRICT=1, where it fails the install."""

    def run(self):
        for step in (super().run, self.run_cuda):
            try:
                step()
            except Exception as exc:
                self._failed(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._failed(exc)

    def run_cuda(self):
        """FASTZERO_BUILD_CUDA=1: build the CUDA kernels now (nvcc; sm_80 and
        sm_90, or FASTZERO_CUDA_ARCHS) instead of on first use."""
        if not BUILD_CUDA:
            return
        archs = build["parse_cuda_archs"](os.environ.get("FASTZERO_CUDA_ARCHS", ""))
        objects = build["compile_objects"](Path(self.build_temp) / "cuda", archs=archs or build["CUDA_ARCHS"])
        in_tree = self.inplace or getattr(self, "editable_mode", False)  # pip install -e: beside the sources
        package_dir = HERE / "fastzero" if in_tree else Path(self.build_lib) / "fastzero"
        package_dir.mkdir(parents=True, exist_ok=True)
        build["link"](objects, package_dir / build["CUDA_LIBRARY"])

    @staticmethod
    def _failed(exc):
        if STRICT:
            raise exc
        print(f"fastzero: native kernels were not built ({exc}); they will be built on first use", file=sys.stderr)


MAPPED = {"fastzero.triton_kernels": "triton_kernels", "fastzero._csrc": "csrc", "fastzero.bench": "bench"}


def extensions():
    if not flag("FASTZERO_BUILD_NATIVE", True):
        return []
    try:
        from pybind11.setup_helpers import Pybind11Extension
    except ImportError:
        return []
    return [
        Pybind11Extension(
            f"fastzero.{build['CPU_MODULE']}",
            sources=[f"csrc/cpu/{s}" for s in build["CPU_SOURCES"]],
            include_dirs=["csrc/cpu", "csrc/common"],
            extra_compile_args=list(build["CXXFLAGS"]),
            extra_link_args=[f for f in build["CPU_LDFLAGS"] if f != "-shared"],
            cxx_std=17,
        )
    ]


setup(
    name="fastzero",
    version=VERSION,
    description="Kernel-first large-model training: fused optimizers, ZeRO, offload, sparse attention",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # Every package under fastzero/ (discovered, so a new one cannot be left
    # out of the wheel), plus three folders installed inside fastzero's
    # namespace: a top-level `triton_kernels` would shadow the Triton
    # project's own package and a top-level `bench` is too generic a name;
    # csrc/ ships for the just-in-time build where install-time failed.
    packages=[
        *find_packages(include=["fastzero", "fastzero.*"]),
        *MAPPED,
        *[f"fastzero.bench.{p}" for p in find_packages("bench")],
    ],
    package_dir=MAPPED,
    package_data={
        "fastzero._csrc": ["cpu/*.cpp", "cpu/*.h", "cpu/*.inc", "cuda/*.cu", "cuda/*.cuh", "cuda/*.h", "common/*.h"],
        "fastzero.bench": ["baselines/*.json", "gpu_check.sh"],
    },
    ext_modules=extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
    install_requires=["torch>=2.4", "pybind11>=2.10", "ninja"],
    entry_points={"console_scripts": ["fastzero=fastzero.launcher:main"]},
    extras_require={
        "bench": ["matplotlib>=3.7", "rich>=13", "pytest-benchmark>=4"],
        "test": [
            "pytest>=7",
            "pytest-benchmark>=4",
            "matplotlib>=3.7",
            "rich>=13",
            "ruff>=0.6",
            "triton>=3.2",
            "numpy",
            "tensorboard>=2.12",
            "hjson",  # hjson config files (tests/test_config.py); optional for users
            "transformers>=4.40",  # GPT-2 in tests: tied heads (tests/faults), drift vs torch (tests/runtime)
            "safetensors>=0.4",  # fastzero.utils.zero_to_fp32's safe_serialization (tests/utils)
            "wandb",  # the wandb monitor, run offline (tests/runtime/test_monitoring.py); optional for users
        ],
        "safetensors": ["safetensors>=0.4"],
        "monitor": ["tensorboard>=2.12", "wandb"],
        "peers": ["deepspeed>=0.14"],
    },
    zip_safe=False,
)
