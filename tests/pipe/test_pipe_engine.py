"""The pipeline engine trains as one process does (4 Gloo ranks): each
schedule (1f1b, interleaved, zb-h1) at pipe 2 x data 2 and pipe 4, with a
tied weight on the first and last stages, gradient clipping by the norm
over every stage, ZeRO stages 0-3 over the data axis (stage 3 gathering
each param once per step, whatever the micro-batches); bf16 and fp16 track
fp32; a non-finite gradient on one stage skips the step on every rank (and
lowers the fp16 loss scale on every rank alike); misuse is refused with the
fix."""

import json

import pytest
import torch

from tests.dist import run_ranks
from tests.paths import WORKERS

WORLD = 4
TOL = dict(rtol=1e-5, atol=1e-6)
BASE = {"blocks": 6, "micro_batches": 4, "steps": 10, "clip": 0.05, "tied": True}
# int8 gradients: this model's layers are 8 wide, and int4 codes of 8-value blocks move Adam's small-gradient
# elements about as far as training does (tests/runtime/test_zeropp.py covers int4 on a model of real widths)
ZEROPP = {
    "zero_quantized_weights": True,
    "zero_quantized_gradients": True,
    "zero_quantized_gradients_bits": 8,
    "zero_quantized_block_size": 16,
}

RUNS = {
    "1f1b-p2-z0": {"schedule": "1f1b", "stages": 2, "zero": 0},
    "1f1b-p4-z1": {"schedule": "1f1b", "stages": 4, "zero": 1},
    "1f1b-p2-z2": {"schedule": "1f1b", "stages": 2, "zero": 2},
    "interleaved-p2-z1": {"schedule": "interleaved", "stages": 2, "virtual": 2, "zero": 1},
    "interleaved-p4-z0": {"schedule": "interleaved", "stages": 4, "virtual": 2, "zero": 0, "micro_batches": 8},
    "zb-h1-p2-z2": {"schedule": "zb-h1", "stages": 2, "zero": 2},
    "zb-h1-p4-z0": {"schedule": "zb-h1", "stages": 4, "zero": 0, "micro_batches": 6},
    "1f1b-p2-z3": {"schedule": "1f1b", "stages": 2, "zero": 3},
    "zb-h1-p2-z3": {"schedule": "zb-h1", "stages": 2, "zero": 3, "micro_batches": 6},
    "interleaved-p2-z3": {"schedule": "interleaved", "stages": 2, "virtual": 2, "zero": 3},
    "untied-p2-z1": {"schedule": "1f1b", "stages": 2, "zero": 1, "tied": False},
    "bf16": {"schedule": "1f1b", "stages": 2, "zero": 1, "dtype": "bf16"},
    "fp16": {"schedule": "1f1b", "stages": 2, "zero": 2, "dtype": "fp16"},
    "fp16-skip-z3": {"schedule": "zb-h1", "stages": 2, "zero": 3, "dtype": "fp16", "inf_at": 1, "inf_stage": 0},
    "skip": {"schedule": "zb-h1", "stages": 2, "zero": 1, "inf_at": 1, "inf_stage": 1},
    "auto": {"schedule": "auto", "stages": 2, "zero": 1},
    "loader": {"schedule": "1f1b", "stages": 2, "zero": 1, "loader": True},  # initialize(training_data=...)
    "bad-interleaved": {"schedule": "interleaved", "stages": 2, "expect_error": True},
    # a two-rank process group per channel (NCCL's layout for interleaved and zb-h1), here on Gloo
    "interleaved-p2-channels": {
        "schedule": "interleaved",
        "stages": 2,
        "virtual": 2,
        "zero": 1,
        "groups": "per_channel",
    },
    "zb-h1-p4-channels": {"schedule": "zb-h1", "stages": 4, "zero": 2, "groups": "per_channel"},
    # ZeRO++ over the data axis (quantized: tracks the reference, below)
    "zeropp-p2-z2": {"schedule": "1f1b", "stages": 2, "zero": 2, "zeropp": ZEROPP},
    "zeropp-p2-z3": {"schedule": "zb-h1", "stages": 2, "zero": 3, "zeropp": ZEROPP},
}
INEXACT = ("bf16", "fp16", "fp16-skip-z3", "skip", "auto", "zeropp-p2-z2", "zeropp-p2-z3")
EXACT = [k for k, r in RUNS.items() if not r.get("expect_error") and k not in INEXACT]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every run in one start of 4 ranks (starting them is most of the time)."""
    tmp = tmp_path_factory.mktemp("pipe")
    runs = [dict(BASE, **r, out=str(tmp / f"run{i}")) for i, r in enumerate(RUNS.values())]
    spec = tmp / "runs.json"
    spec.write_text(json.dumps(runs))
    run_ranks(WORKERS / "pipe_train.py", WORLD, [spec], timeout=900)
    return {key: [torch.load(f"{r['out']}.rank{k}.pt") for k in range(WORLD)] for key, r in zip(RUNS, runs)}


@pytest.mark.parametrize("key", EXACT)
def test_matches_single_process_adamw(results, key):
    ref = results[key][0]["reference"]
    run = dict(BASE, **RUNS[key])
    assert all(n > run["clip"] for n in ref["norms"]), "the test must clip every step"
    data = WORLD // run["stages"]
    held = {d: set() for d in range(data)}
    for rank, res in enumerate(results[key]):
        assert res["schedule"] == run["schedule"] and res["dp_world_size"] == data
        where = f"{key} rank {rank} (stage {res['stage']})"
        for name, value in res["initial"].items():
            torch.testing.assert_close(value, ref["initial"][name], rtol=0, atol=0, msg=lambda m, w=where: f"{w} {m}")
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), **TOL)
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(ref["norms"]), **TOL)
        for name, value in res["params"].items():
            want = ref["params"][name]
            torch.testing.assert_close(value, want, **TOL, msg=lambda m, n=name, w=where: f"{w} {n}: {m}")
        held[res["data_rank"]] |= set(res["params"])
        assert res["eval"][0] == pytest.approx(ref["eval"], rel=1e-5)
        assert 0 <= res["bubble"]["measured"] < 1 and 0 < res["bubble"]["theory"] < 1
    for names in held.values():  # the stages of one data rank hold the whole model between them
        assert names == set(ref["params"])


@pytest.mark.parametrize("key", ["bf16", "fp16"])
def test_low_precision_tracks_fp32(results, key):
    ref = results[key][0]["reference"]
    for res in results[key]:
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), rtol=2e-2, atol=2e-2)
        for name, value in res["params"].items():
            torch.testing.assert_close(value, ref["params"][name], rtol=0, atol=3e-2)


@pytest.mark.parametrize("key", ["zeropp-p2-z2", "zeropp-p2-z3"])
def test_zeropp_over_the_data_axis_tracks_the_reference(results, key):
    """qwZ and qgZ (int8 gradients, blocks of 16) under the pipeline: the
    losses track one process's, and the params stay close to its params
    relative to how far training moved them (a broken exchange would be the
    whole way off)."""
    ref = results[key][0]["reference"]
    for res in results[key]:
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), rtol=2e-2, atol=2e-2)
        for name, value in res["params"].items():
            moved = (ref["params"][name] - ref["initial"][name]).abs().mean()
            assert (value - ref["params"][name]).abs().mean() < 0.2 * moved, name


def test_a_non_finite_gradient_on_one_stage_skips_the_step_everywhere(results):
    for res in results["skip"]:
        assert res["skipped"] == [0] + [1] * (BASE["steps"] - 1), res["skipped"]
        assert res["norms"][1] != res["norms"][1] or res["norms"][1] == float("inf")


def test_fp16_overflow_on_one_stage_skips_and_lowers_the_scale_on_every_rank(results):
    for res in results["fp16-skip-z3"]:
        assert res["skipped"] == [0] + [1] * (BASE["steps"] - 1), res["skipped"]
        # hysteresis 1: one overflow halves it
        assert res["scales"] == [256.0] + [128.0] * (BASE["steps"] - 1), res["scales"]


def test_fp16_scales_the_loss_without_overflow(results):
    for res in results["fp16"]:
        n = BASE["steps"]
        assert res["skipped"] == [0] * n and res["scales"] == [256.0] * n, (res["skipped"], res["scales"])


@pytest.mark.parametrize("key", [k for k, r in RUNS.items() if r.get("zero") == 3])
def test_stage3_gathers_each_param_once_per_step_not_per_micro_batch(results, key):
    for res in results[key]:
        # every param of the stage is partitioned (threshold 0): one all-gather each per step, at 4 or 6
        # micro-batches alike (per micro-batch would be 4-6 times as many)
        assert res["units"] > 10, res["units"]
        assert res["gathers"] == [res["units"]] * BASE["steps"], (res["gathers"], res["units"])
        assert res["eval_gathers"] == res["units"]


@pytest.mark.parametrize("key", [k for k, r in RUNS.items() if r.get("zero") == 2 and not r.get("expect_error")])
def test_stage2_reduce_scatters_each_bucket_once_per_step_not_per_micro_batch(results, key):
    for res in results[key]:
        # one reduce-scatter per bucket per step, during the last backward, at 4 or 6 micro-batches alike
        assert res["buckets"] > 0
        assert res["scatters"] == [res["buckets"]] * BASE["steps"], (res["scatters"], res["buckets"])


def test_the_transport_is_the_one_pipeline_p2p_groups_names(results):
    for key, run in RUNS.items():
        if not run.get("expect_error"):
            want = "ChannelP2P" if run.get("groups") == "per_channel" else "P2P"  # auto on Gloo: shared
            assert {res["transport"] for res in results[key]} == {want}, key


def test_auto_picks_a_schedule_that_trains_the_same(results):
    ref = results["auto"][0]["reference"]
    for res in results["auto"]:
        assert res["schedule"] in ("1f1b", "zb-h1")
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), **TOL)


def failure(tmp, fail: str) -> list[dict]:
    run = dict(BASE, schedule="1f1b", stages=2, zero=0, fail=fail, timeout=5, expect_error=True, out=str(tmp / "r"))
    spec = tmp / "runs.json"
    spec.write_text(json.dumps([run]))
    run_ranks(WORKERS / "pipe_train.py", 2, [spec], timeout=120)
    return [torch.load(f"{run['out']}.rank{k}.pt") for k in range(2)]


def test_a_data_iterator_that_runs_dry_mid_step_is_named_and_the_other_stage_stops(tmp_path):
    first, last = failure(tmp_path, "dry")
    assert "PipelineError: the data iterator ran dry at micro-batch 4 of 4" in first["error"], first["error"]
    # the last stage runs dry too, or first waits for the activation the first stage never sent
    ran_dry = "ran dry at micro-batch 4 of 4" in last["error"]
    assert ran_dry or ("rank 0" in last["error"] and "check its log" in last["error"]), last["error"]


def test_a_stage_that_raises_fails_its_neighbours_within_the_timeout(tmp_path):
    raised, waiting = failure(tmp_path, "raise")[::-1]
    assert "injected failure in a stage-1 layer" in raised["error"]
    # a timeout, or the transport's error when the failed rank's process is gone first: either names the peer
    assert waiting["error"].startswith(("PipelineTimeout", "PipelinePeerError")), waiting["error"]
    assert "rank 1" in waiting["error"] and "check its log" in waiting["error"], waiting["error"]
    assert waiting["seconds"] < 60, waiting["seconds"]


def test_train_batch_on_a_model_that_is_not_a_pipeline_module_names_the_fix():
    import fastzero

    cfg = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = fastzero.initialize(model=torch.nn.Linear(2, 2), config=cfg)
    with pytest.raises(TypeError, match="not a fastzero.pipe.PipelineModule: train it with loss = engine"):
        engine.train_batch(iter([]))


def test_interleaved_without_virtual_stages_is_refused(results):
    for res in results["bad-interleaved"]:
        assert "virtual_stages >= 2" in res["error"], res["error"]
