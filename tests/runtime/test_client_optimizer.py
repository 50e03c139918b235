"""Any torch.optim.Optimizer under ZeRO (fastzero.runtime.client_optimizer):
SGD (momentum, nesterov), Adagrad, RMSprop and a custom Lion at stages 0-3
on 2 Gloo ranks against a single-process torch run of the same optimizer;
checkpoints of their state across world sizes and stages; DeepSpeed's
refusals; ``optimizer.state[p]["step"]`` of the fused optimizers;
``sub_group_size``."""

import json
import re
import warnings

import pytest
import torch

import fastzero
from fastzero.config import ConfigError
from fastzero.ops import CPUAdam, FusedAdam, FusedLamb
from fastzero.runtime.checkpoint_io import CheckpointError
from fastzero.runtime.client_optimizer import sub_groups
from tests.dist import run_ranks
from tests.paths import WORKERS
from tests.runtime.test_zero_engine import assert_params, assert_tracks
from tests.workers.train_anyopt import OPTIMIZERS, make_optimizer
from tests.workers.train_zero import MICRO, global_batch, make_model

WORKER = WORKERS / "train_anyopt.py"
STEPS = 6


def reference(opt: str, world: int, steps: int = STEPS, gas: int = 2, clip: float = 0.5):
    """Plain torch, one process, the global batch of every step."""
    model = make_model()
    optimizer = make_optimizer(opt, model)
    for step in range(steps):
        x, y = global_batch(step, MICRO * gas * world)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, optimizer, model


def train(tmp_path, world: int, runs: list[dict], name: str = "runs"):
    for i, run in enumerate(runs):
        run["out"] = str(tmp_path / f"{name}{i}")
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps(runs))
    run_ranks(WORKER, world, [spec], timeout=600)
    return [[torch.load(f"{run['out']}.rank{r}.pt") for r in range(world)] for run in runs]


def assemble(ranks_pieces: list[list[dict]], shapes: dict) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank's pieces of the state, whole per param and key; each
    element covered exactly once."""
    out, seen = {}, {}
    for pieces in ranks_pieces:
        for piece in pieces:
            n = shapes[piece["name"]].numel()
            seen.setdefault(piece["name"], torch.zeros(n, dtype=torch.int32))[piece["lo"] : piece["hi"]] += 1
            for key, t in piece["tensors"].items():
                flat = out.setdefault(piece["name"], {}).setdefault(key, torch.full((n,), float("nan")))
                flat[piece["lo"] : piece["hi"]] = t.float().cpu()
    for name, count in seen.items():
        assert bool((count == 1).all()), f"{name}: elements covered {count.tolist()} times"
    return out


def torch_state(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """torch's state per param name, flat, with the param as ``master``."""
    out = {}
    for name, p in model.named_parameters():
        st = {k: v.reshape(-1) for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        out[name] = {"master": p.detach().reshape(-1), **st}
    return out


SHAPES = {n: p.shape for n, p in make_model().named_parameters()}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_client_optimizers_match_torch_at_every_stage_on_two_ranks(tmp_path, opt):
    """fp32: params and every state tensor equal torch's to fp32 rounding
    (clipping on). bf16: the fp32 masters track torch's fp32 run and the
    bf16 params are their masters rounded."""
    runs = [dict(opt=opt, stage=s, dtype=d) for d in ("fp32", "bf16") for s in (0, 1, 2, 3)]
    results = train(tmp_path, 2, runs)
    want, optimizer, model = reference(opt, 2)
    want_state = torch_state(model, optimizer)
    init = {n: p.detach() for n, p in make_model().named_parameters()}
    for run, ranks in zip(runs, results):
        state = assemble([res["state"] for res in ranks] if run["stage"] else [ranks[0]["state"]], SHAPES)
        for res in ranks:
            assert res["inner"] == type(optimizer).__name__
            if run["dtype"] == "fp32":
                assert_params(res["params"], want)
            else:  # the masters track fp32 (the bf16 params' own rounding is as large as a few steps' movement)
                masters = {n: s["master"].view(SHAPES[n]) for n, s in state.items()}
                assert_tracks(masters, want, init, 0.25)
                for n, p in res["params"].items():
                    assert torch.equal(p, masters[n].bfloat16().float()), (run, n)
        assert {n: set(s) for n, s in state.items()} == {n: set(s) for n, s in want_state.items()}, run
        for name, keys in want_state.items():
            for key, t in keys.items():
                got = state[name][key]
                if run["dtype"] == "fp32":
                    # RMSprop's momentum sums g / sqrt(running g^2): an element whose grad nearly cancels between
                    # the two ranks' micro-batches carries the sum's rounding, so amplified (seen: one element of
                    # 2145 at 2e-4 relative, on an AVX-512 CPU)
                    rtol = 1e-3 if (opt, key) == ("rmsprop", "momentum_buffer") else 1e-4
                    torch.testing.assert_close(
                        got, t, rtol=rtol, atol=1e-5, msg=lambda m, w=(run, name, key): f"{w}: {m}"
                    )
                else:  # bf16 forward and grads: the state tracks fp32's
                    assert (got - t).abs().mean() < 0.1 * t.abs().mean() + 1e-3, (run, name, key)
        mem = ranks[0]["memory"]
        assert (mem["master"] > 0) == (run["dtype"] == "bf16") and mem["optimizer"] > 0, (run, mem)


@pytest.mark.parametrize("opt", ["rmsprop", "sgd"])
def test_checkpoints_of_any_state_move_across_world_sizes_and_stages(tmp_path, opt):
    """Saved at world 2 stage 2 after 3 steps: loads at world 1 stage 0 and
    at world 2 stage 3 with every state tensor and scalar exactly as saved,
    and training then continues as the run that never checkpointed."""
    save = str(tmp_path / "ckpt")
    (saver,) = train(tmp_path, 2, [dict(opt=opt, stage=2, save_at=3, save=save, clip=0.0)], "save")
    (straight,) = train(tmp_path, 2, [dict(opt=opt, stage=2, clip=0.0)], "straight")
    (one,) = train(tmp_path, 1, [dict(opt=opt, stage=0, gas=4, start=3, load=save, clip=0.0)], "one")
    (three,) = train(tmp_path, 2, [dict(opt=opt, stage=3, start=3, load=save, clip=0.0)], "three")
    saved = assemble([res["saved"] for res in saver], SHAPES)
    scalars = {s["name"]: s["scalars"] for res in saver for s in res["saved"]}
    want, optimizer, _ = reference(opt, 2, clip=0.0)
    assert set(next(iter(saved.values()))) > {"master"}  # the optimizer's own state went into the pieces
    for loaded, ranks in (
        (assemble([one[0]["loaded"]], SHAPES), one),
        (assemble([r["loaded"] for r in three], SHAPES), three),
    ):
        assert {n: set(s) for n, s in loaded.items()} == {n: set(s) for n, s in saved.items()}
        for name, keys in saved.items():
            for key, t in keys.items():
                assert torch.equal(loaded[name][key], t), (name, key)
        for res in ranks:
            for piece in res["loaded"]:
                assert {k: float(v) for k, v in piece["scalars"].items()} == {
                    k: float(v) for k, v in scalars[piece["name"]].items()
                }
            assert_params(res["params"], straight[0]["params"], rtol=1e-5, atol=1e-6)
            assert_params(res["params"], want)
    if opt == "rmsprop":
        assert all(float(s["step"]) == 3 for s in scalars.values())


def test_a_checkpoint_of_another_optimizer_is_refused_by_name(tmp_path):
    save = str(tmp_path / "ckpt")
    train(tmp_path, 1, [dict(opt="sgd", stage=1, save_at=1, save=save, steps=1)], "save")
    model = make_model()
    engine, *_ = _initialize(model, make_optimizer("adagrad", model), stage=1)
    with pytest.raises(
        CheckpointError, match=r"saved by torch\.optim\.sgd\.SGD .*Adagrad.*load_optimizer_states=False"
    ):
        engine.load_checkpoint(save)
    engine.load_checkpoint(save, load_optimizer_states=False)  # the weights only
    model = make_model()
    groups = [{"params": g["params"]} for g in make_optimizer("sgd", model).param_groups]  # the saved run's groups
    fused, *_ = fastzero.initialize(model=model, model_parameters=groups, config=_cfg(1, optimizer={"type": "AdamW"}))
    with pytest.raises(CheckpointError, match=r"saved by torch\.optim\.sgd\.SGD and this engine's optimizer is adam"):
        fused.load_checkpoint(save)


# -- single process: refusals, offload, sub_group_size, state["step"] -----------------------------------------------
def _cfg(stage: int, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.5, "zero_optimization": {"stage": stage}}
    for key, value in extra.items():
        if key == "zero":
            cfg["zero_optimization"].update(value)
        else:
            cfg[key] = value
    return cfg


def _initialize(model, optimizer, stage, **extra):
    extra.setdefault("zero_allow_untested_optimizer", True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fastzero.initialize(model=model, optimizer=optimizer, config=_cfg(stage, **extra))


def _train(engine, steps: int = 4) -> None:
    for step in range(steps):
        x, y = global_batch(step, MICRO)
        engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y))
        engine.step()


def test_untested_optimizers_need_deepspeeds_key_at_stages_1_to_3():
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for stage in (1, 2, 3):
        with pytest.raises(
            ConfigError, match=rf"SGD at zero_optimization.stage {stage}.*zero_allow_untested_optimizer"
        ):
            fastzero.initialize(model=model, optimizer=sgd, config=_cfg(stage))
    engine, opt, *_ = fastzero.initialize(model=model, optimizer=sgd, config=_cfg(0))  # stage 0: as DeepSpeed
    assert type(opt.inner) is torch.optim.SGD


def test_the_untested_optimizer_warning_is_said_once():
    class Once(torch.optim.SGD):
        pass

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model = make_model()
            fastzero.initialize(
                model=model,
                optimizer=Once(model.parameters(), lr=0.1),
                config=_cfg(1, zero_allow_untested_optimizer=True),
            )
    said = [w for w in caught if "optimizer=Once" in str(w.message)]
    assert len(said) == 1 and "zero_allow_untested_optimizer" in str(said[0].message)


def test_offload_with_an_untested_optimizer_follows_zero_force_ds_cpu_optimizer():
    model = make_model()
    offload = {"offload_optimizer": {"device": "cpu"}}
    with pytest.raises(
        ConfigError, match=r"SGD with zero_optimization.offload_optimizer.*zero_force_ds_cpu_optimizer: false"
    ):
        _initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, zero=offload)
    # false: SGD itself runs on the CPU shard, as the non-offloaded run does
    results = []
    for zero in (offload, {}):
        model = make_model()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        engine, opt, *_ = _initialize(model, sgd, 2, zero=zero, zero_force_ds_cpu_optimizer=False)
        _train(engine)
        results.append(([p.detach().clone() for p in engine.module.parameters()], engine.memory_breakdown()))
        shard = engine.groups[0].layout.shard_size
    (offloaded, mem), (plain, plain_mem) = results
    assert all(torch.equal(a, b) for a, b in zip(offloaded, plain))
    assert mem["optimizer"] == 0 and mem["offload_master"] == 4 * shard and mem["offload_optimizer"] == 4 * shard
    assert plain_mem["optimizer"] == 4 * shard and plain_mem["master"] == 0  # fp32: the shard is its own master


def test_a_client_optimizer_that_cannot_be_rebuilt_says_how_to_fix_it():
    class Fixed(torch.optim.SGD):
        def __init__(self, params):  # its defaults (lr, momentum...) are not its constructor's arguments
            super().__init__(params, lr=0.1)

    model = make_model()
    with pytest.raises(ConfigError, match=r"Fixed\(param_groups, \*\*optimizer.defaults\).*keyword arguments"):
        _initialize(model, Fixed(model.parameters()), 1)


def test_the_engine_optimizer_shares_groups_and_state_with_the_rebuilt_one():
    """An lr change through the engine's optimizer reaches the math; a
    closure is refused; state_dict round-trips through torch's."""
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.4, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(sgd, 1, gamma=0.5)  # built on the client: the engine re-points it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, opt, _, sched = fastzero.initialize(
            model=model,
            optimizer=sgd,
            lr_scheduler=scheduler,
            config=_cfg(1, bf16={"enabled": True}, zero_allow_untested_optimizer=True),
        )
    assert opt.param_groups is opt.inner.param_groups and opt.state is opt.inner.state
    _train(engine, 2)
    assert opt.inner.param_groups[0]["lr"] == 0.1 and engine.get_lr() == [0.1]
    opt.zero_grad()  # a script's call: the engine's gradients stay attached
    sd = opt.state_dict()
    assert all("momentum_buffer" in s for s in sd["state"].values())
    before = [p.detach().clone() for p in engine.module.parameters()]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for g in opt.param_groups:
        g["momentum"] = 0.0
    _train(engine, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    opt.load_state_dict(sd)
    assert opt.param_groups is opt.inner.param_groups and opt.param_groups[0]["lr"] == 0.1
    assert opt.param_groups[0]["momentum"] == 0.9
    with pytest.raises(ValueError, match="no closure"):
        opt.step(lambda: 0.0)


@pytest.mark.parametrize(("stage", "kind"), [(0, "AdamW"), (1, "AdamW"), (3, "AdamW"), (1, "SGD")])
def test_a_scheduler_on_the_scripts_own_optimizer_steers_the_engine(stage, kind):
    """A scheduler built on the optimizer the script passed, kept and stepped by the script (not passed to
    initialize; Hugging Face's Trainer does this): the engine's steps use its lrs, per param group, as the
    script's optimizer does in plain torch."""

    def setup(model):
        first, rest = list(model[0].parameters()), list(model[2].parameters()) + list(model[3].parameters())
        groups = [{"params": first, "weight_decay": 0.1}, {"params": rest, "lr": 3e-3}]
        opt = torch.optim.AdamW(groups, lr=1e-2) if kind == "AdamW" else torch.optim.SGD(groups, lr=0.1)
        warm = lambda s: min(1.0, (s + 1) / 3)  # a warm-up: lr 1/3 of the base, then 2/3, then the base
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, [warm, lambda s: 0.5**s])

    ref = make_model()
    ropt, rsched = setup(ref)
    model = make_model()
    opt, sched = setup(model)
    extra = {} if kind == "AdamW" else {"zero_allow_untested_optimizer": True}
    engine, *_ = fastzero.initialize(model=model, optimizer=opt, config=_cfg(stage, gradient_clipping=0.0, **extra))
    for step in range(4):
        x, y = global_batch(step, MICRO)
        ropt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ropt.step()
        rsched.step()
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        sched.step()
        assert engine.get_lr() == [g["lr"] for g in ropt.param_groups], step
    with engine.gathered():
        got = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    assert_params(got, dict(ref.named_parameters()), rtol=1e-5, atol=1e-6)


def test_sub_groups_cut_whole_tensors_at_the_limit():
    ts = [torch.zeros(n) for n in (3, 4, 10, 1, 1, 2)]
    assert [[t.numel() for t in g] for g in sub_groups(ts, 7)] == [[3, 4], [10], [1, 1, 2]]
    assert [[t.numel() for t in g] for g in sub_groups(ts, 100)] == [[3, 4, 10, 1, 1, 2]]


@pytest.mark.parametrize("kind", ["client-bf16", "offload-adam-bf16", "offload-adam-fp32"])
def test_sub_group_size_gives_the_same_bits_with_bounded_temporaries(kind):
    """A small sub_group_size: the same params and state bit for bit as one
    group; the offloaded step's staging buffers hold at most sub_group_size
    elements per kind (grads in, param copies out)."""
    results = []
    for limit in (1_000_000_000, 100):
        model = make_model()
        zero = {"sub_group_size": limit}
        dtype = {"bf16": {"enabled": True}} if kind.endswith("bf16") else {}
        if kind.startswith("client"):  # stage 0: one master per param (2145, 65, 1105, 17, 17, 17 elements)
            rmsprop = torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.5)
            engine, opt, *_ = _initialize(model, rmsprop, 0, zero=zero, **dtype)
            assert [len(g) for g in opt.sub_groups] == ([6] if limit > 1000 else [1, 1, 1, 3])
        else:
            zero["offload_optimizer"] = {"device": "cpu"}
            engine, opt, *_ = fastzero.initialize(
                model=model, config=_cfg(1, zero=zero, optimizer={"type": "AdamW", "params": {"lr": 1e-2}}, **dtype)
            )
        _train(engine)
        state = [{k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)} for s in opt.state.values()]
        results.append(([p.detach().clone() for p in engine.module.parameters()], state, engine.memory_breakdown()))
    (params, state, mem), (small_params, small_state, small_mem) = results
    assert all(torch.equal(a, b) for a, b in zip(params, small_params))
    assert len(state) == len(small_state) and all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(state, small_state)
    )
    if kind.startswith("offload"):
        per_element = 2 if kind.endswith("bf16") else 4
        kinds = 2 if kind.endswith("bf16") else 1  # grads in and, in bf16, the param copies out
        numel = sum(m.numel() for m in opt.device_of)
        assert mem["offload_staging"] == kinds * numel * per_element  # one buffer per tensor
        assert 0 < small_mem["offload_staging"] <= kinds * 100 * per_element


def _step_of_every_param(opt) -> None:
    for g in opt.param_groups:
        for p in g["params"]:
            assert float(opt.state[p]["step"]) == float(g["step"]), (type(opt).__name__, float(g["step"]))


@pytest.mark.parametrize("cls", [FusedAdam, CPUAdam, FusedLamb])
def test_state_step_of_the_fused_optimizers_is_the_group_counter(cls):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 17)]
    opt = cls([{"params": params[:1]}, {"params": params[1:], "lr": 1e-2}], lr=1e-3)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        _step_of_every_param(opt)
        assert float(opt.state[params[0]]["step"]) == step + 1
    sd = opt.state_dict()
    assert all(float(s["step"]) == 3 for s in sd["state"].values())
    assert sd["state"][0]["step"] is not sd["state"][1]["step"]  # torch increments each in place
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = torch.optim.AdamW([{"params": copies[:1]}, {"params": copies[1:]}])
    if cls is not FusedLamb:  # torch's AdamW loads it and counts on, each param its own step
        ref.load_state_dict(sd)
        for p in copies:
            p.grad = torch.ones_like(p)
        ref.step()
        assert [float(ref.state[p]["step"]) for p in copies] == [4.0, 4.0]
    fresh = cls([{"params": params[:1]}, {"params": params[1:], "lr": 1e-2}], lr=1e-3)
    fresh.load_state_dict(sd)
    _step_of_every_param(fresh)
    assert float(fresh.state[params[1]]["step"]) == 3


@pytest.mark.parametrize("kind", ["offload", "onebit", "checkpoint"])
def test_state_step_through_the_engine(tmp_path, kind):
    """OffloadedAdam and OneBitAdam (past freeze_step too) keep it; a
    checkpoint load sets it from the saved counter."""
    if kind == "offload":
        config = _cfg(1, zero={"offload_optimizer": {"device": "cpu"}}, optimizer={"type": "AdamW"})
    elif kind == "onebit":
        config = _cfg(0, optimizer={"type": "OneBitAdam", "params": {"freeze_step": 2}})
    else:
        config = _cfg(2, optimizer={"type": "AdamW"})
    engine, opt, *_ = fastzero.initialize(model=make_model(), config=config)
    _train(engine, 3)
    _step_of_every_param(opt)
    assert float(opt.param_groups[0]["step"]) == 3
    if kind == "checkpoint":
        engine.save_checkpoint(str(tmp_path))
        other, other_opt, *_ = fastzero.initialize(model=make_model(), config=_cfg(1, optimizer={"type": "AdamW"}))
        other.load_checkpoint(str(tmp_path))
        _step_of_every_param(other_opt)
        assert float(other_opt.param_groups[0]["step"]) == 3


def test_a_torch_adam_with_amsgrad_runs_as_a_client_optimizer():
    model = make_model()
    ref = make_model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, amsgrad=True)
    engine, opt, *_ = _initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True), 1)
    assert type(opt.inner) is torch.optim.Adam
    _train(engine)
    for step in range(4):
        x, y = global_batch(step, MICRO)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
    for (name, p), q in zip(engine.module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert re.search("max_exp_avg_sq", str(list(next(iter(opt.state.values())))))


@pytest.mark.parametrize("loss_scale", [0.0, 1024.0])  # dynamic, static
def test_fp16_unscales_before_the_client_step(loss_scale):
    """fp16: the loss scale is divided out of the grads before SGD's step
    (left in, the update would be 2**16 or 1024 times too large)."""
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    fp16 = {"enabled": True, "loss_scale": loss_scale, "initial_scale_power": 16}
    engine, opt, *_ = _initialize(model, sgd, 2, fp16=fp16, gradient_clipping=0.0)
    _train(engine, 4)
    assert engine.loss_scale > 1 and engine.skipped_steps == 0
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        x, y = global_batch(step, MICRO)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    got = {n: p.detach().float() for n, p in engine.module.named_parameters()}
    init = {n: p.detach() for n, p in make_model().named_parameters()}
    assert_tracks(got, {n: p.detach() for n, p in ref.named_parameters()}, init, 0.1)
