"""OneBitLamb (1-bit LAMB): the optimizer on one process and on 2 Gloo
ranks against a plain-PyTorch reference of DeepSpeed's math
(tests/runtime/onebit_family_reference.py), the engine's convergence against
uncompressed LAMB, a checkpoint that resumes the same run, and the refusals."""

import json

import pytest
import torch

from fastzero.config import ConfigError, ConfigNotSupported, load_config
from fastzero.ops import FusedLamb
from fastzero.runtime.onebit_lamb import OneBitLamb
from tests.dist import run_ranks
from tests.runtime import onebit_family_reference as ref
from tests.runtime.test_zero_engine import WORKER

FAMILY = WORKER.parent / "onebit_family.py"
TRAIN = WORKER.parent / "train_onebit.py"
# a tight factor band and a fast EMA, so that the clamps and the threshold are exercised in a few steps
KNOBS = dict(freeze_step=6, coeff_beta=0.5, factor_max=1.3, factor_min=0.8, factor_threshold=0.05)


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_one_process_is_lamb_then_its_reference(wd):
    """Two param groups at different lrs: the warm-up is FusedLamb's LAMB
    without bias correction bit for bit; every param and every coefficient
    after every step, warm-up and compressed, equals the reference's."""
    model, twin, simulated = ref.model(), ref.model(), ref.model()
    opt = OneBitLamb(ref.param_groups(model), weight_decay=wd, betas=(0.9, 0.99), **KNOBS)
    lamb = FusedLamb(ref.param_groups(twin), bias_correction=False, weight_decay=wd, betas=(0.9, 0.99))
    reference = ref.OneBitLambRef([simulated], wd=wd, betas=(0.9, 0.99), **KNOBS)
    for step in range(20):
        for m in (model, twin, simulated):
            ref.set_grads(m, 0, step)
        assert opt.compressing == (step >= KNOBS["freeze_step"])
        opt.step()
        reference.step()
        if step < KNOBS["freeze_step"]:
            lamb.step()
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters())), step
        _close(ref.flat(model.parameters()), ref.flat(simulated.parameters()), f"step {step + 1}")
        _close(torch.tensor(opt.get_lamb_coeffs()), torch.tensor(reference.coeffs), f"coefficients, step {step + 1}")
    ema = [c for g in opt.param_groups for c in g["lamb_coeff_freeze"]]
    _close(torch.tensor(ema), torch.tensor([c for g in reference.lamb_coeff_freeze for c in g]), "lamb_coeff_freeze")
    factors = [f for g in opt.param_groups for f in g["last_factor"]]
    assert any(f != 1.0 for f in factors) and all(0.8 <= f <= 1.3 for f in factors)


def test_two_ranks_against_the_reference(tmp_path):
    """2 Gloo ranks, each on its own data: the warm-up on averaged
    gradients, then the scaled momentum averaged compressed; both ranks'
    params after every step as the reference's, and the same on both."""
    kwargs = dict(weight_decay=0.05, **KNOBS)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"optimizer": "OneBitLamb", "kwargs": kwargs, "steps": 16, "out": str(tmp_path / "l")}))
    run_ranks(FAMILY, 2, [spec], timeout=300)
    got = [torch.load(tmp_path / f"l.rank{r}.pt") for r in range(2)]
    models = [ref.model(), ref.model()]
    reference = ref.OneBitLambRef(models, wd=0.05, **KNOBS)
    for step in range(16):
        for r, m in enumerate(models):
            ref.set_grads(m, r, step)
        reference.step()
        for r in range(2):
            _close(got[r]["params"][step], ref.flat(models[r].parameters()), f"rank {r} step {step + 1}")
            _close(torch.tensor(got[r]["coeffs"][step]), torch.tensor(reference.coeffs), f"coefficients {step + 1}")
        assert torch.equal(got[0]["params"][step], got[1]["params"][step])


def test_a_param_without_momentum_at_the_freeze_is_not_scaled_by_infinity():
    """DeepSpeed divides by the param's momentum RMS: a zero one would give an infinite scaling coefficient."""
    model = ref.model()
    model[2].bias.requires_grad_(False)  # a frozen param in a group: no momentum, never touched
    opt = OneBitLamb(ref.param_groups(model), **KNOBS)
    for step in range(10):
        ref.set_grads(model, 0, step)
        if step < KNOBS["freeze_step"]:
            model[0].bias.grad = None  # no gradient in the warm-up: momentum 0 at the freeze
        opt.step()
    scaling = opt.param_groups[0]["scaling_coeff"]
    assert scaling[1] == 1.0 and all(torch.isfinite(p).all() for p in model.parameters())


def test_state_dict_after_the_freeze_resumes_the_same_run():
    model = ref.model()
    opt = OneBitLamb(ref.param_groups(model), weight_decay=0.01, **KNOBS)
    for step in range(9):
        ref.set_grads(model, 0, step)
        opt.step()
    sd = torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, opt.state_dict())
    saved = [p.detach().clone() for p in model.parameters()]
    for step in range(9, 14):
        ref.set_grads(model, 0, step)
        opt.step()
    expected = ref.flat(model.parameters())
    resumed = ref.model(seed=5)
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), saved):
            p.copy_(q)
    opt2 = OneBitLamb(ref.param_groups(resumed), weight_decay=0.01, **KNOBS)
    opt2.load_state_dict(sd)
    for step in range(9, 14):
        ref.set_grads(resumed, 0, step)
        opt2.step()
    assert torch.equal(ref.flat(resumed.parameters()), expected)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(amsgrad=True), "amsgrad"),
        (dict(bias_correction=True), "bias_correction=True"),
        (dict(eps_inside_sqrt=True), "eps_inside_sqrt"),
        (dict(freeze_step=0), "freeze_step=0: must be an int >= 1"),
        (dict(coeff_beta=1.0), r"coeff_beta=1.0: must be a number in \[0.0, 1.0\)"),
        (dict(factor_min=2.0, factor_max=1.0), "factor_min=2.0 > factor_max=1.0"),
        (dict(factor_threshold=-0.1), "factor_threshold=-0.1"),
        (dict(max_grad_norm=-1.0), "max_grad_norm"),
        (dict(min_coeff=5.0, max_coeff=1.0), "min_coeff"),
    ],
)
def test_bad_arguments_name_the_problem(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OneBitLamb(ref.model().parameters(), **kwargs)


def _cfg(stage=0, **params):
    return {
        "train_batch_size": 8,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "OneBitLamb", "params": params},
    }


@pytest.mark.parametrize(
    "config,error,match",
    [
        (_cfg(amsgrad=True), ConfigNotSupported, "amsgrad"),
        (_cfg(bias_correction=True), ConfigNotSupported, "bias_correction = true: OneBitLamb's math has none"),
        (_cfg(freeze_step=0), ConfigError, "freeze_step = 0: must be >= 1"),
        (_cfg(coeff_beta=1.5), ConfigError, r"coeff_beta = 1.5: must be in \[0, 1\)"),
        (_cfg(factor_min=5.0), ConfigError, r"factor_min = 5.0: must be <= optimizer.params.factor_max \(4.0\)"),
        (_cfg(min_coeff=20.0), ConfigError, "min_coeff = 20.0"),
        (_cfg(stage=2), ConfigNotSupported, r"OneBitLamb works with zero_optimization.stage 0 or 1 \(stage is 2\)"),
        (_cfg(stage=3), ConfigNotSupported, r"stage is 3"),
        (  # offload: stage 0 has nothing partitioned to offload, and at stage 1 it is refused by name
            {**_cfg(), "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
            ConfigError,
            "offload_optimizer needs stage >= 1",
        ),
        (
            {**_cfg(), "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
            ConfigNotSupported,
            r"OneBitLamb with offload_optimizer",
        ),
        (_cfg(factor_treshold=0.1), ConfigError, r"did you mean 'factor_threshold'\?"),
    ],
)
def test_bad_configs(config, error, match):
    with pytest.raises(error, match=match):
        load_config(config)


def test_deepspeed_config_is_accepted():
    """DeepSpeed's 1-bit LAMB tutorial config."""
    params = dict(lr=11e-3, weight_decay=0.01, bias_correction=False, max_coeff=0.3, min_coeff=0.01)
    params.update(freeze_step=1000, cuda_aware=False, comm_backend_name="nccl", coeff_beta=0.9)
    params.update(factor_max=4.0, factor_min=0.5, factor_threshold=0.1)
    cfg = load_config(_cfg(**params))
    assert cfg.optimizer.type == "OneBitLamb" and cfg.optimizer.params["max_coeff"] == 0.3


def _train(tmp_path, name, runs, world=2):
    for run in runs:
        run["out"] = str(tmp_path / run.pop("name"))
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps(runs))
    run_ranks(TRAIN, world, [spec], timeout=600)
    return lambda run_name, rank=0: torch.load(tmp_path / f"{run_name}.rank{rank}.pt", weights_only=False)


def test_engine_converges_like_lamb(tmp_path):
    """Under the engine (stage 0, fp32 and bf16, 2 ranks): the held-out loss
    after 200 steps within 5% of uncompressed LAMB's, every rank with the
    same params, and no gradient all-reduce after the freeze."""
    steps, lamb = 200, dict(bias_correction=False)
    runs = [
        dict(name="lamb", optimizer="Lamb", steps=steps, params=lamb, lr=1e-2),
        dict(name="onebit", optimizer="OneBitLamb", steps=steps, params=dict(freeze_step=20), lr=1e-2),
        dict(name="bf16", optimizer="OneBitLamb", dtype="bf16", steps=steps, params=dict(freeze_step=20), lr=1e-2),
    ]
    load = _train(tmp_path, "converge", runs)
    base = load("lamb")
    assert base["eval_loss"] < 0.1 * base["losses"][0]  # the task is learnt
    for run in ("onebit", "bf16"):
        res = [load(run, r) for r in range(2)]
        assert res[0]["eval_loss"] <= 1.05 * base["eval_loss"], (run, res[0]["eval_loss"], base["eval_loss"])
        assert all(torch.equal(res[1]["params"][k], v) for k, v in res[0]["params"].items())
    sent = load("onebit")["sent"]
    assert "all_reduce" not in sent or sent["all_reduce"] < 100 * (steps - 21)
    assert load("onebit")["memory"]["compression_errors"] > 0


def test_engine_checkpoint_resumes_the_same_run(tmp_path):
    """Saved after the freeze: the errors, the fresh variance (per rank) and
    the coefficients (in the manifest) come back; the resumed run is the
    straight one, loss for loss and bit for bit. At another world size the
    fresh variance restarts from the frozen one, and it says so."""
    ckpt = str(tmp_path / "ckpt")
    params = dict(freeze_step=10, weight_decay=0.01)
    runs = [
        dict(name="straight", optimizer="OneBitLamb", steps=30, params=params, freeze=10),
        dict(name="first", optimizer="OneBitLamb", steps=20, params=params, freeze=10, save_at=20, save=ckpt),
        dict(name="resumed", optimizer="OneBitLamb", steps=30, params=params, freeze=10, start=20, load=ckpt),
    ]
    load = _train(tmp_path, "resume", runs)
    for rank in range(2):
        straight, resumed = load("straight", rank), load("resumed", rank)
        assert resumed["losses"] == straight["losses"][20:]
        assert all(torch.equal(resumed["params"][k], v) for k, v in straight["params"].items())
        assert resumed["load_warnings"] == []
    runs = [dict(name="one", optimizer="OneBitLamb", steps=22, params=params, freeze=10, start=20, load=ckpt)]
    one = _train(tmp_path, "one", runs, world=1)("one")
    assert any("exp_avg_sq_fresh" in w for w in one["load_warnings"]), one["load_warnings"]


def test_stage_1_warmup_is_stage_0s_and_it_converges_like_lamb(tmp_path):
    """At ZeRO stage 1 (chunks that cut params in pieces: small buckets) the
    warm-up is stage 0's LAMB (trust ratios from every rank's pieces), the
    compressed phase learns as uncompressed LAMB does, every rank holds the
    same params, and the optimizer state is partitioned."""
    steps, lamb, warm = 200, dict(bias_correction=False), dict(freeze_step=1000, weight_decay=0.01)
    runs = [
        dict(name="warm0", optimizer="OneBitLamb", stage=0, steps=12, params=warm, lr=1e-2),
        dict(name="warm1", optimizer="OneBitLamb", stage=1, steps=12, params=warm, lr=1e-2),
        dict(name="lamb", optimizer="Lamb", steps=steps, params=lamb, lr=1e-2),
        dict(name="onebit1", optimizer="OneBitLamb", stage=1, steps=steps, params=dict(freeze_step=20), lr=1e-2),
        dict(
            name="bf16",
            optimizer="OneBitLamb",
            stage=1,
            dtype="bf16",
            steps=steps,
            params=dict(freeze_step=20),
            lr=1e-2,
        ),
    ]
    load = _train(tmp_path, "stage1", runs)
    for rank in range(2):
        w0, w1 = load("warm0", rank), load("warm1", rank)
        for k, v in w0["params"].items():
            torch.testing.assert_close(w1["params"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
        torch.testing.assert_close(torch.tensor(w1["losses"]), torch.tensor(w0["losses"]), rtol=1e-5, atol=0)
    base = load("lamb")
    assert base["eval_loss"] < 0.1 * base["losses"][0]  # the task is learnt
    for run in ("onebit1", "bf16"):
        res = [load(run, r) for r in range(2)]
        assert res[0]["eval_loss"] <= 1.05 * base["eval_loss"], (run, res[0]["eval_loss"], base["eval_loss"])
        assert all(torch.equal(res[1]["params"][k], v) for k, v in res[0]["params"].items())
    mem, numel = load("onebit1")["memory"], load("onebit1")["numel"]
    assert mem["compression_errors"] > 0
    # exp_avg, exp_avg_sq, exp_avg_sq_fresh of half the params (padded), not of all of them
    assert mem["optimizer"] < 0.6 * 3 * 4 * numel, (mem, numel)


def test_stage_1_checkpoint_resumes_the_same_run(tmp_path):
    """Saved at stage 1 after the freeze: the resumed run is the straight
    one, loss for loss and bit for bit; the per-param coefficients are
    per model param, so the checkpoint also resumes at stage 0."""
    ckpt = str(tmp_path / "ckpt")
    params = dict(freeze_step=10, weight_decay=0.01)
    runs = [
        dict(name="straight", optimizer="OneBitLamb", stage=1, steps=30, params=params, freeze=10),
        dict(name="first", optimizer="OneBitLamb", stage=1, steps=20, params=params, freeze=10, save_at=20, save=ckpt),
        dict(name="resumed", optimizer="OneBitLamb", stage=1, steps=30, params=params, freeze=10, start=20, load=ckpt),
        dict(name="at0", optimizer="OneBitLamb", stage=0, steps=30, params=params, freeze=10, start=20, load=ckpt),
    ]
    load = _train(tmp_path, "resume1", runs)
    for rank in range(2):
        straight, resumed = load("straight", rank), load("resumed", rank)
        assert resumed["losses"] == straight["losses"][20:]
        assert all(torch.equal(resumed["params"][k], v) for k, v in straight["params"].items())
        assert resumed["load_warnings"] == []
    at0 = load("at0")
    assert at0["losses"][0] == load("straight")["losses"][20]  # the same params at the load
    assert at0["losses"][-1] < 1.5 * load("straight")["losses"][-1]  # and it goes on training
