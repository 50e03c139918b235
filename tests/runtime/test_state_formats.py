"""Adam's state formats under the runtime (docs/zero.md, "Optimizer state
formats"): the shard's states in the format at every ZeRO stage and with
ZeRO-Offload, counted by memory_breakdown(); offload at stage 2 trains as
the non-offloaded run does, to the bit; checkpoints hold fp32 values per
element, resume to the bit at the same layout and format and load into any
other layout and format.

Tolerances against fp32 states (the mean distance to the fp32-state run, as a
fraction of how far training moved the params): int8 codes have 3 mantissa
bits, so exp_avg and exp_avg_sq are each within 1/16 of their value and one
step's update m / sqrt(v) within about 1/16 + 1/32 < 0.1 of fp32's, at worst;
bf16 stochastic rounding moves a state by less than one bf16 ulp (2^-7
relative), so the update is within 2^-7 + 2^-8 < 0.02. A parallel layout
cuts blocks (int8) and keys the rounding bits (bf16) by element index in the
shard's tensors, so those runs are compared with the fp32 run at these
bounds, and with themselves (uninterrupted, or not offloaded) to the bit."""

import logging

import pytest
import torch

import fastzero
from fastzero.checkpoint import consolidate
from fastzero.config import ConfigError
from fastzero.ops import FusedAdam
from fastzero.ops.adam import int8_codes
from fastzero.ops.adam.reference import sr_bits, sr_seed_at
from fastzero.runtime import checkpoint_io as ckpt
from fastzero.runtime import offload
from fastzero.runtime.checkpoint_io import CheckpointError
from fastzero.runtime.groups import STATE_KEYS, PieceState
from tests.runtime.test_engine_single import batches, cfg
from tests.runtime.test_zero_engine import assert_params, reference, train
from tests.workers.train_zero import make_model

FORMATS = ("fp32", "bf16", "int8")
TRACKS = {"fp32": 1e-5, "bf16": 0.02, "int8": 0.1}  # the module docstring's bounds


def engine_for(fmt: str, stage: int = 2, *, offloaded: bool = False, bf16: bool = True, zero=None, **params):
    """A single-process engine whose buckets (640 elements) cut the params,
    so int8 pieces start mid-block."""
    zero = {"stage": stage, "reduce_bucket_size": 640, "stage3_param_persistence_threshold": 100, **(zero or {})}
    if offloaded:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = cfg(
        zero_optimization=zero,
        optimizer={"type": "AdamW", "params": {"lr": 1e-2, "state_format": fmt, **params}},
        **({"bf16": {"enabled": True}} if bf16 else {}),
    )
    engine, *_ = fastzero.initialize(model=make_model(), config=config)
    return engine


def run_engine(engine, data):
    for x, y in data:
        engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y))
        engine.step()


def params_of(engine) -> dict:
    with engine.gathered() as module:
        return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def state_bytes(fmt: str, numels: list[int], block: int = 256) -> int:
    """exp_avg and exp_avg_sq of optimizer tensors of `numels` elements."""
    per = {"fp32": 8, "bf16": 4, "int8": 2}[fmt]
    scales = sum(8 * int8_codes.blocks_of(n, block) for n in numels) if fmt == "int8" else 0
    return per * sum(numels) + scales


def tracking(got: dict, want: dict) -> float:
    """The largest mean distance to `want`, as a fraction of the distance the
    params moved from their initial values."""
    init = dict(make_model().named_parameters())
    return max(((got[n] - p).abs().mean() / (p - init[n].detach()).abs().mean()).item() for n, p in want.items())


# -- the shard's states in the format ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_keeps_the_shard_states_in_the_format(stage, fmt):
    engine = engine_for(fmt, stage, block_size=64) if fmt == "int8" else engine_for(fmt, stage)
    run_engine(engine, batches(2))
    opt = engine.optimizer
    assert type(opt) is FusedAdam and opt.state_format == fmt
    numels = []
    for t in (t for g in opt.param_groups for t in g["params"]):  # the shard's tensors (params at stage 0)
        state = opt.state[t]
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}[fmt]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == dtype
        assert state["exp_avg"].numel() == t.numel()
        if fmt == "int8":
            assert state["exp_avg_absmax"].numel() == int8_codes.blocks_of(t.numel(), 64)
        numels.append(t.numel())
    mem = engine.memory_breakdown()
    assert mem["optimizer"] == state_bytes(fmt, numels, block=64), mem
    assert mem["master"] == 4 * sum(numels)


@pytest.mark.parametrize("offloaded", [False, True])
def test_a_fastzero_client_optimizer_keeps_its_state_format(offloaded):
    model = make_model()
    client = FusedAdam(model.parameters(), lr=1e-2, state_format="int8", block_size=128)
    zero = {"stage": 2, **({"offload_optimizer": {"device": "cpu"}} if offloaded else {})}
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": zero}
    engine, opt, *_ = fastzero.initialize(model=model, optimizer=client, config=config)
    assert (type(opt) is offload.OffloadedAdam) == offloaded
    assert (opt.state_format, opt.block_size, opt.seed) == ("int8", 128, 0)
    model = make_model()
    seeded = FusedAdam(model.parameters(), state_format="bf16", seed=9)
    _, opt, *_ = fastzero.initialize(model=model, optimizer=seeded, config=config)
    assert (opt.state_format, opt.seed) == ("bf16", 9)


def test_a_format_in_the_config_beside_a_client_optimizer_is_refused_naming_the_fix():
    model = make_model()
    config = cfg(optimizer={"type": "AdamW", "params": {"state_format": "int8"}})
    with pytest.raises(ConfigError, match=r"keep one; for int8 states .*FusedAdam\(\.\.\., state_format='int8'\)"):
        fastzero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)


# -- ZeRO-Offload ---------------------------------------------------------------------------------------


def test_an_aligned_slice_draws_the_whole_tensors_rounding_bits():
    """sr_seed_at: the offloaded step's pieces round as one step over the shard."""
    for seed, step in ((0, 1), (7, 12345), (2**32 - 1, 2**32 + 5)):
        for offset, n in ((0, 300), (64, 64), (3 << 20, 1 << 20), ((5 << 32) + (1 << 12), 1 << 12)):
            whole = sr_bits(seed, step, offset + torch.arange(n))
            piece = sr_bits(sr_seed_at(seed, step, offset), step, torch.arange(n))
            assert all(torch.equal(a, b) for a, b in zip(whole, piece)), (seed, step, offset)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("stage", [2, 3])
def test_offloaded_pieces_give_the_bits_of_the_non_offloaded_step(stage, fmt, monkeypatch):
    """bf16 training, one process: the offloaded step in pieces of 64
    elements (int8: one block, 256) equals the non-offloaded one to the bit;
    bf16 states need the pieces' seeds for it (without them they differ)."""
    data = batches(4)
    results = []
    for offloaded, chunk in ((False, None), (True, None), (True, 64)):
        engine = engine_for(fmt, stage, offloaded=offloaded)
        if chunk:
            engine.optimizer.chunk = chunk
        run_engine(engine, data)
        results.append(params_of(engine))
        if offloaded:
            mem = engine.memory_breakdown()
            numels = [m.numel() for m in engine.optimizer.device_of]
            assert mem["optimizer"] == 0 and mem["offload_optimizer"] == state_bytes(fmt, numels), mem
    for other in results[1:]:
        assert_params(other, results[0], rtol=0, atol=0)
    if fmt == "bf16" and stage == 2:  # the test can fail: pieces keyed by their own indices round otherwise
        monkeypatch.setattr(offload, "sr_seed_at", lambda seed, step, lo: seed)
        engine = engine_for(fmt, offloaded=True)
        engine.optimizer.chunk = 64
        run_engine(engine, data)
        assert any(not torch.equal(p, results[0][n]) for n, p in params_of(engine).items())


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_a_small_sub_group_size_keeps_the_bits_and_whole_blocks(fmt):
    """sub_group_size 300: rotating staging buffers of 128 elements (int8:
    one block of 256), the same params as the non-offloaded run."""
    data = batches(3)
    plain = engine_for(fmt)
    run_engine(plain, data)
    ring = engine_for(fmt, offloaded=True, zero={"sub_group_size": 300})
    run_engine(ring, data)
    assert ring.optimizer.ring and ring.optimizer.piece_cap == (256 if fmt == "int8" else 128)
    assert_params(params_of(ring), params_of(plain), rtol=0, atol=0)


def test_offload_at_stage_2_trains_as_the_non_offloaded_run_on_two_ranks(tmp_path):
    """2 Gloo ranks, fp32 training: with each format, the offloaded stage-2
    run (pieces of 64 elements; int8 256) equals the non-offloaded one to the
    bit, on every rank, tracks torch's AdamW (fp32 states) within the
    format's bound, and memory_breakdown() counts the shard's states."""
    runs = [dict(stage=2, opt={"state_format": f}, **o) for f in FORMATS for o in ({}, {"offload": True, "chunk": 64})]
    results = train(tmp_path, 2, runs)
    want = reference(2)
    for i in range(0, len(runs), 2):
        fmt = runs[i]["opt"]["state_format"]
        plain, offloaded = results[i], results[i + 1]
        for rank in range(2):
            assert_params(offloaded[rank]["params"], plain[rank]["params"], rtol=0, atol=0)
            assert_params(plain[rank]["params"], plain[0]["params"], rtol=0, atol=0)
            numels = plain[rank]["state_numels"]
            assert plain[rank]["memory"]["optimizer"] == state_bytes(fmt, numels), fmt
            assert offloaded[rank]["memory"]["offload_optimizer"] == state_bytes(fmt, numels), fmt
            assert offloaded[rank]["memory"]["optimizer"] == 0
        assert tracking(plain[0]["params"], want) < TRACKS[fmt], fmt


# -- checkpoints ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("offloaded", [False, True])
@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_a_resume_at_the_same_layout_and_format_continues_to_the_bit(tmp_path, fmt, offloaded):
    """Saved after 3 of 6 steps (pieces of fp32 values), loaded into a fresh
    engine: the same params as the uninterrupted run, to the bit. The seed
    (both formats round stochastically) is the checkpoint's (the loading
    config says another)."""
    params = {"seed": 11} if fmt == "bf16" else {"block_size": 64, "seed": 12}
    data = batches(6)
    full = engine_for(fmt, offloaded=offloaded, **params)
    run_engine(full, data)
    first = engine_for(fmt, offloaded=offloaded, **params)
    run_engine(first, data[:3])
    first.save_checkpoint(tmp_path)
    manifest = ckpt.read_manifest(ckpt.resolve(tmp_path, None))
    assert manifest["state_format"] == {
        "format": fmt,
        "seed": params.get("seed"),
        "block_size": params.get("block_size"),
    }
    rank_file = torch.load(ckpt.resolve(tmp_path, None) / "rank00000.pt")
    assert all(p[k].dtype == torch.float32 for p in rank_file["pieces"] for k in STATE_KEYS)
    resumed = engine_for(fmt, offloaded=offloaded, **({"seed": 5} if fmt == "bf16" else {"block_size": 64, "seed": 5}))
    resumed.load_checkpoint(tmp_path)
    assert resumed.optimizer.seed == params.get("seed")
    run_engine(resumed, data[3:])
    assert_params(params_of(resumed), params_of(full), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("only", ["load_optimizer_states", "load_module_only"])
def test_a_weights_only_load_leaves_packed_states_as_they_are(tmp_path, fmt, stage, only):
    """load_optimizer_states=False / load_module_only=True into packed states: the weights are the saved ones,
    the states the loading engine's own (the weights alone never read the packed per-block state; int8's
    failed here on its scales before)."""
    saved = engine_for(fmt, stage)
    run_engine(saved, batches(2))
    saved.save_checkpoint(tmp_path)
    other = engine_for(fmt, stage)
    run_engine(other, batches(1, seed=9))
    states = {
        k: v.clone()
        for k, v in other.optimizer.state[other.optimizer.param_groups[0]["params"][0]].items()
        if isinstance(v, torch.Tensor)
    }
    other.load_checkpoint(tmp_path, **({only: False} if only == "load_optimizer_states" else {only: True}))
    assert_params(params_of(other), params_of(saved), rtol=0, atol=0)
    after = other.optimizer.state[other.optimizer.param_groups[0]["params"][0]]
    assert all(torch.equal(after[k], v) for k, v in states.items() if k not in ("master_param", "step"))


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_groups_state_api_moves_packed_states_between_engines(stage, fmt):
    """Pieces out of a trained engine hold fp32 values (decoded); in to a
    fresh engine they give it the same states to the bit (codes and scales),
    though pieces start mid-block."""
    engine = engine_for(fmt, stage)
    run_engine(engine, batches(2))
    fresh = engine_for(fmt, stage)
    pairs = zip(engine.groups, engine.optimizer.param_groups, fresh.groups, fresh.optimizer.param_groups)
    for group, opt_group, other, other_opt_group in pairs:
        out = group.pieces_out(engine.optimizer, opt_group["params"])
        assert all(t.dtype == torch.float32 for piece in out for t in piece.tensors.values())
        saved = {}
        for piece in out:
            copies = {k: v.clone() for k, v in piece.tensors.items()}
            saved.setdefault(piece.name, []).append(PieceState(piece.name, piece.lo, piece.hi, copies))
        other.pieces_in(fresh.optimizer, other_opt_group["params"], saved)
        for a, b in zip(opt_group["params"], other_opt_group["params"], strict=True):
            mine, theirs = engine.optimizer.state[a], fresh.optimizer.state[b]
            keys = sorted(k for k in mine if k != "step")  # the step is the group's (the manifest's) counter
            assert keys == sorted(k for k in theirs if k != "step")
            assert all(torch.equal(mine[k], theirs[k]) for k in keys), keys


def moments(engine) -> dict:
    """exp_avg and exp_avg_sq of each owned piece, fp32, by (param name, lo)."""
    out = {}
    for g, og in zip(engine.groups, engine.optimizer.param_groups):
        for piece in g.pieces_out(engine.optimizer, og["params"]):
            for key in ("exp_avg", "exp_avg_sq"):
                out[piece.name, piece.lo, key] = piece.tensors[key].detach().float().cpu().clone()
    return out


def test_loads_convert_between_formats_and_say_so(tmp_path, caplog):
    """int8 -> fp32: exactly the decoded values (logged as info); fp32 ->
    int8 and -> bf16: each value within its code's rounding (a warning);
    training goes on. The same layout here (stage 2, one process)."""
    data = batches(5)
    saved = {}
    for fmt in ("int8", "fp32"):
        engine = engine_for(fmt, bf16=False)
        run_engine(engine, data[:3])
        engine.save_checkpoint(tmp_path / fmt)
        saved[fmt] = moments(engine)
    caplog.set_level(logging.INFO, logger="fastzero.runtime.checkpoint_io")
    for source, target, level in (
        ("int8", "fp32", logging.INFO),
        ("fp32", "int8", logging.WARNING),
        ("fp32", "bf16", logging.WARNING),
    ):
        caplog.clear()
        engine = engine_for(target, bf16=False)
        engine.load_checkpoint(tmp_path / source)
        (record,) = [r for r in caplog.records if "were converted" in r.getMessage()]
        assert record.levelno == level and f"state_format={target!r}" in record.getMessage()
        got = moments(engine)
        for key, want in saved[source].items():
            if target == "fp32":
                assert torch.equal(got[key], want), key
            else:  # int8: within 1/16 of each value, or the smallest codes' step of the block's scale
                rel = 1 / 16 if target == "int8" else 2**-8
                floor = 2.0**-17 if key[2] == "exp_avg" else 2.0**-33
                assert ((got[key] - want).abs() <= rel * want.abs() + floor * want.abs().max()).all(), key
        run_engine(engine, data[3:])
        assert engine.global_steps == 5


def test_round_trips_across_formats_and_layouts_keep_training_on_two_ranks(tmp_path):
    """int8 at stage 2 on 2 ranks, saved at step 3: resumed at the same
    layout, to the bit; by 1 process at stage 1 with fp32 states, and with
    int8 states (blocks cut elsewhere), training goes on within the
    formats' bounds of torch's AdamW; a fp32 checkpoint loads into int8
    states. bf16 resumes to the bit with its seed. consolidate() reads the
    masters of an int8 checkpoint."""
    ck = {f: str(tmp_path / f"ckpt-{f}") for f in FORMATS}
    opt = {"int8": {"state_format": "int8"}, "bf16": {"state_format": "bf16", "seed": 7}, "fp32": {}}
    first_runs = [dict(stage=2, opt=opt["int8"], steps=6), dict(stage=2, opt=opt["bf16"], steps=6)]
    first_runs += [dict(stage=2, opt=opt[f], steps=3, save_at=3, save=ck[f]) for f in ("int8", "bf16", "fp32")]
    full_int8, full_bf16, first_int8, _, _ = train(tmp_path, 2, first_runs)
    (tmp_path / "b").mkdir()
    bf16_other_seed = {"state_format": "bf16", "seed": 1}
    same = [dict(stage=2, opt=opt["int8"], steps=6, start=3, load=ck["int8"])]
    same += [dict(stage=2, opt=bf16_other_seed, steps=6, start=3, load=ck["bf16"])]
    resumed_int8, resumed_bf16 = train(tmp_path / "b", 2, same)
    for rank in range(2):
        assert_params(resumed_int8[rank]["params"], full_int8[rank]["params"], rtol=0, atol=0)
        assert_params(resumed_bf16[rank]["params"], full_bf16[rank]["params"], rtol=0, atol=0)
    (tmp_path / "c").mkdir()
    other = [
        dict(stage=1, gas=4, opt=opt["fp32"], steps=6, start=3, load=ck["int8"]),
        dict(stage=1, gas=4, opt=opt["int8"], steps=6, start=3, load=ck["int8"]),
        dict(stage=1, gas=4, opt=opt["int8"], steps=6, start=3, load=ck["fp32"]),
    ]
    to_fp32, to_int8, fp32_to_int8 = train(tmp_path / "c", 1, other)
    want = reference(2, steps=6)
    assert tracking(to_fp32[0]["params"], want) < TRACKS["int8"]
    assert tracking(to_int8[0]["params"], want) < TRACKS["int8"]
    assert tracking(fp32_to_int8[0]["params"], want) < TRACKS["int8"]
    masters = consolidate(ck["int8"])
    assert_params({n: masters[n] for n in want}, first_int8[0]["params"], rtol=0, atol=0)


def test_a_manifest_with_a_bad_state_format_is_refused(tmp_path):
    engine = engine_for("int8", bf16=False)
    run_engine(engine, batches(1))
    engine.save_checkpoint(tmp_path)
    path = ckpt.resolve(tmp_path, None) / "manifest.json"
    path.write_text(path.read_text().replace('"format": "int8"', '"format": "int4"'))
    with pytest.raises(CheckpointError, match="field 'state_format' must be null or an object"):
        engine.load_checkpoint(tmp_path)
