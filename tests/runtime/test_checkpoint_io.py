"""Checkpoints: exact resume, resume at another world size and stage,
consolidation, a crash mid-save, and checkpoints that do not fit."""

import os
import subprocess
import sys

import pytest
import torch

import fastzero
from fastzero.checkpoint import consolidate
from fastzero.runtime import checkpoint_files as files
from fastzero.runtime import checkpoint_io as ckpt
from fastzero.runtime.checkpoint_io import CheckpointError
from fastzero.runtime.groups import STATE_KEYS, PieceState, ZeroGroup
from tests.runtime.test_engine_single import batches, cfg
from tests.runtime.test_zero_engine import assert_params, reference, train
from tests.workers.train_zero import make_model


def test_exact_resume_on_two_ranks(tmp_path):
    """Saved after 3 of 6 steps and loaded by fresh processes: the same
    losses, bit for bit, and the same params as the uninterrupted run."""
    save = str(tmp_path / "ckpt")
    full, first = train(
        tmp_path, 2, [dict(stage=2, dtype="bf16", steps=6), dict(stage=2, dtype="bf16", steps=3, save_at=3, save=save)]
    )
    (tmp_path / "b").mkdir()
    (resumed,) = train(tmp_path / "b", 2, [dict(stage=2, dtype="bf16", steps=6, start=3, load=save)])
    for r in range(2):
        assert first[r]["losses"] + resumed[r]["losses"] == full[r]["losses"]
        assert_params(resumed[r]["params"], full[r]["params"], rtol=0, atol=0)


@pytest.mark.parametrize("world, stage, gas", [(2, 1, 4), (1, 0, 8), (1, 2, 8)])
def test_resume_at_another_world_size_and_stage(tmp_path, world, stage, gas):
    """Saved by 4 ranks at stage 2, loaded by `world` ranks at `stage` with
    the same global batch: training goes on as if uninterrupted (fp32)."""
    save = str(tmp_path / "ckpt")
    (saved,) = train(tmp_path, 4, [dict(stage=2, gas=2, steps=3, save_at=3, save=save)])
    (tmp_path / "b").mkdir()
    (resumed,) = train(tmp_path / "b", world, [dict(stage=stage, gas=gas, steps=6, start=3, load=save)])
    want = reference(4, steps=6)
    for res in resumed:
        assert_params(res["params"], want)
    # consolidate: the fp32 model at the save, loadable as is
    sd = consolidate(save)
    model = make_model()
    model.load_state_dict(sd)
    assert_params(dict(model.named_parameters()), reference(4, steps=3))


def run_engine(engine, data):
    for x, y in data:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_groups_state_api_moves_pieces_between_engines(stage):
    """Every group is a ZeroGroup; the pieces it owns cover each param once;
    pieces out of a trained engine and in to a fresh one give the fresh one
    the same masters, optimizer state and (bf16) params."""
    config = cfg(zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 100}, bf16={"enabled": True})
    engine, *_ = fastzero.initialize(model=make_model(), config=config)
    run_engine(engine, batches(2))
    fresh, *_ = fastzero.initialize(model=make_model(), config=config)
    pairs = zip(engine.groups, engine.optimizer.param_groups, fresh.groups, fresh.optimizer.param_groups)
    for group, opt_group, other, other_opt_group in pairs:
        assert isinstance(group, ZeroGroup) and isinstance(other, ZeroGroup)
        out = group.pieces_out(engine.optimizer, opt_group["params"])
        covered = dict.fromkeys(group.names, 0)
        for piece in out:
            covered[piece.name] += piece.hi - piece.lo
        assert covered == {n: s.numel() for n, s in zip(group.names, group.shapes)}
        saved = {}
        for piece in out:
            copies = {k: v.clone() for k, v in piece.tensors.items()}
            saved.setdefault(piece.name, []).append(PieceState(piece.name, piece.lo, piece.hi, copies))
        other.pieces_in(fresh.optimizer, other_opt_group["params"], saved)
        for handle in other.gather():
            handle.wait()
        for a, b in zip(out, other.pieces_out(fresh.optimizer, other_opt_group["params"]), strict=True):
            assert (a.name, a.lo, a.hi) == (b.name, b.lo, b.hi)
            assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in STATE_KEYS)
    with engine.gathered() as trained, fresh.gathered() as loaded:
        for (name, p), q in zip(trained.named_parameters(), loaded.parameters()):
            assert torch.equal(p, q), name


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": 1}))
    run_engine(engine, batches(2))
    engine.save_checkpoint(tmp_path, tag="good")
    before = {k: v.clone() for k, v in consolidate(tmp_path).items()}
    run_engine(engine, batches(2, seed=9))
    real_write = files._write

    def failing_write(path, obj):
        if path.name == "extra.pt":
            raise OSError("disk full")
        return real_write(path, obj)

    monkeypatch.setattr(files, "_write", failing_write)
    for tag in ("next", "good"):  # a new tag, and overwriting the old one
        with pytest.raises(OSError, match="disk full"):
            engine.save_checkpoint(tmp_path, tag=tag)
        assert (tmp_path / "latest").read_text() == "good" and not (tmp_path / "next").exists()
        after = consolidate(tmp_path)
        assert all(torch.equal(after[k], v) for k, v in before.items())
    monkeypatch.setattr(files, "_write", real_write)
    fresh, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": 1}))
    path, _ = fresh.load_checkpoint(tmp_path)
    assert path.endswith("good") and fresh.global_steps == 2


def test_another_model_or_a_corrupt_file_is_refused_and_nothing_changes(tmp_path):
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": 2}))
    run_engine(engine, batches(2))
    engine.save_checkpoint(tmp_path)
    other = torch.nn.Sequential(
        torch.nn.Linear(33, 64), torch.nn.GELU(), torch.nn.Linear(64, 17), torch.nn.LayerNorm(17)
    )
    target, *_ = fastzero.initialize(model=other, config=cfg(zero_optimization={"stage": 2}))
    snapshot = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(CheckpointError, match=r"param 0.weight has shape \(65, 33\) in the checkpoint"):
        target.load_checkpoint(tmp_path)
    rank_file = ckpt.resolve(tmp_path, "global_step2") / "rank00000.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:200])
    same, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": 2}))
    snapshot = [p.detach().clone() for p in same.module.parameters()]
    with pytest.raises(CheckpointError, match="rank00000.pt has 200 bytes; the manifest records"):
        same.load_checkpoint(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, same.module.parameters()))
    assert same.global_steps == 0
    with pytest.warns(UserWarning, match="no 'latest'"):
        assert same.load_checkpoint(tmp_path / "nowhere") == (None, None)


def test_save_mid_accumulation_is_refused(tmp_path):
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg(gradient_accumulation_steps=2))
    run_engine(engine, batches(1))
    with pytest.raises(RuntimeError, match="middle of gradient accumulation"):
        engine.save_checkpoint(tmp_path)


def test_consolidate_command(tmp_path):
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg(bf16={"enabled": True}))
    run_engine(engine, batches(2))
    engine.save_checkpoint(tmp_path / "c")
    out = tmp_path / "model.pt"
    cmd = [sys.executable, "-m", "fastzero.checkpoint", "consolidate", str(tmp_path / "c"), str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    sd = torch.load(out)
    assert all(v.dtype == torch.float32 for v in sd.values())
    model = make_model()
    model.load_state_dict(sd)
    # the fp32 masters, which the bf16 params are the rounding of
    for (name, p), q in zip(model.named_parameters(), engine.module.parameters()):
        assert torch.equal(p.to(torch.bfloat16), q), name
    bad = subprocess.run(
        [sys.executable, "-m", "fastzero.checkpoint", "consolidate", str(tmp_path), str(out)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "not a fastzero checkpoint" in bad.stderr or "no 'latest'" in bad.stderr


def masters(engine) -> dict:
    """Each owned piece's fp32 master and exp_avg, by (param name, lo)."""
    out = {}
    for g, og in zip(engine.groups, engine.optimizer.param_groups):
        for piece in g.pieces_out(engine.optimizer, og["params"]):
            out[piece.name, piece.lo] = {k: v.detach().clone() for k, v in piece.tensors.items()}
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_load_from_fp32_weights_false_remakes_the_masters_from_the_16bit_weights(tmp_path, stage):
    """zero_optimization.load_from_fp32_weights: true (default) restores the
    saved fp32 masters; false re-makes each from the bf16 weight (the master
    equals the bf16 param upcast); the optimizer state loads either way."""
    zero = {"stage": stage, "stage3_param_persistence_threshold": 100}
    trained, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization=zero, bf16={"enabled": True}))
    run_engine(trained, batches(3))
    trained.save_checkpoint(tmp_path)
    saved = masters(trained)
    with trained.gathered() as module:
        weights = {n: p.detach().float().reshape(-1).clone() for n, p in module.named_parameters()}
    for from_fp32 in (True, False):
        config = cfg(zero_optimization={**zero, "load_from_fp32_weights": from_fp32}, bf16={"enabled": True})
        fresh, *_ = fastzero.initialize(model=make_model(), config=config)
        fresh.load_checkpoint(tmp_path)
        loaded = masters(fresh)
        assert loaded.keys() == saved.keys()
        rounded = 0
        for (name, lo), state in loaded.items():
            want = saved[name, lo]["master"]
            if not from_fp32:
                hi = lo + want.numel()
                assert torch.equal(state["master"], weights[name][lo:hi]), name
                assert torch.equal(state["master"], want.to(torch.bfloat16).float()), name
                rounded += int((state["master"] != want).sum())
            else:
                assert torch.equal(state["master"], want), name
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[key], saved[name, lo][key]), (name, key)
        assert from_fp32 or rounded > 0  # the rounding did change masters: the saved ones were not used
        with trained.gathered() as a, fresh.gathered() as b:  # the bf16 params are the same either way
            for (name, p), q in zip(a.named_parameters(), b.parameters()):
                assert torch.equal(p, q), name


def test_tag_validation_compares_every_ranks_tag(tmp_path):
    """Two ranks save under different tags: warn (every rank warns, rank 0's
    tag is saved), fail (every rank raises, nothing saved), ignore (rank 0's
    tag, no word). The same tag on every rank: no warning."""
    from tests.dist import run_ranks
    from tests.paths import WORKERS

    run_ranks(WORKERS / "tag_validation.py", 2, [tmp_path, tmp_path / "out"], timeout=240)
    for rank in range(2):
        for mode, res in torch.load(tmp_path / f"out.rank{rank}.pt").items():
            root, differ, same = tmp_path / mode, res["differ"], res["same"]
            assert same["error"] is None and not same["warnings"] and same["path"] == str(root / "same")
            if mode == "fail":
                assert differ["path"] is None, differ
                assert "the ranks' tags differ (rank 0: 't0', rank 1: 't1')" in differ["error"], differ
                assert "tag_validation is 'fail': nothing was saved" in differ["error"]
                assert res["left"] == ["latest", "same", "zero_to_fp32.py"]
                continue
            assert differ["error"] is None and differ["path"] == str(root / "t0"), (mode, differ)
            assert res["left"] == ["latest", "same", "t0", "zero_to_fp32.py"]
            if mode == "warn":
                assert len(differ["warnings"]) == 1 and "rank 0's tag is used" in differ["warnings"][0], differ
            else:
                assert not differ["warnings"], differ


class Frozen(torch.nn.Module):
    """A frozen embedding-like layer before a trained MLP, and a buffer."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.base = torch.nn.Linear(33, 33)
        self.base.requires_grad_(False)
        self.head = make_model()
        self.register_buffer("scale", torch.rand(17) + seed)

    def forward(self, x):
        return self.head(self.base(x)) * self.scale


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_exclude_frozen_parameters_leaves_them_out_and_a_strict_load_keeps_the_models(tmp_path, stage):
    """save_checkpoint(exclude_frozen_parameters=True): the frozen params are
    not in the checkpoint nor in its consolidated state_dict; a strict load
    keeps the loading model's own frozen params and loads all the rest; a
    buffer missing from the checkpoint still fails a strict load."""
    from fastzero.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    config = cfg(zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 100})
    trained, *_ = fastzero.initialize(model=Frozen(seed=1), config=config)
    run_engine(trained, batches(2))
    trained.save_checkpoint(tmp_path / "full")
    trained.save_checkpoint(tmp_path / "lean", exclude_frozen_parameters=True)
    full, lean = consolidate(tmp_path / "full"), get_fp32_state_dict_from_zero_checkpoint(tmp_path / "lean")
    assert {"base.weight", "base.bias", "scale"} <= full.keys()
    assert full.keys() - lean.keys() == {"base.weight", "base.bias"}
    assert all(torch.equal(lean[k], full[k]) for k in lean)

    fresh, *_ = fastzero.initialize(model=Frozen(seed=2), config=config)
    with fresh.gathered() as module:
        own = {k: v.clone() for k, v in module.base.state_dict().items()}
    fresh.load_checkpoint(tmp_path / "lean", load_module_strict=True)
    with trained.gathered() as a, fresh.gathered() as b:
        for name, p in b.named_parameters():
            want = own[name.removeprefix("base.")] if name.startswith("base.") else a.get_parameter(name)
            assert torch.equal(p, want), name
            assert not name.startswith("base.") or not torch.equal(p, a.get_parameter(name)), name
        assert torch.equal(b.scale, a.scale)  # the buffer was loaded

    class Extra(Frozen):
        def __init__(self, seed):
            super().__init__(seed)
            self.register_buffer("extra", torch.zeros(3))

    other, *_ = fastzero.initialize(model=Extra(seed=2), config=config)
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \['extra'\]"):
        other.load_checkpoint(tmp_path / "lean", load_module_strict=True)
    with pytest.warns(UserWarning, match=r"missing from the checkpoint .*: \['extra'\]"):
        other.load_checkpoint(tmp_path / "lean", load_module_strict=False)


def test_the_saved_zero_to_fp32_script_consolidates_as_deepspeeds(tmp_path):
    """save_checkpoint leaves zero_to_fp32.py beside the checkpoints, as
    DeepSpeed does; run in place with DeepSpeed's command line it writes
    the fp32 weights."""
    from tests.paths import REPO

    engine, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": 2}))
    for x, y in batches(2):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    script = tmp_path / "ckpt" / "zero_to_fp32.py"
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), str(out)], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    sd = torch.load(out / "pytorch_model.bin")
    assert set(sd) == set(engine.module_state_dict())
    assert all(torch.equal(sd[k], v) for k, v in engine.module_state_dict().items())
