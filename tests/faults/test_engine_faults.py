"""Faults in training, on 2 Gloo ranks: a NaN on one rank (fp32 and bf16,
every stage), two backward() calls before a step, ranks started with
different configs or models, and a stage-3 branch that differs across ranks.
Each must end the same way on every rank: the same skip, the same result, or
the same clear error."""

import json
import math
import warnings

import pytest
import torch

import fastzero
from tests.dist import run_ranks
from tests.paths import WORKERS
from tests.runtime.test_zero_engine import assert_params, reference
from tests.workers.train_zero import MICRO, global_batch, make_model

WORKER = WORKERS / "faults.py"
THRESHOLD = {"stage3_param_persistence_threshold": 100}


def run(tmp_path, runs, world=2):
    for i, r in enumerate(runs):
        r["out"] = str(tmp_path / f"run{i}")
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    run_ranks(WORKER, world, [spec])
    return [[torch.load(f"{r['out']}.rank{k}.pt") for k in range(world)] for r in runs]


def test_a_nan_on_one_rank_skips_the_step_on_every_rank_in_fp32_and_bf16(tmp_path):
    # no clipping: the norm is computed anyway (it used to be only for clipping, and NaN spread to every weight)
    runs = [dict(stage=s, nan_at=[2, 1], clip=0.0, zero=THRESHOLD) for s in (0, 1, 2, 3)]
    runs += [dict(stage=s, nan_at=[2, 1], clip=0.0, dtype="bf16", zero=THRESHOLD) for s in (1, 3)]
    want = reference(2, steps=4, clip=0.0, skip=(2,))
    for spec, ranks in zip(runs, run(tmp_path, runs)):
        for res in ranks:
            assert res["error"] is None, (spec, res["error"])
            assert res["skipped"] == 1, spec
            assert all(torch.isfinite(p).all() for p in res["params"].values()), spec
            if spec.get("dtype") != "bf16":
                assert_params(res["params"], want)
        assert all(torch.equal(ranks[0]["params"][n], ranks[1]["params"][n]) for n in ranks[0]["params"])
        (warning,) = ranks[0]["warnings"]
        assert "step 3: the gradient norm is nan" in warning and "skipped on every rank" in warning, warning
        assert "first non-finite gradient: " in warning, warning
        assert ranks[1]["warnings"] == []  # said once, by rank 0


def test_non_finite_grads_raise_stops_every_rank(tmp_path):
    runs = [dict(stage=s, nan_at=[1, 0], config={"non_finite_grads": "raise"}) for s in (0, 2)]
    for ranks in run(tmp_path, runs):
        for res in ranks:
            kind, message = res["error"]
            assert kind == "NonFiniteGradients" and "step 2: the gradient norm is nan" in message, message


def reference_twice(world: int, steps: int, gas: int, clip: float = 0.5):
    """Two losses' gradients summed before each step (what two backward() calls do)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    mse = torch.nn.functional.mse_loss
    for step in range(steps):
        x, y = global_batch(step, MICRO * gas * world)
        x2, y2 = global_batch(100 + step, MICRO * gas * world)
        opt.zero_grad()
        (mse(model(x), y) + mse(model(x2), y2)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_two_backward_calls_before_a_step_accumulate_at_every_stage(tmp_path):
    runs = [dict(stage=s, gas=gas, twice=True, steps=3, zero=THRESHOLD) for s in (0, 1, 2, 3) for gas in (1, 2)]
    wants = {gas: reference_twice(2, 3, gas) for gas in (1, 2)}
    for spec, ranks in zip(runs, run(tmp_path, runs)):
        for res in ranks:
            assert res["error"] is None, (spec, res["error"])
            assert_params(res["params"], wants[spec["gas"]])


def test_ranks_with_different_configs_or_models_all_stop_naming_the_difference(tmp_path):
    lr2 = {"optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.1}}}
    runs = [
        dict(stage=1, config_on={"1": lr2}),
        dict(stage=2, config_on={"1": {"zero_optimization": {"stage": 1}}}),
        dict(stage=1, config_on={"1": {"gradient_clipping": 2.0}}),
        dict(stage=1, config_on={"1": {"train_batch_size": 7}}),  # only rank 1's config fails to load
        dict(stage=3, wide_on=1, zero=THRESHOLD),
    ]
    expected = [
        ("RankMismatch", "config key optimizer.params.lr is 0.01 on rank 0 and 0.02 on rank 1"),
        ("RankMismatch", "config key zero_optimization.stage is 2 on rank 0 and 1 on rank 1"),
        ("RankMismatch", "config key gradient_clipping is 0.5 on rank 0 and 2.0 on rank 1"),
        ("ConfigError", "train_batch_size 7"),
        ("RankMismatch", "model entry 0.weight is 'param (65, 33) float32' on rank 0 and 'param (66, 33) float32'"),
    ]
    for (kind, text), ranks in zip(expected, run(tmp_path, runs)):
        for rank, res in enumerate(ranks):
            assert res["error"] is not None, (kind, text)
            got_kind, message = res["error"]
            if kind == "ConfigError" and rank == 0:  # rank 0 is told which rank failed, and why
                assert got_kind == "RankMismatch" and "rank 1 could not load its config" in message, message
                assert text in message, message
            else:
                assert got_kind == kind and text in message, message


def test_a_stage3_branch_that_differs_across_ranks_is_an_error_on_every_rank(tmp_path):
    runs = [dict(stage=3, model="branchy", diverge=True, gas=1, zero=THRESHOLD)]
    (ranks,) = run(tmp_path, runs)
    for res in ranks:
        kind, message = res["error"]
        assert kind == "Stage3Divergence", message
        assert "rank 0 is at the forward of 'b2', rank 1 is at the forward of 'b1'" in message, message
        assert "register_external_parameter" not in message  # not the tied-weight hint


def test_nan_skip_single_process_warns_and_counts():
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "steps_per_print": 1,
    }
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    x, y = global_batch(0, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.backward(torch.nn.functional.mse_loss(engine(x), y) * math.inf)
        engine.step()
    assert engine.skipped_steps == 1 and engine.global_steps == 1
    assert any("first non-finite gradient: 0.weight" in str(w.message) for w in caught)
    assert all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
    assert engine.monitor.history[-1]["skipped_steps"] == 1
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))  # the next step trains as usual
    engine.step()
    assert engine.skipped_steps == 1 and not torch.equal(engine.module[0].weight, before["0.weight"])


def test_the_stage3_tied_weight_hint_is_given_only_for_an_empty_param():
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, **THRESHOLD},
    }
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg)
    with pytest.raises(RuntimeError) as shape_error:  # the model's own shape error: no hint
        engine(torch.randn(4, 34))
    assert "cannot be multiplied" in str(shape_error.value)
    assert "register_external_parameter" not in str(shape_error.value)

    def dead_peer(*_):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:29500")

    handle = engine.module[2].register_forward_pre_hook(dead_peer)
    with pytest.raises(RuntimeError) as peer_error:
        engine(torch.randn(4, 33))
    assert "register_external_parameter" not in str(peer_error.value)
    handle.remove()
