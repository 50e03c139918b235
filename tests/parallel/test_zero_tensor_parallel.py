"""ZeRO over the data axis of a tensor 2 x data 2 topology (4 Gloo ranks):
a hand-split Linear pair trains exactly as single-process AdamW on the
unsplit model, at every stage, with gradient clipping; a Megatron-style mpu
trains the same as the Topology; the loader splits over the data ranks; a
non-finite gradient on one tensor rank skips the step everywhere."""

import json

import pytest
import torch

from tests.dist import run_ranks
from tests.paths import WORKERS
from tests.workers import train_tp as W

STEPS = 6
WORLD = 4
TOL = dict(rtol=1e-5, atol=1e-6)


RUNS = {
    **{s: {"stage": s, "steps": STEPS} for s in (0, 1, 2, 3)},
    "init": {"stage": 3, "steps": STEPS, "init": True},
    "uneven": {"stage": 2, "steps": STEPS, "cut": "uneven"},  # tensor ranks hold 8 and 6 rows: shapes differ
    "mpu": {"stage": 2, "steps": STEPS, "mpu": True},
    "skip": {"stage": 2, "steps": 3, "skip_at": 1},
    "skip_fp16": {"stage": 1, "steps": 3, "skip_at": 1, "fp16": True},
    "sampler": {"sampler": True},
    "bad_mpu": {"bad_mpu": True},
    "init_elsewhere": {"init_elsewhere": True},
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every run in one start of 4 ranks (starting them is most of the time)."""
    tmp = tmp_path_factory.mktemp("tp")
    runs = [dict(r, out=str(tmp / f"run{i}")) for i, r in enumerate(RUNS.values())]
    spec = tmp / "runs.json"
    spec.write_text(json.dumps(runs))
    run_ranks(WORKERS / "train_tp.py", WORLD, [spec], timeout=600)
    return {key: [torch.load(f"{r['out']}.rank{k}.pt") for k in range(WORLD)] for key, r in zip(RUNS, runs)}


@pytest.mark.parametrize("stage", [0, 1, 2, 3, "init", "uneven"])  # init: stage 3, built under fastzero.zero.Init
def test_matches_single_process_adamw(results, stage):
    losses, norms, params = W.reference(STEPS)
    assert all(n > W.CLIP for n in norms), "the test must clip every step"
    for res in results[stage]:
        tp, dp = res["tp_rank"], res["dp_rank"]
        assert (res["dp_world_size"], res["mp_world_size"], res["world_size"]) == (2, 2, 4)
        assert res["train_batch_size"] == W.MICRO * W.GAS * W.DP  # data ranks only
        want = [losses[s][m][dp] for s in range(STEPS) for m in range(W.GAS)]
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(want), **TOL)
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(norms), **TOL)
        for name, (got, index) in W.full_view(res["params"], tp, RUNS[stage].get("cut", "even")).items():
            torch.testing.assert_close(got, params[name][index], **TOL, msg=lambda m, n=name: f"stage {stage} {n}: {m}")
        # the gradients are reduced over the data group (2 ranks), never the world
        assert res["grad_ops"] and all(size == 2 for _, size in res["grad_ops"]), res["grad_ops"]


def test_mpu_trains_as_topology(results):
    for topo, mpu in zip(results[2], results["mpu"]):
        assert mpu["losses"] == topo["losses"]
        assert mpu["norms"] == topo["norms"]
        for name, p in topo["params"].items():
            assert torch.equal(mpu["params"][name], p), name


@pytest.mark.parametrize("run", ["skip", "skip_fp16"])
def test_non_finite_on_one_tensor_rank_skips_everywhere(results, run):
    # the NaN is in the replicated bias's gradient on tensor rank 1, whose replicated sum is not counted in the norm
    for res in results[run]:
        assert res["skipped"] == [False, True, False], (res["tp_rank"], res["dp_rank"], res["skipped"])
        if run == "skip_fp16":  # the loss scaler took the same decision everywhere: halved once, at the overflow
            assert res["scales"] == [2.0**12, 2.0**11, 2.0**11], res["scales"]
    # and the ranks stay together: the replicas of a param agree across data ranks
    by_tp = {}
    for res in results[run]:
        by_tp.setdefault(res["tp_rank"], []).append(res["params"])
    for a, b in by_tp.values():
        for name in a:
            assert torch.equal(a[name], b[name]), name


def test_loader_splits_over_data_ranks(results):
    indices = results["sampler"]
    # ranks 0, 1 are data rank 0 (tensor ranks 0, 1); ranks 2, 3 data rank 1
    assert indices[0] == indices[1] and indices[2] == indices[3]
    assert sorted(indices[0] + indices[2]) == list(range(24))


def test_a_model_partitioned_over_other_ranks_is_refused(results):
    for rank, message in enumerate(results["init_elsewhere"]):
        data = [0, 2] if rank % 2 == 0 else [1, 3]
        assert f"over ranks [0, 1, 2, 3], but the engine partitions over its data-parallel group, ranks {data}" in (
            message
        ), message


def test_an_mpu_whose_sizes_do_not_make_the_world_is_refused(results):
    for message in results["bad_mpu"]:
        assert "data-parallel size 4 x tensor size 2 x pipe size 1 != world size 4" in message, message
