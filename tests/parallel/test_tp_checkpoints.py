"""Checkpoints across tensor-parallel layouts: a GPT-2 saved at tensor 2 x
data 2 under ZeRO stage 2 resumes at tensor 1 x data 2 under stage 3 and at
tensor 2 x data 1 with the losses of the uninterrupted run, and the
consolidated checkpoint is the unsplit Hugging Face model (strict load,
same logits)."""

import json

import pytest
import torch

from fastzero.runtime.checkpoint_io import consolidate, read_manifest, resolve
from tests.dist import run_ranks
from tests.runtime.test_zero_engine import WORKER
from tests.workers.autotp_model import build
from tests.workers.tp_checkpoint import batch

pytest.importorskip("transformers")
SCRIPT = WORKER.parent / "tp_checkpoint.py"
STEPS, SAVE_AT = 8, 4


def _run(tmp_path, world: int, **run) -> dict:
    run["out"] = str(tmp_path / run["name"])
    run_ranks(SCRIPT, world, [json.dumps(run)], timeout=900)
    return torch.load(f"{run['out']}.rank0.pt", weights_only=False)


def test_saved_at_tp2_dp2_resumes_at_other_tensor_sizes_and_consolidates(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    straight = _run(tmp_path, 4, name="straight", tp=2, stage=2, steps=STEPS)
    first = _run(tmp_path, 4, name="first", tp=2, stage=2, steps=SAVE_AT, save=ckpt)
    assert first["losses"] == straight["losses"][:SAVE_AT]
    manifest = read_manifest(resolve(ckpt, None))
    assert manifest["tensor_parallel"]["size"] == 2
    assert manifest["tensor_parallel"]["splits"]["transformer.h.0.attn.c_attn.weight"] == [1, 3]  # Conv1D, q/k/v
    assert manifest["params"]["transformer.h.0.attn.c_attn.weight"] == [48, 144]  # the logical shape
    for name, world, tp, stage in (("tp1_dp2_s3", 2, 1, 3), ("tp2_dp1_s2", 2, 2, 2), ("tp2_dp2_s1", 4, 2, 1)):
        resumed = _run(tmp_path, world, name=name, tp=tp, stage=stage, steps=STEPS, start=SAVE_AT, load=ckpt)
        torch.testing.assert_close(
            torch.tensor(resumed["losses"]), torch.tensor(straight["losses"][SAVE_AT:]), rtol=1e-5, atol=0,
            msg=lambda m, n=name: f"{n}: {m}",
        )  # fmt: skip
    state = consolidate(ckpt)
    model = build("gpt2")  # a fresh model of the same config
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model(input_ids=batch(-1)).logits
    torch.testing.assert_close(logits, first["logits"], rtol=1e-5, atol=1e-5)
