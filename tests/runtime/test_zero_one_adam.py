"""ZeroOneAdam (0/1 Adam): its policies, the optimizer on one process and on
2 Gloo ranks against a plain-PyTorch reference of DeepSpeed's math
(tests/runtime/onebit_family_reference.py), the engine's convergence against
AdamW, a checkpoint that resumes the same run, and the refusals."""

import json

import pytest
import torch

from fastzero.config import ConfigError, ConfigNotSupported, load_config
from fastzero.ops import FusedAdam
from fastzero.runtime.zero_one_adam import ZeroOneAdam, is_variance_step, local_step_interval
from tests.dist import run_ranks
from tests.runtime import onebit_family_reference as ref
from tests.runtime.test_zero_engine import WORKER

FAMILY = WORKER.parent / "onebit_family.py"
TRAIN = WORKER.parent / "train_onebit.py"
POLICY = dict(var_freeze_step=12, var_update_scaler=3, local_step_scaler=3, local_step_clipper=4)


def test_policies_follow_deepspeeds_counters():
    """The variance steps and the local-step interval, from their closed
    forms, against DeepSpeed's counters run step by step."""
    for freeze, scaler in ((40, 3), (100, 1), (7, 16), (300, 5)):
        interval, counter, steps = 1, 0, []
        for t in range(1, freeze + 20):
            if t <= freeze and t % interval == 0:
                steps.append(t)
                counter += 1
                if counter == scaler:
                    counter, interval = 0, interval * 2
        assert [t for t in range(1, freeze + 20) if is_variance_step(t, freeze, scaler)] == steps
    for scaler, clipper in ((1, 16), (3, 5), (4, 1), (2, 64)):
        interval, counter = 1, 0
        for t in range(11, 300):
            assert local_step_interval(t, 10, scaler, clipper) == interval, (t, scaler, clipper)
            counter += 1
            if counter == scaler:
                counter, interval = 0, min(clipper, interval * 2)


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def test_one_process_is_adamw_then_its_reference():
    """Two param groups at different lrs, weight decay: the first
    var_update_scaler steps are all variance steps, FusedAdam's AdamW without
    bias correction bit for bit; then every param after every step equals the
    reference's (compressed momentum steps, then local steps with syncs)."""
    kwargs = dict(weight_decay=0.1, betas=(0.9, 0.99), **POLICY)
    model, twin, simulated = ref.model(), ref.model(), ref.model()
    opt = ZeroOneAdam(ref.param_groups(model), **kwargs)
    adam = FusedAdam(ref.param_groups(twin), bias_correction=False, weight_decay=0.1, betas=(0.9, 0.99))
    reference = ref.ZeroOneAdamRef([simulated], wd=0.1, betas=(0.9, 0.99), **POLICY)
    kinds = []
    for step in range(32):
        for m in (model, twin, simulated):
            ref.set_grads(m, 0, step)
        kinds.append(opt.compressing)
        opt.step()
        reference.step()
        if step < POLICY["var_update_scaler"]:
            adam.step()
            for p, q in zip(model.parameters(), twin.parameters()):
                assert torch.equal(p, q), step
        _close(ref.flat(model.parameters()), ref.flat(simulated.parameters()), f"step {step + 1}")
    assert opt.steps_done == 32
    # variance steps (not compressing) at 1, 2, 3, then 4, 6, 8, then 12; local steps after 12
    assert [t + 1 for t, c in enumerate(kinds) if not c] == [1, 2, 3, 4, 6, 8, 12]
    assert all(torch.equal(opt.state[p]["synced_param"], p) for p in model.parameters())  # t=32 synced (H=4)


def test_two_ranks_against_the_reference(tmp_path):
    """2 Gloo ranks, each on its own data: uncompressed averages at the
    variance steps, the compressed average of the gradients between them,
    then local steps (the ranks' params differ) and compressed syncs (they
    agree again), every rank's params after every step as the reference's."""
    kwargs = dict(weight_decay=0.05, **POLICY)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"optimizer": "ZeroOneAdam", "kwargs": kwargs, "steps": 28, "out": str(tmp_path / "z")}))
    run_ranks(FAMILY, 2, [spec], timeout=300)
    got = [torch.load(tmp_path / f"z.rank{r}.pt")["params"] for r in range(2)]
    models = [ref.model(), ref.model()]
    reference = ref.ZeroOneAdamRef(models, wd=0.05, **POLICY)
    apart = 0
    for step in range(28):
        for r, m in enumerate(models):
            ref.set_grads(m, r, step)
        reference.step()
        for r in range(2):
            _close(got[r][step], ref.flat(models[r].parameters()), f"rank {r} step {step + 1}")
        apart += not torch.equal(got[0][step], got[1][step])
    # local steps 13-15 (H=1: synced), 16-18 (H=2: 17 apart), 19-28 (H=4: 19, 21-23, 25-27 apart)
    assert apart == 1 + 7 and torch.equal(got[0][-1], got[1][-1])


def test_elements_without_a_gradient_and_frozen_params_stay_put():
    """Embedding rows no variance step saw have variance 0: compression
    gives their momentum +-scale, which must not move them (it would by
    lr * scale / eps), in the momentum steps or the local ones. (Rows with a
    tiny variance do move far under compression, in DeepSpeed's too: a small
    lr keeps this run finite.)"""
    torch.manual_seed(0)
    emb, head, frozen = torch.nn.Embedding(64, 8), torch.nn.Linear(8, 3), torch.nn.Linear(3, 3)
    frozen.requires_grad_(False)
    params = [*emb.parameters(), *head.parameters(), *frozen.parameters()]
    opt = ZeroOneAdam(params, lr=1e-4, **POLICY)
    before = emb.weight.detach().clone(), [p.detach().clone() for p in frozen.parameters()]
    for step in range(24):
        idx = torch.randint(0, 32, (16,), generator=torch.Generator().manual_seed(step))  # rows 32-63 never used
        opt.zero_grad()
        frozen(head(emb(idx))).pow(2).mean().backward()
        opt.step()
    assert torch.equal(emb.weight[32:], before[0][32:])
    assert not torch.equal(emb.weight[:32], before[0][:32])
    assert all(torch.equal(p, q) for p, q in zip(frozen.parameters(), before[1]))
    assert all(torch.isfinite(p).all() for p in params)


def test_state_dict_mid_interval_resumes_the_same_run():
    """Saved between syncs (t=17, H=2): the accumulator and the sum of lrs come back with the errors."""
    model = ref.model()
    opt = ZeroOneAdam(ref.param_groups(model), **POLICY)
    for step in range(17):
        ref.set_grads(model, 0, step)
        opt.step()
    sd = torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, opt.state_dict())
    saved = [p.detach().clone() for p in model.parameters()]
    assert sd["onebit"]["extra"]["lrs"][0] == ref.LRS[0]
    for step in range(17, 22):
        ref.set_grads(model, 0, step)
        opt.step()
    expected = ref.flat(model.parameters())
    resumed = ref.model(seed=5)
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), saved):
            p.copy_(q)
    opt2 = ZeroOneAdam(ref.param_groups(resumed), **POLICY)
    opt2.load_state_dict(sd)
    for step in range(17, 22):
        ref.set_grads(resumed, 0, step)
        opt2.step()
    assert torch.equal(ref.flat(resumed.parameters()), expected)


def test_bf16_params_with_master_weights():
    model = ref.model().to(torch.bfloat16)
    opt = ZeroOneAdam(model.parameters(), lr=1e-2, master_weights=True, **POLICY)
    for step in range(20):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 12, generator=gen).bfloat16(), torch.randn(16, 3, generator=gen)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
    for p in model.parameters():
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and torch.equal(p, master.to(torch.bfloat16))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(amsgrad=True), "amsgrad"),
        (dict(bias_correction=True), "bias_correction=True"),
        (dict(eps_inside_sqrt=True), "eps_inside_sqrt"),
        (dict(var_freeze_step=0), "var_freeze_step=0: must be an int >= 1"),
        (dict(var_update_scaler=1.5), "var_update_scaler=1.5"),
        (dict(local_step_scaler=0), "local_step_scaler=0"),
        (dict(local_step_clipper=-2), "local_step_clipper=-2"),
        (dict(max_grad_norm=-1.0), "max_grad_norm"),
    ],
)
def test_bad_arguments_name_the_problem(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroOneAdam(ref.model().parameters(), **kwargs)


def _cfg(stage=0, **params):
    return {
        "train_batch_size": 8,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "ZeroOneAdam", "params": params},
    }


@pytest.mark.parametrize(
    "config,error,match",
    [
        (_cfg(amsgrad=True), ConfigNotSupported, "amsgrad"),
        (_cfg(bias_correction=True), ConfigNotSupported, "bias_correction = true: ZeroOneAdam's math has none"),
        (_cfg(var_freeze_step=0), ConfigError, "var_freeze_step = 0: must be >= 1"),
        (_cfg(local_step_clipper=0), ConfigError, "local_step_clipper = 0"),
        (_cfg(stage=1), ConfigNotSupported, r"stage 1 with local_step_clipper 16: .* set optimizer.params.local_step"),
        (_cfg(stage=2), ConfigNotSupported, r"ZeroOneAdam works with zero_optimization.stage 0 or 1 \(stage is 2\)"),
        (  # offload: stage 0 has nothing partitioned to offload, and at stage 1 it is refused by name
            {**_cfg(), "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
            ConfigError,
            "offload_optimizer needs stage >= 1",
        ),
        (
            {**_cfg(), "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
            ConfigNotSupported,
            r"ZeroOneAdam with offload_optimizer",
        ),
        (_cfg(var_freez_step=10), ConfigError, r"did you mean 'var_freeze_step'\?"),
    ],
)
def test_bad_configs(config, error, match):
    with pytest.raises(error, match=match):
        load_config(config)


def test_deepspeed_config_is_accepted():
    """DeepSpeed's 0/1 Adam tutorial config."""
    params = dict(lr=1e-3, weight_decay=0.01, bias_correction=False, var_freeze_step=1000)
    params.update(var_update_scaler=16, local_step_scaler=1000, local_step_clipper=16, cuda_aware=False)
    params.update(comm_backend_name="nccl")
    cfg = load_config(_cfg(**params))
    assert cfg.optimizer.type == "ZeroOneAdam" and cfg.optimizer.params["local_step_scaler"] == 1000


def _train(tmp_path, name, runs, world=2):
    for run in runs:
        run["out"] = str(tmp_path / run.pop("name"))
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps(runs))
    run_ranks(TRAIN, world, [spec], timeout=600)
    return lambda run_name, rank=0: torch.load(tmp_path / f"{run_name}.rank{rank}.pt", weights_only=False)


# var_freeze_step is meant to be the end of the lr warm-up; without one, this short run needs a long variance phase
# (77 variance steps of 150) to stay close to AdamW: frozen early, the variance, without bias correction, is small
ENGINE = dict(var_freeze_step=150, var_update_scaler=32, local_step_scaler=20, local_step_clipper=4)


def test_engine_converges_like_adamw(tmp_path):
    """Under the engine (stage 0, fp32 and bf16, 2 ranks): the held-out loss
    after 200 steps within 10% of AdamW's (without bias correction, as 0/1
    Adam), every rank with the same params at the end (a sync step), and
    the local steps send no gradient all-reduce."""
    steps = 200  # 200 = 0 mod H=4: the last step syncs
    runs = [
        dict(name="adam", optimizer="AdamW", steps=steps, params=dict(bias_correction=False)),
        dict(name="zo", optimizer="ZeroOneAdam", steps=steps, params=ENGINE, freeze=150),
        dict(name="zo_bf16", optimizer="ZeroOneAdam", dtype="bf16", steps=steps, params=ENGINE, freeze=150),
    ]
    load = _train(tmp_path, "converge", runs)
    adam = load("adam")
    assert adam["eval_loss"] < 0.1 * adam["losses"][0]  # the task is learnt
    for run in ("zo", "zo_bf16"):
        res = [load(run, r) for r in range(2)]
        assert res[0]["eval_loss"] <= 1.10 * adam["eval_loss"], (run, res[0]["eval_loss"], adam["eval_loss"])
        assert all(torch.equal(res[1]["params"][k], v) for k, v in res[0]["params"].items())
    sent = load("zo")["sent"]  # after step 151: local steps, a compressed sync every H (and scalars)
    assert "all_reduce" not in sent or sent["all_reduce"] < 100 * (steps - 151)
    assert load("zo")["memory"]["compression_errors"] > 0


def test_engine_checkpoint_resumes_the_same_run(tmp_path):
    """Saved at a sync in the local phase (t=28, H=2 there): the resumed run
    is the straight one, loss for loss and bit for bit, on both ranks.
    Saved between two syncs, it resumes from rank 0's params on every rank."""
    ckpt = str(tmp_path / "ckpt")
    params = dict(var_freeze_step=20, var_update_scaler=2, local_step_scaler=4, local_step_clipper=4)
    runs = [
        dict(name="straight", optimizer="ZeroOneAdam", steps=36, params=params, freeze=20),
        dict(name="first", optimizer="ZeroOneAdam", steps=28, params=params, freeze=20, save_at=28, save=ckpt),
        dict(name="resumed", optimizer="ZeroOneAdam", steps=36, params=params, freeze=20, start=28, load=ckpt),
    ]
    load = _train(tmp_path, "resume", runs)
    for rank in range(2):
        straight, resumed = load("straight", rank), load("resumed", rank)
        assert resumed["losses"] == straight["losses"][28:]
        assert all(torch.equal(resumed["params"][k], v) for k, v in straight["params"].items())
        assert resumed["load_warnings"] == []
    # saved between syncs (t=30, H=4): rank 0's params become every rank's sync point; the ranks agree again at the
    # next sync and the run goes on close to the straight one
    runs = [
        dict(name="mid", optimizer="ZeroOneAdam", steps=30, params=params, freeze=20, save_at=30, save=ckpt + "2"),
        dict(name="after", optimizer="ZeroOneAdam", steps=36, params=params, freeze=20, start=30, load=ckpt + "2"),
    ]
    load = _train(tmp_path, "mid", runs)
    after = [load("after", r) for r in range(2)]
    assert all(torch.equal(after[1]["params"][k], v) for k, v in after[0]["params"].items())
    assert after[0]["eval_loss"] <= 1.05 * load("straight")["eval_loss"]


def test_stage_1_syncs_every_step_and_converges_like_adamw(tmp_path):
    """At ZeRO stage 1 (local_step_clipper 1: no local steps, which would
    need every rank's whole state): the variance steps are stage 0's AdamW,
    the others take the compressed average of the gradients, the held-out
    loss is within 25% of AdamW's (measured: +20%, against +6% at stage 0
    syncing every step: one compression scale per chunk of gradients,
    rather than of the smoother momenta, loses more), every rank holds the
    same params, the state is partitioned, and a checkpoint resumes the
    same run."""
    steps, ckpt = 200, str(tmp_path / "ckpt")
    params = dict(ENGINE, local_step_clipper=1)
    runs = [
        dict(name="adam", optimizer="AdamW", steps=steps, params=dict(bias_correction=False)),
        dict(name="zo1", optimizer="ZeroOneAdam", stage=1, steps=steps, params=params, freeze=150),
        dict(name="zo1_bf16", optimizer="ZeroOneAdam", stage=1, dtype="bf16", steps=steps, params=params, freeze=150),
        dict(name="first", optimizer="ZeroOneAdam", stage=1, steps=160, params=params, save_at=160, save=ckpt),
        dict(name="resumed", optimizer="ZeroOneAdam", stage=1, steps=steps, params=params, start=160, load=ckpt),
    ]
    load = _train(tmp_path, "stage1", runs)
    adam = load("adam")
    for run in ("zo1", "zo1_bf16"):
        res = [load(run, r) for r in range(2)]
        assert res[0]["eval_loss"] <= 1.25 * adam["eval_loss"], (run, res[0]["eval_loss"], adam["eval_loss"])
        assert all(torch.equal(res[1]["params"][k], v) for k, v in res[0]["params"].items())
    mem, numel = load("zo1")["memory"], load("zo1")["numel"]
    assert mem["compression_errors"] > 0 and mem["optimizer"] < 0.6 * 2 * 4 * numel, (mem, numel)
    for rank in range(2):
        straight, resumed = load("zo1", rank), load("resumed", rank)
        assert resumed["losses"] == straight["losses"][160:]
        assert all(torch.equal(resumed["params"][k], v) for k, v in straight["params"].items())
    # the first 2 steps are variance steps (I = 1): AdamW without bias correction on the averaged gradient
    first = [
        dict(name=n, optimizer=o, stage=st, steps=2, params=p)
        for n, o, st, p in [("adam2", "AdamW", 1, dict(bias_correction=False)), ("zo2", "ZeroOneAdam", 1, params)]
    ]
    load = _train(tmp_path, "first", first)
    for k, v in load("adam2")["params"].items():
        torch.testing.assert_close(load("zo2")["params"][k], v, rtol=1e-6, atol=1e-7)


def test_state_step_follows_every_kind_of_step():
    """state[p]["step"] (what torch's optimizers keep and scripts read) is
    the group's count after variance, momentum and local steps alike."""
    model = torch.nn.Linear(4, 3)
    opt = ZeroOneAdam(model.parameters(), var_freeze_step=4, var_update_scaler=1, local_step_scaler=2)
    for t in range(1, 9):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        assert all(float(opt.state[p]["step"]) == t for p in model.parameters()), t
