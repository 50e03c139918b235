"""DeepSpeed training scripts (tests/deepspeed_scripts/, written against
DeepSpeed's public API with only ``import fastzero as deepspeed`` changed),
launched with DeepSpeed's launcher flags through ``fastzero``, checked
against plain PyTorch."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.deepspeed_scripts import gpt2_zero3, mlp_fp16_zero2
from tests.dist import free_port
from tests.paths import REPO

SCRIPTS = REPO / "tests" / "deepspeed_scripts"


def launch(flags: list[str], script: str, args: list[str], timeout: float = 600) -> str:
    cmd = [sys.executable, "-m", "fastzero.launcher", *flags, "--master_port", str(free_port())]
    cmd += [str(SCRIPTS / script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def write_config(path, config: dict) -> str:
    path.write_text(json.dumps(config))
    return str(path)


def test_gpt2_under_zero3_matches_torch(tmp_path):
    transformers = pytest.importorskip("transformers")
    lr, steps = 3e-3, 6
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100},
        "steps_per_print": 1000,
    }
    out = tmp_path / "result.pt"
    args = ["--deepspeed", "--deepspeed_config", write_config(tmp_path / "ds.json", config), "--out", str(out)]
    stdout = launch(["--num_nodes", "1", "--num_gpus", "2"], "gpt2_zero3.py", [*args, "--save_dir", str(tmp_path)])
    assert "rank 0: done" in stdout and "rank 1: done" in stdout
    got = torch.load(out)

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_zero3.gpt2_config())
    gpt2_zero3.init_weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for step in range(steps):
        tokens = gpt2_zero3.global_batch(step, 2 * got["world"])
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-4, atol=1e-5)
    want = model.state_dict()
    for name, value in got["state"].items():
        torch.testing.assert_close(value, want[name], rtol=1e-3, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    # resumed from the middle: the same second half, bit for bit
    assert got["again"] == got["losses"][steps // 2 :]
    for name, value in got["first_pass"].items():
        assert torch.equal(value, got["state"][name]), name
    # the zero_to_fp32 helper's weights are the engine's
    for name, value in got["fp32"].items():
        assert torch.equal(value, got["state"][name].float()), name
    assert set(got["fp32"]) >= {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize("client", ["", "sgd"])
def test_mlp_in_fp16_under_zero2(tmp_path, client):
    steps = 16  # two epochs of the loader: RepeatingLoader restarts it
    config = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "fp16": {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 3, "hysteresis": 1},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 500, "overlap_comm": True},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"},
        },
        "gradient_clipping": 1.0,
        "communication_data_type": "fp32",
        "dataloader_drop_last": True,
        "steps_per_print": 1000,
        "comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["reduce_scatter_tensor", "all_reduce"]},
    }
    if client:
        config["zero_allow_untested_optimizer"] = True
    else:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01}}
    out = tmp_path / "result.pt"
    args = ["--deepspeed_config", write_config(tmp_path / "ds.json", config), "--out", str(out), "--steps", str(steps)]
    if client:
        args += ["--client_optimizer", client]
    launch(["--num_gpus", "2", "--master_addr", "127.0.0.1", "--no_local_rank"], "mlp_fp16_zero2.py", args)
    got = torch.load(out)
    assert got["batches_per_epoch"] == 35 // 4  # 70 rows over 2 ranks, the short batch dropped
    assert got["dynamic"] is True and got["cur_iter"] == steps
    assert all(got["applied"]) and all(n > 0 for n in got["norms"])
    assert got["scales"] == [1024.0 * 2 ** (i // 3) for i in range(steps)]  # DeepSpeed doubles after 3 clean steps
    assert got["lrs"] == pytest.approx([0.0, 0.0025, 0.005, 0.0075] + [0.01] * (steps - 4))  # WarmupLR, linear
    assert got["eval_after"] < 0.8 * got["eval_before"], (got["eval_before"], got["eval_after"])  # it learns
    assert got["same_output"] and got["restored"]
    # the logger counted the ops in prof_ops: each step's reduce-scatter (one bucket of 500 elements or fewer per
    # param's worth) and at least the loss scaler's overflow all-reduce, nothing else
    assert set(got["comm_counts"]) == {"reduce_scatter_tensor", "all_reduce"}
    assert got["comm_counts"]["reduce_scatter_tensor"] % steps == 0 and got["comm_counts"]["all_reduce"] >= steps
    saved = torch.load(str(out) + ".16bit/model.bin")
    bare = mlp_fp16_zero2.make_model()
    assert set(saved) == set(bare.state_dict()) and all(v.dtype == torch.float16 for v in saved.values())
