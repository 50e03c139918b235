"""ds_config.json -> validated objects.

DeepSpeed's keys, meanings and defaults (DeepSpeed 0.19's documentation), so
a DeepSpeed config works unchanged. Every problem is a :class:`ConfigError`
that names the key (as a dotted path), the value and what is allowed: a key
that does not exist (with a did-you-mean), a value of the wrong type or range,
a combination that cannot work. What fastzero does with each DeepSpeed key is
one table, :data:`fastzero.config_keys.KEYS` (docs/config_keys.md): a valid
DeepSpeed setting that fastzero does not implement raises
:class:`ConfigNotSupported` with the table's reason; nothing is ignored.
Which optimizer works with which ZeRO stage and with offload is one table,
:data:`OPTIMIZER_RULES`, which the engine's optimizer builder reads too.

    cfg = load_config("ds_config.json", world_size=4)
    cfg.train_micro_batch_size_per_gpu, cfg.zero_optimization.stage, cfg.fp16.enabled
"""

from __future__ import annotations

import difflib
import json
import math
import os
import warnings
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from fastzero.config_keys import ALIAS, REFUSED, lookup, refusal


class ConfigError(ValueError):
    """A config that cannot work, with the key, the value and what is allowed."""


class ConfigNotSupported(ConfigError):
    """A valid DeepSpeed setting that this version of fastzero does not implement."""


def _opt(
    default: Any,
    kind: str,
    *,
    choices: tuple = (),
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    nullable: bool = False,
    infinite: bool = False,
) -> Any:
    """A field with its check: kind is bool, int, float, str, str_list, choice or dict;
    `infinite`: a number that may also be infinity (never)."""
    meta = dict(kind=kind, choices=choices, low=low, high=high, low_open=low_open, nullable=nullable)
    meta["infinite"] = infinite
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


def _section(cls: type) -> Any:
    return field(default_factory=cls, metadata=dict(kind="section", section=cls))


# -- sections -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FP16Config:
    enabled: bool = _opt(False, "bool")
    loss_scale: float = _opt(0.0, "float", low=0.0)  # 0: dynamic loss scaling
    initial_scale_power: int = _opt(16, "int", low=0, high=64)
    loss_scale_window: int = _opt(1000, "int", low=1)
    hysteresis: int = _opt(2, "int", low=1)
    consecutive_hysteresis: bool = _opt(False, "bool")
    min_loss_scale: float = _opt(1.0, "float", low=0.0, low_open=True)
    auto_cast: bool = _opt(False, "bool")  # accepted: the engine always casts floating-point inputs


@dataclass(frozen=True)
class BF16Config:
    enabled: bool = _opt(False, "bool")
    # DeepSpeed's name; fastzero's meaning: no fp32 master at all, the rank's bf16 shard is the param Adam/AdamW
    # update, written with stochastic rounding (optimizer.params.bf16_stochastic_round, default true here)
    bf16_master_weights_and_grads: bool = _opt(False, "bool")


@dataclass(frozen=True)
class OffloadConfig:
    device: str = _opt("none", "choice", choices=("none", "cpu", "nvme"))
    pin_memory: bool = _opt(False, "bool")


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = _opt(0, "int", low=0, high=3)
    overlap_comm: bool = _opt(False, "bool")
    # fastzero's (Megatron's name): stages 1-2, step() returns with the param all-gather in flight, each module's
    # forward waiting for its buckets; params read outside a forward need engine.wait_params() (docs/zero.md)
    overlap_param_gather: bool = _opt(False, "bool")
    contiguous_gradients: bool = _opt(True, "bool")
    reduce_bucket_size: int = _opt(500_000_000, "int", low=1)
    allgather_bucket_size: int = _opt(500_000_000, "int", low=1)
    reduce_scatter: bool = _opt(True, "bool")
    allgather_partitions: bool = _opt(True, "bool")
    offload_optimizer: OffloadConfig = _section(OffloadConfig)
    offload_param: OffloadConfig = _section(OffloadConfig)
    stage3_prefetch_bucket_size: int = _opt(50_000_000, "int", low=0)
    stage3_param_persistence_threshold: int = _opt(100_000, "int", low=0)
    stage3_max_live_parameters: int = _opt(1_000_000_000, "int", low=0)
    stage3_max_reuse_distance: int = _opt(1_000_000_000, "int", low=0)
    stage3_gather_16bit_weights_on_model_save: bool = _opt(False, "bool")
    # fastzero's: the ranks agree on each module before gathering its params (a branch that differs across ranks is
    # an error naming the module, not an abort or a hang); one tiny host-side all-reduce per module forward
    stage3_check_divergence: bool = _opt(True, "bool")
    # params that get no gradient in a step count as zero gradients (a branch not taken); false: an error naming them
    ignore_unused_parameters: bool = _opt(True, "bool")
    # accepted: every fastzero checkpoint loads at any world size and stage (config_keys.py says why for each)
    elastic_checkpoint: bool = _opt(False, "bool")
    round_robin_gradients: bool = _opt(False, "bool")
    # false: a load re-makes the fp32 masters from the checkpoint's 16-bit weights, not its saved masters
    load_from_fp32_weights: bool = _opt(True, "bool")
    # the optimizer step over the shard runs in sub-groups of at most this many elements, bounding the step's
    # temporary buffers: the offloaded Adam step's staging (it cuts tensors), a client optimizer's fp32 gradients
    # (whole tensors: a larger one is a sub-group of its own). DeepSpeed's default
    sub_group_size: int = _opt(1_000_000_000, "int", low=1)
    # ZeRO++ (docs/zeropp.md): qwZ, the param all-gathers in int8 codes (stage 3; stages 1-2: the post-step one);
    # qgZ, the gradient reduce-scatter as an all-to-all of int4/int8 codes (stages 1-3), hierarchical across nodes;
    # hpZ, stage 3's secondary param pieces over groups of this many data-parallel ranks (0 and 1: off)
    zero_quantized_weights: bool = _opt(False, "bool")
    zero_quantized_gradients: bool = _opt(False, "bool")
    zero_hpz_partition_size: int = _opt(1, "int", low=0)
    zero_quantized_nontrainable_weights: bool = _opt(False, "bool")
    # fastzero's: values per fp32 scale for both (even, for int4), the gradients' width and rounding
    zero_quantized_block_size: int = _opt(256, "int", low=2)
    zero_quantized_gradients_bits: int = _opt(4, "int")  # 4 or 8: _check_zeropp says so
    zero_quantized_gradients_rounding: str = _opt("stochastic", "choice", choices=("stochastic", "nearest"))


# Adam's and AdamW's state format (docs/zero.md, "Optimizer state formats"): how exp_avg and exp_avg_sq are
# stored, DeepSpeed's fp32_optimizer_states beside it; and how bf16 params kept without an fp32 master are
# written (bf16_stochastic_round, docs/zero.md "bf16 params without an fp32 master"). Resolved by _state_format
# into state_format and bf16_stochastic_round (and seed for either's stochastic rounding, block_size for int8)
STATE_FORMAT_PARAMS = dict(
    state_format=None, fp32_optimizer_states=None, seed=None, block_size=None, bf16_stochastic_round=None
)
STATE_FORMAT_TYPES = ("adam", "adamw")
OPTIMIZER_PARAMS = {
    # type -> allowed params (DeepSpeed's names) and fastzero's defaults
    "adam": dict(
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        adam_w_mode=True,
        bias_correction=True,
        **STATE_FORMAT_PARAMS,
    ),
    "adamw": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bias_correction=True, **STATE_FORMAT_PARAMS),
    "lamb": dict(
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        bias_correction=True,
        max_grad_norm=0.0,
        max_coeff=10.0,
        min_coeff=0.01,
        eps_inside_sqrt=False,
    ),
    "onebitadam": dict(
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        freeze_step=100000,
        bias_correction=True,
        eps_inside_sqrt=False,
        max_grad_norm=0.0,
        comm_backend_name="",  # DeepSpeed's backend choice: accepted and ignored, any torch.distributed backend works
        cuda_aware=False,
    ),
    # bias_correction: accepted as False only (DeepSpeed's accept it and apply none)
    "zerooneadam": dict(
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        bias_correction=False,
        eps_inside_sqrt=False,
        max_grad_norm=0.0,
        var_freeze_step=100000,
        var_update_scaler=16,
        local_step_scaler=32678,
        local_step_clipper=16,
        comm_backend_name="",
        cuda_aware=False,
    ),
    "onebitlamb": dict(
        lr=1e-3,
        freeze_step=100000,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        bias_correction=False,
        eps_inside_sqrt=False,
        max_grad_norm=0.0,
        max_coeff=10.0,
        min_coeff=0.01,
        comm_backend_name="",
        cuda_aware=False,
        coeff_beta=0.9,
        factor_max=4.0,
        factor_min=0.5,
        factor_threshold=0.1,
    ),
}
OPTIMIZER_NAMES = {
    "adam": "Adam",
    "adamw": "AdamW",
    "lamb": "Lamb",
    "onebitadam": "OneBitAdam",
    "zerooneadam": "ZeroOneAdam",
    "onebitlamb": "OneBitLamb",
}
ONEBIT_FAMILY = ("onebitadam", "zerooneadam", "onebitlamb")  # the types that take DeepSpeed's comm_backend_name
# DeepSpeed's optimizer params fastzero's kernels do not offer when true (false, their default, is accepted)
OPTIMIZER_UNSUPPORTED_PARAMS = {
    "amsgrad": "fastzero's Adam kernels have no AMSGrad variant: pass torch.optim.Adam(params, amsgrad=True) as "
    "initialize(optimizer=...), or drop amsgrad",
    "torch_adam": "fastzero's Adam is its own kernel on every device (CPU SIMD, CUDA, Triton) with torch.optim.AdamW's "
    "math; torch's implementation instead is not a switch here: drop torch_adam, or pass torch.optim.AdamW(...) as "
    "initialize(optimizer=...)",
}


@dataclass(frozen=True)
class OptimizerRule:
    """Where an optimizer runs: the ZeRO stages it works with and whether its
    step can be offloaded to the CPU, each limit with its reason."""

    stages: tuple[int, ...] = (0, 1, 2, 3)
    stages_reason: str = ""
    offload: bool = True
    offload_reason: str = ""
    no_master: bool = True  # with bf16.bf16_master_weights_and_grads: bf16 params updated without an fp32 master
    no_master_reason: str = ""


_NO_SR_PARAMS = (
    "its step keeps an fp32 master of every bf16 param; writing bf16 params with stochastic rounding "
    "(bf16_stochastic_round) is Adam's and AdamW's"
)

# What combines with what, by optimizer (OPTIMIZER_NAMES' values): the config check and the engine's optimizer
# builder (which also sees optimizers a script passes) both read it.
OPTIMIZER_RULES: dict[str, OptimizerRule] = {
    "Adam": OptimizerRule(),
    "AdamW": OptimizerRule(),
    "Lamb": OptimizerRule(
        stages=(0,),
        stages_reason="its trust ratio needs each param whole, and stages 1-3 partition them; use stage 0, or "
        "Adam/AdamW",
        offload=False,
        offload_reason="the CPU step is Adam/AdamW's (CPUAdam)",
        no_master=False,
        no_master_reason=_NO_SR_PARAMS,
    ),
    "OneBitAdam": OptimizerRule(
        stages=(0, 1),
        stages_reason="after freeze_step each rank needs its whole local gradient, which stages 2-3 reduce and free "
        "during backward",
        offload=False,
        offload_reason="its compressed step runs where the params are, and the CPU step is Adam/AdamW's (CPUAdam)",
        no_master=False,
        no_master_reason=_NO_SR_PARAMS,
    ),
    "ZeroOneAdam": OptimizerRule(
        stages=(0, 1),
        stages_reason="after a variance step each rank needs its whole local gradient, which stages 2-3 reduce and "
        "free during backward",
        offload=False,
        offload_reason="its compressed and local steps run where the params are, and the CPU step is Adam/AdamW's "
        "(CPUAdam)",
        no_master=False,
        no_master_reason=_NO_SR_PARAMS,
    ),
    "OneBitLamb": OptimizerRule(
        stages=(0, 1),
        stages_reason="after freeze_step each rank needs its whole local gradient, which stages 2-3 reduce and free "
        "during backward",
        offload=False,
        offload_reason="its compressed step runs where the params are, and the CPU step is Adam/AdamW's (CPUAdam)",
        no_master=False,
        no_master_reason=_NO_SR_PARAMS,
    ),
}


def zero_one_adam_local_steps(clipper: int) -> str:
    """Why ZeroOneAdam at stage 1 refuses local steps (the config check and the optimizer say the same)."""
    return (
        f"ZeroOneAdam at zero_optimization.stage 1 with local_step_clipper {clipper}: a local step updates every "
        "param with the rank's own momentum and variance, which stage 1 partitions, so at stage 1 the ranks sync "
        "(compressed) every step; set optimizer.params.local_step_clipper: 1 (no local steps), or use stage 0"
    )


def check_optimizer(name: str, stage: int, offload: bool, no_master: bool = False) -> None:
    """Raises :class:`ConfigNotSupported`, with the reason from
    :data:`OPTIMIZER_RULES`, when optimizer `name` does not work at ZeRO
    `stage`, with the optimizer offloaded (`offload`) or with bf16 params
    kept without fp32 masters (`no_master`: ``bf16.bf16_master_weights_and_grads``)."""
    rule = OPTIMIZER_RULES[name]
    if stage not in rule.stages:
        *rest, last = map(str, rule.stages)
        stages = f"{', '.join(rest)} or {last}" if rest else last
        raise ConfigNotSupported(
            f"{name} works with zero_optimization.stage {stages} (stage is {stage}): {rule.stages_reason}"
        )
    if offload and not rule.offload:
        raise ConfigNotSupported(f"{name} with offload_optimizer: {rule.offload_reason}")
    if no_master and not rule.no_master:
        raise ConfigNotSupported(
            f"{name} with bf16.bf16_master_weights_and_grads: {rule.no_master_reason}; use optimizer type Adam or "
            "AdamW, or set bf16.bf16_master_weights_and_grads: false (fp32 masters)"
        )


SCHEDULER_PARAMS = {
    # DeepSpeed's defaults (deepspeed/runtime/lr_schedules.py); None = required
    "WarmupLR": dict(warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000, warmup_type="log"),
    "WarmupDecayLR": dict(
        total_num_steps=None, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000, warmup_type="log"
    ),
    "WarmupCosineLR": dict(
        total_num_steps=None, warmup_min_ratio=0.0, warmup_num_steps=1000, cos_min_ratio=0.0001, warmup_type="log"
    ),
    "OneCycle": dict(
        cycle_min_lr=None,
        cycle_max_lr=None,
        decay_lr_rate=0.0,
        cycle_first_step_size=2000,
        cycle_second_step_size=None,
        cycle_first_stair_count=0,
        cycle_second_stair_count=None,
        decay_step_size=0,
        cycle_momentum=True,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=0.0,
    ),
    "LRRangeTest": dict(
        lr_range_test_min_lr=0.001,
        lr_range_test_step_size=2000,
        lr_range_test_step_rate=1.0,
        lr_range_test_staircase=False,
    ),
}
# None means "same as the first" (cycle_second_*), "each param group's lr" (warmup_max_lr)
OPTIONAL_NONE = {"cycle_second_step_size", "cycle_second_stair_count", "warmup_max_lr"}
# Step counts the schedules divide by or count down from (fastzero.runtime.lr_schedules' constructor checks,
# mirrored here so that a config that loads also builds): at least 1. Every other count may be 0.
SCHEDULER_MIN_ONE = ("warmup_num_steps", "total_num_steps", "lr_range_test_step_size", "cycle_first_step_size")


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = _opt("", "str")
    params: dict = _opt({}, "dict")


@dataclass(frozen=True)
class SchedulerConfig:
    type: str = _opt("", "str")
    params: dict = _opt({}, "dict")


@dataclass(frozen=True)
class MonitorConfig:
    enabled: bool = _opt(False, "bool")
    output_path: str = _opt("", "str")
    job_name: str = _opt("DeepSpeedJobName", "str")


@dataclass(frozen=True)
class WandbConfig:
    """DeepSpeed's ``wandb`` section: wandb.init(project, group, entity=team)."""

    enabled: bool = _opt(False, "bool")
    group: str | None = _opt(None, "str", nullable=True)
    team: str | None = _opt(None, "str", nullable=True)
    project: str = _opt("deepspeed", "str")


@dataclass(frozen=True)
class FlopsProfilerConfig:
    """DeepSpeed's ``flops_profiler`` section (its defaults): the forward of the
    step run after `profile_step` completed steps is profiled on rank 0."""

    enabled: bool = _opt(False, "bool")
    recompute_fwd_factor: float = _opt(0.0, "float", low=0.0)  # bwd ~ (2 + factor) x fwd with recomputation
    profile_step: int = _opt(1, "int", low=0)
    module_depth: int = _opt(-1, "int", low=-1)  # -1: every depth
    top_modules: int = _opt(1, "int", low=1)
    detailed: bool = _opt(True, "bool")
    output_file: str | None = _opt(None, "str", nullable=True)  # None: stdout


@dataclass(frozen=True)
class CommsLoggerConfig:
    """DeepSpeed's ``comms_logger`` section (its defaults): which
    collectives the communication logger times (fastzero.comm.logger)."""

    enabled: bool = _opt(False, "bool")
    verbose: bool = _opt(False, "bool")  # log every op as it completes (rank 0)
    prof_all: bool = _opt(True, "bool")  # every op; false: only those in prof_ops (or called with prof=True)
    prof_ops: tuple[str, ...] = _opt((), "str_list")  # log names, e.g. ["all_reduce", "reduce_scatter_tensor"]
    debug: bool = _opt(False, "bool")  # record names carry the caller: "all_reduce | [Caller Func: f]"


@dataclass(frozen=True)
class CheckpointConfig:
    # every rank's save tag is compared: a mismatch is ignored, warned about (on every rank) or an error
    tag_validation: str = _opt("warn", "choice", choices=("ignore", "warn", "fail"))
    load_universal: bool = _opt(False, "bool")  # accepted: every fastzero load is universal
    use_node_local_storage: bool = _opt(False, "bool")  # each node saves to and loads from its own disk
    checkpoint_serialization: bool = _opt(True, "bool")  # false is refused (config_keys.py)


@dataclass(frozen=True)
class TensorParallelConfig:
    # AutoTP training: initialize shards the model over this many ranks (fastzero.tp_model_init); 0 or 1: off
    autotp_size: int = _opt(0, "int", low=0)
    dtype: str | None = _opt(None, "str", nullable=True)  # accepted: the training dtype is fp16/bf16's


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """DeepSpeed's ``activation_checkpointing`` section: what
    ``fastzero.checkpointing.checkpoint`` does with the inputs it saves
    (docs/parallel.md); ``initialize`` passes it to
    ``fastzero.checkpointing.configure``."""

    partition_activations: bool = _opt(False, "bool")  # each TP rank keeps 1/tp of every saved input
    contiguous_memory_optimization: bool = _opt(False, "bool")  # partitions copied into one preallocated buffer
    cpu_checkpointing: bool = _opt(False, "bool")  # saved inputs held in (pinned) CPU memory
    number_checkpoints: int | None = _opt(None, "int", low=1, nullable=True)  # the buffer's slots
    synchronize_checkpoint_boundary: bool = _opt(False, "bool")  # device synchronize at each checkpoint's ends
    profile: bool = _opt(False, "bool")  # time forward, recompute and the gathers; checkpointing.timings()


@dataclass(frozen=True)
class PipelineConfig:
    """The ``pipeline`` section: how the pipeline engine runs a
    ``fastzero.pipe.PipelineModule`` (docs/pipeline.md). DeepSpeed's keys
    are the module's constructor arguments there; fastzero checks them
    against the module."""

    # the schedule (fastzero.pipe.schedule): auto picks the fastest that fits the memory
    schedule: str = _opt("auto", "choice", choices=("auto", "1f1b", "interleaved", "zb-h1"))
    virtual_stages: int | None = _opt(None, "int", low=1, nullable=True)  # must equal the module's (None: its own)
    p2p_timeout: float = _opt(300.0, "float", low=0.0, low_open=True)  # seconds a stage waits for a neighbour
    # the p2p transport's process groups: one per channel (what NCCL needs for interleaved and zb-h1), one shared
    # (Gloo's tags keep channels apart), or auto (per channel on NCCL, shared on Gloo)
    p2p_groups: str = _opt("auto", "choice", choices=("auto", "shared", "per_channel"))
    stages: int | str = _opt("auto", "auto_int")  # DeepSpeed's: the module's num_stages ("auto": whatever it has)
    partition: str = _opt("best", "str")  # DeepSpeed's: accepted, the module's partition_method decides
    seed_layers: bool = _opt(False, "bool")  # DeepSpeed's: accepted, the module's seed_layers decides
    activation_checkpoint_interval: int = _opt(0, "int", low=0)  # DeepSpeed's: accepted, the module's decides
    pipe_partitioned: bool = _opt(True, "bool")  # DeepSpeed's: accepted, activations travel whole (docs)
    grad_partitioned: bool = _opt(True, "bool")  # DeepSpeed's: accepted, gradients travel whole (docs)


@dataclass(frozen=True)
class Config:
    train_batch_size: int | None = _opt(None, "int", low=1, nullable=True)
    train_micro_batch_size_per_gpu: int | None = _opt(None, "int", low=1, nullable=True)
    gradient_accumulation_steps: int | None = _opt(None, "int", low=1, nullable=True)
    optimizer: OptimizerConfig = _section(OptimizerConfig)
    scheduler: SchedulerConfig = _section(SchedulerConfig)
    fp16: FP16Config = _section(FP16Config)
    bf16: BF16Config = _section(BF16Config)
    gradient_clipping: float = _opt(0.0, "float", low=0.0)
    # the gradient reduction (fastzero.comm.buckets): the dtype the sum is taken in (default: the training dtype),
    # and where the average's division happens: before the sum (prescale), or by a factor before and the rest after
    communication_data_type: str | None = _opt(None, "choice", choices=("fp32", "fp16", "bf16"), nullable=True)
    prescale_gradients: bool = _opt(False, "bool")
    gradient_predivide_factor: float = _opt(1.0, "float", low=0.0, low_open=True)
    # fastzero's: a non-finite gradient norm in fp32/bf16 training skips the step (DeepSpeed's behaviour under
    # fp16) or raises; under fp16 the loss scaler skips and lowers the scale
    non_finite_grads: str = _opt("skip", "choice", choices=("skip", "raise"))
    zero_optimization: ZeroConfig = _section(ZeroConfig)
    # infinity: never (Accelerate sets it so)
    steps_per_print: int | float = _opt(10, "int", low=1, infinite=True)
    dataloader_drop_last: bool = _opt(False, "bool")  # the training_data loader drops a last, short micro-batch
    wall_clock_breakdown: bool = _opt(False, "bool")
    # memory in use (device or process, and model states by kind) logged every steps_per_print steps
    memory_breakdown: bool = _opt(False, "bool")
    tensorboard: MonitorConfig = _section(MonitorConfig)
    csv_monitor: MonitorConfig = _section(MonitorConfig)
    wandb: WandbConfig = _section(WandbConfig)
    flops_profiler: FlopsProfilerConfig = _section(FlopsProfilerConfig)
    comms_logger: CommsLoggerConfig = _section(CommsLoggerConfig)
    checkpoint: CheckpointConfig = _section(CheckpointConfig)
    tensor_parallel: TensorParallelConfig = _section(TensorParallelConfig)
    activation_checkpointing: ActivationCheckpointingConfig = _section(ActivationCheckpointingConfig)
    pipeline: PipelineConfig = _section(PipelineConfig)
    # a client optimizer fastzero does not take over (SGD, Adagrad, a custom one) at ZeRO stages 1-3: refused unless
    # true (DeepSpeed's key); with offload_optimizer it runs on the CPU shard only when zero_force_ds_cpu_optimizer
    # is false
    zero_allow_untested_optimizer: bool = _opt(False, "bool")
    zero_force_ds_cpu_optimizer: bool = _opt(True, "bool")


# -- parsing ----------------------------------------------------------------------------------------


def _check_value(path: str, value: Any, meta: dict) -> Any:
    kind = meta["kind"]
    if value is None and meta.get("nullable"):
        return None
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{path} = {value!r}: must be true or false")
        return value
    if kind in ("int", "float"):
        if meta.get("infinite") and value == math.inf:
            return value
        # bool is an int in Python; a config that says `true` for a number is wrong
        ok = isinstance(value, int) and not isinstance(value, bool)
        if kind == "float":
            ok = ok or isinstance(value, float)
        elif isinstance(value, float) and value.is_integer():  # 5e8 in JSON is a float
            value, ok = int(value), True
        if not ok or (kind == "float" and not math.isfinite(value)):
            raise ConfigError(f"{path} = {value!r}: must be {'an integer' if kind == 'int' else 'a number'}")
        low, high = meta.get("low"), meta.get("high")
        if low is not None and (value < low or (meta.get("low_open") and value == low)):
            raise ConfigError(f"{path} = {value!r}: must be {'>' if meta.get('low_open') else '>='} {low}")
        if high is not None and value > high:
            raise ConfigError(f"{path} = {value!r}: must be <= {high}")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{path} = {value!r}: must be a string")
        return value
    if kind == "choice":
        if not isinstance(value, str) or value.lower() not in meta["choices"]:
            raise ConfigError(f"{path} = {value!r}: must be one of {', '.join(meta['choices'])}")
        return value.lower()
    if kind == "auto_int":
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ConfigError(f'{path} = {value!r}: must be "auto" or an integer >= 1')
    if kind == "str_list":
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{path} = {value!r}: must be a list of strings")
        return tuple(value)
    if kind == "dict":
        if not isinstance(value, dict):
            raise ConfigError(f"{path} = {value!r}: must be an object")
        return dict(value)
    raise AssertionError(kind)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _unknown(path: str, key: str, allowed: list[str], what: str = "key") -> ConfigError:
    lower = {a.lower(): a for a in allowed}
    close = difflib.get_close_matches(str(key).lower(), list(lower), n=1, cutoff=0.6)
    hint = f"; did you mean {lower[close[0]]!r}?" if close else ""
    return ConfigError(f"{path}{key}: no such {what}{hint} Allowed: {', '.join(sorted(allowed))}")


def _not_supported(path: str, reason: str) -> ConfigNotSupported:
    """The table's refusal, with its reason."""
    return ConfigNotSupported(f"{path}: a DeepSpeed setting that fastzero does not support: {reason}; remove it to run")


def _renamed(raw: dict, prefix: str) -> dict:
    """`raw` with DeepSpeed's second names (the table's aliases within one
    section, as ``prefetch_bucket_size``) under their main name; both given
    is a ConfigError."""
    out = dict(raw)
    for key in raw:
        found = lookup(f"{prefix}{key}")
        if found is None or found[0] != f"{prefix}{key}" or found[1].status != ALIAS:
            continue
        target = found[1].note.removeprefix(prefix)
        if "." in target or "*" in target:  # not a plain rename: a section's own code reads it
            continue
        if target in out:
            raise ConfigError(
                f"{prefix}{key} and {prefix}{target} are both given: {key} is another name of {target}; keep one"
            )
        out[target] = out.pop(key)
    return out


def _parse(cls: type, raw: Any, path: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'the config'} = {raw!r}: must be an object")
    prefix = f"{path}." if path else ""
    if cls is ZeroConfig:
        raw = _legacy_offload(raw)
    raw = _renamed(raw, prefix)
    names = [f.name for f in fields(cls)]
    for key in raw:
        if key not in names:
            found = lookup(f"{prefix}{key}")
            if found is not None and found[1].status == REFUSED:
                raise _not_supported(found[0], found[1].note)
            raise _unknown(prefix, key, names)
    values = {}
    for f in fields(cls):
        if f.metadata["kind"] == "section":
            values[f.name] = _parse(f.metadata["section"], raw.get(f.name), f"{prefix}{f.name}")
        elif f.name in raw:
            values[f.name] = _check_value(f"{prefix}{f.name}", raw[f.name], f.metadata)
            reason = refusal(f"{prefix}{f.name}", values[f.name])
            if reason is not None:
                raise ConfigNotSupported(f"{prefix}{f.name} = {json.dumps(values[f.name])}: {reason}")
    return cls(**values)


LEGACY_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}


def _legacy_offload(raw: dict) -> dict:
    """DeepSpeed's deprecated ZeRO switches as the sections they stand for:
    ``cpu_offload: true`` is ``offload_optimizer.device: cpu``,
    ``cpu_offload_param: true`` is ``offload_param.device: cpu``, and
    ``cpu_offload_use_pin_memory`` is the ``pin_memory`` of those that are
    on. Given beside the new key with another value: a ConfigError."""
    if not any(k in raw for k in (*LEGACY_OFFLOAD, "cpu_offload_use_pin_memory")):
        return raw
    out = dict(raw)
    flag = dict(kind="bool")
    for old, new in LEGACY_OFFLOAD.items():
        if old not in out:
            continue
        on = _check_value(f"zero_optimization.{old}", out.pop(old), flag)
        section = out.get(new)
        device = section.get("device") if isinstance(section, dict) else None
        if device is not None:
            if (str(device).lower() == "cpu") != on:
                raise ConfigError(
                    f"zero_optimization.{old} = {json.dumps(on)} and zero_optimization.{new}.device = {device!r} "
                    f"disagree: {old} is DeepSpeed's old switch for {new}.device 'cpu'; keep {new} only"
                )
        elif on:
            out[new] = {**(section if isinstance(section, dict) else {}), "device": "cpu"}
    if "cpu_offload_use_pin_memory" in out:
        pin = _check_value("zero_optimization.cpu_offload_use_pin_memory", out.pop("cpu_offload_use_pin_memory"), flag)
        on = [
            new
            for new in LEGACY_OFFLOAD.values()
            if isinstance(out.get(new), dict) and str(out[new].get("device", "none")).lower() == "cpu"
        ]
        if not on:
            raise ConfigError(
                "zero_optimization.cpu_offload_use_pin_memory pins the CPU copies of an offload, and no offload is on: "
                "remove it, or set offload_optimizer.device 'cpu'"
            )
        for new in on:
            given = out[new].get("pin_memory")
            if given is not None and given != pin:
                raise ConfigError(
                    f"zero_optimization.cpu_offload_use_pin_memory = {json.dumps(pin)} and zero_optimization.{new}."
                    f"pin_memory = {json.dumps(given)} disagree: keep {new}.pin_memory only"
                )
            out[new] = {**out[new], "pin_memory": pin}
    return out


TORCH_OPTIMIZER = "optimizer.type=<torch.optim class>"  # the table's row for DeepSpeed's fallback


def _torch_optimizer(name: str) -> bool:
    """Whether `name` is a torch.optim optimizer (DeepSpeed builds any type it
    does not know as torch.optim's class of that name)."""
    import torch.optim  # here: the config layer needs torch only for this

    cls = getattr(torch.optim, name, None)
    return isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)


def _resolve_optimizer(opt: OptimizerConfig, no_master: bool = False) -> OptimizerConfig:
    """The optimizer section checked, its type's defaults filled in;
    `no_master`: ``bf16.bf16_master_weights_and_grads`` (Adam's
    ``bf16_stochastic_round`` defaults to it)."""
    if not opt.type and not opt.params:
        return opt
    key = opt.type.lower()
    found = lookup(f"optimizer.type={key}") or (lookup(TORCH_OPTIMIZER) if _torch_optimizer(opt.type) else None)
    if key not in OPTIMIZER_PARAMS and found is not None and found[1].status == REFUSED:
        raise _not_supported(f"optimizer.type = {opt.type}", found[1].note)
    if key not in OPTIMIZER_PARAMS:
        raise _unknown("optimizer.type = ", opt.type, list(OPTIMIZER_NAMES.values()), "optimizer")
    allowed = OPTIMIZER_PARAMS[key]
    for name in opt.params:
        if name in OPTIMIZER_UNSUPPORTED_PARAMS:
            if opt.params[name] is False:
                continue  # DeepSpeed's default: what fastzero does anyway (dropped below)
            raise ConfigNotSupported(
                f"optimizer.params.{name} = {opt.params[name]!r}: {OPTIMIZER_UNSUPPORTED_PARAMS[name]}"
            )
        if name == "comm_backend_name" and key not in ONEBIT_FAMILY:
            raise ConfigNotSupported(f"optimizer.params.{name}: not supported by fastzero's {OPTIMIZER_NAMES[key]}")
        if name == "bf16_stochastic_round" and key not in STATE_FORMAT_TYPES:
            raise ConfigNotSupported(
                f"optimizer.params.bf16_stochastic_round: {OPTIMIZER_NAMES[key]} writes bf16 params rounded to "
                "nearest from fp32 masters; stochastic rounding of bf16 params without a master is Adam's and "
                "AdamW's: use optimizer.type Adam or AdamW, or leave bf16_stochastic_round out"
            )
        if name in STATE_FORMAT_PARAMS and key not in STATE_FORMAT_TYPES:
            raise ConfigNotSupported(
                f"optimizer.params.{name}: {OPTIMIZER_NAMES[key]} keeps its states in fp32; the state formats "
                "(state_format 'fp32', 'param_dtype', 'bf16' with seed, 'int8' with seed and block_size; DeepSpeed's "
                f"fp32_optimizer_states) are Adam's and AdamW's: use optimizer.type Adam or AdamW, or leave {name} out"
            )
        if name not in allowed:
            raise _unknown(f"optimizer.params ({OPTIMIZER_NAMES[key]}).", name, list(allowed))
    params = {**allowed, **{k: v for k, v in opt.params.items() if k not in OPTIMIZER_UNSUPPORTED_PARAMS}}
    if key in STATE_FORMAT_TYPES:
        params.update(_state_format({k: params.pop(k) for k in STATE_FORMAT_PARAMS}, no_master))
    for name, value in params.items():
        path = f"optimizer.params.{name}"
        if name in STATE_FORMAT_PARAMS:
            continue  # checked by _state_format
        if name == "betas":
            pair = isinstance(value, (list, tuple)) and len(value) == 2
            if not pair or not all(_is_number(b) and 0 <= b < 1 for b in value):
                raise ConfigError(f"{path} = {value!r}: must be two numbers in [0, 1)")
            params[name] = tuple(float(b) for b in value)
        elif isinstance(allowed[name], str):
            params[name] = str(value)
        elif isinstance(allowed[name], bool):
            params[name] = _check_value(path, value, dict(kind="bool"))
        elif isinstance(allowed[name], int):
            params[name] = _check_value(path, value, dict(kind="int", low=0))
        else:
            params[name] = _check_value(path, value, dict(kind="float", low=0.0))
    if key in ("lamb", "onebitlamb") and params["min_coeff"] > params["max_coeff"]:
        raise ConfigError(
            f"optimizer.params.min_coeff = {params['min_coeff']!r}: must be <= optimizer.params.max_coeff "
            f"({params['max_coeff']!r}), the trust ratio's bounds"
        )
    if key == "onebitadam" and params["freeze_step"] < 1:
        raise ConfigError(
            f"optimizer.params.freeze_step = {params['freeze_step']}: must be >= 1, the uncompressed warm-up steps "
            "whose variance 1-bit Adam then freezes"
        )
    if key in ("zerooneadam", "onebitlamb"):
        _check_onebit_family(OPTIMIZER_NAMES[key], params)
    return replace(opt, type=OPTIMIZER_NAMES[key], params=params)


def _state_format(given: dict, no_master: bool = False) -> dict:
    """Adam's ``state_format`` (with ``seed`` for bf16 and int8, ``block_size``
    for int8) and ``bf16_stochastic_round`` from the optimizer params of
    :data:`STATE_FORMAT_PARAMS`: checked, DeepSpeed's
    ``fp32_optimizer_states`` folded in (true is 'fp32', false
    'param_dtype'; given with state_format, the two must agree).
    ``bf16_stochastic_round`` defaults to `no_master`
    (``bf16.bf16_master_weights_and_grads``) and needs it."""
    from fastzero.checks import INT8_BLOCK_SIZES, STATE_FORMATS  # imports torch: only here, as _torch_optimizer

    fmt, fp32, seed, block, sr = (given[k] for k in STATE_FORMAT_PARAMS)
    sr = no_master if sr is None else _check_value("optimizer.params.bf16_stochastic_round", sr, dict(kind="bool"))
    if sr and not no_master:
        raise ConfigError(
            "optimizer.params.bf16_stochastic_round = true writes bf16 params kept without an fp32 master, and "
            "bf16.bf16_master_weights_and_grads is false (the engine keeps fp32 masters, which hold every bit of "
            "the update): set bf16.bf16_master_weights_and_grads: true, or leave bf16_stochastic_round out"
        )
    if fp32 is not None:
        fp32 = _check_value("optimizer.params.fp32_optimizer_states", fp32, dict(kind="bool"))
    if fmt is None:
        fmt = "param_dtype" if fp32 is False else "fp32"
    fmt = _check_value("optimizer.params.state_format", fmt, dict(kind="choice", choices=STATE_FORMATS))
    if fp32 is not None and fp32 != (fmt == "fp32"):
        raise ConfigError(
            f"optimizer.params.fp32_optimizer_states = {json.dumps(fp32)} contradicts optimizer.params.state_format "
            f"= {fmt!r}: keep one (fp32_optimizer_states true is state_format 'fp32', false is 'param_dtype')"
        )
    out = {"state_format": fmt, "bf16_stochastic_round": sr}
    if seed is not None:
        if fmt not in ("bf16", "int8") and not sr:
            raise ConfigError(
                f"optimizer.params.seed = {seed!r}: the seed of stochastic rounding, which only state_format 'bf16' "
                f"and 'int8' and bf16_stochastic_round do (state_format is {fmt!r}, bf16_stochastic_round false); "
                "set state_format: 'bf16' or 'int8', or leave seed out"
            )
        out["seed"] = _check_value("optimizer.params.seed", seed, dict(kind="int", low=0, high=2**32 - 1))
    if block is not None:
        if fmt != "int8":
            raise ConfigError(
                f"optimizer.params.block_size = {block!r}: the block of int8 states' scales (state_format is "
                f"{fmt!r}); set state_format: 'int8', or leave block_size out"
            )
        block = _check_value("optimizer.params.block_size", block, dict(kind="int", low=0))
        if block not in INT8_BLOCK_SIZES:
            raise ConfigError(
                f"optimizer.params.block_size = {block}: int8 states take a power of two from 64 to 4096 "
                f"({', '.join(map(str, INT8_BLOCK_SIZES))}; default 256)"
            )
        out["block_size"] = block
    return out


def _check_onebit_family(name: str, params: dict) -> None:
    """ZeroOneAdam's and OneBitLamb's params beyond the types' checks."""
    for flag in ("bias_correction", "eps_inside_sqrt"):
        if params[flag]:
            raise ConfigNotSupported(
                f"optimizer.params.{flag} = true: {name}'s math has none (DeepSpeed's {name} accepts "
                f"{flag} and applies none); set it to false or leave it out"
            )
    counts = ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper", "freeze_step")
    for count in counts:
        if count in params and params[count] < 1:
            raise ConfigError(f"optimizer.params.{count} = {params[count]}: must be >= 1 (a number of steps)")
    if "coeff_beta" in params and not params["coeff_beta"] < 1:
        raise ConfigError(f"optimizer.params.coeff_beta = {params['coeff_beta']!r}: must be in [0, 1), an EMA's beta")
    if "factor_min" in params and params["factor_min"] > params["factor_max"]:
        raise ConfigError(
            f"optimizer.params.factor_min = {params['factor_min']!r}: must be <= optimizer.params.factor_max "
            f"({params['factor_max']!r}), the lamb factor's bounds"
        )


def _resolve_scheduler(sched: SchedulerConfig) -> SchedulerConfig:
    if not sched.type and not sched.params:
        return sched
    if sched.type not in SCHEDULER_PARAMS:
        raise _unknown("scheduler.type = ", sched.type, list(SCHEDULER_PARAMS), "scheduler")
    allowed = SCHEDULER_PARAMS[sched.type]
    for name in sched.params:
        if name not in allowed:
            raise _unknown(f"scheduler.params ({sched.type}).", name, list(allowed))
    params = {**allowed, **sched.params}
    for name, value in params.items():
        path = f"scheduler.params.{name}"
        default = allowed[name]
        if value is None:
            if name not in OPTIONAL_NONE:
                raise ConfigError(f"{path} is required by {sched.type}")
        elif name == "warmup_type":
            params[name] = _check_value(path, value, dict(kind="choice", choices=("log", "linear")))
        elif isinstance(default, bool):
            params[name] = _check_value(path, value, dict(kind="bool"))
        elif isinstance(default, int) or name.endswith(("_steps", "_step_size", "_stair_count")):
            low = 1 if name in SCHEDULER_MIN_ONE else 0
            params[name] = _check_value(path, value, dict(kind="int", low=low))
        else:
            params[name] = _check_value(path, value, dict(kind="float", low=0.0))
    return replace(sched, params=params)


def _resolve_batch(cfg: Config, world_size: int) -> Config:
    """Any two of the three batch sizes give the third (train = micro *
    accumulation * world size); all three must agree."""
    tbs, mbs, gas = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    if tbs is None and mbs is None:
        raise ConfigError("set train_batch_size or train_micro_batch_size_per_gpu (or both)")
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * world_size:
            raise ConfigError(
                f"train_batch_size {tbs} != train_micro_batch_size_per_gpu {mbs} * gradient_accumulation_steps {gas}"
                f" * world size {world_size} = {mbs * gas * world_size}; fix one, or leave one out to derive it"
            )
    elif tbs is not None and mbs is not None:
        gas, rem = divmod(tbs, mbs * world_size)
        if rem or gas < 1:
            raise ConfigError(
                f"train_batch_size {tbs} is not a multiple of train_micro_batch_size_per_gpu {mbs} * world size "
                f"{world_size} = {mbs * world_size}"
            )
    elif tbs is not None:
        gas = gas or 1
        mbs, rem = divmod(tbs, gas * world_size)
        if rem or mbs < 1:
            raise ConfigError(
                f"train_batch_size {tbs} is not a multiple of gradient_accumulation_steps {gas} * world size "
                f"{world_size} = {gas * world_size}"
            )
    else:
        gas = gas or 1
        tbs = mbs * gas * world_size
    return replace(cfg, train_batch_size=tbs, train_micro_batch_size_per_gpu=mbs, gradient_accumulation_steps=gas)


def _check_combinations(cfg: Config) -> None:
    zero = cfg.zero_optimization
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError("fp16.enabled and bf16.enabled are both true: choose one precision")
    if zero.offload_optimizer.device == "nvme" or zero.offload_param.device == "nvme":
        raise ConfigNotSupported("zero_optimization.offload_*.device = 'nvme': fastzero offloads to the CPU only")
    if zero.offload_optimizer.device != "none" and zero.stage < 1:
        raise ConfigError(
            f"zero_optimization.offload_optimizer needs stage >= 1 (stage is {zero.stage}): the optimizer state "
            "that is offloaded is the partitioned one"
        )
    if zero.offload_param.device != "none" and zero.stage != 3:
        raise ConfigError(f"zero_optimization.offload_param needs stage 3 (stage is {zero.stage})")
    if zero.offload_param.device != "none" and zero.offload_optimizer.device == "none":
        raise ConfigError(
            "zero_optimization.offload_param needs offload_optimizer.device 'cpu' too: the offloaded param shards are "
            "what the CPU step updates"
        )
    if cfg.non_finite_grads == "raise" and cfg.fp16.enabled and cfg.fp16.loss_scale == 0:
        raise ConfigError(
            "non_finite_grads = 'raise' with fp16 dynamic loss scaling: overflows are how the scaler finds its scale; "
            "leave it 'skip', or set fp16.loss_scale to a static scale"
        )
    if cfg.prescale_gradients and cfg.gradient_predivide_factor != 1.0:
        raise ConfigError(
            f"prescale_gradients with gradient_predivide_factor = {cfg.gradient_predivide_factor}: prescaling divides "
            "by the number of ranks before the sum, so the predivide factor would be ignored; keep one"
        )
    _check_bf16_masters(cfg)
    if cfg.optimizer.type:
        offload = zero.offload_optimizer.device != "none"
        check_optimizer(cfg.optimizer.type, zero.stage, offload, no_master=cfg.bf16.bf16_master_weights_and_grads)
    clipper = cfg.optimizer.params.get("local_step_clipper", 1)
    if cfg.optimizer.type == "ZeroOneAdam" and zero.stage == 1 and clipper != 1:
        raise ConfigNotSupported(zero_one_adam_local_steps(clipper))


def _check_bf16_masters(cfg: Config) -> None:
    """``bf16.bf16_master_weights_and_grads`` keeps bf16 params without fp32
    masters: it needs bf16 training (fp16 keeps its masters: fastzero's
    stochastic rounding writes bf16 only)."""
    if not cfg.bf16.bf16_master_weights_and_grads or cfg.bf16.enabled:
        return
    why = (
        "; fp16 keeps its fp32 masters: its loss scaling would work without them (the kernel unscales in fp32), "
        "but fastzero's stochastic rounding writes bf16 params only, and fp16 params rounded to nearest lose every "
        "update below half an fp16 ulp"
        if cfg.fp16.enabled
        else ""
    )
    raise ConfigError(
        "bf16.bf16_master_weights_and_grads = true keeps bf16 params without fp32 masters, and bf16.enabled is "
        f"false{why}: set bf16.enabled: true (and fp16.enabled: false), or leave bf16_master_weights_and_grads out"
    )


class _Pairs(list):
    """A JSON object as its (key, value) pairs, duplicates kept, until
    :func:`_objects` turns it into a dict knowing where it sits."""


def _objects(value: Any, path: str) -> Any:
    """`value` with every :class:`_Pairs` a dict; a key given twice in one
    object is a ConfigError naming it and its path (json keeps the last one
    silently, so one of the two settings would be lost)."""
    if isinstance(value, _Pairs):
        out: dict = {}
        for key, item in value:
            where = f"{path}.{key}" if path else key
            if key in out:
                raise ConfigError(f"{where}: the key {key!r} appears twice in one object; keep one")
            out[key] = _objects(item, where)
        return out
    if isinstance(value, list):
        return [_objects(item, f"{path}[{i}]") for i, item in enumerate(value)]
    return value


def read_config_file(path: str | os.PathLike) -> Any:
    """The JSON of a config file, every object a dict; ConfigError naming the
    file when it is missing, a directory, unreadable, not UTF-8 or neither
    JSON nor hjson, or when an object repeats a key.

    JSON is tried first; a file that is not JSON is read as hjson (JSON with
    comments, unquoted keys and strings, optional commas; DeepSpeed reads
    every config with hjson) when the optional ``hjson`` package is installed,
    and otherwise is a ConfigError saying ``pip install hjson``."""
    path = Path(os.fsdecode(path))
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; name the JSON file") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        raw = json.loads(text, object_pairs_hook=_Pairs)
    except json.JSONDecodeError as exc:
        raw = _read_hjson(path, text, exc)
    try:
        return _objects(raw, "")
    except ConfigError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


def _read_hjson(path: Path, text: str, json_error: json.JSONDecodeError) -> Any:
    """`text`, not JSON (`json_error`), as hjson; objects as :class:`_Pairs`."""
    try:
        import hjson
    except ImportError:
        raise ConfigError(
            f"config file {path} is not valid JSON ({json_error}); if it is hjson, pip install hjson to read it"
        ) from None
    try:
        raw = hjson.loads(text, object_pairs_hook=_Pairs)
    except hjson.HjsonDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid JSON ({json_error}) nor hjson ({exc})") from None
    if not isinstance(raw, _Pairs):  # hjson reads almost any text as a string: a config is an object
        raise ConfigError(
            f"config file {path} is not valid JSON ({json_error}), and as hjson it is a {type(raw).__name__}, "
            "not an object"
        )
    return raw


def config_from_args(args: Any, config: Any) -> Any:
    """The config ``initialize(args=..., config=...)`` uses: `config`, or the
    path in ``args.deepspeed_config``, ``args.deepscale_config`` (deprecated,
    with a FutureWarning) or ``args.fastzero_config`` (the arguments of
    ``fastzero.add_config_arguments``). ConfigError when two of those name
    different files, or when `config` is given too (DeepSpeed's assertions)."""
    if args is None:
        return config
    names = ("deepspeed_config", "deepscale_config", "fastzero_config")
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    if "deepscale_config" in given:
        warnings.warn("--deepscale_config is deprecated, use --deepspeed_config", FutureWarning, stacklevel=3)
    paths = {os.fsdecode(v) if isinstance(v, (str, bytes, os.PathLike)) else id(v) for v in given.values()}
    if len(paths) > 1:
        listed = " and ".join(f"--{name} {value}" for name, value in given.items())
        raise ConfigError(f"Not sure how to proceed, we were given both {listed}: give one")
    if not given:
        return config
    if config is not None:
        name, value = next(iter(given.items()))
        raise ConfigError(
            "Not sure how to proceed, we were given deepspeed configs in the deepspeed arguments and "
            f"deepspeed.initialize() function call (--{name} {value} and config=): give one"
        )
    return next(iter(given.values()))


def autotp_size(config: str | os.PathLike | dict) -> int:
    """``tensor_parallel.autotp_size`` of a config (a path or a dict) read
    before the full check, which needs the data-parallel size that it
    decides; 0 when absent or not an int (the full check then names it)."""
    raw = read_config_file(os.fsdecode(config)) if isinstance(config, (str, os.PathLike)) else config
    section = raw.get("tensor_parallel") if isinstance(raw, dict) else None
    value = section.get("autotp_size", 0) if isinstance(section, dict) else 0
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def load_config(config: str | os.PathLike | dict, world_size: int = 1) -> Config:
    """Parses and validates a DeepSpeed config (a path to a JSON or hjson file:
    a str or any ``os.PathLike``; or a dict) for a run of `world_size`
    data-parallel ranks. Loaded from a file, every error names the file too."""
    if isinstance(config, (str, os.PathLike)):
        config = os.fsdecode(config)
        raw = read_config_file(config)
        try:
            return _validate(raw, world_size)
        except ConfigError as exc:
            raise type(exc)(f"config file {config}: {exc}") from None
    if isinstance(config, dict):
        return _validate(config, world_size)
    raise ConfigError(f"config must be a path or a dict, got {type(config).__name__}")


def load_section(config: Any, name: str) -> Any:
    """One section of a config (a :class:`Config`, a dict, or a path to a
    JSON/hjson file), parsed and checked on its own: no batch-size or
    world-size checks, for callers such as ``fastzero.checkpointing.configure``
    that read one section of the user's file."""
    if isinstance(config, Config):
        return getattr(config, name)
    cls = next((f.metadata["section"] for f in fields(Config) if f.name == name), None)
    if cls is None:
        raise ConfigError(f"{name}: not a section of the config")
    if isinstance(config, (str, os.PathLike)):
        path = os.fsdecode(config)
        try:
            return _parse(cls, read_config_file(path).get(name), name)
        except ConfigError as exc:
            raise type(exc)(f"config file {path}: {exc}") from None
    if isinstance(config, dict):
        return _parse(cls, config.get(name), name)
    raise ConfigError(f"config must be a Config, a path or a dict, got {type(config).__name__}")


def _check_zeropp(cfg: Config, world_size: int) -> None:
    """ZeRO++'s keys against the stage, the precision settings and the data-parallel world."""
    zero = cfg.zero_optimization
    key = "zero_optimization."
    if zero.zero_quantized_weights and zero.stage == 0:
        raise ConfigError(
            f"{key}zero_quantized_weights needs stage >= 1 (stage is 0): it quantizes the all-gather of the "
            "partitioned params, and stage 0 partitions none"
        )
    if zero.zero_quantized_gradients and zero.stage == 0:
        raise ConfigError(
            f"{key}zero_quantized_gradients needs stage >= 1 (stage is 0): it quantizes the gradient "
            "reduce-scatter, and stage 0 all-reduces; for compressed all-reduce use a 1-bit optimizer (OneBitAdam)"
        )
    hpz = zero.zero_hpz_partition_size
    if hpz > 1 and zero.stage != 3:
        raise ConfigError(
            f"{key}zero_hpz_partition_size = {hpz} needs stage 3 (stage is {zero.stage}): only stage 3 gathers "
            "params for each forward and backward; at stages 1-2 every rank holds them whole"
        )
    if hpz > 1 and world_size % hpz:
        raise ConfigError(
            f"{key}zero_hpz_partition_size = {hpz} does not divide the data-parallel world size {world_size}: "
            "make it a divisor (the ranks per node, usually)"
        )
    if zero.zero_quantized_gradients_bits not in (4, 8):
        raise ConfigError(
            f"{key}zero_quantized_gradients_bits = {zero.zero_quantized_gradients_bits}: must be 4 (int4) or 8 (int8)"
        )
    if zero.zero_quantized_gradients and zero.zero_quantized_gradients_bits == 4 and zero.zero_quantized_block_size % 2:
        raise ConfigError(
            f"{key}zero_quantized_block_size = {zero.zero_quantized_block_size} with int4 gradients: int4 packs "
            "two codes a byte, so blocks must be even"
        )
    if zero.zero_quantized_gradients and cfg.communication_data_type is not None:
        raise ConfigError(
            f"communication_data_type = {cfg.communication_data_type!r} with {key}zero_quantized_gradients: "
            "quantized gradients travel as int4/int8 codes, not in a float dtype; drop one"
        )
    if zero.zero_quantized_nontrainable_weights and zero.stage != 3:
        raise ConfigError(
            f"{key}zero_quantized_nontrainable_weights needs stage 3 (stage is {zero.stage}): it keeps stage 3's "
            "frozen params as int8 codes"
        )
    compressed = zero.zero_quantized_gradients or zero.zero_quantized_weights
    if compressed and cfg.optimizer.type in [OPTIMIZER_NAMES[t] for t in ONEBIT_FAMILY]:
        raise ConfigError(
            f"{key}zero_quantized_weights/zero_quantized_gradients with {cfg.optimizer.type}: the 1-bit "
            "optimizers compress their own exchange (stages 0-1) and are not combined with ZeRO++; use one"
        )


def _validate(raw: dict, world_size: int) -> Config:
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size = {world_size!r}: must be an integer >= 1")
    cfg = _parse(Config, raw, "")
    optimizer = _resolve_optimizer(cfg.optimizer, cfg.bf16.bf16_master_weights_and_grads)
    cfg = replace(cfg, optimizer=optimizer, scheduler=_resolve_scheduler(cfg.scheduler))
    cfg = _resolve_batch(cfg, world_size)
    _check_combinations(cfg)
    _check_zeropp(cfg, world_size)
    return cfg


def to_dict(cfg: Any) -> Any:
    """The config as plain JSON-able values (with every default filled in)."""
    if is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in fields(cfg)}
    if isinstance(cfg, tuple):
        return list(cfg)
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg
