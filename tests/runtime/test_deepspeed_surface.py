"""The engine's DeepSpeed surface (issue 14, landing in steps): the
checkpoint methods' signatures and arguments, was_step_applied,
empty_partition_cache."""

import inspect
import math

import pytest
import torch

import fastzero
import fastzero.runtime.engine
from tests.runtime.test_engine_single import batches, cfg
from tests.workers.train_zero import make_model

# DeepSpeed 0.19's DeepSpeedEngine signatures: positional callers depend on the order
DS_LOAD = ["load_dir", "tag", "load_module_strict", "load_optimizer_states", "load_lr_scheduler_states"]
DS_LOAD += ["load_module_only", "custom_load_fn"]
DS_SAVE = ["save_dir", "tag", "client_state", "save_latest", "exclude_frozen_parameters"]


def train(engine, data):
    for x, y in data:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


def test_checkpoint_methods_take_deepspeeds_arguments_in_its_order():
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg())
    assert list(inspect.signature(engine.load_checkpoint).parameters) == DS_LOAD
    assert list(inspect.signature(engine.save_checkpoint).parameters) == DS_SAVE


def test_refused_checkpoint_arguments_are_named(tmp_path):
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg())
    with pytest.raises(NotImplementedError, match="custom_load_fn"):
        engine.load_checkpoint(tmp_path, custom_load_fn=lambda *a: None)


@pytest.mark.parametrize("stage", [1, 3])
def test_load_module_only_takes_the_weights_and_nothing_else(tmp_path, stage):
    config = cfg(zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 100}, bf16={"enabled": True})
    trained, *_ = fastzero.initialize(model=make_model(), config=config)
    train(trained, batches(3))
    trained.save_checkpoint(tmp_path)
    fresh, *_ = fastzero.initialize(model=make_model(), config=config)
    path, client = fresh.load_checkpoint(tmp_path, load_module_only=True)
    assert path.endswith("global_step3") and client == {}
    with trained.gathered() as a, fresh.gathered() as b:
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), name
    assert fresh.global_steps == 0 and fresh.micro_steps == 0
    for group in fresh.optimizer.param_groups:
        assert int(float(group.get("step", 0))) == 0
        for p in group["params"]:
            state = fresh.optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                assert key not in state or not state[key].any(), key


def test_was_step_applied_and_optimizer_overflow_follow_skipped_steps():
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg())
    assert not engine.was_step_applied() and not engine.optimizer.overflow
    train(engine, batches(1))
    assert engine.was_step_applied() and not engine.optimizer.overflow
    x, y = batches(1)[0]
    with pytest.warns(RuntimeWarning, match="skipped on every rank"):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y) * math.nan)
        engine.step()
    assert not engine.was_step_applied() and engine.skipped_steps == 1
    assert engine.optimizer.overflow  # DeepSpeed's ZeRO optimizers' flag, which Accelerate reads
    train(engine, batches(1))
    assert not engine.optimizer.overflow


def test_empty_partition_cache_releases_gathered_params_at_stage3():
    config = cfg(zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 100})
    engine, *_ = fastzero.initialize(model=make_model(), config=config)
    engine.fetcher.gather_all()
    assert all(p.numel() > 0 for p in engine.module.parameters())
    engine.empty_partition_cache()
    sizes = {n: p.numel() for n, p in engine.module.named_parameters()}
    assert sizes["0.weight"] == 0 and sizes["2.weight"] == 0, sizes  # persistent small ones stay
    train(engine, batches(1))  # and training goes on
    plain, *_ = fastzero.initialize(model=make_model(), config=cfg())
    plain.empty_partition_cache()  # a no-op below stage 3


def test_deepspeeds_config_getters_and_attributes(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    config = cfg(bf16={"enabled": True}, gradient_clipping=0.5, zero_optimization={"stage": 2})
    data = torch.utils.data.TensorDataset(torch.randn(16, 33), torch.randn(16, 17))
    engine, _, loader, _ = fastzero.initialize(model=make_model(), config=config, training_data=data)
    assert engine.config == config  # the config given, as DeepSpeed's engine.config
    assert (engine.fp16_enabled(), engine.bfloat16_enabled(), engine.zero_optimization_stage()) == (False, True, 2)
    assert engine.gradient_clipping() == 0.5 and engine.optimizer_name() == "adamw" and engine.scheduler_name() is None
    assert engine.get_mom() == [g["betas"] for g in engine.optimizer.param_groups]
    assert engine.local_rank == 0 and engine.training_dataloader is loader and engine.data_parallel_group is None
    assert engine.zero_optimization() and engine.zero_offload_optimizer() is None and not engine.pipeline_parallelism
    assert (engine.steps_per_print(), engine.wall_clock_breakdown(), engine.dataloader_drop_last()) == (
        10,
        False,
        False,
    )
    assert engine.get_batch_info() == (8, 8, 1) and engine.communication_data_type == torch.bfloat16
    assert engine.client_optimizer is None and engine.client_lr_scheduler is None
    engine.set_train_micro_batch_size(4)
    assert engine.get_batch_info() == (4, 4, 1)
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    client, *_ = fastzero.initialize(model=model, config={"train_micro_batch_size_per_gpu": 8}, optimizer=sgd)
    assert client.optimizer_name() == "SGD" and client.get_mom() == [0.9]


def test_deepspeeds_zero_config_getters_read_the_config():
    zero = {
        "stage": 3,
        "overlap_comm": False,
        "reduce_bucket_size": 1234,
        "stage3_prefetch_bucket_size": 55,
        "stage3_param_persistence_threshold": 77,
        "stage3_max_live_parameters": 999,
        "stage3_max_reuse_distance": 888,
        "stage3_gather_16bit_weights_on_model_save": True,
        "sub_group_size": 4321,
        "offload_optimizer": {"device": "cpu"},
    }
    config = cfg(zero_optimization=zero, gradient_predivide_factor=2.0, zero_allow_untested_optimizer=True)
    engine, *_ = fastzero.initialize(model=make_model(), config=config)
    got = {name: getattr(engine, name)() for name in DS_GETTERS}
    assert got == {
        "zero_optimization_partition_weights": True,
        "zero_optimization_partition_gradients": True,
        "zero_gather_16bit_weights_on_model_save": True,
        "zero_overlap_comm": False,
        "zero_reduce_bucket_size": 1234,
        "zero_prefetch_bucket_size": 55,
        "zero_param_persistence_threshold": 77,
        "zero_max_live_parameters": 999,
        "zero_max_reuse_distance": 888,
        "zero_sub_group_size": 4321,
        "zero_cpu_offload": True,
        "zero_offload_param": None,
        "zero_quantized_weights": False,
        "zero_hpz_partition_size": 1,
        "zero_allow_untested_optimizer": True,
        "postscale_gradients": True,
        "gradient_predivide_factor": 2.0,
        "initial_dynamic_scale": 2.0**16,
        "amp_enabled": False,
        "autotp_size": 0,
        "get_data_parallel_rank": 0,
        "get_model_parallel_rank": 0,
        "get_tensor_parallel_rank": 0,
    }
    plain, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": 1}))
    assert not plain.zero_optimization_partition_gradients() and not plain.zero_cpu_offload()


DS_GETTERS = (
    "zero_optimization_partition_weights",
    "zero_optimization_partition_gradients",
    "zero_gather_16bit_weights_on_model_save",
    "zero_overlap_comm",
    "zero_reduce_bucket_size",
    "zero_prefetch_bucket_size",
    "zero_param_persistence_threshold",
    "zero_max_live_parameters",
    "zero_max_reuse_distance",
    "zero_sub_group_size",
    "zero_cpu_offload",
    "zero_offload_param",
    "zero_quantized_weights",
    "zero_hpz_partition_size",
    "zero_allow_untested_optimizer",
    "postscale_gradients",
    "gradient_predivide_factor",
    "initial_dynamic_scale",
    "amp_enabled",
    "autotp_size",
    "get_data_parallel_rank",
    "get_model_parallel_rank",
    "get_tensor_parallel_rank",
)


def test_save_fp16_model_and_frozen_params_in_16bit_saves(tmp_path):
    """save_fp16_model (DeepSpeed's older name) writes what save_16bit_model writes; exclude_frozen_parameters
    leaves the frozen params out."""
    model = make_model()
    model[3].weight.requires_grad_(False)
    engine, *_ = fastzero.initialize(model=model, config=cfg(bf16={"enabled": True}))
    train(engine, batches(2))
    assert engine.save_fp16_model(tmp_path / "a") and engine.save_16bit_model(tmp_path / "b")
    a, b = (torch.load(tmp_path / d / "pytorch_model.bin") for d in ("a", "b"))
    assert a.keys() == b.keys() == engine.module.state_dict().keys()
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == torch.bfloat16 for k in a)
    assert engine.save_16bit_model(tmp_path / "c", exclude_frozen_parameters=True)
    c = torch.load(tmp_path / "c" / "pytorch_model.bin")
    assert c.keys() == a.keys() - {"3.weight"}


def test_zero3_consolidated_16bit_state_dict_is_the_whole_model_on_rank_0():
    """Accelerate's route to a stage-3 model's weights."""
    model = make_model()
    model[0].bias.requires_grad_(False)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    engine, *_ = fastzero.initialize(model=model, config=cfg(bf16={"enabled": True}, zero_optimization=zero))
    train(engine, batches(2))
    sd = engine._zero3_consolidated_16bit_state_dict()
    with engine.gathered() as module:
        want = {k: v.detach().clone() for k, v in module.state_dict().items()}
    assert all(p.numel() == 0 for p in engine.module.parameters() if p.requires_grad)  # partitioned again
    assert sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in want)
    assert sd["0.weight"].dtype == torch.bfloat16 and sd["0.weight"].shape == (65, 33)
    assert "0.bias" not in engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    flat, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": 2}))
    with pytest.raises(ValueError, match="module_state_dict"):
        flat._zero3_consolidated_16bit_state_dict()


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_keeps_gradients_local_until_a_backward_outside(stage):
    """DeepSpeed's no_sync(): the backward inside reduces nothing; the one after reduces the sum, and the step
    equals two backwards before one step."""
    data = batches(3)
    want, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": stage}))
    got, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": stage}))
    loss = lambda engine, i: torch.nn.functional.mse_loss(engine(data[i][0]), data[i][1])
    reductions = lambda engine: [e for e in engine.comm.record if e.op in ("all_reduce", "reduce_scatter")]
    for engine in (want, got):
        train(engine, data[2:])
    before = len(reductions(got))
    with got.no_sync():
        got.backward(loss(got, 0))
        assert len(reductions(got)) == before  # nothing reduced inside
        with pytest.raises(RuntimeError, match="inside no_sync"):
            got.step()
        with pytest.raises(RuntimeError, match="does not nest"), got.no_sync():
            pass
    got.backward(loss(got, 1))
    assert len(reductions(got)) > before
    got.step()
    want.backward(loss(want, 0))
    want.backward(loss(want, 1))
    want.step()
    with got.gathered() as a, want.gathered() as b:
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    stage2, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": 2}))
    with pytest.raises(RuntimeError, match="stage 2"), stage2.no_sync():
        pass


class UserModel(torch.nn.Module):
    """The test model under a forward of a script's own: Module.compile traces user code (a model made of
    torch's modules alone, such as an nn.Sequential, runs uncompiled under it, in DeepSpeed too)."""

    def __init__(self):
        super().__init__()
        self.net = make_model()

    def forward(self, x):
        return self.net(x)


def test_compile_compiles_the_wrapped_module_and_trains_the_same():
    """DeepSpeed's engine.compile(backend, compile_kwargs): the module's forward through torch.compile (a
    backend that keeps the traced graph and runs it as traced), the same weights as uncompiled; refused at
    stage 3."""
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    plain, *_ = fastzero.initialize(model=UserModel(), config=cfg(zero_optimization={"stage": 1}))
    compiled, *_ = fastzero.initialize(model=UserModel(), config=cfg(zero_optimization={"stage": 1}))
    assert not compiled.is_compiled
    compiled.compile(backend=backend, compile_kwargs={"dynamic": False})
    compiled.compile(backend="eager")  # once per engine: a second call changes nothing
    assert compiled.is_compiled
    data = batches(3)
    train(plain, data)
    train(compiled, data)
    assert graphs  # the forward ran through the compiled graph
    assert all(torch.equal(p, q) for p, q in zip(plain.module.parameters(), compiled.module.parameters()))
    stage3, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": 3}))
    with pytest.raises(NotImplementedError, match="stage 3"):
        stage3.compile()


def test_set_gradient_accumulation_boundary_decides_when_step_steps():
    """Accelerate's way: the boundary set before each micro-batch, step()
    called after each; only the micro-batch marked True steps."""
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg(gradient_accumulation_steps=3))
    for boundary, stepped in ((False, 0), (False, 0), (True, 1), (False, 1), (True, 2)):
        engine.set_gradient_accumulation_boundary(boundary)
        assert engine.is_gradient_accumulation_boundary() is boundary
        train(engine, batches(1))
        assert engine.global_steps == stepped
    with pytest.raises(TypeError, match="give True or False"):
        engine.set_gradient_accumulation_boundary(1)


def test_set_train_batch_size_changes_the_accumulation_steps():
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg())
    engine.set_train_batch_size(24)
    assert engine.gradient_accumulation_steps() == 3 and engine.train_batch_size() == 24
    with pytest.raises(ValueError, match="not a multiple of micro-batch 8"):
        engine.set_train_batch_size(20)


def test_module_state_dict_and_load_module_state_dict_round_trip():
    engine, *_ = fastzero.initialize(model=make_model(), config=cfg(zero_optimization={"stage": 1}))
    saved = {k: v.clone() for k, v in engine.module_state_dict().items()}
    train(engine, batches(2))
    assert not all(torch.equal(saved[k], v) for k, v in engine.module_state_dict().items())
    engine.load_module_state_dict({"module": saved})
    assert all(torch.equal(saved[k], v) for k, v in engine.module_state_dict().items())
    engine.module[0].weight.requires_grad_(False)
    assert "0.weight" not in engine.module_state_dict(exclude_frozen_parameters=True)
    with pytest.raises(ValueError, match="under 'module'"):
        engine.load_module_state_dict(saved)


def test_deepspeeds_top_level_names(caplog):
    import fastzero.pipe
    import fastzero.runtime.pipe_engine

    assert fastzero.pipe is fastzero.__getattr__("pipe") and fastzero.PipelineModule is fastzero.pipe.PipelineModule
    assert fastzero.DeepSpeedEngine is fastzero.runtime.engine.Engine
    assert fastzero.PipelineEngine is fastzero.runtime.pipe_engine.PipelineEngine
    assert fastzero.logger is fastzero.utils.logger and fastzero.logger.name == "fastzero"
    with caplog.at_level("INFO", logger="fastzero"):
        fastzero.log_dist("hello", ranks=[0])  # no process group: every process logs, as DeepSpeed's
    assert "[Rank -1] hello" in caplog.text


def test_get_accelerator_answers_as_deepspeeds_cpu_accelerator(monkeypatch):
    import fastzero.accelerator as acc

    monkeypatch.setattr(acc, "_current", None)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    a = fastzero.accelerator.get_accelerator()
    assert a is acc.get_accelerator()  # one per process
    assert (a.device_name(), a.device_name(0), a.current_device_name(), a.device_count()) == ("cpu", "cpu:0", "cpu", 1)
    assert a.is_available() and a.communication_backend_name() == "gloo" and a.device() == torch.device("cpu")
    assert a.on_accelerator(torch.zeros(1)) and a.memory_allocated() > 0 and a.max_memory_allocated() > 0
    a.manual_seed(3)
    first = torch.rand(2)
    a.manual_seed(3)
    assert torch.equal(torch.rand(2), first)
    a.synchronize()
    monkeypatch.setattr(acc, "_current", None)
    monkeypatch.setenv("DS_ACCELERATOR", "tpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='tpu'"):
        acc.get_accelerator()


# DeepSpeed module paths that training scripts reach through `import fastzero as deepspeed`, as attributes only
DS_PATHS = {
    "ops.adam.DeepSpeedCPUAdam": "fastzero.ops.adam.optimizers.CPUAdam",
    "runtime.engine.DeepSpeedEngine": "fastzero.runtime.engine.Engine",
    "runtime.utils.see_memory_usage": "fastzero.runtime.utils.see_memory_usage",
    "runtime.activation_checkpointing.checkpointing.checkpoint": "fastzero.parallel.checkpointing.checkpoint",
    "runtime.activation_checkpointing.checkpointing.get_cuda_rng_tracker": "fastzero.parallel.rng.get_cuda_rng_tracker",
    "runtime.pipe.topology.PipeModelDataParallelTopology": "fastzero.parallel.topology.PipeModelDataParallelTopology",
    "runtime.pipe.topology.PipeDataParallelTopology": "fastzero.parallel.topology.PipeDataParallelTopology",
    "runtime.pipe.ProcessTopology": "fastzero.parallel.topology.ProcessTopology",
    "runtime.pipe.PipelineModule": "fastzero.pipe.module.PipelineModule",
    "runtime.pipe.module.TiedLayerSpec": "fastzero.pipe.module.TiedLayerSpec",
    "runtime.pipe.engine.PipelineEngine": "fastzero.runtime.pipe_engine.PipelineEngine",
}


def test_deepspeeds_module_paths_reach_the_same_objects():
    """In a fresh process (nothing imported but fastzero), each DeepSpeed path resolves attribute by attribute to
    fastzero's object, and the schedules' names are DeepSpeed's."""
    import json
    import subprocess
    import sys

    script = f"""
import importlib, json
import fastzero as deepspeed
out = {{}}
for path, where in {DS_PATHS!r}.items():
    obj = deepspeed
    for part in path.split("."):
        obj = getattr(obj, part)
    module, name = where.rsplit(".", 1)
    out[path] = obj is getattr(importlib.import_module(module), name)
out["schedules"] = deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES
print(json.dumps(out))
"""
    got = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    assert got.pop("schedules") == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert got == dict.fromkeys(DS_PATHS, True)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        fastzero.runtime.nothing  # noqa: B018


def test_see_memory_usage_prints_deepspeeds_lines_only_when_forced(capsys, monkeypatch):
    from fastzero.runtime.utils import see_memory_usage

    see_memory_usage("quiet")
    assert capsys.readouterr().out == ""
    keep = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB resident while it prints
    see_memory_usage("after building the model", force=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "after building the model"
    ma = lines[1].split()
    assert ma[0] == "MA" and ma[2:4] == ["GB", "Max_MA"] and ma[5:7] == ["GB", "CA"] and ma[8:10] == ["GB", "Max_CA"]
    assert float(ma[1]) >= keep.numel() * 4 / 1024**3 - 0.01 and float(ma[4]) >= float(ma[1]) - 0.01
    assert float(ma[7]) == 0.0  # the CPU reserves nothing apart
    assert lines[2].startswith("CPU Virtual Memory:  used = ") and lines[2].endswith("%")
    # with a process group, only rank 0 prints
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    see_memory_usage("rank 1", force=True)
    assert capsys.readouterr().out == ""
