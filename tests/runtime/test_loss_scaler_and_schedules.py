"""The loss scaler and learning-rate schedules against DeepSpeed's
semantics: hand-worked sequences, and DeepSpeed's own classes side by side
where deepspeed is installed."""

import math
import os

import pytest
import torch

from fastzero.config import load_config
from fastzero.runtime.loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimum,
    StaticLossScaler,
    loss_scaler_from_config,
)
from fastzero.runtime.lr_schedules import SCHEDULES, LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR


def deepspeed_module(name):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        return __import__(name, fromlist=["_"])
    except Exception as exc:  # noqa: BLE001 - any import failure: the comparison is skipped
        pytest.skip(f"deepspeed not importable ({type(exc).__name__}); the hand-worked tests still run")


def test_dynamic_scaler_hand_worked():
    s = DynamicLossScaler(init_scale=1024, scale_window=3, min_scale=1, hysteresis=2)
    scales = []
    for overflow in [True, True, False, False, False, False, True, True]:
        s.update(overflow)
        scales.append(s.loss_scale)
    # 1st overflow eats the hysteresis, 2nd halves; 3 clean steps after it (counting from the 2nd clean) double
    assert scales == [1024, 512, 512, 512, 512, 1024, 1024, 512]


def test_overflow_at_the_minimum_raises():
    s = DynamicLossScaler(init_scale=2, scale_window=100, min_scale=1, hysteresis=1)
    s.update(True)
    assert s.loss_scale == 1
    with pytest.raises(LossScaleAtMinimum, match="min_loss_scale"):
        s.update(True)


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_dynamic_scaler_matches_deepspeed(consecutive, hysteresis, monkeypatch):
    ds = deepspeed_module("deepspeed.runtime.fp16.loss_scaler")
    monkeypatch.setattr(ds.dist, "get_rank", lambda: 0)
    theirs = ds.DynamicLossScaler(
        init_scale=2.0**16,
        scale_window=4,
        min_scale=1.0,
        delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive,
        raise_error_at_min_scale=False,
    )
    ours = DynamicLossScaler(
        init_scale=2.0**16,
        scale_window=4,
        min_scale=1.0,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        raise_at_min=False,
    )
    gen = torch.Generator().manual_seed(hysteresis + 10 * consecutive)
    for _ in range(200):
        overflow = bool(torch.rand((), generator=gen) < 0.3)
        theirs.update_scale(overflow)
        ours.update(overflow)
        assert ours.loss_scale == theirs.cur_scale


def test_scaler_from_config():
    fp16 = load_config({"train_batch_size": 1, "fp16": {"enabled": True, "initial_scale_power": 12}}).fp16
    s = loss_scaler_from_config(fp16)
    assert isinstance(s, DynamicLossScaler) and s.loss_scale == 4096 and s.hysteresis == 2
    static = loss_scaler_from_config(load_config({"train_batch_size": 1, "fp16": {"loss_scale": 128}}).fp16)
    assert isinstance(static, StaticLossScaler) and static.loss_scale == 128


def optimizer(lrs=(0.1, 0.2)):
    """An optimizer with betas (so OneCycle cycles momentum) and two groups."""
    return torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs])


def lrs_over(sched, opt, steps):
    """lr and beta1 of every group, before the first step and after each."""
    out = [[v for g in opt.param_groups for v in (g["lr"], g["betas"][0])]]
    for _ in range(steps):
        sched.step()
        out.append([v for g in opt.param_groups for v in (g["lr"], g["betas"][0])])
    return out


def test_warmup_lr_hand_worked():
    opt = optimizer()
    lrs = lrs_over(WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10), opt, 12)
    assert lrs[0][0::2] == [0.0, 0.0]  # before the first step
    assert lrs[1][0] == 0.0 and lrs[3][0] == pytest.approx(math.log(3) / math.log(10))
    assert lrs[11][0] == 1.0 and lrs[12][0::2] == [1.0, 1.0]
    linear = optimizer()
    lin = lrs_over(WarmupLR(linear, 0.0, 1.0, 10, "linear"), linear, 5)
    assert [x[0] for x in lin[1:]] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    own = optimizer()
    tops = [g["lr"] for g in own.param_groups]
    assert len(set(tops)) > 1
    ends = lrs_over(WarmupLR(own, warmup_num_steps=4, warmup_type="linear"), own, 6)[-1]
    assert ends[0::2] == tops  # warmup_max_lr None: each group warms up to its own lr


@pytest.mark.parametrize(
    "ours, theirs_name, kwargs",
    [
        (WarmupLR, "WarmupLR", dict(warmup_min_lr=0.01, warmup_max_lr=0.5, warmup_num_steps=7)),
        (WarmupLR, "WarmupLR", dict(warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=1, warmup_type="linear")),
        (WarmupLR, "WarmupLR", dict(warmup_num_steps=6)),  # up to each group's own lr
        (WarmupDecayLR, "WarmupDecayLR", dict(total_num_steps=30, warmup_max_lr=0.3, warmup_num_steps=5)),
        (WarmupDecayLR, "WarmupDecayLR", dict(total_num_steps=9, warmup_num_steps=12, warmup_type="linear")),
        (WarmupCosineLR, "WarmupCosineLR", dict(total_num_steps=40, warmup_num_steps=6, warmup_min_ratio=0.1)),
        (
            WarmupCosineLR,
            "WarmupCosineLR",
            dict(total_num_steps=20, warmup_num_steps=3, cos_min_ratio=0.2, warmup_type="linear"),
        ),
        (LRRangeTest, "LRRangeTest", dict(lr_range_test_min_lr=0.01, lr_range_test_step_size=4)),
        (
            LRRangeTest,
            "LRRangeTest",
            dict(lr_range_test_step_size=3, lr_range_test_step_rate=2.0, lr_range_test_staircase=True),
        ),
        (OneCycle, "OneCycle", dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=10)),
        (
            OneCycle,
            "OneCycle",
            dict(
                cycle_min_lr=0.01,
                cycle_max_lr=0.1,
                cycle_first_step_size=8,
                cycle_second_step_size=12,
                decay_step_size=3,
                decay_lr_rate=0.5,
                decay_mom_rate=0.1,
                cycle_first_stair_count=4,
            ),
        ),
    ],
)
def test_schedules_match_deepspeed(ours, theirs_name, kwargs):
    ds = deepspeed_module("deepspeed.runtime.lr_schedules")
    opt_a, opt_b = optimizer(), optimizer()
    a = lrs_over(ours(opt_a, **kwargs), opt_a, 45)
    b = lrs_over(getattr(ds, theirs_name)(opt_b, **kwargs), opt_b, 45)
    assert sum(a, []) == pytest.approx(sum(b, []), rel=1e-12, abs=1e-15)


def test_schedule_state_dict_resumes():
    opt_a, opt_b = optimizer(), optimizer()
    a = WarmupDecayLR(opt_a, total_num_steps=50, warmup_num_steps=10)
    for _ in range(17):
        a.step()
    b = WarmupDecayLR(opt_b, total_num_steps=50, warmup_num_steps=10)
    b.load_state_dict(a.state_dict())
    a.step()
    b.step()
    assert [g["lr"] for g in opt_a.param_groups] == [g["lr"] for g in opt_b.param_groups]


@pytest.mark.parametrize("bad", [dict(warmup_num_steps=0), dict(warmup_type="cubic")])
def test_bad_schedule_arguments(bad):
    with pytest.raises(ValueError, match="warmup"):
        WarmupLR(optimizer(), **bad)


def test_one_cycle_keeps_each_groups_beta2():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], betas=(0.9, 0.95))
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4)
    for _ in range(6):
        sched.step()
    assert opt.param_groups[0]["betas"][1] == 0.95  # DeepSpeed's would be 0.99


def test_one_cycle_get_mom_is_deepspeeds():
    """get_mom: (beta1, beta2) per group at last_batch_iteration, what step() applies; None without cycling."""
    opt = optimizer()
    for group, beta2 in zip(opt.param_groups, (0.99, 0.95)):
        group["betas"] = (0.9, beta2)
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4, cycle_min_mom=0.8)
    seen = []
    for _ in range(9):
        sched.step()
        mom = sched.get_mom()
        assert mom == [tuple(g["betas"]) for g in opt.param_groups]
        assert [b2 for _, b2 in mom] == [0.99, 0.95]
        seen.append(mom[0][0])
    # beta1 falls from max_mom to min_mom over the first 4 steps, back over the next 4, then stays (no decay)
    assert seen == pytest.approx([0.875, 0.85, 0.825, 0.8, 0.825, 0.85, 0.875, 0.9, 0.9])
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert OneCycle(sgd, cycle_min_lr=0.01, cycle_max_lr=0.1).get_mom() is None
    no_cycle = OneCycle(optimizer(), cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_momentum=False)
    assert no_cycle.get_mom() is None


def test_every_configured_schedule_exists():
    from fastzero.config import SCHEDULER_PARAMS

    assert set(SCHEDULES) == set(SCHEDULER_PARAMS)
