"""OneBitAdam: the optimizer on one process against plain-PyTorch math, its
errors, the config checks, and training as 4 Gloo ranks under the engine
(stages 0 and 1, fp32/bf16/fp16) and on its own: convergence against AdamW,
the bytes after freeze_step, and a checkpoint after freeze_step that resumes
the same run."""

import json
import subprocess
import sys

import pytest
import torch

from fastzero.config import ConfigError, ConfigNotSupported, load_config
from fastzero.ops import FusedAdam
from fastzero.ops.reference import onebit as ref
from fastzero.runtime.onebit_adam import OneBitAdam
from tests.dist import run_ranks
from tests.runtime.test_zero_engine import WORKER

TRAIN = WORKER.parent / "train_onebit.py"


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.Tanh(), torch.nn.Linear(20, 3))


def _grads(model, step):
    gen = torch.Generator().manual_seed(step)
    dtype = next(model.parameters()).dtype
    x, y = torch.randn(16, 12, generator=gen).to(dtype), torch.randn(16, 3, generator=gen)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x).float(), y).backward()


def test_warmup_is_adamw_then_the_compressed_step_is_its_reference():
    """One process, two param groups at different lrs: the warm-up steps are
    FusedAdam's AdamW exactly; after freeze_step each group's step is
    m = b1 m + (1 - b1) g, compressed and decompressed with error feedback
    (worker then server), then
    p = p (1 - lr wd) - lr (m / bc1) / (sqrt(v / bc2(freeze)) + eps)."""
    lrs, wd, betas, eps, freeze = (1e-2, 3e-3), 0.1, (0.9, 0.99), 1e-8, 3
    model, twin = _model(), _model()
    groups = lambda m: [{"params": m[0].parameters(), "lr": lrs[0]}, {"params": m[2].parameters(), "lr": lrs[1]}]
    opt = OneBitAdam(groups(model), freeze_step=freeze, betas=betas, eps=eps, weight_decay=wd)
    adam = FusedAdam(groups(twin), betas=betas, eps=eps, weight_decay=wd)
    for step in range(freeze):
        for m, o in ((model, opt), (twin, adam)):
            _grads(m, step)
            o.step()
        assert not opt.compressing or step == freeze - 1
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    assert opt.compressing
    # the reference from here on, in plain torch, over each group's flattened params
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])
    ref_groups = []
    for group in adam.param_groups:
        params = group["params"]
        m, v = flat([adam.state[p]["exp_avg"] for p in params]), flat([adam.state[p]["exp_avg_sq"] for p in params])
        padded = -(-m.numel() // 8) * 8
        ref_groups.append([group["lr"], params, m, v, torch.zeros(padded), torch.zeros(padded)])
    for step in range(freeze, freeze + 6):
        _grads(model, step)
        opt.step()
        _grads(twin, step)
        for g in ref_groups:
            lr, params, m, v, worker, server = g
            n = m.numel()
            m = betas[0] * m + (1 - betas[0]) * flat([p.grad for p in params])
            bits, scales, worker = ref.compress(torch.cat([m, torch.zeros(worker.numel() - n)]), worker)
            bits, scales, server = ref.compress(ref.decompress(bits, scales), server)
            m = ref.decompress(bits, scales)[:n]
            g[2], g[4], g[5] = m, worker, server
            bc1, bc2 = 1 - betas[0] ** (step + 1), 1 - betas[1] ** freeze
            with torch.no_grad():
                p_flat = flat(params) * (1 - lr * wd) - lr * (m / bc1) / ((v / bc2).sqrt() + eps)
                off = 0
                for p in params:
                    p.copy_(p_flat[off : off + p.numel()].view_as(p))
                    off += p.numel()
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert opt.steps_done == freeze + 6


def test_it_lives_in_the_runtime_and_ops_re_exports_it_lazily():
    """OneBitAdam needs process groups: fastzero.runtime holds it, and
    ``from fastzero.ops import OneBitAdam`` still works without importing
    ops pulling in the runtime."""
    import fastzero.ops

    assert fastzero.ops.OneBitAdam is OneBitAdam
    code = "import sys, fastzero.ops; assert 'fastzero.runtime' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchOptimizer'"):
        fastzero.ops.NoSuchOptimizer  # noqa: B018


def test_attach_engine_hands_over_the_collectives_and_clipping():
    """Under the engine the optimizer only updates: max_grad_norm is the
    engine's gradient_clipping, so steps with large gradients are AdamW's
    (and on its own it clips: they are not)."""
    for attached in (False, True):
        model, twin = _model(), _model()
        opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=5, max_grad_norm=1e-3)
        adam = FusedAdam(twin.parameters(), lr=1e-2)
        if attached:
            opt.attach_engine(opt.comm, exchange_momentum=True)
        for step in range(2):  # two steps: clipping each by its own factor changes the direction
            for m, o in ((model, opt), (twin, adam)):
                _grads(m, step)
                o.step()
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
        assert same == attached


def test_elements_without_a_warmup_gradient_and_frozen_params_stay_put():
    """An embedding row no warm-up batch used has a frozen variance of 0:
    compression gives its momentum +-scale, which must not move it (it would
    by lr * scale / eps). A param that does not train is left alone."""
    torch.manual_seed(0)
    emb, head, frozen = torch.nn.Embedding(64, 8), torch.nn.Linear(8, 3), torch.nn.Linear(3, 3)
    frozen.requires_grad_(False)
    params = [*emb.parameters(), *head.parameters(), *frozen.parameters()]
    opt = OneBitAdam(params, lr=1e-2, freeze_step=3)
    before = emb.weight.detach().clone(), [p.detach().clone() for p in frozen.parameters()]
    for step in range(10):
        gen = torch.Generator().manual_seed(step)
        idx = torch.randint(0, 32, (16,), generator=gen)  # rows 32-63 never used
        opt.zero_grad()
        frozen(head(emb(idx))).pow(2).mean().backward()
        opt.step()
    assert torch.equal(emb.weight[32:], before[0][32:])
    assert not torch.equal(emb.weight[:32], before[0][:32])
    assert all(torch.equal(p, q) for p, q in zip(frozen.parameters(), before[1]))
    assert all(torch.isfinite(p).all() for p in params)


def test_state_dict_after_the_freeze_resumes_the_same_run():
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    for step in range(5):
        _grads(model, step)
        opt.step()
    saved_params = [p.detach().clone() for p in model.parameters()]
    # a deep copy, as torch.save would write it (state_dict() holds references to the live state)
    sd = torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, opt.state_dict())
    assert sd["onebit"]["world_size"] == 1 and sd["onebit"]["errors"][0][0].abs().sum() > 0
    for step in range(5, 9):
        _grads(model, step)
        opt.step()
    expected = [p.detach().clone() for p in model.parameters()]
    resumed = _model()
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), saved_params):
            p.copy_(q)
    opt2 = OneBitAdam(resumed.parameters(), lr=1e-2, freeze_step=2)
    opt2.load_state_dict(sd)
    for step in range(5, 9):
        _grads(resumed, step)
        opt2.step()
    for p, q in zip(resumed.parameters(), expected):
        assert torch.equal(p, q)


def test_bf16_params_with_master_weights():
    torch.manual_seed(0)
    model = _model().to(torch.bfloat16)
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2, master_weights=True)
    for step in range(6):
        _grads(model, step)
        opt.step()
    for p in model.parameters():
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and torch.equal(p, master.to(torch.bfloat16))


def test_an_overflow_skips_the_step_and_keeps_the_errors():
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=1)
    for step in range(3):
        _grads(model, step)
        opt.step()
    worker_error = lambda: opt.error_state()["errors"][0][0]
    before = ([p.detach().clone() for p in model.parameters()], worker_error(), opt.steps_done)
    _grads(model, 3)
    opt.step(found_inf=1.0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before[0]))
    assert torch.equal(worker_error(), before[1]) and opt.steps_done == before[2]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(freeze_step=-1), "freeze_step=-1: must be an int >= 1"),
        (dict(freeze_step=0), "freeze_step=0"),
        (dict(freeze_step=2.5), "freeze_step=2.5"),
        (dict(amsgrad=True), "amsgrad"),
        (dict(eps_inside_sqrt=True), "eps_inside_sqrt"),
        (dict(max_grad_norm=-1.0), "max_grad_norm"),
        (dict(lr=-1.0), "learning rate -1.0"),
    ],
)
def test_bad_arguments_name_the_problem(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OneBitAdam(_model().parameters(), **kwargs)


def _cfg(stage=0, **params):
    return {
        "train_batch_size": 8,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "OneBitAdam", "params": params},
    }


@pytest.mark.parametrize(
    "config,error,match",
    [
        (_cfg(freeze_step=-1), ConfigError, r"freeze_step = -1: must be >= 0"),
        (_cfg(freeze_step=0), ConfigError, r"freeze_step = 0: must be >= 1"),
        (_cfg(stage=2), ConfigNotSupported, r"OneBitAdam works with zero_optimization.stage 0 or 1 \(stage is 2\)"),
        (_cfg(stage=3), ConfigNotSupported, r"stage is 3"),
        (
            {**_cfg(stage=1), "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
            ConfigNotSupported,
            "OneBitAdam with offload_optimizer",
        ),
        (_cfg(freeze_steps=10), ConfigError, r"did you mean 'freeze_step'\?"),
    ],
)
def test_bad_configs(config, error, match):
    with pytest.raises(error, match=match):
        load_config(config)


def test_deepspeed_config_keys_are_accepted():
    """DeepSpeed's 1-bit Adam configs name a comm backend: any works here."""
    cfg = load_config(_cfg(freeze_step=10, comm_backend_name="nccl", cuda_aware=False))
    assert cfg.optimizer.type == "OneBitAdam" and cfg.optimizer.params["freeze_step"] == 10


def _train(tmp_path, name, runs, world=4, timeout=600):
    for run in runs:
        run["out"] = str(tmp_path / run.pop("name"))
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps(runs))
    run_ranks(TRAIN, world, [spec], timeout=timeout)
    return lambda run_name, rank=0: torch.load(tmp_path / f"{run_name}.rank{rank}.pt", weights_only=False)


def _close_to_adam(res, adam, run):
    """Within 5% of AdamW's held-out loss (or better)."""
    assert res["eval_loss"] <= 1.05 * adam["eval_loss"], (run, res["eval_loss"], adam["eval_loss"])


STEPS = 200


def test_four_ranks_converge_like_adam_at_stages_0_and_1(tmp_path):
    """Fixed seeds, deterministic data: 1-bit Adam's loss after a few hundred
    steps is within 5% of AdamW's, every rank holds the same params, and
    after freeze_step the gradient traffic is sign bits."""
    runs = [
        dict(name="adam", optimizer="AdamW", steps=STEPS),
        dict(name="onebit0", optimizer="OneBitAdam", stage=0, steps=STEPS),
        dict(name="onebit1", optimizer="OneBitAdam", stage=1, steps=STEPS),
    ]
    load = _train(tmp_path, "converge", runs)
    adam = load("adam")
    assert adam["eval_loss"] < 0.1 * adam["losses"][0]  # the task is learnt
    for run in ("onebit0", "onebit1"):
        res = [load(run, r) for r in range(4)]
        _close_to_adam(res[0], adam, run)
        for other in res[1:]:  # the same model everywhere
            assert all(torch.equal(other["params"][k], v) for k, v in res[0]["params"].items())
    # stage 0 after the freeze: only the compressed exchange (and scalars), no gradient all-reduce
    sent, numel = load("onebit0")["sent"], load("onebit0")["numel"]
    assert "all_reduce" not in sent or sent["all_reduce"] < 100 * (STEPS - 21)
    fp16_allreduce = 2 * numel * 2 * 3 / 4  # one fp16 ring all-reduce of the params' size, per step
    per_step = (sent["all_to_all"] + sent["all_gather"]) / (STEPS - 21)
    assert per_step <= fp16_allreduce / 16 + 64 * 4, (per_step, fp16_allreduce)
    # stage 1: the gradient reduce-scatter is compressed; the param all-gather stays
    mem = load("onebit1")["memory"]
    assert mem["compression_errors"] > 0


def test_bf16_and_fp16_and_standalone_converge(tmp_path):
    runs = [
        dict(name="adam", optimizer="AdamW", steps=STEPS),
        dict(name="bf16", optimizer="OneBitAdam", dtype="bf16", steps=STEPS),
        dict(name="fp16", optimizer="OneBitAdam", dtype="fp16", stage=1, steps=STEPS),
        dict(name="alone", optimizer="OneBitAdam", standalone=True, steps=STEPS),
        dict(name="alone_scaled", optimizer="OneBitAdam", standalone=True, rank_scale=True, steps=STEPS),
        # gradients far below fp16's normal range once unscaled: only the loss scale keeps them
        dict(name="adam_small", optimizer="AdamW", loss_mult=1e-6, steps=STEPS),
        dict(
            name="fp16_small",
            optimizer="OneBitAdam",
            dtype="fp16",
            stage=1,
            scale_power=20,
            loss_mult=1e-6,
            steps=STEPS,
        ),
    ]
    load = _train(tmp_path, "precisions", runs)
    adam = load("adam")
    for run in ("bf16", "fp16", "alone"):
        res = load(run)
        _close_to_adam(res, adam, run)
        assert all(torch.equal(load(run, 3)["params"][k], v) for k, v in res["params"].items())
    _close_to_adam(load("fp16_small"), load("adam_small"), "fp16_small")
    alone = load("alone")["sent"]
    assert "all_reduce" not in alone or alone["all_reduce"] < 100 * (STEPS - 21)
    # each rank unscales by its own grad_scale: powers of two, so exactly the unscaled run
    for rank in range(4):
        scaled, plain = load("alone_scaled", rank)["params"], load("alone", rank)["params"]
        assert all(torch.equal(scaled[k], v) for k, v in plain.items())


@pytest.mark.parametrize("stage", [0, 1])
def test_checkpoint_after_freeze_resumes_the_same_run(tmp_path, stage):
    ckpt = str(tmp_path / "ckpt")
    runs = [
        dict(name="straight", optimizer="OneBitAdam", stage=stage, steps=40, freeze=10),
        dict(name="first", optimizer="OneBitAdam", stage=stage, steps=25, freeze=10, save_at=25, save=ckpt),
        dict(name="resumed", optimizer="OneBitAdam", stage=stage, steps=40, freeze=10, start=25, load=ckpt),
    ]
    load = _train(tmp_path, "resume", runs, world=2)
    for rank in range(2):
        straight, resumed = load("straight", rank), load("resumed", rank)
        assert resumed["losses"] == straight["losses"][25:]
        assert all(torch.equal(resumed["params"][k], v) for k, v in straight["params"].items())
        assert resumed["load_warnings"] == []
    # at another world size the optimizer state moves, the error buffers restart from zero, and it says so
    runs = [dict(name="one", optimizer="OneBitAdam", stage=stage, steps=27, freeze=10, start=25, load=ckpt)]
    one = _train(tmp_path, "one", runs, world=1)("one")
    assert any("error-feedback buffers" in w for w in one["load_warnings"]), one["load_warnings"]
