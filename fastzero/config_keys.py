"""Every DeepSpeed config key, in one table, with what fastzero does with it.

:data:`KEYS` maps each key, as a dotted path (``zero_optimization.stage``), to
its status:

- **implemented**: a field of :mod:`fastzero.config`'s dataclasses, with
  DeepSpeed's meaning;
- **accepted**: a field too, parsed and checked, that changes nothing in
  fastzero for the documented reason (``zero_optimization.elastic_checkpoint``:
  every fastzero checkpoint is elastic);
- **alias**: an old or second DeepSpeed name of another key, read as that key;
- **refused**: :class:`fastzero.config.ConfigNotSupported` with the reason. A
  refused section (``pipeline``) refuses all of its keys.

A value can be refused where the key is accepted (``Key.refuse``:
``checkpoint.checkpoint_serialization = false``). Keys fastzero adds are marked
``own``. ``optimizer.type=<name>`` and ``scheduler.type=<name>`` (lower-case
optimizer names, as DeepSpeed matches them) are the types. The parser reads
this table for every key that is not a field; ``docs/config_keys.md`` is
generated from it (``python -m fastzero.config_keys > docs/config_keys.md``).
The vendored list of DeepSpeed's keys that the tests check this table against
is ``tests/data/deepspeed_config_keys.txt`` (DeepSpeed 0.19.8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

IMPLEMENTED, ACCEPTED, ALIAS, REFUSED = "implemented", "accepted", "alias", "refused"


@dataclass(frozen=True)
class Key:
    """One key's status; `note`: what it does (implemented), why it changes
    nothing (accepted), the key it names (alias), the reason (refused)."""

    status: str
    note: str = ""
    own: bool = False  # fastzero's key, not DeepSpeed's
    refuse: tuple = ()  # (value, reason): that value is refused with the reason


def done(note: str = "", *, refuse: tuple = ()) -> Key:
    return Key(IMPLEMENTED, note, refuse=refuse)


def own(note: str) -> Key:
    return Key(IMPLEMENTED, note, own=True)


def accepted(why: str, *, refuse: tuple = ()) -> Key:
    return Key(ACCEPTED, why, refuse=refuse)


def alias(target: str) -> Key:
    return Key(ALIAS, target)


def refused(why: str) -> Key:
    return Key(REFUSED, why)


# Reasons shared by several keys
PIPELINE = "the pipeline engine loads and saves every stage's pieces itself (checkpoints are elastic across layouts)"
INFERENCE_TP = (
    "DeepSpeed's inference tensor-parallel settings (kernel injection, policies); fastzero trains with AutoTP "
    "(tensor_parallel.autotp_size, fastzero.tp_model_init) or a topology/mpu passed to initialize"
)
NVME = "fastzero offloads to the CPU only; NVMe offload (ZeRO-Infinity) is not implemented"
REMOVED = "removed from DeepSpeed (0.19.8 refuses it too: deepspeedai/DeepSpeed#8489)"
CPU_ADAM = "fastzero's CPU step is its own CPUAdam, with no such knob"
STAGE3_FETCH = "fastzero's stage 3 fetches each module's params with one bucketed all-gather; no such knob"

KEYS: dict[str, Key] = {
    # -- batch sizes, steps, logging ------------------------------------------------------------------------------
    "train_batch_size": done("train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size"),
    "train_micro_batch_size_per_gpu": done("samples per rank per forward"),
    "gradient_accumulation_steps": done("micro-steps per optimizer step"),
    "managed_gradient_accumulation": refused(
        "fastzero always tracks micro-steps and steps at the accumulation boundary (DeepSpeed's default true); "
        "a client-owned boundary is not implemented"
    ),
    "steps_per_print": done(
        "how often the engine logs its metrics (loss, lr, grad norm, samples/s, ...); infinity: never "
        "(Accelerate sets it)"
    ),
    "wall_clock_breakdown": done("the logged metrics add the forward/backward/step time split"),
    "dataloader_drop_last": done("the training_data loader drops a last, short micro-batch"),
    "log_level": refused("fastzero logs with the logging module; set the 'fastzero' logger's level"),
    "dump_state": refused("DeepSpeed prints its engine state at start; fastzero has no such dump"),
    "disable_python_gc": refused("DeepSpeed's manual garbage-collection pacing is not implemented"),
    "memory_breakdown": done("memory in use and model-state bytes by kind, logged every steps_per_print steps"),
    "timers": refused("DeepSpeed's throughput timer; fastzero's timers are engine.take_timers()"),
    # fastzero's: what a non-finite gradient does outside fp16 (which the loss scaler handles)
    "non_finite_grads": own("skip: a non-finite gradient norm skips the step, as fp16 does; raise: an error"),
    # -- gradients and communication ------------------------------------------------------------------------------
    "gradient_clipping": done(
        "clips the global gradient norm (0: off). Default 0, where DeepSpeed 0.19 defaults to 1.0: a DeepSpeed "
        "config that leaves it out clipped at 1.0 there; set it to keep that"
    ),
    "communication_data_type": done("the dtype the gradient sum over ranks is taken in (fp32, fp16, bf16)"),
    "seq_parallel_communication_data_type": refused("fastzero has no sequence parallelism yet"),
    "prescale_gradients": done("each rank's gradient divided by the number of ranks before the sum"),
    "gradient_predivide_factor": done("gradients divided by it before the sum, by ranks / it after"),
    "gradient_allreduce_op": refused(
        "fastzero averages gradients over the data-parallel ranks; 'sum' is not implemented"
    ),
    "disable_allgather": refused("stages 1-2 all-gather the updated params; the broadcast fallback is not implemented"),
    "sparse_gradients": refused(REMOVED),
    "sequence_parallel_size": refused("fastzero has no sequence parallelism yet"),
    "use_data_before_expert_parallelism": refused("fastzero has no expert parallelism"),
    "expert_parallel": refused("fastzero has no expert parallelism"),
    "vocabulary_size": refused("DeepSpeed only warns when it is no multiple of 8; fastzero does not read it"),
    # -- optimizer and scheduler ----------------------------------------------------------------------------------
    "optimizer": done("the optimizer, by type and params"),
    "optimizer.type": done("one of the types below (case-insensitive)"),
    "optimizer.params": done(
        "the type's hyperparameters, checked by name (docs/optimizers.md); Adam and AdamW also take state_format "
        "('fp32' default, 'param_dtype', 'bf16' with seed, 'int8' with seed and block_size) and DeepSpeed's "
        "fp32_optimizer_states (docs/zero.md, optimizer state formats), and bf16_stochastic_round (torchao's name; "
        "default true with bf16.bf16_master_weights_and_grads, which it needs; false there: rounded to nearest)"
    ),
    "optimizer.legacy_fusion": refused("DeepSpeed's legacy fp16 fused optimizer is not implemented"),
    "optimizer.type=adam": done("Adam (fastzero.ops); adam_w_mode true (default): AdamW's decoupled decay"),
    "optimizer.type=adamw": done("AdamW (fastzero.ops)"),
    "optimizer.type=lamb": done("Lamb (fastzero.ops), stage 0"),
    "optimizer.type=onebitadam": done("1-bit Adam (docs/onebit.md), stages 0-1"),
    "optimizer.type=zerooneadam": done("0/1 Adam (docs/onebit.md), stages 0-1"),
    "optimizer.type=onebitlamb": done("1-bit LAMB (docs/onebit.md), stages 0-1"),
    "optimizer.type=adagrad": refused("fastzero has no Adagrad kernel yet"),
    "optimizer.type=lion": refused("fastzero has no Lion kernel yet"),
    "optimizer.type=muon": refused("fastzero has no Muon optimizer yet"),
    "optimizer.type=muadam": refused("the MuP optimizers (mup package) are not implemented"),
    "optimizer.type=muadamw": refused("the MuP optimizers (mup package) are not implemented"),
    "optimizer.type=musgd": refused("the MuP optimizers (mup package) are not implemented"),
    # DeepSpeed builds any other name as the torch.optim class of that name
    "optimizer.type=<torch.optim class>": refused(
        "DeepSpeed builds torch.optim's class of that name; fastzero's engine runs its fused kernels over its shards: "
        "use Adam, AdamW or Lamb, or pass torch.optim.Adam/AdamW to initialize(optimizer=...)"
    ),
    "zero_allow_untested_optimizer": done(
        "any torch.optim optimizer at ZeRO stages 1-3, rebuilt over the rank's fp32 shard"
    ),
    "zero_force_ds_cpu_optimizer": done("false: a client optimizer steps the offloaded CPU shard; true refuses it"),
    "scheduler": done("the learning-rate schedule, by type and params"),
    "scheduler.type": done("one of the types below"),
    "scheduler.params": done("the schedule's parameters, checked by name, DeepSpeed's defaults"),
    "scheduler.type=WarmupLR": done(
        "DeepSpeed's WarmupLR schedule (runtime/lr_schedules.py); warmup_max_lr left out: each param group's lr, "
        "as DeepSpeed 0.19"
    ),
    "scheduler.type=WarmupDecayLR": done("DeepSpeed's WarmupDecayLR schedule (runtime/lr_schedules.py)"),
    "scheduler.type=WarmupCosineLR": done("DeepSpeed's WarmupCosineLR schedule (runtime/lr_schedules.py)"),
    "scheduler.type=OneCycle": done("DeepSpeed's OneCycle schedule (runtime/lr_schedules.py)"),
    "scheduler.type=LRRangeTest": done("DeepSpeed's LRRangeTest schedule (runtime/lr_schedules.py)"),
    # -- precision ------------------------------------------------------------------------------------------------
    "fp16": done("float16 training with a loss scaler"),
    "fp16.enabled": done(),
    "fp16.loss_scale": done("0: dynamic loss scaling, else that static scale"),
    "fp16.initial_scale_power": done("the dynamic scale starts at 2**power"),
    "fp16.loss_scale_window": done("steps without overflow before the scale doubles"),
    "fp16.hysteresis": done("overflows tolerated before the scale halves"),
    "fp16.consecutive_hysteresis": done("hysteresis refills on every step without overflow"),
    "fp16.min_loss_scale": done("the scale never goes below it"),
    "fp16.auto_cast": accepted(
        "the engine always casts floating-point forward inputs to the training dtype (DeepSpeed's true); with "
        "false, inputs already in float16 are unchanged by that cast, and others need it"
    ),
    "fp16.fp16_master_weights_and_grads": refused(
        "fp16 params keep fp32 masters: fastzero's stochastic rounding writes bf16 params only, and fp16 params "
        "rounded to nearest lose every update below half an fp16 ulp; bf16.bf16_master_weights_and_grads drops "
        "the masters under bf16"
    ),
    "bf16": done("bfloat16 training, with fp32 masters (or none: bf16_master_weights_and_grads)"),
    "bf16.enabled": done(),
    "bf16.immediate_grad_update": refused("gradients are reduced in buckets, then stepped; not implemented"),
    "bf16.check_grad_overflow": refused("a non-finite gradient is handled by non_finite_grads (skip or raise)"),
    "bf16.bf16_master_weights_and_grads": done(
        "no fp32 master: the rank's bf16 shard is the param Adam/AdamW update, written with stochastic rounding "
        "(optimizer.params.bf16_stochastic_round, default true; false: to nearest), 2 bytes per param instead "
        "of 6; the gradients are bf16, as always. DeepSpeed's keeps a separate bf16 master copy (and bf16 grads) "
        "updated rounded to nearest, at stages 1-3; fastzero's keeps no copy, at stages 0-3 and with "
        "offload_optimizer. Refused with fp16, Lamb, the 1-bit optimizers and client optimizers other than Adam "
        "(docs/zero.md)"
    ),
    "bf16.bf16_optimizer_states": refused(
        "DeepSpeed's bf16 states are rounded to nearest; fastzero's are optimizer.params.state_format: 'bf16' "
        "(stochastic rounding) or 'int8' (block-wise), for Adam and AdamW (docs/zero.md)"
    ),
    "bfloat16": alias("bf16"),
    "amp": refused(f"{REMOVED}; use bf16 or fp16"),
    "torch_autocast": refused("torch.autocast around the forward is not implemented; use bf16 or fp16"),
    "torch_autocast.enabled": refused("see torch_autocast"),
    "torch_autocast.dtype": refused("see torch_autocast"),
    "torch_autocast.lower_precision_safe_modules": refused("see torch_autocast"),
    "data_types": refused(
        "DeepSpeed's grad_accum_dtype/param_dtype/buffer_dtype overrides are not implemented; fastzero's dtypes "
        "follow fp16/bf16"
    ),
    "fp8": refused("fp8 training is not implemented"),
    # -- ZeRO -----------------------------------------------------------------------------------------------------
    "zero_optimization": done("ZeRO stages 0-3 (docs/zero.md)"),
    "zero_optimization.stage": done("0: DDP-style, 1: optimizer state, 2: + gradients, 3: + params partitioned"),
    "zero_optimization.overlap_comm": done("reduce buckets during backward (stage 0 always does)"),
    "zero_optimization.overlap_param_gather": own(
        "stages 1-2: step() returns with the param all-gather in flight, each module's forward waiting for its own "
        "buckets; read params outside a forward after engine.wait_params() (docs/zero.md)"
    ),
    "zero_optimization.contiguous_gradients": accepted(
        "fastzero's gradients always live in contiguous flat buckets; the value changes nothing"
    ),
    "zero_optimization.reduce_bucket_size": done("elements per gradient reduction bucket"),
    "zero_optimization.allgather_bucket_size": done("elements per param all-gather bucket (stages 1-2)"),
    "zero_optimization.reduce_scatter": accepted(
        "stages 1-2 always reduce-scatter their buckets; DeepSpeed's all-reduce fallback has no use here"
    ),
    "zero_optimization.allgather_partitions": accepted(
        "stages 1-2 always all-gather the updated partitions; DeepSpeed's broadcast fallback has no use here"
    ),
    "zero_optimization.use_multi_rank_bucket_allreduce": refused(
        "stages 1-2 reduce-scatter their buckets; the multi-rank all-reduce variant is not implemented"
    ),
    "zero_optimization.offload_optimizer": done("the optimizer state and step on the CPU (CPUAdam), stages 1-3"),
    "zero_optimization.offload_optimizer.device": done("none or cpu (nvme is refused)"),
    "zero_optimization.offload_optimizer.pin_memory": done("page-locked CPU copies (default false; DeepSpeed's true)"),
    "zero_optimization.offload_optimizer.nvme_path": refused(NVME),
    "zero_optimization.offload_optimizer.buffer_count": refused(NVME),
    "zero_optimization.offload_optimizer.pipeline_read": refused(NVME),
    "zero_optimization.offload_optimizer.pipeline_write": refused(NVME),
    "zero_optimization.offload_optimizer.fast_init": refused(NVME),
    "zero_optimization.offload_optimizer.ratio": refused(
        "the whole optimizer state is offloaded; partial offload is not implemented"
    ),
    "zero_optimization.offload_optimizer.super_offload": refused("SuperOffload is not implemented"),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": refused(CPU_ADAM),
    "zero_optimization.offload_param": done("stage 3's param shards on the CPU"),
    "zero_optimization.offload_param.device": done("none or cpu (nvme is refused)"),
    "zero_optimization.offload_param.pin_memory": done("page-locked CPU copies (default false; DeepSpeed's true)"),
    "zero_optimization.offload_param.nvme_path": refused(NVME),
    "zero_optimization.offload_param.buffer_count": refused(NVME),
    "zero_optimization.offload_param.buffer_size": refused(NVME),
    "zero_optimization.offload_param.max_in_cpu": refused(NVME),
    "zero_optimization.cpu_offload": alias("zero_optimization.offload_optimizer.device"),
    "zero_optimization.cpu_offload_param": alias("zero_optimization.offload_param.device"),
    "zero_optimization.cpu_offload_use_pin_memory": alias("zero_optimization.offload_*.pin_memory"),
    "zero_optimization.stage3_prefetch_bucket_size": done("elements fetched ahead of use"),
    "zero_optimization.prefetch_bucket_size": alias("zero_optimization.stage3_prefetch_bucket_size"),
    "zero_optimization.stage3_param_persistence_threshold": done("params this small stay whole on every rank"),
    "zero_optimization.param_persistence_threshold": alias("zero_optimization.stage3_param_persistence_threshold"),
    "zero_optimization.stage3_max_live_parameters": done("elements gathered at once"),
    "zero_optimization.max_live_parameters": alias("zero_optimization.stage3_max_live_parameters"),
    "zero_optimization.stage3_max_reuse_distance": done("a param reused within this many elements stays gathered"),
    "zero_optimization.max_reuse_distance": alias("zero_optimization.stage3_max_reuse_distance"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": done("save_16bit_model gathers at stage 3"),
    "zero_optimization.gather_16bit_weights_on_model_save": alias(
        "zero_optimization.stage3_gather_16bit_weights_on_model_save"
    ),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": alias(
        "zero_optimization.stage3_gather_16bit_weights_on_model_save"
    ),
    "zero_optimization.stage3_model_persistence_threshold": refused(
        "only stage3_param_persistence_threshold bounds which params stay whole"
    ),
    "zero_optimization.model_persistence_threshold": refused(
        "only stage3_param_persistence_threshold bounds which params stay whole"
    ),
    "zero_optimization.stage3_module_granularity_threshold": refused(STAGE3_FETCH),
    "zero_optimization.module_granularity_threshold": refused(STAGE3_FETCH),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": refused(STAGE3_FETCH),
    "zero_optimization.use_all_reduce_for_fetch_params": refused(STAGE3_FETCH),
    "zero_optimization.stage3_allgather_sequential": refused(STAGE3_FETCH),
    "zero_optimization.allgather_sequential": refused(STAGE3_FETCH),
    # fastzero's: the ranks agree on each module before gathering its params
    "zero_optimization.stage3_check_divergence": own(
        "stage 3: the ranks agree on each module before gathering its params; a branch that differs across ranks "
        "is an error naming the module"
    ),
    "zero_optimization.sub_group_size": done(
        "the optimizer step runs over the shard in sub-groups of at most this many elements"
    ),
    "zero_optimization.elastic_checkpoint": accepted(
        "every fastzero checkpoint is elastic: it loads at any world size and stage (a node-local one once its nodes' "
        "directories are merged; docs/checkpoints.md)"
    ),
    "zero_optimization.load_from_fp32_weights": done(
        "true: a load restores the saved fp32 masters; false: the masters are re-made from the 16-bit weights"
    ),
    "zero_optimization.round_robin_gradients": accepted(
        "DeepSpeed's offload-time copy order; fastzero reduce-scatters each bucket straight into its owner's "
        "partition, so there is no per-rank copy to reorder"
    ),
    "zero_optimization.ignore_unused_parameters": done(
        "true: params without a gradient count as zero; false: an error naming them"
    ),
    "zero_optimization.legacy_stage1": refused("DeepSpeed's old stage 1; fastzero has one stage 1"),
    "zero_optimization.zero_hpz_partition_size": done(
        "ZeRO++ hpZ (stage 3): a secondary copy of each param split over groups of this many data-parallel ranks, "
        "so a step's gathers after the first stay inside the group (docs/zeropp.md)"
    ),
    "zero_optimization.zero_quantized_weights": done(
        "ZeRO++ qwZ: param all-gathers as block-wise int8 codes (stage 3; stages 1-2: the post-step all-gather)"
    ),
    "zero_optimization.zero_quantized_nontrainable_weights": done(
        "stage 3's frozen params kept as int8 codes, dequantized for the modules that use them"
    ),
    "zero_optimization.zero_quantized_gradients": done(
        "ZeRO++ qgZ (stages 1-3): the gradient reduce-scatter as an all-to-all of int4 (or int8) codes, "
        "hierarchical (inside each node, then across) with several nodes"
    ),
    "zero_optimization.zero_quantized_block_size": own("values per fp32 scale in ZeRO++'s codes (default 256)"),
    "zero_optimization.zero_quantized_gradients_bits": own("qgZ's code width: 4 (default) or 8"),
    "zero_optimization.zero_quantized_gradients_rounding": own(
        "qgZ's rounding: stochastic (default, unbiased; keyed by step, bucket and rank) or nearest (even)"
    ),
    "zero_optimization.zeropp_loco_param": refused(REMOVED),
    "zero_optimization.mics_shard_size": refused(REMOVED),
    "zero_optimization.mics_hierarchical_params_gather": refused(REMOVED),
    "zero_optimization.memory_efficient_linear": refused(
        "DeepSpeed's stage 3 linear that frees its input; fastzero's stage 3 does not replace modules"
    ),
    "zero_optimization.override_module_apply": refused("fastzero's stage 3 does not override nn.Module.apply"),
    "zero_optimization.pipeline_loading_checkpoint": refused(PIPELINE),
    "zero_optimization.log_trace_cache_warnings": refused("fastzero's stage 3 keeps no trace cache"),
    "zero_optimization.enable_sanity_checks": refused("DeepSpeed's internal checks; fastzero's checks always run"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": refused("fastzero has no Muon optimizer"),
    "zero_optimization.compute_grad_norm": refused("the gradient norm is always computed (clipping, non-finite)"),
    "zero_optimization.parameter_alignment": refused("fastzero aligns its flat buffers itself"),
    "zero_optimization.leaf_module": refused(
        "stage 3 leaf modules are not implemented; fastzero gathers by module, with prefetch"
    ),
    "zero_optimization.zenflow": refused("ZenFlow is not implemented"),
    # -- checkpoints ----------------------------------------------------------------------------------------------
    "checkpoint": done("how checkpoints are saved and loaded (docs/checkpoints.md)"),
    "checkpoint.tag_validation": done("Ignore, Warn (default) or Fail: every rank's save tag is compared"),
    "checkpoint.load_universal": accepted(
        "every fastzero load is universal (any world size and stage), but a node-local one's"
    ),
    "checkpoint.use_node_local_storage": done(
        "the save directory is on each node's own disk: each node's first rank writes the shared files there, every "
        "rank its own; a load reads its node's only, at the layout that saved it (docs/checkpoints.md)"
    ),
    "checkpoint.parallel_write": refused(
        "pipeline_stage splits DeepSpeed's save by pipeline stage; every fastzero rank already writes its own pieces"
    ),
    "checkpoint.checkpoint_serialization": accepted(
        "true is what fastzero does (torch.save's zipfile format)",
        refuse=(False, "fastzero always writes torch.save's zipfile format; the legacy format is not implemented"),
    ),
    "checkpoint.writer": refused(
        "DeepSpeed's fast/decoupled checkpoint writers; fastzero writes with torch.save and fsyncs every file"
    ),
    "datastates_ckpt": refused("DataStates asynchronous checkpointing is not implemented"),
    "nebula": refused(REMOVED),
    # -- monitoring and profiling ---------------------------------------------------------------------------------
    "tensorboard": done("scalars to TensorBoard (rank 0)"),
    "tensorboard.enabled": done(),
    "tensorboard.output_path": done(),
    "tensorboard.job_name": done(),
    "csv_monitor": done("scalars to CSV files (rank 0)"),
    "csv_monitor.enabled": done(),
    "csv_monitor.output_path": done(),
    "csv_monitor.job_name": done(),
    "wandb": done("scalars to Weights & Biases (rank 0; pip install wandb)"),
    "wandb.enabled": done(),
    "wandb.project": done(),
    "wandb.team": done(),
    "wandb.group": done(),
    "comet": refused("the Comet monitor is not implemented; use tensorboard or csv_monitor"),
    "flops_profiler": done("per-module FLOPs, MACs, params and latency of one forward, printed as DeepSpeed does"),
    "flops_profiler.enabled": done(),
    "flops_profiler.profile_step": done(),
    "flops_profiler.module_depth": done(),
    "flops_profiler.top_modules": done(),
    "flops_profiler.detailed": done(),
    "flops_profiler.output_file": done(),
    "flops_profiler.recompute_fwd_factor": done(),
    "activation_checkpointing": done(
        "what fastzero.checkpointing.checkpoint does with saved inputs; initialize configures it (docs/parallel.md)"
    ),
    "activation_checkpointing.partition_activations": done("each tensor-parallel rank keeps 1/tp of a saved input"),
    "activation_checkpointing.contiguous_memory_optimization": done(
        "partitions copied into one preallocated buffer of number_checkpoints slots (needs partition_activations)"
    ),
    "activation_checkpointing.cpu_checkpointing": done("saved inputs held in (pinned) CPU memory"),
    "activation_checkpointing.number_checkpoints": done(),
    "activation_checkpointing.synchronize_checkpoint_boundary": done(),
    "activation_checkpointing.profile": done("forward, recompute and gather times: fastzero.checkpointing.timings()"),
    "comms_logger": done(
        "per collective and message size: count, latency, algbw and busbw; fastzero.comm.log_summary() prints "
        "DeepSpeed's table (docs/monitoring.md)"
    ),
    "comms_logger.enabled": done("read as written (DeepSpeed enables the logger whenever the section is present)"),
    "comms_logger.verbose": done("each op logged as it completes, on rank 0"),
    "comms_logger.prof_all": done("every collective (default true); false: prof_ops only"),
    "comms_logger.prof_ops": done("the log names to time when prof_all is false"),
    "comms_logger.debug": done("record names carry the caller (the engine's: fastzero:<tag>)"),
    "autotuning": refused("DeepSpeed's autotuner is not implemented"),
    # -- parallelism and training techniques not in fastzero -----------------------------------------------------
    "pipeline": done("the pipeline engine's settings (docs/pipeline.md)"),
    "pipeline.schedule": own("1f1b, interleaved, zb-h1, or auto: the fastest that fits the memory"),
    "pipeline.virtual_stages": own("virtual stages per rank for the interleaved schedule; must equal the module's"),
    "pipeline.p2p_timeout": own("seconds a stage waits for a neighbour's activation or gradient before it raises"),
    "pipeline.p2p_groups": own(
        "`auto` (per channel on NCCL, shared on Gloo), `shared` (one group, channels told apart by tag), "
        "`per_channel` (a two-rank group per channel: what NCCL needs for interleaved and zb-h1)"
    ),
    "pipeline.stages": accepted("PipelineModule's num_stages decides; a number here must equal it"),
    "pipeline.partition": accepted("PipelineModule's partition_method decides"),
    "pipeline.seed_layers": accepted("PipelineModule's seed_layers decides"),
    "pipeline.activation_checkpoint_interval": accepted("PipelineModule's activation_checkpoint_interval decides"),
    "pipeline.pipe_partitioned": accepted("activations travel whole between stages (no tensor-rank split yet)"),
    "pipeline.grad_partitioned": accepted("gradients travel whole between stages (no tensor-rank split yet)"),
    "tensor_parallel": done("AutoTP training (docs/parallel.md)"),
    "tensor_parallel.autotp_size": done(
        "initialize shards the model's Linear layers over this many ranks (fastzero.tp_model_init; the data-parallel "
        "size is world / autotp_size); 0 or 1: off"
    ),
    "tensor_parallel.dtype": accepted("the training dtype is fp16/bf16's (or tp_model_init's dtype=)"),
    "tensor_parallel.injection_policy_tuple": refused(INFERENCE_TP),
    "tensor_parallel.keep_module_on_host": refused(INFERENCE_TP),
    "tensor_parallel.kernel_inject": refused(INFERENCE_TP),
    "tensor_parallel.replace_with_kernel_inject": refused(INFERENCE_TP),
    "tensor_parallel.preset_model": refused(
        "AutoTP picks its plan from model.config.model_type (docs/parallel.md); pass tp_model_init(plan=...) for others"
    ),
    "tensor_parallel.partition_config": refused(
        "a custom partition plan is tp_model_init(model, tp_size, plan={module-name regex: colwise | rowwise | "
        "replicate}) (docs/parallel.md)"
    ),
    "tensor_parallel.tensor_parallel": refused(INFERENCE_TP),
    "tensor_parallel.tp": refused(INFERENCE_TP),
    "tensor_parallel.tp_overlap_comm": refused(
        "the row-parallel all-reduce is not overlapped with the next matmul; the tensor-parallel layers communicate "
        "synchronously"
    ),
    "tensor_parallel.vocab_parallel_ce_backend": refused(
        "AutoTP keeps the LM head whole (full-vocabulary logits); a vocab-parallel head is "
        "fastzero.parallel.vocab_parallel_cross_entropy in the model"
    ),
    "tensor_parallel.vocab_parallel_lm_head": refused(
        "AutoTP keeps the LM head whole (full-vocabulary logits); build the head with "
        "fastzero.parallel.ColumnParallelLinear and vocab_parallel_cross_entropy"
    ),
    "sparse_attention": refused(
        f"{REMOVED}; fastzero's sparse attention kernels are called from the model (docs/sparse_attention.md)"
    ),
    "aio": refused(NVME),
    "compile": refused(
        "DeepSpeed's compile/DeepCompile passes are not implemented; call engine.compile(backend, compile_kwargs) "
        "(torch.compile of the model's forward, stages 0-2)"
    ),
    "hybrid_engine": refused("DeepSpeed's RLHF hybrid engine (inference kernels) is not implemented"),
    "weight_quantization": refused("weight quantization is not implemented"),
    "data_efficiency": refused("DeepSpeed's data efficiency library (curriculum, random-LTD) is not implemented"),
    "curriculum_learning": refused(REMOVED),
    "compression_training": refused(REMOVED),
    "elasticity": refused(REMOVED),
    "eigenvalue": refused(REMOVED),
    "progressive_layer_drop": refused(REMOVED),
    "quantize_training": refused(REMOVED),
    "graph_harvesting": refused(REMOVED),
}


def lookup(path: str) -> tuple[str, Key] | None:
    """The entry for `path`, or for the nearest section above it that is
    refused as a whole; None for a key that is in no table row."""
    if path in KEYS:
        return path, KEYS[path]
    parts = path.split(".")
    for n in range(len(parts) - 1, 0, -1):
        above = ".".join(parts[:n])
        if above in KEYS:
            return (above, KEYS[above]) if KEYS[above].status == REFUSED else None
    return None


def refusal(path: str, value: Any) -> str | None:
    """The reason `value` is refused for `path` (Key.refuse), or None."""
    key = KEYS.get(path)
    if key is not None and key.refuse and value == key.refuse[0] and type(value) is type(key.refuse[0]):
        return key.refuse[1]
    return None


STATUS_TEXT = {IMPLEMENTED: "implemented", ACCEPTED: "accepted", ALIAS: "alias of", REFUSED: "refused"}


def markdown() -> str:
    """docs/config_keys.md: the table, one row per key, sorted by path."""
    lines = [
        "# Config keys",
        "",
        "<!-- generated by `python -m fastzero.config_keys > docs/config_keys.md` from fastzero/config_keys.py; "
        "tests/test_config_keys.py checks that it is in sync -->",
        "",
        "Every key of DeepSpeed's `ds_config.json` (DeepSpeed 0.19.8: its pydantic config models, the sections it",
        "reads from constants, and the keys it has removed), with what fastzero does with it:",
        "",
        "- **implemented**: DeepSpeed's meaning;",
        "- **accepted**: parsed and checked, and it changes nothing in fastzero, for the reason given;",
        "- **alias of**: an old or second DeepSpeed name, read as the key named;",
        "- **refused**: `ConfigNotSupported`, whose message gives the reason below. A refused section refuses",
        "  every key inside it.",
        "",
        "A key that is in no row is an error (`no such key`, with a did-you-mean). *(fastzero)* marks fastzero's",
        "own keys. `optimizer.type=<name>` rows are the optimizer types (any case), `scheduler.type=<name>` the",
        "schedules.",
        "",
        "| key | status | meaning or reason |",
        "| --- | --- | --- |",
    ]
    for path in sorted(KEYS):
        key = KEYS[path]
        note = f"`{key.note}`" if key.status == ALIAS else key.note
        if key.refuse:
            value = str(key.refuse[0]).lower() if isinstance(key.refuse[0], bool) else key.refuse[0]
            note = f"{note}; `{value}` is refused: {key.refuse[1]}"
        name = f"`{path}`" + (" *(fastzero)*" if key.own else "")
        lines.append(f"| {name} | {STATUS_TEXT[key.status]} | {note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
