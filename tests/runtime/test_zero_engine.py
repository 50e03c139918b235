"""The ZeRO engine, stages 0-2, as 2 and 4 Gloo processes on this machine,
against single-process torch.optim.AdamW on the same global batches."""

import json

import pytest
import torch

from tests.dist import run_ranks, start_ranks
from tests.paths import WORKERS
from tests.workers.train_zero import MICRO, global_batch, make_model

WORKER = WORKERS / "train_zero.py"


def reference(world: int, steps: int = 10, gas: int = 2, lr: float = 1e-2, clip: float = 0.5, skip=()):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    for step in range(steps):
        x, y = global_batch(step, MICRO * gas * world)
        if step in skip:
            continue
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def train(tmp_path, world, runs, timeout=300):
    for i, run in enumerate(runs):
        run["out"] = str(tmp_path / f"run{i}")
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    run_ranks(WORKER, world, [spec], timeout=timeout)
    return [[torch.load(f"{run['out']}.rank{r}.pt") for r in range(world)] for run in runs]


def assert_params(got: dict, want: dict, rtol=1e-4, atol=1e-5):
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def assert_tracks(got: dict, want: dict, init: dict, fraction: float):
    """Low precision: the mean distance to the fp32 result is a small
    fraction of how far training moved the params."""
    for name, p in want.items():
        moved = (p - init[name]).abs().mean()
        assert (got[name] - p).abs().mean() < fraction * moved, name


def assert_trained(run: dict, res: dict, want: dict) -> None:
    """fp32 runs equal the reference; low precision tracks it."""
    if run.get("dtype") in ("bf16", "fp16"):
        assert_tracks(res["params"], want, {n: p.detach() for n, p in make_model().named_parameters()}, 0.1)
    else:
        assert_params(res["params"], want)


RUNS_2 = [dict(stage=s, overlap=o) for s in (0, 1, 2) for o in (True, False)]


def test_stages_match_torch_adamw_on_two_ranks(tmp_path):
    results = train(tmp_path, 2, [dict(r) for r in RUNS_2])
    want = reference(2)
    for run, ranks in zip(RUNS_2, results):
        for res in ranks:
            assert_params(res["params"], want)
        assert res["grad_ops"] == (["all_reduce"] if run["stage"] == 0 else ["reduce_scatter"]), run


def test_stages_match_torch_adamw_on_four_ranks_without_accumulation(tmp_path):
    runs = [dict(stage=s, gas=1, clip=1.0) for s in (0, 1, 2)]
    results = train(tmp_path, 4, runs)
    want = reference(4, gas=1, clip=1.0)
    for ranks in results:
        for res in ranks:
            assert_params(res["params"], want)


def test_bf16_and_fp16_track_fp32(tmp_path):
    runs = [dict(stage=2, dtype="bf16"), dict(stage=1, dtype="fp16"), dict(stage=0, dtype="bf16")]
    results = train(tmp_path, 2, runs)
    want, init = reference(2), {n: p.detach() for n, p in make_model().named_parameters()}
    for run, ranks in zip(runs, results):
        assert_tracks(ranks[0]["params"], want, init, 0.1)
        for res in ranks[1:]:  # every rank holds the same params
            assert_params(res["params"], ranks[0]["params"], rtol=0, atol=0)
        assert ranks[0]["skipped"] == 0, run


def test_reduction_options_keep_the_average(tmp_path):
    """prescale_gradients and gradient_predivide_factor move where the
    average divides (before the sum, or partly), communication_data_type the
    dtype of the sum: fp32 runs still equal torch's AdamW; a bf16 run summing
    in fp32 tracks it as the default bf16 run does."""
    runs = [
        dict(stage=0, top={"prescale_gradients": True}),
        dict(stage=1, top={"gradient_predivide_factor": 2.0}),
        dict(stage=2, top={"prescale_gradients": True, "communication_data_type": "fp16"}, clip=0),
        dict(stage=3, top={"gradient_predivide_factor": 4.0}),
        dict(stage=2, dtype="bf16", top={"communication_data_type": "fp32"}),
        dict(stage=3, dtype="bf16", top={"communication_data_type": "fp32", "prescale_gradients": True}),
    ]
    results = train(tmp_path, 2, runs)
    want, init = reference(2), {n: p.detach() for n, p in make_model().named_parameters()}
    for run, ranks in zip(runs, results):
        if run.get("dtype") == "bf16":
            assert_tracks(ranks[0]["params"], want, init, 0.1)
        elif run["top"].get("communication_data_type") == "fp16":  # fp32 grads summed in fp16
            assert_tracks(ranks[0]["params"], reference(2, clip=0), init, 0.01)
        else:
            assert_params(ranks[0]["params"], want)
        for res in ranks[1:]:
            assert_params(res["params"], ranks[0]["params"], rtol=0, atol=0)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_unused_params_are_named_on_every_rank_when_not_ignored(tmp_path, stage):
    run = dict(stage=stage, model="branchy", steps=2, zero={"ignore_unused_parameters": False})
    with pytest.raises(AssertionError) as info:
        train(tmp_path, 2, [run])
    for rank in range(2):
        assert f"rank {rank} exited" in str(info.value)
    said = "step 1: params got no gradient: b1.weight, b1.bias (rank 0); b1.weight, b1.bias (rank 1)"
    assert str(info.value).count(said) == 2


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_inf_on_one_rank_skips_the_step_everywhere_and_halves_the_scale(tmp_path, stage):
    (ranks,) = train(tmp_path, 2, [dict(stage=stage, dtype="fp16", inf_at=[3, 1], steps=6)])
    for res in ranks:
        assert res["skipped"] == 1
        assert res["scales"] == [4096.0] * 3 + [2048.0] * 3  # hysteresis 1: halved at once
        assert_params(res["params"], ranks[0]["params"], rtol=0, atol=0)
    init = {n: p.detach() for n, p in make_model().named_parameters()}
    assert_tracks(ranks[0]["params"], reference(2, steps=6, skip={3}), init, 0.1)


def test_memory_is_partitioned(tmp_path):
    """Per rank, fp32 master and optimizer state are 1/N of the total (stage
    >= 1), gradients too at stage 2 (plus the bucket buffers)."""
    runs = [dict(stage=s, dtype="bf16", steps=2) for s in (0, 1, 2)]
    for world in (2, 4):
        (tmp_path / f"w{world}").mkdir()
        results = train(tmp_path / f"w{world}", world, [dict(r) for r in runs])
        for run, ranks in zip(runs, results):
            numel, total, shard, buckets = ranks[0]["layouts"][0]
            mem = ranks[0]["memory"]
            params = sum(p.numel() for p in make_model().parameters())
            assert numel == params and total - params < world * 16 * buckets  # padding only
            assert mem["params"] == 2 * total  # bf16 params, whole on every rank at stages 0-2
            held = numel if run["stage"] == 0 else total // world  # stage 0: every param, unpadded
            assert mem["master"] == 4 * held and mem["optimizer"] == 8 * held, (world, run, mem)
            assert mem["grads"] == (2 * total if run["stage"] <= 1 else 2 * total // world), (world, run, mem)
            assert (mem["grad_buckets"] > 0) == (run["stage"] == 2)


def test_stage2_reduce_scatters_are_launched_during_backward(tmp_path):
    (ranks,) = train(tmp_path, 2, [dict(stage=2, overlap=True, bucket=320, steps=2)])
    for res in ranks:
        launches = res["grad_launches"]
        buckets = res["layouts"][0][3]
        assert len(launches) == buckets > 2
        assert sum(t < 0 for t in launches) >= buckets - 1, launches  # all but the last before backward ended
    (ranks,) = train(tmp_path, 2, [dict(stage=2, overlap=False, bucket=320, steps=2)])
    assert all(t >= 0 for t in ranks[0]["grad_launches"])  # without overlap: after backward


def test_a_rank_that_dies_mid_training_makes_the_other_fail_within_the_timeout(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(
        "import os, sys, time, torch, fastzero\n"
        "from tests.workers.train_zero import config, make_model\n"
        "engine, *_ = fastzero.initialize(model=make_model(), config=config(dict(stage=2, gas=1)))\n"
        "x, y = torch.randn(4, 33), torch.randn(4, 17)\n"
        "engine.backward(torch.nn.functional.mse_loss(engine(x), y)); engine.step()\n"
        "if engine.comm.rank == 1:\n"
        "    os._exit(0)  # dies without a word\n"
        "t0 = time.time()\n"
        "try:\n"
        "    for _ in range(3):\n"
        "        engine.backward(torch.nn.functional.mse_loss(engine(x), y)); engine.step()\n"
        "except Exception as exc:\n"
        "    print('failed after', round(time.time() - t0, 1), type(exc).__name__, flush=True)\n"
        "    os._exit(3)\n"
        "print('no error', flush=True)\n"
    )
    procs = start_ranks(script, 2, env={"FASTZERO_DIST_TIMEOUT": "5"})
    out, err = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=30)
    assert "failed after" in out and "no error" not in out, out + err[-2000:]
    assert float(out.split()[2]) < 60
