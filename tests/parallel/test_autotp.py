"""AutoTP (fastzero.tp_model_init): Hugging Face GPT-2 (Conv1D, fused
q/k/v) and a LLaMA-style model (grouped KV heads) built from small configs,
sharded at TP=2 over Gloo: full-vocabulary logits, the loss and every
param's gradient equal the unsharded model's (each sharded param's
gradient is its piece of the unsharded one); tied weights stay tied; and
the refusals name the fix."""

import pytest
import torch
from torch import nn

from fastzero.parallel.autotp import tp_model_init
from tests.dist import run_ranks
from tests.runtime.test_zero_engine import WORKER

AUTOTP = WORKER.parent / "autotp_model.py"

pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_sharded_model_equals_the_unsharded_one(tmp_path, arch):
    out = str(tmp_path / arch)
    run_ranks(AUTOTP, 2, [arch, out], timeout=300)
    for rank in range(2):
        got = torch.load(f"{out}.rank{rank}.pt", weights_only=False)
        tp, twin = got["results"]["tp"], got["results"]["twin"]
        assert tp["logits"].shape == twin["logits"].shape  # full vocabulary on every rank
        torch.testing.assert_close(tp["logits"], twin["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tp["loss"], twin["loss"], rtol=1e-6, atol=1e-6)
        sharded = 0
        for name, (grad, ref, split) in got["grads"].items():
            assert grad.shape == ref.shape, name
            torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            sharded += split
        assert sharded >= 2 * 4  # every attention and MLP projection of both layers
        if arch == "gpt2":
            assert got["tied"]  # lm_head is still wte


def test_unknown_model_without_a_plan_is_refused():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(ValueError, match="no built-in plan for this model .* pass plan="):
        tp_model_init(model, 2)


def test_a_plan_must_name_every_linear_layer(monkeypatch):
    from fastzero.parallel import autotp

    monkeypatch.setattr(autotp, "_tensor_group", lambda *a: None)
    monkeypatch.setattr(autotp.groups, "group_rank", lambda g: 0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"no plan entry for the Linear layers 2; add them to plan="):
        tp_model_init(model, 2, plan={r"^0$": "colwise"})
    with pytest.raises(ValueError, match="'sideways' is not one of colwise, rowwise, replicate"):
        tp_model_init(model, 2, plan={r"^0$": "sideways"})


def test_heads_that_do_not_divide_are_refused(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from fastzero.parallel import autotp

    monkeypatch.setattr(autotp, "_tensor_group", lambda *a: None)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=48, n_head=3, n_layer=1, vocab_size=32))
    with pytest.raises(ValueError, match="num_attention_heads = 3 is not divisible by 2"):
        tp_model_init(model, 2)


TRAIN = WORKER.parent / "train_autotp.py"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_autotp_training_at_tensor_2_data_2_equals_single_process_adamw(tmp_path, stage):
    """`tensor_parallel.autotp_size: 2` alone: a GPT-2 trains 6 steps at
    tensor 2 x data 2 under ZeRO `stage` with clipping; the global losses
    and every rank's pieces of the final weights equal one process's
    torch AdamW on the unsharded model, same global batches (weights to
    1e-4: an element whose gradient is near zero moves by up to lr per
    step on the sign of a rounding difference, Adam's nature)."""
    out = str(tmp_path / "run")
    run_ranks(TRAIN, 4, ["gpt2", stage, 6, out], timeout=900)
    for rank in range(4):
        got = torch.load(f"{out}.rank{rank}.pt", weights_only=False)
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(got["twin_losses"]), rtol=1e-5, atol=0)
        assert got["params"].keys() == got["expected"].keys()
        for name, value in got["params"].items():
            torch.testing.assert_close(
                value, got["expected"][name], rtol=1e-4, atol=1e-4, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}"
            )
