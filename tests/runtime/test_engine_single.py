"""The flat layout, and the engine in one process: the client optimizers it
takes over, param groups, schedules, monitoring and its errors."""

import csv
import re

import pytest
import torch

import fastzero
from fastzero.comm import FlatLayout
from fastzero.comm.layout import ALIGN
from fastzero.config import ConfigError, ConfigNotSupported
from fastzero.ops import FusedLamb
from fastzero.runtime.onebit_adam import OneBitAdam
from fastzero.runtime.onebit_lamb import OneBitLamb
from fastzero.runtime.zero_one_adam import ZeroOneAdam
from tests.test_config import REFUSED, zero_section
from tests.workers.train_zero import make_model


@pytest.mark.parametrize(
    "numels, world, bucket", [([5, 700, 33, 1], 2, 256), ([4096], 4, 1000), ([3], 3, 10**9), ([100] * 20, 4, 64)]
)
def test_layout_covers_every_element_once(numels, world, bucket):
    lay = FlatLayout(numels, world, bucket)
    assert lay.numel == sum(numels) and lay.total % (world * ALIGN) == 0
    assert all(b.size == world * b.chunk and b.chunk % ALIGN == 0 for b in lay.buckets)
    assert all(b.size <= max(bucket, world * ALIGN) for b in lay.buckets)
    assert lay.shard_size * world == lay.total
    # every element of every param is owned by exactly one rank, at a distinct shard position
    owners = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for rank in range(world):
        used = torch.zeros(lay.shard_size, dtype=torch.int64)
        for s in lay.segments(rank):
            owners[s.param][s.lo : s.hi] += 1
            used[s.shard_offset : s.shard_offset + s.hi - s.lo] += 1
            b = next(b for b in lay.buckets if b.shard_start <= s.shard_offset < b.shard_start + b.chunk)
            flat_lo = lay.offsets[s.param] + s.lo
            assert flat_lo - b.owned(rank)[0] == s.shard_offset - b.shard_start  # shard position = chunk position
        assert used.max() <= 1
    assert all(bool((o == 1).all()) for o in owners)
    assert lay.offsets[-1] == 0  # the last param first: backward's order


def cfg(**over):
    base = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    base.update(over)
    return base


def batches(n, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 33, generator=gen), torch.randn(8, 17, generator=gen)) for _ in range(n)]


@pytest.mark.parametrize("client", ["Adam", "AdamW", "factory"])
def test_a_torch_optimizer_is_taken_over_with_its_math(client):
    model, ref = make_model(), make_model()
    groups = lambda m: [
        {"params": list(m[0].parameters()), "weight_decay": 0.2},
        {"params": list(m[2].parameters()) + list(m[3].parameters()), "lr": 3e-3},
    ]
    cls = torch.optim.Adam if client == "Adam" else torch.optim.AdamW
    opt = (lambda params: cls(params, lr=1e-2)) if client == "factory" else cls(groups(model), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1}}
    given = groups(model) if client == "factory" else None
    engine, eopt, _, _ = fastzero.initialize(model=model, optimizer=opt, config=config, model_parameters=given)
    ropt = cls(groups(ref), lr=1e-2)
    assert [g["lr"] for g in eopt.param_groups] == [1e-2, 3e-3]
    for x, y in batches(5):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        ropt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ropt.step()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_config_scheduler_drives_the_engine_lr():
    sched = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"},
    }
    engine, _, _, lr_scheduler = fastzero.initialize(model=make_model(), config=cfg(scheduler=sched))
    lrs = []
    for x, y in batches(5):
        lrs.append(engine.get_lr()[0])
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    # DeepSpeed's sequence: the constructor's lr (t = -1 gives warmup_min_lr), then t = 0, 1, ... after each step
    assert lrs == pytest.approx([0.0, 0.0, 0.0025, 0.005, 0.0075])
    assert lr_scheduler is engine.lr_scheduler


def test_monitor_writes_csv_every_steps_per_print(tmp_path):
    config = cfg(
        steps_per_print=2,
        wall_clock_breakdown=True,
        csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "job"},
    )
    engine, *_ = fastzero.initialize(model=make_model(), config=config)
    for x, y in batches(5):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    engine.monitor.close()
    rows = list(csv.DictReader((tmp_path / "job" / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == [2, 4]
    for r in rows:
        assert float(r["loss"]) > 0 and float(r["grad_norm"]) > 0 and float(r["samples_per_sec"]) > 0
        assert float(r["lr"]) == 1e-2 and float(r["backward_ms"]) > 0 and float(r["peak_memory_mb"]) > 0


def test_tensorboard_logs_deepspeed_tags(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = cfg(steps_per_print=1, tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "tb"})
    engine, *_ = fastzero.initialize(model=make_model(), config=config)
    for x, y in batches(3):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    engine.monitor.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    losses = acc.Scalars("Train/Samples/train_loss")
    assert [e.step for e in losses] == [8, 16, 24] and all(e.value > 0 for e in losses)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(config={"train_micro_batch_size_per_gpu": 8}), ConfigError, "no optimizer"),
        (dict(config=cfg(), optimizer=torch.optim.SGD), ConfigError, "keep one"),
        (dict(config={"train_micro_batch_size_per_gpu": 8}, optimizer="sgd"), ConfigError, "callable"),
        (
            dict(config=cfg(optimizer={"type": "Lamb"}, zero_optimization={"stage": 2})),
            ConfigNotSupported,
            "trust ratio",
        ),
        (
            dict(config=cfg(zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}})),
            ConfigError,
            "offload_param needs offload_optimizer",
        ),
        (
            dict(config=cfg(optimizer={"type": "OneBitAdam"}, zero_optimization={"stage": 2})),
            ConfigNotSupported,
            "OneBitAdam works with zero_optimization.stage 0 or 1",
        ),
        (dict(config=cfg(optimizer={"type": "AdamW", "params": {"lr": -1}})), ConfigError, "lr = -1"),
    ],
)
def test_initialize_errors_name_the_problem(kwargs, error, match):
    with pytest.raises(error, match=match):
        fastzero.initialize(model=make_model(), **kwargs)


CLIENT_OPTIMIZERS = {
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
    "Lamb": FusedLamb,
    "OneBitAdam": OneBitAdam,
    "ZeroOneAdam": ZeroOneAdam,
    "OneBitLamb": OneBitLamb,
}


@pytest.mark.parametrize("name, stage, offload, reason", REFUSED)
def test_a_passed_optimizer_is_held_to_the_same_table(name, stage, offload, reason):
    """The optimizer builder reads fastzero.config.OPTIMIZER_RULES too: an
    optimizer the script passes (which the config check never sees) is
    refused with the same reason."""
    model = make_model()
    client = CLIENT_OPTIMIZERS[name](model.parameters(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": zero_section(stage, offload)}
    with pytest.raises(ConfigNotSupported, match=re.escape(reason)):
        fastzero.initialize(model=model, optimizer=client, config=config)


def test_take_timers_reads_the_phase_times_and_restarts_them():
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg())
    for x, y in batches(2):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    times = engine.take_timers()
    assert set(times) == {"forward", "backward", "step"} and all(t > 0 for t in times.values())
    assert engine.take_timers() == dict.fromkeys(times, 0.0)


def test_untested_client_optimizer_is_refused_at_stage_1_without_deepspeeds_key():
    model = make_model()
    with pytest.raises(ConfigError, match="SGD at zero_optimization.stage 1.*zero_allow_untested_optimizer: true"):
        fastzero.initialize(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            config={"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1}},
        )


def test_loss_backward_instead_of_engine_backward_is_caught():
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": 2}))
    ((x, y),) = batches(1)
    torch.nn.functional.mse_loss(engine(x), y).backward()
    with pytest.raises(RuntimeError, match="engine.backward"):
        engine.step()


def test_training_data_gives_a_loader_of_micro_batches():
    data = torch.utils.data.TensorDataset(torch.randn(40, 33), torch.randn(40, 17))
    engine, _, loader, _ = fastzero.initialize(model=make_model(), config=cfg(), training_data=data)
    sizes = [len(x) for x, _ in loader]
    assert sizes == [8] * 5
    for x, y in loader:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    assert engine.global_steps == 5 and engine.global_samples == 40


def test_the_training_data_loader_shuffles_as_deepspeeds_with_one_rank_too():
    """DeepSpeed's loader (under a launcher, any world size) samples with
    DistributedSampler(shuffle=True, seed=0): the same order here."""
    data = torch.utils.data.TensorDataset(torch.arange(24))
    _, _, loader, _ = fastzero.initialize(model=make_model(), config=cfg(), training_data=data)
    seen = [int(i) for (batch,) in loader for i in batch]
    want = list(torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0))
    assert seen == want and seen != sorted(seen)
    loader.data_sampler.set_epoch(1)
    assert [int(i) for (batch,) in loader for i in batch] != seen  # DeepSpeed's way to reshuffle


def test_dataloader_drop_last_drops_the_short_micro_batch():
    data = torch.utils.data.TensorDataset(torch.randn(20, 33), torch.randn(20, 17))
    _, _, kept, _ = fastzero.initialize(model=make_model(), config=cfg(), training_data=data)
    config = cfg(dataloader_drop_last=True)
    _, _, dropped, _ = fastzero.initialize(model=make_model(), config=config, training_data=data)
    assert [len(x) for x, _ in kept] == [8, 8, 4]
    assert [len(x) for x, _ in dropped] == [8, 8]
