"""Pipeline checkpoints load at any layout (4 Gloo ranks): saved at pipe 2 x
data 2 (ZeRO 1, and ZeRO 2), loaded at pipe 4, at pipe 1 (x data 4, and on
one process), at pipe 2 x data 2 with another ZeRO stage and interleaved
virtual stages; training goes on as the uninterrupted run. With tensor
parallelism (the model's blocks ColumnParallelLinear / RowParallelLinear):
saved at pipe 2 x data 2 (tensor 1), loaded at pipe 2 x tensor 2 and at
pipe 1 x tensor 2 x data 2 on the plain engine; saved at pipe 2 x tensor 2,
loaded at pipe 2 x data 2 and at pipe 4 (the plain model's nn.Linear
blocks). Consolidated, a pipeline checkpoint is the plain model's
state_dict; another model's checkpoint fails on every rank, naming the
param."""

import json
import re
import subprocess
import sys

import pytest
import torch

from tests.dist import ROOT, run_ranks
from tests.paths import WORKERS

sys.path.insert(0, str(WORKERS))
from pipe_ckpt import layers, loss_fn  # noqa: E402

WORLD = 4
BLOCKS = 6
STEPS = 2
TOL = dict(rtol=1e-5, atol=1e-6)
SAVES = {
    "z1": {"zero": 1},
    "z2": {"zero": 2},
    "tp1": {"zero": 1, "tp": True},  # the tensor-parallel variant at tensor 1 (data 2)
    "tp2": {"zero": 1, "tp": True, "tensor": 2},  # data 1
}
LOADS = {  # what each checkpoint is loaded at
    "z1": {
        "pipe4": {"stages": 4, "zero": 1},
        "pipe1-data4": {"stages": 1, "zero": 2},
        "pipe2-z2-interleaved": {"stages": 2, "zero": 2, "virtual": 2, "schedule": "interleaved"},
        "pipe2-z0": {"stages": 2, "zero": 0},
        "other-model": {"stages": 2, "zero": 1, "blocks": BLOCKS - 1, "expect_error": True},
        "more-blocks": {"stages": 4, "zero": 1, "blocks": BLOCKS + 1, "expect_error": True},
    },
    "z2": {"pipe4-z1": {"stages": 4, "zero": 1}, "pipe2-z1": {"stages": 2, "zero": 1}},
    "tp1": {
        "pipe2-tensor2": {"stages": 2, "zero": 1, "tp": True, "tensor": 2},
        "plain-engine-tensor2-data2": {"stages": 1, "zero": 2, "tp": True, "tensor": 2, "engine": "plain"},
    },
    "tp2": {
        "pipe2-data2": {"stages": 2, "zero": 1, "tp": True},
        "pipe4-plain-model": {"stages": 4, "zero": 1},
    },
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every save and load in one start of 4 ranks."""
    tmp = tmp_path_factory.mktemp("pipeckpt")
    runs, keys = [], []
    for save, extra in SAVES.items():
        ckpt = str(tmp / f"ckpt-{save}")
        runs.append({"kind": "save", "stages": 2, "blocks": BLOCKS, "steps": STEPS, "dir": ckpt, **extra})
        keys.append((save, "save"))
        for load, spec in LOADS[save].items():
            runs.append({"kind": "load", "blocks": BLOCKS, "steps": STEPS, "dir": ckpt, "seed": 11, **spec})
            keys.append((save, load))
    for i, run in enumerate(runs):
        run["out"] = str(tmp / f"run{i}")
    spec = tmp / "runs.json"
    spec.write_text(json.dumps(runs))
    run_ranks(WORKERS / "pipe_ckpt.py", WORLD, [spec], timeout=900)
    out = {key: [torch.load(f"{r['out']}.rank{k}.pt") for k in range(WORLD)] for key, r in zip(keys, runs)}
    out["dirs"] = {save: tmp / f"ckpt-{save}" for save in SAVES}
    return out


def whole(ranks: list[dict], key: str) -> list[dict]:
    """Each rank's params (`key`: "saved" or "loaded") whole: a param split over the tensor axis is the
    concatenation, in tensor-rank order, of the slices of the ranks at its pipe and data coordinates."""
    out = []
    for res in ranks:
        at = (res["coord"]["pipe"], res["coord"]["data"])
        peers = sorted(
            (r for r in ranks if (r["coord"]["pipe"], r["coord"]["data"]) == at),
            key=lambda r: r["coord"].get("model", 0),
        )
        assert [r["coord"].get("model", 0) for r in peers] == list(range(len(peers)))
        out.append(
            {
                n: torch.cat([r[key][n] for r in peers], res["split"][n]) if n in res["split"] else v
                for n, v in res[key].items()
            }
        )
    return out


def saved_model(results, save: str) -> tuple[dict, list[float]]:
    """The params at the save (every stage's, by name, whole) and the uninterrupted run's losses after it."""
    model = {}
    for saved in whole(results[(save, "save")], "saved"):
        for name, value in saved.items():
            if name in model:  # a tied weight, or a data-parallel replica: the same everywhere
                torch.testing.assert_close(value, model[name], rtol=0, atol=0)
            model[name] = value
    return model, results[(save, "save")][0]["after"]


LOADED = [(s, k) for s, loads in LOADS.items() for k, spec in loads.items() if not spec.get("expect_error")]


@pytest.mark.parametrize("save,load", LOADED)
def test_a_load_at_another_layout_continues_the_uninterrupted_run(results, save, load):
    model, after = saved_model(results, save)
    spec = LOADS[save][load]
    held = set()
    ranks = results[(save, load)]
    for rank, (res, loaded) in enumerate(zip(ranks, whole(ranks, "loaded"))):
        assert res["global_steps"] == STEPS
        assert res["data"] == WORLD // (spec["stages"] * spec.get("tensor", 1))
        assert bool(res["split"]) == bool(spec.get("tp"))  # the parallel layers, at tensor 2 each rank a half
        assert all(res["loaded"][n].numel() * spec.get("tensor", 1) == loaded[n].numel() for n in res["split"])
        for name, value in loaded.items():  # every element of every param this rank holds (its tensor group's)
            torch.testing.assert_close(
                value, model[name], rtol=0, atol=0, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}"
            )
        held |= set(loaded)
        torch.testing.assert_close(torch.tensor(res["after"]), torch.tensor(after), **TOL)
    assert held == set(model)
    # the run it continues must not be trivially equal to a restart: the losses move
    assert after[0] != after[1]


def test_the_uninterrupted_runs_agree_across_ranks_zero_stages_and_tensor_sizes(results):
    """The tensor-parallel variant draws its init as nn.Linear does: the same model at every tensor size."""
    z1 = results[("z1", "save")]
    for save in SAVES:
        for res in results[(save, "save")]:
            torch.testing.assert_close(torch.tensor(res["before"]), torch.tensor(z1[0]["before"]), **TOL)
            torch.testing.assert_close(torch.tensor(res["after"]), torch.tensor(z1[0]["after"]), **TOL)


def test_the_tensor_parallel_manifest_records_the_splits(results):
    from fastzero.runtime.checkpoint_io import read_manifest, resolve

    assert "tensor_parallel" not in read_manifest(resolve(results["dirs"]["tp1"], "ckpt"))
    manifest = read_manifest(resolve(results["dirs"]["tp2"], "ckpt"))
    tp = manifest["tensor_parallel"]
    assert tp["size"] == 2
    assert tp["splits"]["1.up.weight"] == [0, 1] and tp["splits"]["1.up.bias"] == [0, 1]
    assert tp["splits"][f"{BLOCKS}.down.weight"] == [1, 1] and f"{BLOCKS}.down.bias" not in tp["splits"]
    assert manifest["params"]["1.up.weight"] == [16, 8]  # the logical (unsplit) shape


def test_another_models_checkpoint_fails_on_every_rank_naming_the_param(results):
    for res in results[("z1", "other-model")]:  # 5 blocks: the checkpoint's layer 6 is a block no rank has
        assert "CheckpointError" in res["error"], res["error"]
        assert re.search(r"param 6\.\S+ of the checkpoint is not trained by any rank", res["error"]), res["error"]
    for res in results[("z1", "more-blocks")]:  # 7 blocks: layer 7 is a block the checkpoint lacks
        assert "CheckpointError" in res["error"], res["error"]
        assert re.search(r"param 7\.\S+ of the model is not in the checkpoint \(another model\?\)", res["error"]), res[
            "error"
        ]


def test_the_manifest_records_the_layout_and_the_union_of_the_stages(results):
    from fastzero.runtime.checkpoint_io import read_manifest, resolve

    manifest = read_manifest(resolve(results["dirs"]["z1"], "ckpt"))
    model, _ = saved_model(results, "z1")
    assert set(manifest["params"]) == set(model)
    assert sorted(n for g in manifest["groups"] for n in g["names"]) == sorted(model)
    pipe = manifest["pipeline"]
    assert (pipe["stages"], pipe["virtual_stages"]) == (2, 1)
    assert pipe["owners"]["tied_modules.proj.weight"] == [0, 1]
    assert pipe["owners"]["1.up.weight"] == [0] and pipe["owners"][f"{BLOCKS}.up.weight"] == [1]


@pytest.mark.parametrize("save", list(SAVES))
def test_consolidate_gives_the_plain_models_state_dict(results, save, tmp_path):
    from fastzero.pipe import PipelineModule
    from fastzero.runtime.checkpoint_io import consolidate
    from fastzero.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    model, _ = saved_model(results, save)
    plain = PipelineModule.build_sequential(layers(BLOCKS, True), loss_fn=loss_fn, seed_layers=True, base_seed=3)
    sd = consolidate(results["dirs"][save], "ckpt")
    plain.load_state_dict(sd, strict=True)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.detach(), model[name], rtol=0, atol=0)
    for name, t in get_fp32_state_dict_from_zero_checkpoint(str(results["dirs"][save]), "ckpt").items():
        torch.testing.assert_close(t, sd[name], rtol=0, atol=0)
    if save == "z1":  # the command line, once
        out = tmp_path / "model.pt"
        cmd = [sys.executable, "-m", "fastzero.checkpoint", "consolidate", str(results["dirs"][save]), str(out)]
        subprocess.run([*cmd, "--tag", "ckpt"], check=True, cwd=ROOT, capture_output=True)
        plain.load_state_dict(torch.load(out), strict=True)


def test_a_load_on_one_process_continues_the_uninterrupted_run(results, tmp_path):
    """pipe 1 on one rank: a PipelineModule of one stage (the engine is the pipeline engine)."""
    model, after = saved_model(results, "z1")
    run = {"kind": "load", "stages": 1, "zero": 0, "blocks": BLOCKS, "steps": STEPS, "seed": 5}
    run.update(dir=str(results["dirs"]["z1"]), out=str(tmp_path / "one"))
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps([run]))
    run_ranks(WORKERS / "pipe_ckpt.py", 1, [spec], timeout=300)
    res = torch.load(f"{run['out']}.rank0.pt")
    assert res["data"] == 1 and res["global_steps"] == STEPS and set(res["loaded"]) == set(model)
    for name, value in res["loaded"].items():
        torch.testing.assert_close(value, model[name], rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(res["after"]), torch.tensor(after), **TOL)
