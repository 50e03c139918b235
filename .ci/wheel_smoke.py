"""Run by .ci/wheel_smoke.sh inside a fresh virtual environment that has only
the built wheel (and its dependencies) installed, from a folder outside the
source tree: everything a user reaches must be in the wheel."""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(sys.argv[1]).resolve()  # the checkout the wheel was built from
WORK = Path.cwd()


def run(*cmd: str, cwd: Path = WORK) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        sys.exit(f"FAILED ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"ok: {' '.join(cmd)}")
    return proc.stdout


import fastzero  # noqa: E402

installed = Path(fastzero.__file__).resolve()
if SOURCE in installed.parents:
    sys.exit(f"fastzero was imported from the source tree ({installed}), not from the installed wheel")
print(f"fastzero {fastzero.__version__} from {installed.parent}")

# Every module of the package imports (the ZeRO runtime, comm, the bench...).
names = [m.name for m in pkgutil.walk_packages(fastzero.__path__, "fastzero.")]
for name in names:
    if name.endswith("__main__"):
        continue
    importlib.import_module(name)
for required in ("fastzero.runtime.engine", "fastzero.comm", "fastzero.triton_kernels", "fastzero.bench.run"):
    assert required in names, f"{required} is not in the wheel"
print(f"ok: {len(names)} modules import")

import fastzero.ops  # noqa: E402

for name in fastzero.ops.__all__:
    getattr(fastzero.ops, name)
for name in ("CPUAdam", "FusedAdam", "FusedLamb", "OneBitAdam", "SparseAttention"):
    getattr(fastzero.ops, name)
assert callable(fastzero.initialize) and callable(fastzero.init_distributed)
print("ok: every fastzero.ops name")

# The CPU kernels were built into the wheel: no just-in-time build allowed here.
probe = "import fastzero.ops as o; print(o.CPUAdam([__import__('torch').zeros(1, requires_grad=True)]).backend)"
backend = run(sys.executable, "-c", probe).strip()
assert backend.startswith("cpu:"), f"CPUAdam runs {backend!r}, not the CPU kernels"
print("ok: the prebuilt CPU kernels load")

bin_dir = Path(sys.executable).parent
run(str(bin_dir / "fastzero"), "--help")
run(sys.executable, "-m", "fastzero.checkpoint", "--help")
run(sys.executable, "-m", "fastzero.bench.run", "--list")
# The checkout's bench/ (python -m bench.run) against the installed fastzero.
bench_copy = WORK / "bench_checkout"
bench_copy.mkdir()
run("cp", "-r", str(SOURCE / "bench"), str(bench_copy / "bench"))
run(sys.executable, "-m", "bench.run", "--list", cwd=bench_copy)

# A 2-rank training step through the launcher, then the checkpoint CLI on what it saved.
script = WORK / "train.py"
script.write_text(
    """import sys, torch, fastzero
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
config = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 2}}
engine, *_ = fastzero.initialize(model=model, config=config)
rank = engine.comm.rank
gen = torch.Generator().manual_seed(rank)
x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)
for _ in range(2):
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
assert engine.global_steps == 2 and torch.isfinite(loss)
engine.save_checkpoint(sys.argv[1])
print(f"rank {rank} of {engine.comm.world_size} trained", flush=True)
"""
)
out = run(str(bin_dir / "fastzero"), "--nproc_per_node", "2", str(script), str(WORK / "ckpt"))
assert "rank 0 of 2 trained" in out and "rank 1 of 2 trained" in out, out
run(sys.executable, "-m", "fastzero.checkpoint", "info", str(WORK / "ckpt"))
run(sys.executable, "-m", "fastzero.checkpoint", "consolidate", str(WORK / "ckpt"), str(WORK / "model.pt"))
print("wheel smoke test passed", flush=True)
os._exit(0)
