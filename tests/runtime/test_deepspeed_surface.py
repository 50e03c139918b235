"""The engine's DeepSpeed surface (issue 14, landing in steps): the
checkpoint methods' signatures and arguments, was_step_applied,
empty_partition_cache."""

import inspect
import math

import pytest
import torch

import fastzero
from tests.runtime.test_engine_single import batches, cfg
from tests.workers.train_zero import make_model

# DeepSpeed 0.19's DeepSpeedEngine signatures: positional callers depend on the order
DS_LOAD = ["load_dir", "tag", "load_module_strict", "load_optimizer_states", "load_lr_scheduler_states"]
DS_LOAD += ["load_module_only", "custom_load_fn"]
DS_SAVE = ["save_dir", "tag", "client_state", "save_latest", "exclude_frozen_parameters"]


def train(engine, data):
    for x, y in data:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


def test_checkpoint_methods_take_deepspeeds_arguments_in_its_order():
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg())
    assert list(inspect.signature(engine.load_checkpoint).parameters) == DS_LOAD
    assert list(inspect.signature(engine.save_checkpoint).parameters) == DS_SAVE


def test_refused_checkpoint_arguments_are_named(tmp_path):
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg())
    with pytest.raises(NotImplementedError, match="custom_load_fn"):
        engine.load_checkpoint(tmp_path, custom_load_fn=lambda *a: None)


@pytest.mark.parametrize("stage", [1, 3])
def test_load_module_only_takes_the_weights_and_nothing_else(tmp_path, stage):
    config = cfg(zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 100}, bf16={"enabled": True})
    trained, *_ = fastzero.initialize(model=make_model(), config=config)
    train(trained, batches(3))
    trained.save_checkpoint(tmp_path)
    fresh, *_ = fastzero.initialize(model=make_model(), config=config)
    path, client = fresh.load_checkpoint(tmp_path, load_module_only=True)
    assert path.endswith("global_step3") and client == {}
    with trained.gathered() as a, fresh.gathered() as b:
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), name
    assert fresh.global_steps == 0 and fresh.micro_steps == 0
    for group in fresh.optimizer.param_groups:
        assert int(float(group.get("step", 0))) == 0
        for p in group["params"]:
            state = fresh.optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                assert key not in state or not state[key].any(), key


def test_was_step_applied_follows_skipped_steps():
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg())
    assert not engine.was_step_applied()
    train(engine, batches(1))
    assert engine.was_step_applied()
    x, y = batches(1)[0]
    with pytest.warns(RuntimeWarning, match="skipped on every rank"):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y) * math.nan)
        engine.step()
    assert not engine.was_step_applied() and engine.skipped_steps == 1


def test_empty_partition_cache_releases_gathered_params_at_stage3():
    config = cfg(zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 100})
    engine, *_ = fastzero.initialize(model=make_model(), config=config)
    engine.fetcher.gather_all()
    assert all(p.numel() > 0 for p in engine.module.parameters())
    engine.empty_partition_cache()
    sizes = {n: p.numel() for n, p in engine.module.named_parameters()}
    assert sizes["0.weight"] == 0 and sizes["2.weight"] == 0, sizes  # persistent small ones stay
    train(engine, batches(1))  # and training goes on
    plain, *_ = fastzero.initialize(model=make_model(), config=cfg())
    plain.empty_partition_cache()  # a no-op below stage 3
