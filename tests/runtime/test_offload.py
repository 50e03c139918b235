"""ZeRO-Offload of the optimizer (stages 1-2) as 2 Gloo processes: the same
training as torch.optim.AdamW, master and Adam state in CPU memory and not on
the device, checkpoints that move between offloaded and not, clean exits."""

import os

import torch

from tests.dist import run_ranks
from tests.runtime.test_zero_engine import WORKER, assert_params, assert_trained, reference, train
from tests.workers.train_zero import make_model


def test_offloaded_stages_match_torch_adamw(tmp_path):
    runs = [dict(stage=1, offload=True), dict(stage=2, offload=True), dict(stage=2, offload=True, dtype="bf16")]
    results = train(tmp_path, 2, runs)
    want = reference(2)
    for run, ranks in zip(runs, results):
        for res in ranks:
            assert_trained(run, res, want)
            mem = res["memory"]
            shard = res["layouts"][0][2]
            assert mem["master"] == 0 and mem["optimizer"] == 0, mem  # nothing of the optimizer on the device
            assert mem["offload_master"] == 4 * shard and mem["offload_optimizer"] == 8 * shard, mem


def test_the_step_is_pipelined_in_chunks_with_the_same_result(monkeypatch):
    """Chunks smaller than a tensor: grads in, kernel, params out overlap;
    the result is bit-identical to one piece."""
    import fastzero
    from tests.runtime.test_engine_single import batches, cfg

    results = []
    for chunk in (1 << 30, 100):  # one piece, and many
        config = cfg(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}}, bf16={"enabled": True})
        engine, opt, *_ = fastzero.initialize(model=make_model(), config=config)
        opt.chunk = chunk
        for x, y in batches(4):
            engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y))
            engine.step()
        results.append([p.detach().clone() for p in engine.module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_checkpoints_move_between_offloaded_and_not(tmp_path):
    save = str(tmp_path / "ckpt")
    train(tmp_path, 2, [dict(stage=2, offload=True, steps=3, save_at=3, save=save)])
    (tmp_path / "b").mkdir()
    (resumed,) = train(tmp_path / "b", 1, [dict(stage=1, gas=4, steps=6, start=3, load=save)])
    assert_params(resumed[0]["params"], reference(2, steps=6))
    (tmp_path / "c").mkdir()
    (back,) = train(tmp_path / "c", 2, [dict(stage=1, offload=True, steps=6, start=3, load=save)])
    assert_params(back[0]["params"], reference(2, steps=6))


def test_offload_runs_exit_cleanly_every_time(tmp_path):
    """DeepSpeed's CPU offload aborted at exit in 2 of 23 runs here; ours must
    exit 0 every time (FASTZERO_STRESS_RUNS, default 5; 30 for the record)."""
    spec = tmp_path / "runs.json"
    spec.write_text(f'[{{"stage": 2, "offload": true, "dtype": "bf16", "steps": 2, "out": "{tmp_path / "r"}"}}]')
    for _ in range(int(os.environ.get("FASTZERO_STRESS_RUNS", 5))):
        run_ranks(WORKER, 2, [spec], timeout=120)  # raises with the rank's stderr on any nonzero exit
