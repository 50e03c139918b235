"""ZeRO stage 3 as 2 and 4 Gloo processes: the same training as
torch.optim.AdamW, partitioned param memory, prefetch from the recorded
order, a data-dependent branch, checkpoints across stages and world sizes,
the 16-bit model, and params used outside their module's forward."""

import pytest
import torch

import fastzero
import fastzero.zero
from fastzero.checkpoint import consolidate
from fastzero.config import ConfigError
from tests.runtime.test_engine_single import batches, cfg
from tests.runtime.test_zero_engine import assert_params, assert_trained, reference, train
from tests.workers.train_zero import MICRO, global_batch, make_model

NO_PREFETCH = dict(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0, stage3_param_persistence_threshold=100)
PREFETCH = dict(stage3_prefetch_bucket_size=10**6, stage3_max_reuse_distance=0, stage3_param_persistence_threshold=100)


def branchy_reference(world, steps=10, gas=2, lr=1e-2, clip=0.5):
    """torch AdamW on the branchy model; params the branch skipped get zero
    grads (as the engine counts them), not None."""
    model = make_model("branchy")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    for step in range(steps):
        x, y = global_batch(step, MICRO * gas * world)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x, step), y).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_stage3_matches_torch_adamw_with_and_without_prefetch(tmp_path):
    runs = [
        dict(stage=3, zero=NO_PREFETCH),
        dict(stage=3, zero=PREFETCH),
        dict(stage=3, zero=PREFETCH, dtype="bf16"),
        dict(stage=3, zero=PREFETCH, offload=True),
        dict(stage=3, zero=PREFETCH, offload=True, offload_param=True),
        dict(stage=3, zero=PREFETCH, init=True),
        dict(stage=3, zero=NO_PREFETCH, init=True, offload=True, offload_param=True, dtype="bf16"),
    ]
    results = train(tmp_path, 2, runs)
    want = reference(2)
    for run, ranks in zip(runs, results):
        for res in ranks:
            assert_trained(run, res, want)
            mem = res["memory"]
            if run.get("offload"):  # nothing of the optimizer on the device
                assert mem["master"] == mem["optimizer"] == 0 and mem["offload_optimizer"] > 0, mem
            if run.get("offload_param"):  # between steps, no param bytes on the device but the persistent ones
                assert mem["offload_params"] > 0 and mem["params"] < mem["offload_params"], mem
        assert ranks[0]["grad_ops"] == ["reduce_scatter"]


def test_stage3_on_four_ranks(tmp_path):
    (ranks,) = train(tmp_path, 4, [dict(stage=3, gas=1, clip=1.0, zero=PREFETCH)])
    want = reference(4, gas=1, clip=1.0)
    for res in ranks:
        assert_params(res["params"], want)


def test_param_memory_is_partitioned_and_live_params_stay_under_the_limits(tmp_path):
    """Between steps a rank holds 1/N of each partitioned param plus the
    persistent small ones whole; while it runs, the gathered params stay
    under stage3_max_live_parameters (plus the one a module needs)."""
    limit = 3000  # elements: the 65x33 and 17x65 weights are 2145 and 1105
    zero = dict(
        PREFETCH, stage3_max_live_parameters=limit, stage3_max_reuse_distance=10**9, stage3_prefetch_bucket_size=2200
    )
    runs = [dict(stage=3, steps=3, zero=zero)]
    (ranks,) = train(tmp_path, 2, runs)
    model = make_model()
    big = [p.numel() for p in model.parameters() if p.numel() >= 100]
    small = [p.numel() for p in model.parameters() if p.numel() < 100]
    for res in ranks:
        pad = lambda n: -(-n // 32) * 32  # noqa: E731 - chunks are whole multiples of 16 per rank
        shards = sum(pad(n) for n in big) // 2 + sum(pad(n) for n in small) // 2
        persistent = sum(pad(n) for n in small)
        assert res["memory"]["params"] == 4 * (shards + persistent), res["memory"]
        assert res["memory"]["grads"] == 4 * shards
        assert 0 < res["stage3"]["peak_live"] <= limit + max(pad(n) for n in big)


def test_prefetch_gathers_the_next_module_before_the_current_one_ends(tmp_path):
    (ranks,) = train(tmp_path, 2, [dict(stage=3, steps=3, zero=PREFETCH)])
    for res in ranks:
        gathers = {tag.removeprefix("param:"): t for t, tag in res["stage3"]["gathers"]}
        ends = {name: t for t, name in res["stage3"]["ends"]}
        # layer 2 (the second Linear) is prefetched while layer 0 still runs
        assert gathers["2.weight"] < ends["0"], (gathers, ends)
    (ranks,) = train(tmp_path, 2, [dict(stage=3, steps=3, zero=NO_PREFETCH)])
    gathers = {tag.removeprefix("param:"): t for t, tag in ranks[0]["stage3"]["gathers"]}
    ends = {name: t for t, name in ranks[0]["stage3"]["ends"]}
    assert gathers["2.weight"] > ends["0"]  # without prefetch: only when layer 2 starts


def test_a_data_dependent_branch_trains_correctly(tmp_path):
    (ranks,) = train(tmp_path, 2, [dict(stage=3, model="branchy", zero=PREFETCH)])
    want = branchy_reference(2)
    for res in ranks:
        assert_params(res["params"], want)
        assert res["stage3"]["retraced"] >= 1  # it noticed the order change


@pytest.mark.parametrize("save, load", [((3, 2), (1, 4)), ((1, 4), (3, 2))])
def test_checkpoints_between_stage3_and_stage1_across_world_sizes(tmp_path, save, load):
    (s_stage, s_world), (l_stage, l_world) = save, load
    path = str(tmp_path / "ckpt")
    gas = lambda world: 8 // world  # noqa: E731 - the same global batch of 32 at any world size
    train(tmp_path, s_world, [dict(stage=s_stage, gas=gas(s_world), steps=3, save_at=3, save=path, zero=PREFETCH)])
    (tmp_path / "b").mkdir()
    (resumed,) = train(
        tmp_path / "b", l_world, [dict(stage=l_stage, gas=gas(l_world), steps=6, start=3, load=path, zero=PREFETCH)]
    )
    want = reference(4, steps=6)
    for res in resumed:
        assert_params(res["params"], want)


def test_save_16bit_model_matches_the_consolidated_model(tmp_path):
    config = cfg(
        bf16={"enabled": True},
        zero_optimization=dict(PREFETCH, stage=3, stage3_gather_16bit_weights_on_model_save=True),
    )
    engine, *_ = fastzero.initialize(model=make_model(), config=config)
    for x, y in batches(3):
        engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y))
        engine.step()
    assert engine.save_16bit_model(tmp_path / "out")
    engine.save_checkpoint(tmp_path / "ckpt")
    sd16 = torch.load(tmp_path / "out" / "pytorch_model.bin")
    fp32 = consolidate(tmp_path / "ckpt")
    for name, t in fp32.items():
        assert sd16[name].dtype == torch.bfloat16
        assert torch.equal(sd16[name], t.to(torch.bfloat16)), name
    no_gather = cfg(zero_optimization=dict(PREFETCH, stage=3))
    other, *_ = fastzero.initialize(model=make_model(), config=no_gather)
    with pytest.warns(UserWarning, match="stage3_gather_16bit_weights_on_model_save"):
        assert not other.save_16bit_model(tmp_path / "no")


class Tied(torch.nn.Module):
    """An embedding whose weight the head uses directly (a tied LM head)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(300, 64)
        self.mix = torch.nn.Linear(64, 64)

    def forward(self, ids):
        h = torch.nn.functional.gelu(self.mix(self.embed(ids)))
        return h @ self.embed.weight.t()


def test_a_param_used_outside_its_modules_forward_is_named_with_the_fix():
    config = cfg(zero_optimization=dict(PREFETCH, stage=3))
    engine, *_ = fastzero.initialize(model=Tied(), config=config)
    ids = torch.randint(0, 300, (8, 5))
    with pytest.raises(RuntimeError, match=r"embed\.weight.*register_external_parameter"):
        engine(ids)
    engine.register_external_parameter(engine.module, engine.module.embed.weight)
    ref = Tied()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        target = torch.randn(8, 5, 300)
        engine.backward(torch.nn.functional.mse_loss(engine(ids), target))
        engine.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(ids), target).backward()
        opt.step()
    with engine.gathered() as module:
        for (name, p), q in zip(module.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_init_partitions_at_construction_and_needs_stage3():
    with fastzero.zero.Init():
        model = make_model()
    assert all(p.numel() == 0 and p._fz_shard.numel() >= p._fz_shape.numel() for p in model.parameters())
    assert torch.nn.Linear(3, 3).weight.numel() == 9  # outside the context, modules are whole again
    with pytest.raises(
        ConfigError, match=r"partitioned by fastzero.zero.Init: train them with zero_optimization.stage 3"
    ):
        fastzero.initialize(model=model, config=cfg(zero_optimization={"stage": 2}))


def test_live_elements_return_to_zero_with_persistent_params():
    """The fetcher counts gathered non-persistent elements only: between
    steps nothing is live, however many micro-batches ran (persistent params
    stay whole and were once counted as released, driving the count below
    zero and loosening stage3_max_live_parameters)."""
    zero = dict(stage=3, stage3_param_persistence_threshold=100, stage3_max_live_parameters=10**6)
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization=zero))
    persistent = [u for g in engine.groups for u in g.units if u.persistent]
    assert persistent and len(persistent) < sum(len(g.units) for g in engine.groups)
    for x, y in batches(3):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        assert engine.fetcher.live == 0
    with engine.gathered():
        assert engine.fetcher.live > 0
    assert engine.fetcher.live == 0


def _train_steps(engine, data, evaluate=None):
    """Losses of one step per batch; `evaluate`: a batch for a no_grad
    forward between each backward and its step."""
    losses = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        if evaluate is not None:
            with torch.no_grad():
                engine(evaluate)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("zero", [PREFETCH, dict(stage3_param_persistence_threshold=100)], ids=["prefetch", "reuse"])
def test_an_evaluation_between_backward_and_step_changes_no_loss(zero):
    """A forward that no backward follows leaves params whole (prefetched,
    or kept for reuse); the step must not leave them holding the old
    values for the next forward."""
    data = batches(5)
    runs = []
    for evaluate in (None, data[0][0]):
        torch.manual_seed(0)
        engine, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization=dict(stage=3, **zero)))
        runs.append(_train_steps(engine, data, evaluate))
    assert runs[0] == runs[1]


def test_a_load_after_an_evaluation_forward_computes_with_the_loaded_weights(tmp_path):
    data = batches(4)
    zero = dict(stage=3, **PREFETCH)
    torch.manual_seed(0)
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization=zero))
    _train_steps(engine, data[:2])
    engine.save_checkpoint(str(tmp_path), tag="two")
    want = _train_steps(engine, data[2:])
    with torch.no_grad():
        engine(data[0][0])  # leaves prefetched params whole
    engine.load_checkpoint(str(tmp_path), tag="two")
    assert _train_steps(engine, data[2:]) == want


def test_a_load_inside_gathered_parameters_shows_the_loaded_weights(tmp_path):
    """Params held whole by GatheredParameters when a load writes the
    shards are gathered again: inside the block they read as loaded."""
    data = batches(3)
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization=dict(stage=3, **PREFETCH)))
    _train_steps(engine, data[:1])
    with engine.gathered():
        saved = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.save_checkpoint(str(tmp_path), tag="one")
    _train_steps(engine, data[1:])
    with fastzero.zero.GatheredParameters(list(engine.module.parameters())):
        engine.load_checkpoint(str(tmp_path), tag="one")
        for n, p in engine.module.named_parameters():
            assert torch.equal(p, saved[n]), n


def test_frozen_params_partitioned_by_init_stay_partitioned_and_train_as_without_init(tmp_path):
    """The adapter pattern: build under zero.Init, then freeze part of the
    model. The frozen params stay partitioned (gathered for their module's
    forward and backward), the run equals the one without Init, and a
    checkpoint resumes it exactly."""
    freeze = ["0.weight", "2.bias"]
    path = str(tmp_path / "ckpt")
    common = dict(stage=3, gas=1, steps=4, zero=PREFETCH, freeze=freeze)
    with_init, plain = train(tmp_path, 2, [dict(common, init=True, save_at=2, save=path), dict(common)])
    (tmp_path / "b").mkdir()
    (resumed,) = train(tmp_path / "b", 2, [dict(common, init=True, start=2, load=path)])
    before = dict(make_model().named_parameters())
    for a, b, r in zip(with_init, plain, resumed):
        assert a["losses"] == b["losses"] and r["losses"] == a["losses"][2:]
        for name, p in b["params"].items():
            assert torch.equal(a["params"][name], p) and torch.equal(r["params"][name], p), name
        for name in freeze:
            assert torch.equal(a["params"][name], before[name].detach()), name  # frozen: never moved
        assert a["memory"]["frozen_params"] > 0 and "frozen_params" not in b["memory"]


def test_partitioned_params_carry_deepspeeds_attributes():
    """ds_numel, ds_shape, ds_tensor, ds_id and ds_status, as DeepSpeed's
    ZeRO-3 params: the usual count of a partitioned model's params
    (Hugging Face's) gives the model's size, not 0."""
    count = lambda m: sum(p.ds_numel if hasattr(p, "ds_tensor") else p.numel() for p in m.parameters())  # noqa: E731
    want = sum(p.numel() for p in make_model().parameters())
    with fastzero.zero.Init():
        model = make_model()
    assert count(model) == want and all(
        p.ds_status is fastzero.zero.ZeroParamStatus.NOT_AVAILABLE for p in model.parameters()
    )
    zero = dict(stage=3, stage3_param_persistence_threshold=100)
    engine, *_ = fastzero.initialize(model=model, config=cfg(zero_optimization=zero))
    assert count(engine.module) == want
    assert len({p.ds_id for p in model.parameters()}) == len(list(model.parameters()))
    big = [p for p in model.parameters() if p.ds_numel >= 100]
    assert big and all(p.ds_status is fastzero.zero.ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0 for p in big)
    assert all(tuple(p.ds_shape) == tuple(q.shape) for p, q in zip(model.parameters(), make_model().parameters()))
    with fastzero.zero.GatheredParameters(big):
        assert all(p.ds_status is fastzero.zero.ZeroParamStatus.AVAILABLE and p.numel() == p.ds_numel for p in big)
    assert all(p.ds_status is fastzero.zero.ZeroParamStatus.NOT_AVAILABLE for p in big)
