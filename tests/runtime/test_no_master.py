"""bf16 params without an fp32 master (``bf16.bf16_master_weights_and_grads``,
docs/zero.md "bf16 params without an fp32 master"): the rank's bf16 shard is
the param FusedAdam updates, written with stochastic rounding
(``bf16_stochastic_round``).

What is exact and what is not. The rounding bits key on (seed, step, the
element's index in the tensor the optimizer is given): the params at stage
0, the rank's chunk of each bucket at stages 1-2, the rank's chunk of each
param at stage 3. So one process trains to the bit as FusedAdam over those
same tensors of the same bf16 model (at stages 0 and 3 the params
themselves), with accumulation and a skipped non-finite step; ZeRO-Offload
equals the non-offloaded run to the bit; a resume at the same layout
continues to the bit. Another layout rounds with other bits: each is as
unbiased, so a parallel run is compared with a single process's through the
fp32-master run, at a bound.

The bound (TRACK): the mean distance to torch's fp32 AdamW after 10 steps as
a fraction of how far training moved the params. The fp32-master bf16 run
sits at about 0.015 (its bf16 forward and backward). Stochastic rounding adds
an unbiased error of at most one bf16 ulp per element and step (variance
below ulp^2 / 4), a random walk of about one ulp in 10 steps: 2^-8 to 2^-7 of
a param, against a movement of a few tenths of the param here, so at most
about 0.02 more. Rounding to nearest (no master, no stochastic rounding)
comes out past the bound (about 0.085)."""

import contextlib
import json
import logging
import math
import re

import pytest
import torch

import fastzero
from fastzero.checkpoint import consolidate
from fastzero.comm import FlatLayout
from fastzero.config import ConfigError, ConfigNotSupported, load_config
from fastzero.ops import CPUAdam, FusedAdam, FusedLamb
from fastzero.runtime import checkpoint_io as ckpt
from fastzero.runtime import offload
from fastzero.runtime.groups import STATE_KEYS
from fastzero.runtime.offload import OffloadedAdam
from fastzero.runtime.onebit_adam import OneBitAdam
from tests.dist import run_ranks
from tests.paths import WORKERS
from tests.runtime.test_engine_single import batches
from tests.runtime.test_state_formats import tracking
from tests.runtime.test_zero_engine import assert_params, reference, train
from tests.workers.train_zero import make_model

NO_MASTER = {"enabled": True, "bf16_master_weights_and_grads": True}
FP32_MASTER = {"enabled": True}
BUCKET = 640  # cuts the test MLP's 3,366 params into 6 buckets (stages 1-2)
LR, WD, SEED = 1e-2, 0.1, 7
TRACK = 0.05  # the module docstring's bound


def engine_for(stage, *, gas=1, offloaded=False, bf16=NO_MASTER, zero=None, **params):
    zero = {"stage": stage, "reduce_bucket_size": BUCKET, "stage3_param_persistence_threshold": 100, **(zero or {})}
    if offloaded:
        zero["offload_optimizer"] = {"device": "cpu"}
    seed = {"seed": SEED} if bf16 is NO_MASTER and params.get("bf16_stochastic_round", True) else {}
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, **seed, **params}},
        "bf16": bf16,
        "zero_optimization": zero,
    }
    engine, *_ = fastzero.initialize(model=make_model(), config=config)
    return engine


def run_engine(engine, data, inf_at=None):
    for i, (x, y) in enumerate(data):
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss * math.inf if i == inf_at else loss)
        engine.step()


def params_of(engine) -> dict:
    with engine.gathered() as module:
        return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def fused_adam_reference(data, gas=1, inf_at=None, bucket=None) -> dict:
    """FusedAdam(bf16_stochastic_round=True) on the bf16 model, in one plain
    process, over the params (`bucket` None) or over the chunks a one-rank
    flat layout of `bucket` elements cuts them into (stages 1-2's tensors).
    A micro-batch with an infinite loss makes its step skipped."""
    model = make_model().bfloat16()
    params = list(model.parameters())
    tensors, segments = params, []
    if bucket is not None:
        layout = FlatLayout([p.numel() for p in params], 1, bucket)
        segments = [
            (s.param, s.lo, s.hi, slice(s.shard_offset, s.shard_offset + s.hi - s.lo)) for s in layout.segments(0)
        ]
        shard = torch.zeros(layout.shard_size, dtype=torch.bfloat16)
        grads = torch.zeros_like(shard)
        for i, lo, hi, at in segments:
            shard[at] = params[i].detach().reshape(-1)[lo:hi]
        tensors = [shard[b.shard_start : b.shard_start + b.chunk] for b in layout.buckets]
        for t, b in zip(tensors, layout.buckets):
            t.grad = grads[b.shard_start : b.shard_start + b.chunk]
    opt = FusedAdam(tensors, lr=LR, weight_decay=WD, bf16_stochastic_round=True, seed=SEED)
    for start in range(0, len(data), gas):
        for p in params:
            p.grad = None
        for i in range(start, start + gas):
            x, y = data[i]
            loss = torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)
            (loss * math.inf if i == inf_at else loss).backward()
        if not all(bool(torch.isfinite(p.grad).all()) for p in params):
            continue
        with torch.no_grad():
            for i, lo, hi, at in segments:
                grads[at] = params[i].grad.reshape(-1)[lo:hi]
            opt.step(grad_scale=float(gas))  # the engine's average over micro-batches, folded in the same way
            for i, lo, hi, at in segments:
                params[i].reshape(-1)[lo:hi] = shard[at]
    return {n: p.detach().float() for n, p in model.named_parameters()}


# -- one process: the bits of FusedAdam over the tensors the engine updates ------------------------


@pytest.mark.parametrize("gas, inf_at", [(1, None), (2, 3)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_process_trains_as_fused_adam_on_the_bf16_model_to_the_bit(stage, gas, inf_at):
    """Stages 0 and 3 update the params themselves (stage 3's chunk of a
    param is the whole param on one rank), stages 1-2 the chunks of their
    buckets: FusedAdam(bf16_stochastic_round=True) over the same tensors of
    the same bf16 model gives the same bits, with accumulation (the average
    folded into grad_scale) and a non-finite micro-batch skipping its step."""
    data = batches(6)
    engine = engine_for(stage, gas=gas)
    with pytest.warns(RuntimeWarning, match="non-finite") if inf_at is not None else contextlib.nullcontext():
        run_engine(engine, data, inf_at)
    assert engine.skipped_steps == (inf_at is not None) and engine.optimizer.bf16_stochastic_round
    got = params_of(engine)
    want = fused_adam_reference(data, gas, inf_at, bucket=BUCKET if stage in (1, 2) else None)
    assert_params(got, want, rtol=0, atol=0)
    if stage in (1, 2) and gas == 1:  # the bits key on the chunks' indices: over the params they differ
        plain = fused_adam_reference(data, gas)
        assert any(not torch.equal(got[n], plain[n]) for n in plain)


def test_memory_breakdown_counts_no_master():
    """master is 0: 4 bytes per element the rank updates less than with fp32
    masters, everything else the same; offloaded, the CPU copy the step
    updates is bf16 (2 bytes where an fp32 master takes 4) and no param copy
    is staged."""
    for stage in (0, 1, 2, 3):
        for offloaded in (False, True) if stage else (False,):
            mem = {}
            for name, bf16 in (("none", NO_MASTER), ("fp32", FP32_MASTER)):
                engine = engine_for(stage, offloaded=offloaded, bf16=bf16)
                run_engine(engine, batches(1))
                mem[name] = engine.memory_breakdown()
            numel = sum(t.numel() for g in engine.optimizer.param_groups for t in g["params"])
            where = (stage, offloaded)
            assert mem["none"]["master"] == 0, where
            if offloaded:
                assert mem["fp32"]["offload_master"] == 4 * numel and mem["none"]["offload_master"] == 2 * numel
                assert mem["none"]["offload_staging"] == 2 * numel < mem["fp32"]["offload_staging"], where
            else:
                assert mem["fp32"]["master"] == 4 * numel, where
            same = {k: v for k, v in mem["fp32"].items() if k not in ("master", "offload_master", "offload_staging")}
            assert {k: mem["none"][k] for k in same} == same, where


@pytest.mark.parametrize("stage, fmt", [(2, "fp32"), (2, "bf16"), (3, "fp32")])
def test_offloaded_pieces_round_as_the_non_offloaded_step(stage, fmt, monkeypatch):
    """ZeRO-Offload without masters: the CPU step writes the bf16 copy with
    stochastic rounding in pieces of 64 elements, each with the seed under
    which it draws its tensor's bits; the same params as the non-offloaded
    run to the bit (with bf16 states too: one hash gives both). Keyed by the
    pieces' own indices they would differ."""
    data = batches(4)
    plain = engine_for(stage, state_format=fmt)
    run_engine(plain, data)
    offloaded = engine_for(stage, offloaded=True, state_format=fmt)
    assert type(offloaded.optimizer) is OffloadedAdam
    assert all(m.dtype == torch.bfloat16 for m in offloaded.optimizer.device_of)
    offloaded.optimizer.chunk = 64
    run_engine(offloaded, data)
    assert_params(params_of(offloaded), params_of(plain), rtol=0, atol=0)
    if fmt == "fp32" and stage == 2:
        monkeypatch.setattr(offload, "sr_seed_at", lambda seed, step, lo: seed)
        shifted = engine_for(stage, offloaded=True)
        shifted.optimizer.chunk = 64
        run_engine(shifted, data)
        assert any(not torch.equal(p, params_of(plain)[n]) for n, p in params_of(shifted).items())


# -- why: updates below half a bf16 ulp ----------------------------------------------------------------


def student() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))


def teacher_data(steps: int) -> tuple[list, list]:
    """A teacher: the student's initial weights moved by N(0, 0.01) each,
    about what 100 Adam steps of lr 1e-4 can move them. (training, held out)
    batches of 64 rows."""
    teacher = student()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)
        xs = [torch.randn(64, 32, generator=gen) for _ in range(steps + 4)]
        pairs = [(x, teacher(x)) for x in xs]
    return pairs[:steps], pairs[steps:]


def held_out_loss(module: torch.nn.Module, held: list) -> float:
    """The loss of the module's params, in fp32."""
    model = student()
    model.load_state_dict({k: v.float() for k, v in module.state_dict().items()})
    with torch.no_grad():
        return sum(torch.nn.functional.mse_loss(model(x), y).item() for x, y in held) / len(held)


def test_stochastic_rounding_tracks_the_fp32_master_where_rounding_to_nearest_stalls():
    """100 AdamW steps of lr 1e-4 on a tiny MLP regression: most of its
    weights are large enough that an update of about lr is below half their
    bf16 ulp. With fp32 masters and without (stochastic rounding) the
    held-out loss falls alike; rounded to nearest without a master, updates
    below half an ulp are lost and the loss stays about 10 times higher.
    Figures (docs/zero.md): from 0.00225, fp32 0.000107, bf16 with fp32
    masters 0.000108, no master with stochastic rounding 0.000118, no master
    rounded to nearest 0.001268."""
    lr, steps = 1e-4, 100
    train_data, held = teacher_data(steps)
    below = [p.abs() >= 2.0**-5 for p in student().parameters()]  # half a bf16 ulp >= 2^-14 > lr from 2^-5 up
    assert sum(int(b.sum()) for b in below) > 0.7 * sum(b.numel() for b in below)
    losses = {}
    for name, bf16, params in (
        ("fp32", None, {}),
        ("fp32 master", FP32_MASTER, {}),
        ("stochastic", NO_MASTER, {}),
        ("nearest", NO_MASTER, {"bf16_stochastic_round": False}),
    ):
        config = {"train_micro_batch_size_per_gpu": 64, "optimizer": {"type": "AdamW", "params": {"lr": lr, **params}}}
        if bf16 is not None:
            config["bf16"] = bf16
        engine, *_ = fastzero.initialize(model=student(), config=config)
        for x, y in train_data:
            engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y))
            engine.step()
        losses[name] = held_out_loss(engine.module, held)
    start = held_out_loss(student(), held)
    assert losses["fp32 master"] < start / 10 and losses["fp32 master"] == pytest.approx(losses["fp32"], rel=0.02)
    assert losses["stochastic"] == pytest.approx(losses["fp32 master"], rel=0.15), losses
    assert losses["nearest"] > 5 * losses["fp32 master"], losses


# -- the config: the switch and its refusals ------------------------------------------------------------


def config_with(**over) -> dict:
    base = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    return {**base, **over}


def test_the_switch_turns_on_stochastic_rounding_and_its_seed():
    params = load_config(config_with(bf16=NO_MASTER)).optimizer.params
    assert params["bf16_stochastic_round"] is True and params.get("seed") is None
    nearest = config_with(bf16=NO_MASTER, optimizer={"type": "Adam", "params": {"bf16_stochastic_round": False}})
    assert load_config(nearest).optimizer.params["bf16_stochastic_round"] is False
    assert load_config(config_with(bf16=FP32_MASTER)).optimizer.params["bf16_stochastic_round"] is False
    engine = engine_for(0, state_format="int8")
    opt = engine.optimizer
    assert (opt.bf16_stochastic_round, opt.seed, opt.state_format, opt.master_weights) == (True, SEED, "int8", False)
    assert engine.master_dtype == torch.bfloat16 and engine_for(0, bf16=FP32_MASTER).master_dtype == torch.float32


@pytest.mark.parametrize(
    "config, error, match",
    [
        (
            config_with(bf16={"bf16_master_weights_and_grads": True}),
            ConfigError,
            r"bf16.bf16_master_weights_and_grads = true keeps bf16 params without fp32 masters, and bf16.enabled "
            r"is false: set bf16.enabled: true",
        ),
        (
            config_with(bf16={"bf16_master_weights_and_grads": True}, fp16={"enabled": True}),
            ConfigError,
            r"fp16 keeps its fp32 masters: its loss scaling would work without them .* writes bf16 params only",
        ),
        (
            config_with(fp16={"enabled": True, "fp16_master_weights_and_grads": True}),
            ConfigNotSupported,
            r"fp16 params keep fp32 masters: fastzero's stochastic rounding writes bf16 params only",
        ),
        (
            config_with(bf16=FP32_MASTER, optimizer={"type": "AdamW", "params": {"bf16_stochastic_round": True}}),
            ConfigError,
            r"bf16_stochastic_round = true .* set bf16.bf16_master_weights_and_grads: true",
        ),
        (
            config_with(bf16=NO_MASTER, optimizer={"type": "AdamW", "params": {"bf16_stochastic_round": "yes"}}),
            ConfigError,
            r"optimizer.params.bf16_stochastic_round",
        ),
        (
            config_with(
                bf16=NO_MASTER, optimizer={"type": "AdamW", "params": {"bf16_stochastic_round": False, "seed": 3}}
            ),
            ConfigError,
            r"seed = 3: the seed of stochastic rounding, which only state_format 'bf16'\s+and 'int8' and bf16_",
        ),
        (
            config_with(optimizer={"type": "Lamb", "params": {"bf16_stochastic_round": True}}),
            ConfigNotSupported,
            r"bf16_stochastic_round: Lamb writes bf16 params rounded to nearest .* use optimizer.type Adam or AdamW",
        ),
    ]
    + [
        (
            config_with(bf16=NO_MASTER, optimizer={"type": name}, zero_optimization={"stage": stage}),
            ConfigNotSupported,
            rf"{name} with bf16.bf16_master_weights_and_grads: its step keeps an fp32 master .* use optimizer type "
            r"Adam or AdamW, or set bf16.bf16_master_weights_and_grads: false",
        )
        for name, stage in (("Lamb", 0), ("OneBitAdam", 1), ("ZeroOneAdam", 0), ("OneBitLamb", 0))
    ],
)
def test_what_cannot_work_is_refused_naming_the_fix(config, error, match):
    with pytest.raises(error, match=match):
        load_config(config)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            lambda ps: torch.optim.SGD(ps, lr=0.1),
            ConfigNotSupported,
            r"optimizer=SGD with bf16.bf16_master_weights_and_grads: .* pass torch.optim.Adam/AdamW or "
            r"fastzero.ops.FusedAdam, or set bf16.bf16_master_weights_and_grads: false",
        ),
        (lambda ps: FusedLamb(ps, lr=0.1), ConfigNotSupported, r"Lamb with bf16.bf16_master_weights_and_grads"),
        (lambda ps: OneBitAdam(ps, lr=0.1), ConfigNotSupported, r"OneBitAdam with bf16.bf16_master_weights_and_grads"),
    ],
)
def test_a_passed_optimizer_that_cannot_write_bf16_params_is_refused(make, error, match):
    model = make_model()
    config = {"train_micro_batch_size_per_gpu": 8, "bf16": NO_MASTER, "zero_allow_untested_optimizer": True}
    with pytest.raises(error, match=match):
        fastzero.initialize(model=model, optimizer=make(model.parameters()), config=config)


def test_a_passed_adam_writes_bf16_params_with_stochastic_rounding():
    """torch's AdamW and fastzero's Adam are taken over with stochastic
    rounding (and the client's seed and format); a FusedAdam that asks for
    it where the engine keeps fp32 masters is refused, naming the key."""
    config = {"train_micro_batch_size_per_gpu": 8, "bf16": NO_MASTER, "zero_optimization": {"stage": 2}}
    for client, seed, fmt in (
        (lambda ps: torch.optim.AdamW(ps, lr=1e-3), 0, "fp32"),
        (lambda ps: FusedAdam(ps, state_format="int8", seed=None), 0, "int8"),
        (lambda ps: CPUAdam(ps, state_format="bf16", seed=9), 9, "bf16"),
        (lambda ps: FusedAdam(ps, bf16_stochastic_round=True, seed=5), 5, "fp32"),
    ):
        model = make_model()
        _, opt, *_ = fastzero.initialize(model=model, optimizer=client(model.parameters()), config=config)
        assert (opt.bf16_stochastic_round, opt.seed, opt.state_format, opt.master_weights) == (True, seed, fmt, False)
    model = make_model()
    fp32_masters = {**config, "bf16": FP32_MASTER}
    with pytest.raises(ConfigError, match=r"FusedAdam\(bf16_stochastic_round=True\) .* set "):
        fastzero.initialize(
            model=model, optimizer=FusedAdam(model.parameters(), bf16_stochastic_round=True), config=fp32_masters
        )


# -- checkpoints --------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage, offloaded", [(0, False), (2, False), (2, True), (3, False)])
def test_a_resume_continues_to_the_bit_with_the_saved_seed(tmp_path, stage, offloaded):
    """Saved after 3 of 6 steps and loaded into a fresh engine whose config
    says another seed: the checkpoint's seed, and the same params as the
    uninterrupted run to the bit. The pieces' "master" is each bf16 value
    as fp32 (exact); the manifest says so; consolidate() gives the params."""
    data = batches(6)
    full = engine_for(stage, offloaded=offloaded)
    run_engine(full, data)
    first = engine_for(stage, offloaded=offloaded)
    run_engine(first, data[:3])
    first.save_checkpoint(tmp_path)
    path = ckpt.resolve(tmp_path, None)
    manifest = ckpt.read_manifest(path)
    assert manifest["master_dtype"] == "bfloat16" and manifest["dtype"] == "bfloat16"
    assert manifest["state_format"]["seed"] == SEED
    pieces = torch.load(path / "rank00000.pt")["pieces"]
    assert all(p[k].dtype == torch.float32 for p in pieces for k in STATE_KEYS)
    saved = params_of(first)
    masters = consolidate(tmp_path)
    assert_params({n: masters[n] for n in saved}, saved, rtol=0, atol=0)
    resumed = engine_for(stage, offloaded=offloaded, seed=5)
    assert resumed.optimizer.seed == 5
    resumed.load_checkpoint(tmp_path)
    assert resumed.optimizer.seed == SEED
    run_engine(resumed, data[3:])
    assert_params(params_of(resumed), params_of(full), rtol=0, atol=0)


def test_loads_between_fp32_masters_and_none_round_or_keep_and_say_so(tmp_path, caplog):
    """An fp32-master checkpoint into a run without masters: each param the
    master rounded to nearest (a warning); a checkpoint without masters into
    an fp32-master run: the masters take the bf16 values exactly (info).
    Both go on training."""
    data = batches(5)
    for name, bf16 in (("fp32", FP32_MASTER), ("none", NO_MASTER)):
        engine = engine_for(2, bf16=bf16)
        run_engine(engine, data[:3])
        engine.save_checkpoint(tmp_path / name)
    masters = consolidate(tmp_path / "fp32")
    caplog.set_level(logging.INFO, logger="fastzero.runtime.checkpoint_io")
    into_none = engine_for(2)
    into_none.load_checkpoint(tmp_path / "fp32")
    (record,) = [r for r in caplog.records if r.name == ckpt.log.name and "masters" in r.getMessage()]
    assert record.levelno == logging.WARNING and "rounded to nearest into this run's bfloat16 params" in record.message
    assert_params(params_of(into_none), {n: m.bfloat16().float() for n, m in masters.items()}, rtol=0, atol=0)
    assert any(not torch.equal(m.bfloat16().float(), m) for m in masters.values())  # the masters held more bits
    caplog.clear()
    into_fp32 = engine_for(2, bf16=FP32_MASTER)
    into_fp32.load_checkpoint(tmp_path / "none")
    (record,) = [r for r in caplog.records if r.name == ckpt.log.name and "masters" in r.getMessage()]
    assert record.levelno == logging.INFO and "take their values exactly" in record.message
    saved = consolidate(tmp_path / "none")
    for t in into_fp32.optimizer.param_groups[0]["params"]:
        master = into_fp32.optimizer.state[t]["master_param"]
        assert torch.equal(master, master.bfloat16().float())  # bf16 values, held exactly
    assert_params(params_of(into_fp32), {n: saved[n] for n in params_of(into_fp32)}, rtol=0, atol=0)
    for engine in (into_none, into_fp32):
        run_engine(engine, data[3:])
        assert engine.global_steps == 5


def test_a_manifest_with_a_bad_master_dtype_is_refused(tmp_path):
    engine = engine_for(1)
    run_engine(engine, batches(1))
    engine.save_checkpoint(tmp_path)
    path = ckpt.resolve(tmp_path, None) / "manifest.json"
    path.write_text(path.read_text().replace('"master_dtype": "bfloat16"', '"master_dtype": "int8"'))
    with pytest.raises(ckpt.CheckpointError, match=re.escape("field 'master_dtype' must be one of")):
        engine.load_checkpoint(tmp_path)


# -- two ranks ------------------------------------------------------------------------------------------


def test_every_stage_on_two_ranks_tracks_the_fp32_master_run_and_resumes_to_the_bit(tmp_path):
    """2 Gloo ranks, 10 steps of 2 micro-batches each with clipping (the
    worker's defaults): at stages 0-3 without masters every rank holds the
    same params, memory_breakdown() counts no master, and the params track
    torch's fp32 AdamW and the fp32-master bf16 run within TRACK (rounding
    to nearest does not); offloaded stage 2 equals stage 2 to the bit; saved
    at step 5 and resumed at the same layout with another seed, stages 2
    and 3 equal the uninterrupted runs to the bit."""
    top = {"bf16": NO_MASTER}
    ck = {s: str(tmp_path / f"ckpt{s}") for s in (2, 3)}
    runs = [dict(stage=s, top=top, opt={"seed": SEED}) for s in (0, 1, 2, 3)]
    runs += [dict(stage=2, top=top, opt={"seed": SEED}, offload=True, chunk=64)]
    runs += [dict(stage=2, dtype="bf16"), dict(stage=2, top=top, opt={"bf16_stochastic_round": False})]
    runs += [dict(stage=s, top=top, opt={"seed": SEED}, steps=5, save_at=5, save=ck[s]) for s in (2, 3)]
    results = train(tmp_path, 2, runs)
    (tmp_path / "b").mkdir()
    resumes = [dict(stage=s, top=top, opt={"seed": 1}, start=5, load=ck[s]) for s in (2, 3)]
    resumed = train(tmp_path / "b", 2, resumes)
    want, fp32_master = reference(2), results[5][0]["params"]
    for run, ranks in zip(runs[:5], results[:5]):
        for res in ranks:
            assert_params(res["params"], ranks[0]["params"], rtol=0, atol=0)
            assert res["memory"]["master"] == 0, run
        assert tracking(ranks[0]["params"], want) < TRACK, run
        assert tracking(ranks[0]["params"], fp32_master) < TRACK, run
    assert results[4][0]["memory"]["offload_master"] == 2 * sum(results[4][0]["state_numels"])
    assert_params(results[4][0]["params"], results[2][0]["params"], rtol=0, atol=0)
    assert tracking(fp32_master, want) < TRACK / 2
    assert tracking(results[6][0]["params"], want) > TRACK  # no master, rounded to nearest
    for stage, again in zip((2, 3), resumed):
        full = results[stage][0]["params"]
        for res in again:
            assert_params(res["params"], full, rtol=0, atol=0)


def test_the_pipeline_engine_trains_without_masters(tmp_path):
    """Two pipeline stages (a weight tied between the first and the last),
    ZeRO stages 0 and 1 over one data rank: without masters the losses track
    one fp32 process's as the fp32-master bf16 run does, and the tied
    weight's two copies stay equal to the bit (they round with the same
    bits: the same tensor, seed and step)."""
    base = {"blocks": 2, "micro_batches": 4, "steps": 10, "clip": 0.05, "tied": True, "schedule": "1f1b", "stages": 2}
    runs = [dict(base, zero=z, dtype="bf16-nomaster", out=str(tmp_path / f"none{z}")) for z in (0, 1)]
    runs.append(dict(base, zero=1, dtype="bf16", out=str(tmp_path / "master")))
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    run_ranks(WORKERS / "pipe_train.py", 2, [spec], timeout=300)
    for run in runs:
        first, last = (torch.load(f"{run['out']}.rank{k}.pt") for k in range(2))
        ref = first["reference"]
        for res in (first, last):
            torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), rtol=2e-2, atol=2e-2)
            assert (res["master"] == 0) == (run["dtype"] == "bf16-nomaster") and res["skipped"][-1] == 0
        tied = sorted(set(first["params"]) & set(last["params"]))
        assert tied, "the tied weight is on both stages"
        for name in tied:
            assert torch.equal(first["params"][name], last["params"][name]), name
