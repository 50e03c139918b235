"""Stages 1-2 with overlap_param_gather: step() returns with the params' all-gather
in flight and each module's forward waits for its own buckets; stage 3
refreshes its persistent params with one all-gather per step. 2 Gloo ranks,
against single-process torch.optim.AdamW on the same global batches."""

import json
from pathlib import Path

import pytest
import torch

from tests.dist import run_ranks
from tests.runtime.test_zero_engine import assert_params, reference, train


def postgather(tmp_path, runs, world=2):
    return train(tmp_path, world, [dict(run, postgather=True) for run in runs])


@pytest.mark.parametrize("stage", [1, 2])
def test_gathers_are_in_flight_after_step_and_waited_by_each_forward(tmp_path, stage):
    (ranks,) = postgather(tmp_path, [dict(stage=stage, bucket=320, gas=1, steps=6)])
    for res in ranks:
        (buckets,) = res["buckets"]
        assert buckets > 2
        # every bucket's all-gather launched by step(), none waited for when it returned
        assert res["in_flight"] == [(buckets, buckets, True)] * 6
        for sites in res["sites"]:
            assert sites and all(s.startswith("forward:") for s in sites), sites
        # every module's params, read at its forward after each step, equal AdamW's after as many steps
        assert res["checked"] == sorted(res["want"]) and res["worst"] < 1e-5, res["worst"]
        assert_params(res["params"], res["want"])
    want = reference(2, steps=6, gas=1)
    assert_params(ranks[0]["params"], want)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_params_are_whole_at_the_next_forward(tmp_path, dtype):
    (ranks,) = postgather(tmp_path, [dict(stage=2, bucket=320, gas=2, steps=4, dtype=dtype)])
    for res in ranks:
        assert res["in_flight"][-1][0] == res["in_flight"][-1][1] > 2
        assert res["worst"] < 0.05, res["worst"]  # the low-precision copy of fp32 masters
    for res in ranks[1:]:
        assert_params(res["params"], ranks[0]["params"], rtol=0, atol=0)


def test_gathered_and_state_dict_right_after_step_see_the_update(tmp_path):
    runs = [dict(stage=s, bucket=320, gas=1, steps=4, read_at={"1": "gathered", "2": "state_dict"}) for s in (1, 2)]
    for ranks in postgather(tmp_path, runs):
        for res in ranks:
            assert res["after_step"][1][0] == "gathered" and res["after_step"][1][2] == ["gathered"]
            assert res["after_step"][2][0] == "state_dict" and res["after_step"][2][2] == ["state_dict"]
            assert res["after_step"][1][1] < 1e-5 and res["after_step"][2][1] < 1e-5, res["after_step"]


def test_a_checkpoint_saved_right_after_step_resumes_exactly(tmp_path):
    # overlap_comm off too: the load's own all-gather (waited by the loader) must not count as read in flight
    for stage, overlap in ((1, True), (2, True), (1, False)):
        ckpt = str(tmp_path / f"ckpt{stage}{overlap}")
        runs = [
            dict(stage=stage, overlap=overlap, bucket=320, steps=4, save_at=4, save=ckpt),
            dict(stage=stage, overlap=overlap, bucket=320, load=ckpt, start=4, steps=6),
        ]
        saved, resumed = train(tmp_path, 2, runs)
        for res in saved:
            assert_params(res["params"], reference(2, steps=4))
        for res in resumed:
            assert_params(res["params"], reference(2, steps=6))


def test_a_param_read_outside_its_modules_forward_raises_unless_registered(tmp_path):
    with pytest.raises(AssertionError) as info:
        postgather(tmp_path, [dict(stage=1, bucket=320, gas=1, steps=3, outside=True)])
    for rank in range(2):
        assert f"rank {rank} exited" in str(info.value)
    said = "got a gradient, but its post-step all-gather was still in flight when the forward used it"
    assert str(info.value).count(f"head.bias {said}") + str(info.value).count(f"head.weight {said}") == 2
    (ranks,) = postgather(tmp_path, [dict(stage=1, bucket=320, gas=1, steps=3, outside=True, register=True)])
    for res in ranks:
        assert res["worst"] < 1e-5 and res["checked"] == ["body.bias", "body.weight", "head.bias", "head.weight"]
        assert_params(res["params"], res["want"])


def test_stage3_refreshes_persistent_params_with_one_all_gather_per_step(tmp_path):
    # threshold 100: 0.bias (65), 2.bias, 3.weight, 3.bias (17 each) are persistent, the weights partitioned
    runs = [
        dict(stage=3, gas=1, steps=4, zero={"stage3_param_persistence_threshold": 100}, dtype=d) for d in (None, "bf16")
    ]
    for run, ranks in zip(runs, postgather(tmp_path, runs)):
        for res in ranks:
            assert res["persistent"] == [["param:persistent"]] * 4
            if run["dtype"] is None:
                assert res["worst"] < 1e-5, res["worst"]
                assert_params(res["params"], res["want"])
            else:
                assert res["worst"] < 0.05, res["worst"]
        for res in ranks[1:]:
            assert_params(res["params"], ranks[0]["params"], rtol=0, atol=0)


PIPE_RUNS = {
    "1f1b-p2-z1": {"schedule": "1f1b", "stages": 2, "zero": 1},
    "interleaved-p2-z1": {"schedule": "interleaved", "stages": 2, "virtual": 2, "zero": 1},
    "zb-h1-p2-z2": {"schedule": "zb-h1", "stages": 2, "zero": 2},
    "1f1b-p2-z2-bf16": {"schedule": "1f1b", "stages": 2, "zero": 2, "dtype": "bf16"},
}


def test_the_pipeline_engine_overlaps_the_gather_and_trains_as_one_process(tmp_path):
    """4 ranks (2 stages x 2 data ranks), tied first and last layer (the last
    runs it through forward_fn), clipping every step: tests/pipe's runs with
    overlap_param_gather on."""
    from tests.pipe.test_pipe_engine import BASE, TOL

    runs = [dict(BASE, **r, out=str(tmp_path / key)) for key, r in PIPE_RUNS.items()]
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    run_ranks(Path(__file__).parent / "postgather_pipe.py", 4, [spec], timeout=600)
    for key, run in zip(PIPE_RUNS, runs):
        ranks = [torch.load(f"{run['out']}.rank{k}.pt") for k in range(4)]
        ref = ranks[0]["reference"]
        for rank, res in enumerate(ranks):
            assert res["in_flight"] == [True] * run["steps"], (key, rank)
            assert res["wait_sites"] and all(s.startswith("forward:") for s in res["wait_sites"]), res["wait_sites"]
            if run.get("dtype") != "bf16":
                assert res["eval"][0] == pytest.approx(ref["eval"], rel=1e-5)  # eval_batch right after the last step
            for name, value in res["params"].items():
                if run.get("dtype") == "bf16":  # tracks fp32: well inside what training moved
                    moved = (ref["params"][name] - ref["initial"][name]).abs().mean()
                    assert (value - ref["params"][name]).abs().mean() < 0.1 * moved, (key, name)
                else:
                    torch.testing.assert_close(
                        value, ref["params"][name], **TOL, msg=lambda m, n=name, k=key: f"{k} {n}: {m}"
                    )
