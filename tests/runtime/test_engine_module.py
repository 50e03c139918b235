"""The engine as an nn.Module (DeepSpeed's engine is one): the module API,
attributes falling through to the wrapped model, and the fp16 loss scale
where DeepSpeed scripts read it (on the optimizer)."""

import pytest
import torch

import fastzero
from tests.runtime.test_engine_single import batches, cfg
from tests.workers.train_zero import make_model


def train(engine, data):
    for x, y in data:
        engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y))
        engine.step()


def test_the_engine_is_a_module_around_the_model():
    model = make_model()
    engine, *_ = fastzero.initialize(model=model, config=cfg())
    assert isinstance(engine, torch.nn.Module) and engine.module is model
    assert [n for n, _ in engine.named_parameters()] == [f"module.{n}" for n, _ in model.named_parameters()]
    assert all(a is b for a, b in zip(engine.parameters(), model.parameters()))
    assert list(engine.children()) == [model]
    assert engine.eval() is engine and not model.training and not engine.training
    assert engine.train() is engine and model.training and engine.training
    x = torch.randn(4, 33)
    seen = []
    engine.register_forward_hook(lambda mod, args, out: seen.append(out))  # module hooks fire on the engine
    out = engine(x)
    assert torch.equal(out, model(x)) and seen and seen[0] is out


def test_attributes_fall_through_to_the_wrapped_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.custom_flag = "kept"
    engine, *_ = fastzero.initialize(model=model, config=cfg())
    # as DeepSpeed's engine (engine.py: self.config = config): the config given to initialize; the model's is
    # engine.module.config
    assert engine.config == cfg() and engine.module.config.n_embd == 16
    assert engine.custom_flag == "kept" and engine.transformer is model.transformer
    assert engine.get_input_embeddings() is model.get_input_embeddings()
    assert engine._config.train_micro_batch_size_per_gpu == 8  # fastzero's own config
    with pytest.raises(AttributeError, match="neither the engine nor its wrapped module has an attribute 'nope'"):
        _ = engine.nope
    assert not hasattr(engine, "nope")
    ids = torch.randint(0, 64, (2, 8))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1


def test_fp16_scale_views_on_the_optimizer():
    config = cfg(fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 1})
    engine, optimizer, *_ = fastzero.initialize(model=make_model(), config=config)
    assert optimizer is engine.optimizer
    assert optimizer.dynamic_loss_scale is True and optimizer.scale_window == 3
    assert optimizer.cur_scale == optimizer.loss_scale == engine.loss_scale == 256.0
    assert optimizer.cur_iter == 0
    train(engine, batches(4))
    assert optimizer.cur_iter == 4 == engine.loss_scaler.cur_iter
    assert optimizer.cur_scale == engine.loss_scale == 512.0  # doubled after 3 clean steps
    optimizer.loss_scale = 64.0  # the scaler is the source of truth; setting the view sets it
    assert engine.loss_scale == 64.0 == optimizer.cur_scale


@pytest.mark.parametrize("precision", [{"fp16": {"enabled": True, "loss_scale": 128}}, {"bf16": {"enabled": True}}, {}])
def test_static_or_no_scale_views(precision):
    engine, optimizer, *_ = fastzero.initialize(model=make_model(), config=cfg(**precision))
    want = 128.0 if "fp16" in precision else 1.0
    assert optimizer.cur_scale == optimizer.loss_scale == engine.loss_scale == want
    assert optimizer.dynamic_loss_scale is False
    with pytest.raises(AttributeError, match="cur_iter: the loss scale is static"):
        _ = optimizer.cur_iter
    with pytest.raises(AttributeError, match="scale_window: the loss scale is static"):
        _ = optimizer.scale_window
    if "fp16" not in precision:
        with pytest.raises(AttributeError, match="no loss scaler to set"):
            optimizer.loss_scale = 2.0
