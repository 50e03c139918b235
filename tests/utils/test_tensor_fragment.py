"""DeepSpeed's param-state helpers (``deepspeed.utils.safe_get_full_fp32_param``
and the rest, through ``import fastzero as deepspeed``): 2 Gloo ranks at
every ZeRO stage (tests/workers/param_access.py) against one process at
stage 0 whose state is read and written by hand (``p.grad``,
``optimizer.state``); the stage-3 local pieces; int8 states; the refusals.
The reads must match the reference, the writes must read back and train as
the same writes made by hand."""

import json

import pytest
import torch

import fastzero
from tests.dist import run_ranks
from tests.paths import WORKERS
from tests.workers.param_access import SET_PARAM, edits, engine_config, session
from tests.workers.train_zero import make_model

SESSIONS = {
    "stage0": dict(stage=0),
    "stage1": dict(stage=1),
    "stage2": dict(stage=2),
    "stage3": dict(stage=3),
    "stage2-offload": dict(stage=2, offload=True),
    "stage1-bf16": dict(stage=1, dtype="bf16"),
    "stage3-bf16": dict(stage=3, dtype="bf16"),
}
FP32 = dict(rtol=1e-4, atol=1e-6)  # 2 ranks' sums against one process's accumulation: an ulp here and there
# bf16 training on 2 ranks against one process: one process accumulates its 4 micro-batches' gradients in bf16,
# 2 ranks 2 each and then sum, so gradients differ by an ulp of the partial sums, and Adam's fp32 masters and
# states follow them (measured: 2e-3 of gradients up to 0.2, 4e-5 of masters): within 2% of the tensor's largest
# value (None: the atol is that); a misplaced piece or a missing division is off by the values themselves
BF16 = dict(rtol=1.6e-2, atol=None)
EXACT = dict(rtol=0, atol=0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("param_access")
    runs = {name: dict(run, kind="session") for name, run in SESSIONS.items()}
    runs["int8"] = dict(kind="int8", stage=2, opt={"state_format": "int8"})
    runs["tiny"] = dict(kind="tiny", stage=3)
    runs["refusals"] = dict(kind="refusals", stage=1)
    for name, run in runs.items():
        run["out"] = str(tmp / name)
    spec = tmp / "runs.json"
    spec.write_text(json.dumps(list(runs.values())))
    run_ranks(WORKERS / "param_access.py", 2, [spec], timeout=900)
    return {name: [torch.load(f"{run['out']}.rank{r}.pt") for r in range(2)] for name, run in runs.items()}


def reference(dtype: str | None) -> dict:
    """One process, stage 0, the 2 ranks' global batch as 4 micro-batches; reads and writes by hand."""
    model = make_model()
    engine, *_ = fastzero.initialize(model=model, config=engine_config(dict(stage=0, dtype=dtype), gas=4))
    params, state = dict(model.named_parameters()), engine.optimizer.state
    cpu = lambda t: t.detach().float().cpu().clone()
    gas = engine.gradient_accumulation_steps()

    def master(n):
        return state[params[n]].get("master_param", params[n])

    def set_param(n, v):
        with torch.no_grad():
            params[n].copy_(v)
            master(n).copy_(v)

    access = (
        lambda n: cpu(params[n].grad) / gas,
        lambda n: cpu(master(n)),
        lambda n, k: cpu(state[params[n]][k]),
        lambda n, v: params[n].grad.copy_(v * gas),
        set_param,
        lambda n, k, v: state[params[n]][k].copy_(v),
    )
    return session(engine, model, 0, 1, access)


def close(got: dict, want: dict, tol: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, t in want.items():
        at = tol if tol["atol"] is not None else dict(tol, atol=0.02 * float(t.abs().max()))
        torch.testing.assert_close(got[name], t, **at, msg=lambda m, name=name: f"{what}, {name}: {m}")


@pytest.mark.parametrize("name", SESSIONS)
def test_reads_writes_and_training_match_one_process_by_hand(ranks, name):
    dtype = SESSIONS[name].get("dtype")
    want = reference(dtype)
    tol = BF16 if dtype == "bf16" else FP32
    e = edits()
    for rank, got in enumerate(ranks[name]):
        at = f"{name}, rank {rank}"
        for what in ("grad", "fp32", "exp_avg", "exp_avg_sq"):
            close(got[what], want[what], tol, f"{at}: {what} read")
            close(got[what], ranks[name][0][what], EXACT, f"{at}: {what} as rank 0 read it")
        # what was written reads back: fp32 values and states exactly, grads as the grad buffer's dtype holds them
        grads = e["grads"] if dtype != "bf16" else {n: g.bfloat16().float() for n, g in e["grads"].items()}
        close(got["read_back"]["grad"], grads, EXACT if dtype != "bf16" else BF16, f"{at}: grads read back")
        close(got["read_back"]["fp32"], e["params"], EXACT, f"{at}: params read back")
        close(got["read_back"]["state"], e["states"], EXACT, f"{at}: states read back")
        for n in SET_PARAM:  # and the model's weights follow, on every rank
            value = e["params"][n] if dtype != "bf16" else e["params"][n].bfloat16().float()
            torch.testing.assert_close(got["model_after_set"][n], value, **EXACT)
        close(got["after_step"], want["after_step"], tol, f"{at}: the step after the writes")
        close(got["after_more"], want["after_more"], tol, f"{at}: one more step")
    # the writes changed the training: a run that dropped them would not match
    moved = (want["after_step"]["2.weight"] - ranks[name][0]["fp32"]["2.weight"]).abs().max()
    assert moved > 1e-3


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_stage3_local_pieces_are_the_ranks_ranges_of_the_full_values(ranks, dtype):
    name = "stage3" if dtype == "fp32" else "stage3-bf16"
    first, second = ranks[name]
    for n, t in first["local"].items():
        chunk = t["fp32"].numel()  # rank 0's range: [0, chunk); rank 1's: the rest (the split pads the param)
        assert 0 < chunk < t["full_fp32"].numel()
        for what in ("fp32", "exp_avg", "grad"):
            joined = torch.cat([t[what], second["local"][n][what]])
            torch.testing.assert_close(joined, t[f"full_{what}"].reshape(-1), **EXACT, msg=f"{n} {what}")
        for got in (first, second):  # each rank wrote its own elements: the full values hold both ranks' writes
            s = got["local_set"][n]
            for what, one, two in (("fp32", 1.0, 2.0), ("exp_avg", -1.0, -2.0), ("grad", 10.0, 20.0)):
                flat = s[what].reshape(-1)
                assert torch.all(flat[:chunk] == one) and torch.all(flat[chunk:] == two), f"{n} {what}"
            model = got["local_set_model"][n].reshape(-1)  # what the model reads, a persistent param's copy too
            assert torch.all(model[:chunk] == 1.0) and torch.all(model[chunk:] == 2.0), n


def test_int8_states_are_read_decoded_and_written_encoded(ranks):
    a, b = ranks["int8"]
    torch.testing.assert_close(a["before"], b["before"], **EXACT)
    assert a["before"].abs().max() > 0  # two steps of Adam made a state
    value, after = a["value"], a["after"]
    torch.testing.assert_close(after, b["after"], **EXACT)
    # 3 mantissa bits, rounded stochastically: within an eighth of each value, plus the code's floor per block
    err = (after - value).abs()
    assert torch.all(err <= value.abs() / 8 + 1e-3 * 2**-14), err.max()
    assert not torch.equal(after, a["before"])
    for got in (a, b):  # the fp32 param written under packed states: exact, and what the model reads
        torch.testing.assert_close(got["weights_after"], got["weights"], **EXACT)
        torch.testing.assert_close(got["model_weights"], got["weights"], **EXACT)


def test_stage3_local_setters_where_a_rank_owns_none_of_a_param(ranks):
    """A 1-element bias at stage 3 on 2 ranks: one rank owns it. Set on every rank inside engine.gathered()
    (no rank left waiting in the regather of the held params), and read back whole."""
    first, second = ranks["tiny"]
    assert 0 in (first["owned"]["bias"], second["owned"]["bias"])  # the case this test is for
    for got in (first, second):
        for n in ("weight", "bias"):
            split = [first["owned"][n], second["owned"][n]]
            owners = torch.cat([torch.full((k,), float(r + 1)) for r, k in enumerate(split)])
            torch.testing.assert_close(got["fp32"][n].reshape(-1), owners, **EXACT)
            torch.testing.assert_close(got["exp_avg"][n].reshape(-1), -owners, **EXACT)
            torch.testing.assert_close(got["model"][n].reshape(-1), owners, **EXACT)


def test_bad_calls_raise_on_every_rank_and_name_the_fix(ranks):
    for said in ranks["refusals"]:
        assert "engine.backward(loss)" in said["grad before backward"]
        assert "'exp_avg'" in said["unknown key"] or "no such state" in said["unknown key"]
        assert "'momentum_buffer'" in said["unknown key"]
        assert "'nope'" in said["set unknown key"] and "'exp_avg'" in said["set unknown key"]
        assert "3 elements" in said["wrong shape"] and "(65, 33)" in said["wrong shape"]
        assert "(33, 65)" in said["transposed"] and "(or flat)" in said["transposed"]
        assert said["flat set"] == 0.25
        assert all("'x'" in said[k] for k in said if k.startswith("set unknown key "))
        assert "param.data.copy_" in said["frozen"]
        assert "safe_get_full_fp32_param" in said["local at stage 1"]
        assert said["frozen get"] is None
        assert said["grad norm"] > 0
        assert "engine.step()" in said["grad after step"]


def test_without_an_engine_the_getters_give_none():
    p = torch.nn.Linear(3, 4).weight
    assert fastzero.utils.safe_get_full_fp32_param(p) is None
    assert fastzero.utils.safe_get_full_grad(p) is None
    assert fastzero.utils.safe_get_full_optimizer_state(p, "exp_avg") is None
    with pytest.raises(ValueError, match="not one a live fastzero engine trains"):
        fastzero.utils.safe_set_full_grad(p, torch.zeros(4, 3))
