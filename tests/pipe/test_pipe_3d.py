"""3D training: pipe=2 x tensor=2 x data=2 (8 Gloo ranks, one start for
every run) with ColumnParallelLinear/RowParallelLinear blocks and a tied
replicated projection on the first and last stages, ZeRO 1, 2 and 3 over the
data axis, trains as the unsplit model does on one process (AdamW, the
clipping norm over every stage and tensor rank)."""

import json

import pytest
import torch

from tests.dist import run_ranks
from tests.paths import WORKERS

WORLD = 8
TOL = dict(rtol=1e-5, atol=1e-6)
BASE = {"blocks": 2, "micro_batches": 3, "steps": 3, "clip": 0.05, "tensor": 2}
RUNS = {
    "1f1b-z1": {"schedule": "1f1b", "zero": 1},
    "zb-h1-z3": {"schedule": "zb-h1", "zero": 3},
    "1f1b-z2": {"schedule": "1f1b", "zero": 2},
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipe3d")
    runs = [dict(BASE, **r, out=str(tmp / f"run{i}")) for i, r in enumerate(RUNS.values())]
    spec = tmp / "runs.json"
    spec.write_text(json.dumps(runs))
    run_ranks(WORKERS / "pipe_3d.py", WORLD, [spec], timeout=900)
    return {key: [torch.load(f"{r['out']}.rank{k}.pt") for k in range(WORLD)] for key, r in zip(RUNS, runs)}


@pytest.mark.parametrize("key", list(RUNS))
def test_3d_matches_the_unsplit_model_on_one_process(results, key):
    ref = results[key][0]["reference"]
    assert all(n > BASE["clip"] for n in ref["norms"]), "the test must clip every step"
    held = {}
    split = 0
    for rank, res in enumerate(results[key]):
        assert (res["mp_world_size"], res["dp_world_size"]) == (2, 2)
        where = f"{key} rank {rank} {res['coord']}"
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), **TOL)
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(ref["norms"]), **TOL)
        for name, (t, dim, value) in res["params"].items():
            want = ref["params"][name]
            if dim is not None:  # this tensor rank's slice of the whole param
                split += 1
                want = want.chunk(2, dim=dim)[t]
                assert value.shape[dim] * 2 == ref["params"][name].shape[dim]
            assert t == res["coord"]["model"]
            torch.testing.assert_close(value, want, **TOL, msg=lambda m, n=name, w=where: f"{w} {n}: {m}")
            held.setdefault((res["coord"]["data"], res["coord"]["model"]), set()).add(name)
    assert split > 0, "no tensor-parallel param was checked"
    for names in held.values():  # the two stages of each (data, tensor) coordinate hold the whole model
        assert names == set(ref["params"])
