"""Checkpoints: exact resume, resume at another world size and stage,
consolidation, a crash mid-save, and checkpoints that do not fit."""

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
