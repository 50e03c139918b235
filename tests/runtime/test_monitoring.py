"""The monitors DeepSpeed's config turns on: ``memory_breakdown`` (what it
logs against ``Engine.memory_breakdown()``), ``wandb`` (the real package,
offline: what the run files hold against the monitor's own record) and
``flops_profiler`` (its report at the chosen step only, on rank 0, with the
hand-counted FLOPs, and training unchanged by it); their config keys."""

import glob
import json
import logging
import math
import re
import struct
import sys
from pathlib import Path

import pytest
import torch

import fastzero
from fastzero.config import ConfigError, load_config
from fastzero.profiling import report
from tests.dist import run_ranks
from tests.workers.train_zero import make_model

WORKER = Path(__file__).resolve().parent.parent / "workers" / "monitor_ranks.py"
MLP_MACS = 8 * (33 * 65 + 65 * 17)  # make_model's two Linears on a micro-batch of 8 (LayerNorm, GELU: 0)
MLP_PARAMS = 33 * 65 + 65 + 65 * 17 + 17 + 17 * 2


def cfg(**over):
    base = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    base.update(over)
    return base


def train(config, steps=4, model=None):
    engine, *_ = fastzero.initialize(model=model or make_model(), config=config)
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = torch.randn(8, 33, generator=gen), torch.randn(8, 17, generator=gen)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
    engine.monitor.close()
    return engine


# -- config -------------------------------------------------------------------------------------


def test_deepspeed_defaults():
    c = load_config(cfg())
    assert c.memory_breakdown is False
    assert (c.wandb.enabled, c.wandb.group, c.wandb.team, c.wandb.project) == (False, None, None, "deepspeed")
    f = c.flops_profiler
    assert (f.enabled, f.recompute_fwd_factor, f.profile_step, f.module_depth, f.top_modules, f.detailed) == (
        False,
        0.0,
        1,
        -1,
        1,
        True,
    )
    assert f.output_file is None


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(memory_breakdown="yes"), r"memory_breakdown = 'yes': must be true or false"),
        (dict(wandb={"enable": True}), r"wandb.enable: no such key; did you mean 'enabled'"),
        (dict(wandb={"project": 3}), r"wandb.project = 3: must be a string"),
        (dict(wandb={"entity": "me"}), r"wandb.entity: no such key.*Allowed: enabled, group, project, team"),
        (dict(flops_profiler={"top_module": 3}), r"flops_profiler.top_module: no such key; did you mean 'top_modules'"),
        (dict(flops_profiler={"top_modules": 0}), r"flops_profiler.top_modules = 0: must be >= 1"),
        (dict(flops_profiler={"module_depth": -2}), r"flops_profiler.module_depth = -2: must be >= -1"),
        (dict(flops_profiler={"profile_step": -1}), r"flops_profiler.profile_step = -1: must be >= 0"),
        (dict(flops_profiler={"recompute_fwd_factor": -0.5}), r"recompute_fwd_factor = -0.5: must be >= 0"),
        (dict(flops_profiler={"output_file": 7}), r"flops_profiler.output_file = 7: must be a string"),
    ],
)
def test_bad_keys_and_values_are_refused(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(cfg(**over))


# -- memory_breakdown -------------------------------------------------------------------------------


def memory_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "fastzero"]


def test_memory_breakdown_logs_at_steps_per_print(caplog):
    caplog.set_level(logging.INFO, logger="fastzero")
    engine = train(cfg(steps_per_print=2, memory_breakdown=True), steps=5)
    lines = memory_lines(caplog)
    assert [ln for ln in lines if ln.startswith("Engine after step")] == ["Engine after step 2", "Engine after step 4"]
    # the model states: the engine's own count, kind by kind (unchanged since step 2: no new state after step 1)
    states = [ln for ln in lines if ln.startswith("Model states")]
    expected = engine.memory_breakdown()
    listed = ", ".join(f"{k} {v}" for k, v in expected.items())
    assert states == [f"Model states (bytes on rank 0): {listed}, total {sum(expected.values())}"] * 2
    # exp_avg and exp_avg_sq in fp32; the flat params, padded to the layout's alignment, at least the model's
    assert expected["optimizer"] == 2 * 4 * MLP_PARAMS and expected["params"] >= 4 * MLP_PARAMS
    rss = [re.fullmatch(r"Process RSS ([\d.]+) GB Max_RSS ([\d.]+) GB", ln) for ln in lines if "RSS" in ln]
    assert len(rss) == 2 and all(m and 0 < float(m[1]) <= float(m[2]) for m in rss)


def test_steps_per_print_infinity_never_reports():
    """Accelerate writes steps_per_print: inf into every config it builds (DeepSpeed takes it: never print)."""
    engine = train(cfg(steps_per_print=math.inf), steps=3)
    assert engine.steps_per_print() == math.inf and engine.monitor.history == []
    assert len(train(cfg(steps_per_print=1), steps=3).monitor.history) == 3  # the same run reports when asked


def test_no_memory_lines_without_it(caplog):
    caplog.set_level(logging.INFO, logger="fastzero")
    train(cfg(steps_per_print=2), steps=2)
    assert not [ln for ln in memory_lines(caplog) if "Model states" in ln or "RSS" in ln]


# -- wandb ------------------------------------------------------------------------------------------


def wandb_records(run_dir: str):
    """The records of an offline run's .wandb file (leveldb-log framing:
    a 7-byte file header, 32 KiB blocks, records split into typed chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(f"{run_dir}/run-*.wandb")
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += block - pos % block
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, or last chunk
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_logs_deepspeeds_tags(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from fastzero.runtime.monitor import TB_TAGS

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = cfg(steps_per_print=1, wandb={"enabled": True, "project": "proj", "group": "grp", "team": "tm"})
    engine = train(config, steps=3)  # its monitor.close() finishes the run
    import wandb

    wandb.teardown()  # the service process writes the run file: wait until it has shut down
    (run_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    records = list(wandb_records(run_dir))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.run_group, run.entity) == ("proj", "grp", "tm")
    history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    assert [h.step.num for h in history] == [8, 16, 24]  # DeepSpeed's x axis: samples
    for h, row in zip(history, engine.monitor.history, strict=True):
        items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in h.item}
        logged = {k: v for k, v in items.items() if not k.startswith("_")}  # _step, _runtime: wandb's own
        assert logged == {tag: row[key] for key, tag in TB_TAGS.items()}
    assert all(row["loss"] > 0 for row in engine.monitor.history)


def test_wandb_missing_names_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now fails, as where it is not installed
    with pytest.raises(ConfigError, match=r"wandb.enabled needs the wandb package.*pip install wandb"):
        fastzero.initialize(model=make_model(), config=cfg(wandb={"enabled": True}))


# -- flops_profiler ---------------------------------------------------------------------------------


def summary_value(text: str, label: str) -> str:
    return next(ln for ln in text.splitlines() if ln.startswith(label)).split(":", 1)[1].strip()


@pytest.mark.parametrize("gas", [1, 2])
def test_flops_profiler_reports_once_at_its_step(capsys, gas):
    profiler = {"enabled": True, "profile_step": 2, "recompute_fwd_factor": 1.0, "top_modules": 2}
    config = cfg(flops_profiler=profiler, gradient_accumulation_steps=gas, steps_per_print=100)
    engine = train(config, steps=5)
    out = capsys.readouterr().out
    assert out.count("fastzero Flops Profiler") == 1
    assert "Profile Summary at step 3:" in out  # the step after profile_step (2) completed steps
    assert summary_value(out, "world size:") == "1" and summary_value(out, "batch size per GPU:") == "8"
    assert summary_value(out, "fwd MACs per GPU:") == report.macs_to_string(MLP_MACS)
    assert summary_value(out, "fwd flops per GPU:") == report.number_to_string(2 * MLP_MACS).strip()
    assert summary_value(out, "params per GPU:") == report.params_to_string(MLP_PARAMS)
    for label in ("bwd latency:", "step latency:", "iter latency:", "samples/second:"):
        assert label in out
    assert "bwd FLOPS per GPU = 3 * fwd flops per GPU / bwd latency:" in out  # 2 + recompute_fwd_factor
    assert "fwd+bwd FLOPS per GPU = 4 * fwd flops per GPU / (fwd+bwd latency):" in out
    assert "(0): Linear(" in out and "Detailed Profile per GPU" in out
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in engine.module.modules())
    assert engine.monitor.profiler.started is False  # ended after its report


def test_flops_profiler_leaves_training_unchanged(capsys, tmp_path):
    out_file = tmp_path / "prof" / "flops.txt"
    profiler = {"enabled": True, "profile_step": 0, "output_file": str(out_file), "detailed": False}
    plain = train(cfg(), steps=3)
    profiled = train(cfg(flops_profiler=profiler), steps=3)
    for (name, a), b in zip(profiled.module.named_parameters(), plain.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert "Flops Profiler" not in capsys.readouterr().out  # the report went to the file
    text = out_file.read_text()
    assert "Profile Summary at step 1:" in text and "Detailed Profile" not in text
    assert summary_value(text, "fwd MACs per GPU:") == report.macs_to_string(MLP_MACS)


def test_two_ranks_only_rank0_reports(tmp_path):
    pytest.importorskip("wandb")
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    outs = run_ranks(WORKER, 2, ["3"], timeout=240, env=env)
    first, second = outs
    assert "rank 0 done" in first and "rank 1 done" in second
    assert first.count("fastzero Flops Profiler") == 1 and "Profile Summary at step 2:" in first
    # stage 3: the params' whole shapes, not the empty partitioned ones; micro-batch 4
    assert summary_value(first, "params per GPU:") == report.params_to_string(MLP_PARAMS)
    assert summary_value(first, "fwd MACs per GPU:") == report.macs_to_string(MLP_MACS // 2)
    assert summary_value(first, "world size:") == "2"
    assert [ln for ln in first.splitlines() if ln.startswith("Engine after step")] == [
        f"Engine after step {i}" for i in (1, 2, 3)
    ]
    assert "Model states (bytes on rank 0)" in first
    assert "Flops Profiler" not in second and "Engine after step" not in second and "Model states" not in second
    assert len(glob.glob(str(tmp_path / "wandb" / "offline-run-*"))) == 1  # rank 0's run only
