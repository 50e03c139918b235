"""fastzero.zero.GatheredParameters and Engine.refresh_from_module: 2 Gloo
ranks (tests/workers/gathered_params.py) against single-process runs that
start from, or make, the same edit; the refusals in one process."""

import json

import pytest
import torch

import fastzero
import fastzero.zero as zero
from fastzero.checkpoint import consolidate
from tests.dist import run_ranks
from tests.paths import WORKERS
from tests.runtime.test_engine_single import cfg
from tests.workers.gathered_params import (
    EDITED,
    ZERO3,
    edit_values,
    engine_config,
    param_groups,
    train_steps,
)
from tests.workers.train_zero import config, make_model

WORKER = WORKERS / "gathered_params.py"
BEFORE, AFTER = 2, 3  # steps before and after the edit
AFTER_RUNS = [
    dict(kind="after", stage=s, dtype="bf16", modifier=m) for s, m in ((3, 0), (3, 1), (0, 1), (1, 0), (2, 1))
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every 2-rank run at once (one start of the ranks): name -> each rank's results."""
    tmp = tmp_path_factory.mktemp("gathered")
    runs = {
        "init": dict(kind="init", dtype="bf16", steps=3),
        **{f"after{r['stage']}_{r['modifier']}": dict(r, before=BEFORE, after=AFTER) for r in AFTER_RUNS},
        "discard": dict(kind="discard", dtype="bf16"),
        "refusals": dict(kind="refusals"),
    }
    for name, run in runs.items():
        run["out"] = str(tmp / name)
    spec = tmp / "runs.json"
    spec.write_text(json.dumps(list(runs.values())))
    run_ranks(WORKER, 2, [spec], timeout=600)
    return {name: [torch.load(f"{run['out']}.rank{r}.pt") for r in range(2)] for name, run in runs.items()}


EXACT = dict(rtol=0, atol=0)
# bf16 training on 2 ranks against one process: Gloo's bf16 sum of the two ranks' gradients and one process's
# accumulation of its two micro-batches round differently now and then (an ulp), and that spreads a little over
# the steps: torch.testing's bf16 tolerance (about 4 ulps). A missing master refresh is off by 0.1 or more.
BF16 = dict(rtol=1.6e-2, atol=1e-5)


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def assert_equal(got: dict, want: dict, what: str, tol: dict = EXACT) -> None:
    """Every element of every param."""
    assert got.keys() == want.keys(), what
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, **tol, msg=lambda m, name=name: f"{what}, {name}: {m}")


def trained(engine, model) -> dict:
    with engine.gathered():
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


# -- single-process references -------------------------------------------------------------------
# One process with 2 micro-batches per step sees the 2 ranks' rows in the same order (the same global batch).


def reference_init(dtype: str, steps: int) -> dict:
    """(a): the edit made on the whole model before initialize."""
    model = make_model()
    params, values = dict(model.named_parameters()), edit_values()
    with torch.no_grad():
        for name in EDITED[:2]:
            params[name].copy_(values[name])
    engine, *_ = fastzero.initialize(model=model, config=engine_config(3, dtype, gas=2))
    train_steps(engine, range(steps), rank=0, world=1)
    return trained(engine, model)


def reference_after(dtype: str, refresh_masters: bool = True) -> dict:
    """(b), (d): stage 0 in one process; after BEFORE steps the edit is written into the params and, by
    hand, into the optimizer's fp32 masters (with refresh_masters=False, into the params only: what a
    missing refresh would train)."""
    model = make_model()
    model[2].bias.requires_grad_(False)
    engine, *_ = fastzero.initialize(
        model=model, model_parameters=param_groups(model), config=engine_config(0, dtype, gas=2)
    )
    train_steps(engine, range(BEFORE), rank=0, world=1)
    params, values = dict(model.named_parameters()), edit_values()
    with torch.no_grad():
        for name in EDITED:
            p = params[name]
            p.copy_(values[name])
            state = engine.optimizer.state.get(p, {})
            if refresh_masters and "master_param" in state:
                state["master_param"].copy_(p.float())
    train_steps(engine, range(BEFORE, BEFORE + AFTER), rank=0, world=1)
    return trained(engine, model)


# -- 2 ranks ---------------------------------------------------------------------------------------
def test_an_edit_under_init_before_initialize_trains_as_one_process_from_the_same_weights(ranks):
    values, init = edit_values(), dict(make_model().named_parameters())
    want = reference_init("bf16", 3)
    for rank, res in enumerate(ranks["init"]):
        # rank 0's values on every rank (rank 1 wrote 8.0 everywhere), the other params as Init made them
        expected = {n: values[n] if n in EDITED[:2] else p.detach() for n, p in init.items()}
        assert_equal(res["after_edit"], expected, f"rank {rank} after the edit")
        assert_equal(res["params"], want, f"rank {rank} after training", BF16)


@pytest.mark.parametrize("run", AFTER_RUNS, ids=lambda r: f"stage{r['stage']}-modifier{r['modifier']}")
def test_an_edit_after_initialize_reaches_every_rank_and_the_fp32_masters(ranks, run):
    """Stage 3 (shards) and stages 0-2 (whole params): the modifier's values on every rank, the masters
    (consolidated from a checkpoint) equal to them, and training goes on as one process where the same
    edit was made; a run whose masters kept the old values ends elsewhere, so the comparison can fail."""
    values = {n: bf16(t) for n, t in edit_values().items()}
    want, stale = reference_after("bf16"), reference_after("bf16", refresh_masters=False)
    for rank, res in enumerate(ranks[f"after{run['stage']}_{run['modifier']}"]):
        for name in EDITED:
            torch.testing.assert_close(res["after_edit"][name], values[name], rtol=0, atol=0)
        for name in EDITED[:2]:  # the trained ones: their fp32 masters are the edit
            torch.testing.assert_close(res["masters"][name].float(), values[name], rtol=0, atol=0)
        assert_equal(res["params"], want, f"rank {rank}", BF16)
        assert (res["params"]["0.weight"] - stale["0.weight"]).abs().max() > 0.1


def test_without_modifier_rank_edits_of_partitioned_params_are_dropped_with_a_warning(ranks):
    first, second = bf16(edit_values(1)["0.weight"]), bf16(edit_values(2)["0.weight"])
    for rank, res in enumerate(ranks["discard"]):
        for when in ("init", "engine"):  # before initialize (Init's chunks) and after (the engine's shards)
            before, after = res[when]
            assert_equal(after, before, f"rank {rank}, {when}")
        assert len(res["warnings"]) == 2, res["warnings"]
        # nested blocks: an inner exit with modifier_rank commits, an outer one without drops what came after
        torch.testing.assert_close(res["nested_drop"], first, rtol=0, atol=0)
        torch.testing.assert_close(res["nested_commit"], second, rtol=0, atol=0)
        assert all(bool(torch.isfinite(t).all()) for t in res["params"].values())
    assert_equal(ranks["discard"][0]["params"], ranks["discard"][1]["params"], "ranks agree")


def test_ranks_that_disagree_or_fail_inside_the_block_raise_on_every_rank_and_keep_their_params(ranks):
    for res in ranks["refusals"]:
        assert "entered with different params or modifier_rank" in res["mismatch"], res
        assert res["unchanged"], res
    assert ranks["refusals"][1]["failed"] == 'KeyError: "the user\'s own error on rank 1"'
    assert "another rank failed inside the block" in ranks["refusals"][0]["failed"]


# -- one process ------------------------------------------------------------------------------------
def test_bad_input_is_refused_with_the_fix():
    model = make_model()
    with pytest.raises(TypeError, match=r"module.parameters\(\)"):
        zero.GatheredParameters(model)
    with pytest.raises(TypeError, match=r"params\[1\] is a str, not a tensor"):
        zero.GatheredParameters([model[0].weight, "weight"])
    with pytest.raises(TypeError, match=r"params\[0\] is a Linear.*module.parameters\(\)"):
        zero.GatheredParameters([model[0]])
    with pytest.raises(TypeError, match="pass a param, a list of params"):
        zero.GatheredParameters(3)
    for rank in (1, -1, True, 0.0):
        with pytest.raises(ValueError, match=r"there are 1 ranks; pass a rank in \[0, 1\)"):
            zero.GatheredParameters(model.parameters(), modifier_rank=rank)
    with pytest.raises(TypeError, match="fwd_module=str"):
        zero.GatheredParameters(model.parameters(), fwd_module="model")


def test_enabled_false_and_an_empty_list_are_no_ops():
    with zero.Init():
        model = make_model()
    with zero.GatheredParameters(model.parameters(), modifier_rank=0, enabled=False):
        assert all(p.numel() == 0 for p in model.parameters())
    with zero.GatheredParameters([], modifier_rank=0):
        pass
    with zero.GatheredParameters(model.parameters()):
        assert all(p.numel() > 0 for p in model.parameters())


def test_a_param_given_a_tensor_of_another_shape_is_refused_and_dropped():
    engine, *_ = fastzero.initialize(model=make_model(), config=engine_config(3, "bf16", 1))
    w = engine.module[0].weight
    with engine.gathered():
        before = w.detach().clone()
    with pytest.raises(ValueError, match=r"params\[0\] has shape \(3,\) on exit.*of shape \(65, 33\)"):
        with zero.GatheredParameters(w, modifier_rank=0):
            w.data = torch.zeros(3, dtype=w.dtype)
    assert w.numel() == 0
    with engine.gathered():
        assert torch.equal(w, before)


def test_a_param_whose_data_was_replaced_is_taken_whole():
    """``p.data = t`` inside the block (as some loaders do) at stage 3 and stage 1: the new values land
    in the shard, the master and the buffer the step and the all-gather write."""
    values = edit_values()["0.weight"].to(torch.bfloat16)
    for stage in (3, 1):
        engine, *_ = fastzero.initialize(model=make_model(), config=engine_config(stage, "bf16", 1))
        train_steps(engine, range(1), rank=0, world=1)
        w = engine.module[0].weight
        with zero.GatheredParameters(w, modifier_rank=0):
            w.data = values.clone()
        train_steps(engine, range(1, 2), rank=0, world=1)
        with engine.gathered():
            assert (w.float() - values.float()).abs().max() < 0.05, stage  # one step of lr 1e-2 from the edit


@pytest.mark.parametrize("stage", [3, 2])
def test_offloaded_masters_are_refreshed_too(tmp_path, stage):
    """ZeRO-Offload: the CPU fp32 masters take the edit, and the device shard comes back from them."""
    run = dict(stage=stage, dtype="bf16", gas=1, clip=0, offload=True, zero=ZERO3 if stage == 3 else {})
    engine, *_ = fastzero.initialize(model=make_model(), config=config(run))
    train_steps(engine, range(1), rank=0, world=1)
    w, values = engine.module[0].weight, bf16(edit_values()["0.weight"])
    with zero.GatheredParameters(w, modifier_rank=0):
        with torch.no_grad():
            w.copy_(values)
    engine.save_checkpoint(tmp_path, tag="edited")
    torch.testing.assert_close(consolidate(tmp_path, "edited")["0.weight"], values, rtol=0, atol=0)
    with engine.gathered():
        torch.testing.assert_close(w.float(), values, rtol=0, atol=0)
    train_steps(engine, range(1, 2), rank=0, world=1)
    with engine.gathered():
        assert (w.float() - values).abs().max() < 0.05  # one step of lr 1e-2 from the edit


@pytest.mark.parametrize("stage", [3, 2, 0])
def test_refresh_from_module_after_a_state_dict_is_loaded_into_the_params(tmp_path, stage):
    """Inside engine.gathered(): the masters become the loaded values, the Adam state stays."""
    engine, *_ = fastzero.initialize(model=make_model(), config=engine_config(stage, "bf16", 1))
    train_steps(engine, range(1), rank=0, world=1)
    torch.manual_seed(11)
    other = torch.nn.Sequential(
        torch.nn.Linear(33, 65), torch.nn.GELU(), torch.nn.Linear(65, 17), torch.nn.LayerNorm(17)
    )
    torch.nn.init.normal_(other[3].weight)
    state = {n: bf16(t) for n, t in other.state_dict().items()}
    adam = lambda: [(s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for s in engine.optimizer.state.values()]  # noqa: E731
    before = adam()
    with engine.gathered() as module:
        module.load_state_dict(state)
        engine.refresh_from_module()
    engine.save_checkpoint(tmp_path, tag="after")
    assert_equal(consolidate(tmp_path, "after"), state, f"stage {stage}")
    for (m, v), (m2, v2) in zip(before, adam(), strict=True):
        assert torch.equal(m, m2) and torch.equal(v, v2) and m.abs().sum() > 0
    train_steps(engine, range(1, 2), rank=0, world=1)
    with engine.gathered() as module:
        for name, p in module.named_parameters():
            assert (p.float() - state[name]).abs().max() < 0.05, name  # one step of lr 1e-2 from the loaded values


def test_gathered_parameters_inside_engine_gathered_leaves_the_params_whole():
    engine, *_ = fastzero.initialize(model=make_model(), config=engine_config(3, "bf16", 1))
    w = engine.module[0].weight
    with engine.gathered():
        with zero.GatheredParameters(w):
            pass
        assert w.numel() == 65 * 33  # engine.gathered() gathered it: it releases it
    assert w.numel() == 0


def test_refresh_from_module_refuses_params_it_does_not_train_and_params_not_gathered():
    model = make_model()
    model[2].bias.requires_grad_(False)
    engine, *_ = fastzero.initialize(model=model, config=engine_config(3, "bf16", 1))
    with pytest.raises(ValueError, match=r"params\[0\] is not a param this engine trains \('2.bias' is frozen\)"):
        engine.refresh_from_module([model[2].bias])
    with pytest.raises(ValueError, match="not a parameter of the model"):
        engine.refresh_from_module([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match=r"0.weight is not whole on this rank.*engine.gathered\(\)"):
        engine.refresh_from_module()
    with engine.gathered():
        engine.refresh_from_module()  # every param whole: fine


class TiedInForward(torch.nn.Module):
    """The head uses the embedding's weight inside GatheredParameters(fwd_module=self) (DeepSpeed's example)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(300, 64)
        self.mix = torch.nn.Linear(64, 64)

    def forward(self, ids):
        h = torch.nn.functional.gelu(self.mix(self.embed(ids)))
        with zero.GatheredParameters(self.embed.weight, fwd_module=self):
            return h @ self.embed.weight.t()


def test_fwd_module_registers_the_params_as_external_and_trains_as_torch():
    engine, *_ = fastzero.initialize(
        model=TiedInForward(), config=cfg(zero_optimization=dict(stage=3, stage3_param_persistence_threshold=100))
    )
    ref = TiedInForward()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        ids, target = torch.randint(0, 300, (8, 5), generator=gen), torch.randn(8, 5, 300, generator=gen)
        engine.backward(torch.nn.functional.mse_loss(engine(ids), target))
        engine.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(ids), target).backward()
        opt.step()
    assert engine.module.embed.weight.numel() == 0  # released after the block and the backward
    with engine.gathered() as module:
        for (name, p), q in zip(module.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
