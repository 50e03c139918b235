"""ds_config.json parsing: DeepSpeed's keys and defaults, and a clear error
for every key, value or combination that cannot work."""

import json
import math
import re

import pytest

from fastzero.config import OPTIMIZER_RULES, ConfigError, ConfigNotSupported, load_config, to_dict

BASE = {"train_micro_batch_size_per_gpu": 4}


def cfg(**extra):
    return {**BASE, **extra}


def test_defaults_are_deepspeeds():
    c = load_config(BASE)
    assert (c.train_batch_size, c.gradient_accumulation_steps) == (4, 1)
    assert c.zero_optimization.stage == 0 and c.zero_optimization.reduce_bucket_size == 500_000_000
    assert c.zero_optimization.contiguous_gradients and c.zero_optimization.reduce_scatter
    assert not c.zero_optimization.overlap_comm
    assert c.zero_optimization.offload_optimizer.device == "none"
    fp16 = c.fp16
    assert (
        fp16.enabled,
        fp16.loss_scale,
        fp16.initial_scale_power,
        fp16.loss_scale_window,
        fp16.hysteresis,
        fp16.consecutive_hysteresis,
        fp16.min_loss_scale,
    ) == (False, 0.0, 16, 1000, 2, False, 1.0)
    assert (c.steps_per_print, c.gradient_clipping, c.wall_clock_breakdown) == (10, 0.0, False)
    assert c.tensorboard.job_name == "DeepSpeedJobName"
    json.dumps(to_dict(c))  # plain values throughout


def test_reads_a_json_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg(zero_optimization={"stage": 2, "overlap_comm": True}, bf16={"enabled": True})))
    c = load_config(str(path), world_size=2)
    assert c.zero_optimization.stage == 2 and c.zero_optimization.overlap_comm and c.bf16.enabled
    assert c.train_batch_size == 8


@pytest.mark.parametrize(
    "given, world, expected",
    [
        (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4), 2, (32, 4, 4)),
        (dict(train_batch_size=32, gradient_accumulation_steps=2), 4, (32, 4, 2)),
        (dict(train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=5), 2, (30, 3, 5)),
        (dict(train_batch_size=16), 4, (16, 4, 1)),
        (dict(train_batch_size=24, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=4), 2, (24, 3, 4)),
    ],
)
def test_any_two_batch_sizes_give_the_third(given, world, expected):
    c = load_config(given, world_size=world)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == expected


def test_inconsistent_batch_sizes_show_the_arithmetic():
    bad = dict(train_batch_size=30, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    with pytest.raises(
        ConfigError,
        match=r"30 != train_micro_batch_size_per_gpu 4 \* gradient_accumulation_steps 2 "
        r"\* world size 2 = 16",
    ):
        load_config(bad, world_size=2)
    with pytest.raises(ConfigError, match="not a multiple"):
        load_config(dict(train_batch_size=30, train_micro_batch_size_per_gpu=4))
    with pytest.raises(ConfigError, match="set train_batch_size or train_micro_batch_size_per_gpu"):
        load_config({"gradient_accumulation_steps": 2})


@pytest.mark.parametrize(
    "config, match",
    [
        (cfg(optimzer={}), r"optimzer: no such key; did you mean 'optimizer'\?"),
        (cfg(zero_optimization={"stgae": 1}), r"zero_optimization.stgae: no such key; did you mean 'stage'\?"),
        (cfg(fp16={"enabled": True, "loss_scale_windows": 5}), r"fp16.loss_scale_windows.*'loss_scale_window'"),
        (cfg(zero_optimization={"stage": 4}), r"zero_optimization.stage = 4: must be <= 3"),
        (cfg(fp16={"enabled": "yes"}), r"fp16.enabled = 'yes': must be true or false"),
        (cfg(steps_per_print=0), r"steps_per_print = 0: must be >= 1"),
        (cfg(steps_per_print=-math.inf), r"steps_per_print = -inf: must be an integer"),
        (cfg(gradient_clipping=math.inf), r"gradient_clipping = inf: must be a number"),
        (cfg(gradient_clipping=-1.0), r"gradient_clipping = -1.0: must be >= 0"),
        (cfg(zero_optimization={"reduce_bucket_size": True}), r"reduce_bucket_size = True: must be an integer"),
        (cfg(fp16={"min_loss_scale": 0}), r"fp16.min_loss_scale = 0: must be > 0"),
        (cfg(optimizer={"type": "Adma"}), r"optimizer.type = Adma: no such optimizer; did you mean 'Adam'\?"),
        (cfg(optimizer={"type": "Adam", "params": {"lr": -1}}), r"optimizer.params.lr = -1: must be >= 0"),
        (cfg(optimizer={"type": "Adam", "params": {"beta": [0.9, 0.99]}}), r"did you mean 'betas'\?"),
        (cfg(optimizer={"type": "AdamW", "params": {"betas": [0.9, 1.5]}}), r"betas = \[0.9, 1.5\]: must be two"),
        (cfg(scheduler={"type": "WarmupLR", "params": {"warmup_num_step": 5}}), r"did you mean 'warmup_num_steps'\?"),
        (cfg(scheduler={"type": "WarmupDecayLR", "params": {}}), r"total_num_steps is required by WarmupDecayLR"),
        (cfg(scheduler={"type": "WarmupLR", "params": {"warmup_type": "cubic"}}), r"must be one of log, linear"),
        (cfg(scheduler={"type": "Cosine"}), r"scheduler.type = Cosine: no such scheduler"),
        (cfg(fp16={"enabled": True}, bf16={"enabled": True}), r"both true: choose one precision"),
        (cfg(zero_optimization={"offload_optimizer": {"device": "cpu"}}), r"offload_optimizer needs stage >= 1"),
        (cfg(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}}), r"offload_param needs stage 3"),
        (cfg(zero_optimization={"stage": 2, "offload_optimizer": {"device": "gpu"}}), r"must be one of none, cpu"),
        (
            cfg(optimizer={"type": "OneBitAdam"}, zero_optimization={"stage": 2}),
            r"OneBitAdam works with .*stage 0 or 1",
        ),
        ({"train_batch_size": 0}, r"train_batch_size = 0: must be >= 1"),
        ([1, 2], r"config must be a path or a dict"),
    ],
)
def test_bad_configs_name_the_key_the_value_and_what_is_allowed(config, match):
    with pytest.raises(ConfigError, match=match):
        load_config(config)


@pytest.mark.parametrize(
    "config, match",
    [
        (
            cfg(comet={"enabled": True}),
            r"comet: a DeepSpeed setting that fastzero does not support: the Comet monitor is not implemented",
        ),
        (cfg(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}), r"'nvme'"),
        (
            cfg(zero_optimization={"memory_efficient_linear": True}),
            r"zero_optimization.memory_efficient_linear: a DeepSpeed setting",
        ),
        (
            cfg(optimizer={"type": "Adam", "params": {"amsgrad": True}}),
            r"optimizer.params.amsgrad = True: .*amsgrad=True",
        ),
        (cfg(optimizer={"type": "AdamW", "params": {"torch_adam": True}}), r"torch_adam = True: .*torch.optim.AdamW"),
    ],
)
def test_valid_deepspeed_settings_not_supported_yet_say_so(config, match):
    with pytest.raises(ConfigNotSupported, match=match):
        load_config(config)


def optimizer_combinations() -> tuple[list, list]:
    """(refused, allowed): every optimizer of OPTIMIZER_RULES at every ZeRO
    stage, with and without offload_optimizer (which needs stage >= 1), as
    (name, stage, offload, the reason from the table or None)."""
    refused, allowed = [], []
    for name, rule in OPTIMIZER_RULES.items():
        for stage in range(4):
            for offload in (False, True) if stage >= 1 else (False,):
                if stage not in rule.stages:
                    refused.append((name, stage, offload, rule.stages_reason))
                elif offload and not rule.offload:
                    refused.append((name, stage, offload, rule.offload_reason))
                else:
                    allowed.append((name, stage, offload, None))
    return refused, allowed


REFUSED, ALLOWED = optimizer_combinations()


def zero_section(stage: int, offload: bool) -> dict:
    return {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}


def test_the_optimizer_table_says_what_combines():
    refused = {(n, s, o) for n, s, o, _ in REFUSED}
    assert ("Lamb", 1, False) in refused and ("OneBitAdam", 2, False) in refused and ("OneBitAdam", 1, True) in refused
    assert ("Adam", 3, True, None) in ALLOWED and ("OneBitAdam", 1, False, None) in ALLOWED
    assert all(reason for *_, reason in REFUSED)


@pytest.mark.parametrize("name, stage, offload, reason", REFUSED)
def test_each_refused_optimizer_combination_names_the_reason_from_the_table(name, stage, offload, reason):
    config = cfg(optimizer={"type": name}, zero_optimization=zero_section(stage, offload))
    with pytest.raises(ConfigNotSupported, match=re.escape(reason)) as info:
        load_config(config)
    expected = f"stage is {stage}" if stage not in OPTIMIZER_RULES[name].stages else "offload_optimizer"
    assert name in str(info.value) and expected in str(info.value)


@pytest.mark.parametrize("name, stage, offload, reason", ALLOWED)
def test_allowed_optimizer_combinations_load(name, stage, offload, reason):
    optimizer = {"type": name}
    if name == "ZeroOneAdam" and stage == 1:  # no local steps at stage 1 (tests/runtime/test_zero_one_adam.py)
        optimizer["params"] = {"local_step_clipper": 1}
    c = load_config(cfg(optimizer=optimizer, zero_optimization=zero_section(stage, offload)))
    assert c.optimizer.type == name and c.zero_optimization.stage == stage


def test_optimizer_names_and_params():
    c = load_config(cfg(optimizer={"type": "adam", "params": {"lr": 3e-4, "betas": [0.8, 0.9], "adam_w_mode": False}}))
    assert c.optimizer.type == "Adam"
    assert c.optimizer.params["betas"] == (0.8, 0.9) and c.optimizer.params["adam_w_mode"] is False
    assert c.optimizer.params["eps"] == 1e-8  # defaults filled in
    lamb = load_config(cfg(optimizer={"type": "LAMB", "params": {"max_coeff": 5.0}})).optimizer
    assert lamb.type == "Lamb" and lamb.params["max_coeff"] == 5.0 and lamb.params["min_coeff"] == 0.01


def adam(**params) -> dict:
    return cfg(optimizer={"type": "AdamW", "params": params})


@pytest.mark.parametrize(
    "params, resolved",
    [
        ({}, {"state_format": "fp32"}),
        ({"state_format": "BF16"}, {"state_format": "bf16"}),
        ({"state_format": "bf16", "seed": 7}, {"state_format": "bf16", "seed": 7}),
        ({"state_format": "int8", "block_size": 1024}, {"state_format": "int8", "block_size": 1024}),
        ({"fp32_optimizer_states": False}, {"state_format": "param_dtype"}),
        ({"fp32_optimizer_states": True, "state_format": "fp32"}, {"state_format": "fp32"}),
        ({"fp32_optimizer_states": False, "state_format": "int8"}, {"state_format": "int8"}),
    ],
)
def test_adam_state_formats_resolve(params, resolved):
    got = load_config(adam(**params)).optimizer.params
    format_keys = ("state_format", "seed", "block_size", "fp32_optimizer_states")
    assert {k: v for k, v in got.items() if k in format_keys} == resolved


@pytest.mark.parametrize(
    "config, message",
    [
        (adam(state_format="int4"), r"state_format = 'int4': must be one of fp32, bf16, param_dtype, int8"),
        (
            adam(state_format="bf16", fp32_optimizer_states=True),
            r"fp32_optimizer_states = true contradicts optimizer.params.state_format = 'bf16': keep one",
        ),
        (adam(fp32_optimizer_states="no"), r"fp32_optimizer_states = 'no': must be true or false"),
        (adam(seed=3), r"seed = 3: the seed of stochastic rounding.*'bf16' or 'int8', or leave seed out"),
        (adam(state_format="bf16", seed=2**32), r"seed = 4294967296: must be <= 4294967295"),
        (adam(state_format="fp32", block_size=256), r"block_size = 256: .*set state_format: 'int8'"),
        (adam(state_format="int8", block_size=100), r"block_size = 100: int8 states take a power of two"),
        (adam(state_formt="int8"), r"state_formt: no such key; did you mean 'state_format'"),
        (
            cfg(optimizer={"type": "Lamb", "params": {"state_format": "bf16"}}),
            r"optimizer.params.state_format: Lamb keeps its states in fp32; .* are Adam's and AdamW's",
        ),
        (
            cfg(optimizer={"type": "OneBitAdam", "params": {"fp32_optimizer_states": False}}),
            r"fp32_optimizer_states: OneBitAdam keeps .* use optimizer.type Adam or AdamW",
        ),
        (cfg(bf16={"enabled": True, "bf16_optimizer_states": True}), r"optimizer.params.state_format: 'bf16'"),
    ],
)
def test_state_formats_are_refused_where_they_cannot_work(config, message):
    with pytest.raises(ConfigError, match=message):
        load_config(config)


def test_scheduler_defaults_are_deepspeeds():
    s = load_config(cfg(scheduler={"type": "WarmupLR"})).scheduler
    # warmup_max_lr None: each param group's lr (DeepSpeed 0.19's WarmupLR)
    assert s.params == dict(warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000, warmup_type="log")
    s = load_config(cfg(scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}))
    assert s.scheduler.params["cycle_second_step_size"] is None and s.scheduler.params["cycle_momentum"] is True


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.json"))
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_batch_size": 8,, }')  # neither JSON nor hjson
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(str(broken))


class FsPath:
    """An os.PathLike that is neither str nor pathlib.Path (as py.path.local)."""

    def __init__(self, path):
        self.path = str(path)

    def __fspath__(self):
        return self.path


def test_any_pathlike_is_a_config_path(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}))
    assert load_config(FsPath(path), world_size=2).gradient_accumulation_steps == 2
    with pytest.raises(ConfigError, match=f"config file {re.escape(str(tmp_path))}.*nope.json does not exist"):
        load_config(FsPath(tmp_path / "nope.json"))
    with pytest.raises(ConfigError, match="config must be a path or a dict, got int"):
        load_config(3)


HJSON = """
# DeepSpeed reads every config with hjson: comments, bare keys, optional commas
{
  train_batch_size: 16  // the global batch
  train_micro_batch_size_per_gpu: 4
  optimizer: {
    type: AdamW
    params: {lr: 0.001, betas: [0.9, 0.95]}
  }
  /* a block comment */
}
"""


def test_an_hjson_file_with_comments_is_read(tmp_path):
    pytest.importorskip("hjson")
    path = tmp_path / "ds_config.hjson"
    path.write_text(HJSON)
    c = load_config(path, world_size=2)
    assert (c.train_batch_size, c.gradient_accumulation_steps) == (16, 2)
    assert c.optimizer.type == "AdamW" and tuple(c.optimizer.params["betas"]) == (0.9, 0.95)


def test_hjson_keeps_the_duplicate_key_check(tmp_path):
    pytest.importorskip("hjson")
    path = tmp_path / "dup.hjson"
    path.write_text("{\n  train_batch_size: 8\n  optimizer: {\n    type: AdamW\n    type: Adam\n  }\n}\n")
    with pytest.raises(ConfigError, match=r"optimizer.type: the key 'type' appears twice"):
        load_config(path)


def test_hjson_text_that_is_no_object_is_refused(tmp_path):
    pytest.importorskip("hjson")
    path = tmp_path / "words.json"
    path.write_text("just some words")  # hjson: one quoteless string
    with pytest.raises(ConfigError, match="not valid JSON .*as hjson it is a str, not an object"):
        load_config(path)


def test_without_hjson_a_non_json_file_says_how_to_read_it(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "hjson", None)  # import hjson raises ImportError
    path = tmp_path / "ds_config.hjson"
    path.write_text(HJSON)
    with pytest.raises(ConfigError, match="is not valid JSON .*pip install hjson"):
        load_config(path)


@pytest.mark.parametrize(
    "zero, world, match",
    [
        ({"stage": 0, "zero_quantized_weights": True}, 1, r"zero_quantized_weights needs stage >= 1"),
        ({"stage": 0, "zero_quantized_gradients": True}, 1, r"zero_quantized_gradients needs stage >= 1.*1-bit"),
        ({"stage": 2, "zero_hpz_partition_size": 2}, 4, r"zero_hpz_partition_size = 2 needs stage 3"),
        ({"stage": 3, "zero_hpz_partition_size": 3}, 4, r"does not divide the data-parallel world size 4"),
        (
            {"stage": 3, "zero_quantized_gradients": True, "zero_quantized_block_size": 255},
            4,
            r"zero_quantized_block_size = 255 with int4 gradients: .* blocks must be even",
        ),
        ({"stage": 3, "zero_quantized_gradients_bits": 5}, 4, r"must be 4 \(int4\) or 8 \(int8\)"),
        ({"stage": 3, "zero_quantized_gradients_bits": 2}, 4, r"must be 4 \(int4\) or 8 \(int8\)"),
        ({"stage": 3, "zero_quantized_gradients_bits": 16}, 4, r"must be 4 \(int4\) or 8 \(int8\)"),
        ({"stage": 3, "zero_quantized_gradients_rounding": "up"}, 4, r"must be one of stochastic, nearest"),
        ({"stage": 2, "zero_quantized_nontrainable_weights": True}, 4, r"needs stage 3"),
    ],
)
def test_zeropp_settings_that_cannot_work_say_why(zero, world, match):
    with pytest.raises(ConfigError, match=match):
        load_config({"train_batch_size": 4 * world, "zero_optimization": zero}, world_size=world)


def test_zeropp_refuses_a_float_communication_dtype_and_the_one_bit_optimizers():
    zero = {"stage": 2, "zero_quantized_gradients": True}
    with pytest.raises(ConfigError, match="travel as int4/int8 codes"):
        load_config({"train_batch_size": 8, "communication_data_type": "fp32", "zero_optimization": zero}, world_size=2)
    onebit = {"type": "OneBitAdam", "params": {"lr": 1e-3}}
    with pytest.raises(ConfigError, match="compress their own exchange"):
        config = {"train_batch_size": 8, "optimizer": onebit, "zero_optimization": {**zero, "stage": 1}}
        load_config(config, world_size=2)


def test_zeropp_settings_that_work_parse():
    zero = {
        "stage": 3,
        "zero_quantized_weights": True,
        "zero_quantized_gradients": True,
        "zero_hpz_partition_size": 2,
        "zero_quantized_gradients_bits": 8,
        "zero_quantized_block_size": 64,
        "zero_quantized_gradients_rounding": "nearest",
    }
    z = load_config({"train_batch_size": 16, "zero_optimization": zero}, world_size=4).zero_optimization
    assert (z.zero_quantized_weights, z.zero_quantized_gradients, z.zero_hpz_partition_size) == (True, True, 2)
    assert (z.zero_quantized_gradients_bits, z.zero_quantized_block_size) == (8, 64)
    assert z.zero_quantized_gradients_rounding == "nearest"


def test_deepspeeds_false_defaults_of_unoffered_optimizer_switches_are_accepted():
    params = {"lr": 1e-3, "torch_adam": False, "amsgrad": False}
    opt = load_config(cfg(optimizer={"type": "AdamW", "params": params})).optimizer
    assert "torch_adam" not in opt.params and "amsgrad" not in opt.params and opt.params["lr"] == 1e-3
