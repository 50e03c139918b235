"""The README's 1-bit Adam table: AdamW and OneBitAdam (stages 0 and 1,
fp32/bf16/fp16, without the engine) at 4 ranks on the teacher task of
train_onebit.py; prints each run's held-out loss and the bytes each rank sent
per step after freeze_step. Run from the repo root:
``python tests/workers/onebit_table.py [STEPS] [FREEZE]`` (~1 min)."""

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.dist import run_ranks  # noqa: E402

steps, freeze = (int(a) for a in (sys.argv[1:] + ["300", "30"])[:2])
runs = [
    ("AdamW, fp32", dict(optimizer="AdamW")),
    ("AdamW, bf16", dict(optimizer="AdamW", dtype="bf16")),
    ("OneBitAdam stage 0, fp32", dict(optimizer="OneBitAdam", stage=0)),
    ("OneBitAdam stage 0, bf16", dict(optimizer="OneBitAdam", dtype="bf16")),
    ("OneBitAdam without the engine", dict(optimizer="OneBitAdam", standalone=True)),
    ("OneBitAdam stage 1, fp32", dict(optimizer="OneBitAdam", stage=1)),
    ("OneBitAdam stage 1, fp16", dict(optimizer="OneBitAdam", stage=1, dtype="fp16")),
]
with tempfile.TemporaryDirectory() as tmp:
    spec = [dict(run, steps=steps, freeze=freeze, out=f"{tmp}/run{i}") for i, (_, run) in enumerate(runs)]
    Path(tmp, "spec.json").write_text(json.dumps(spec))
    run_ranks(Path(__file__).with_name("train_onebit.py"), 4, [Path(tmp, "spec.json")], timeout=1200)
    print("| run | held-out loss | bytes/step/rank after the freeze |\n|---|---:|---|")
    for i, (name, _) in enumerate(runs):
        res = torch.load(f"{tmp}/run{i}.rank0.pt", weights_only=False)
        sent = ", ".join(f"{round(v / (steps - freeze - 1)):,} {op}" for op, v in sorted(res["sent"].items()))
        print(f"| {name} | {res['eval_loss']:.5f} | {sent} |")
