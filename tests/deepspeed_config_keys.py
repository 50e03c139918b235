"""DeepSpeed's config keys, as dotted paths, read from an installed deepspeed.

    PYTHONPATH=. python -m tests.deepspeed_config_keys > tests/data/deepspeed_config_keys.txt

regenerates the vendored list that tests/test_config_keys.py checks against
fastzero's table (fastzero/config_keys.py). Three sources, as DeepSpeed reads
its config: the pydantic models (every field under its name and its alias,
nested models walked), the sections still read by hand from constants
(``FLOPS_PROFILER_ENABLED = "enabled"`` under ``FLOPS_PROFILER =
"flops_profiler"``), and the top-level keys ``DeepSpeedConfig`` reads by name or
refuses as removed. ``optimizer.type`` and ``scheduler.type`` values are listed
as ``optimizer.type=<name>``.
"""

from __future__ import annotations

import importlib
import typing

# Top-level keys DeepSpeedConfig._initialize_params (deepspeed/runtime/config.py) reads with a getter of its own
# or a literal, beside the sections below; kept by hand: they are not all constants.
TOP_LEVEL = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "managed_gradient_accumulation",
    "steps_per_print",
    "dump_state",
    "disable_python_gc",
    "disable_allgather",
    "communication_data_type",
    "seq_parallel_communication_data_type",
    "prescale_gradients",
    "gradient_predivide_factor",
    "gradient_allreduce_op",
    "gradient_clipping",
    "optimizer",
    "optimizer.type",
    "optimizer.params",
    "optimizer.legacy_fusion",
    "scheduler",
    "scheduler.type",
    "scheduler.params",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "wall_clock_breakdown",
    "memory_breakdown",
    "use_data_before_expert_parallelism",
    "pipeline",
    "data_efficiency",
    "data_types",
    "data_types.grad_accum_dtype",
    "data_types.param_dtype",
    "data_types.buffer_dtype",
    "data_types.keep_in_fp32_modules",
    "checkpoint.load_universal",
    "checkpoint.use_node_local_storage",
    "checkpoint.parallel_write",
    "checkpoint.parallel_write.pipeline_stage",
    "dataloader_drop_last",
    "log_level",
    "datastates_ckpt",
    "weight_quantization",
    "expert_parallel",
    "torch_autocast",
    "torch_autocast.enabled",
    "torch_autocast.dtype",
    "torch_autocast.lower_precision_safe_modules",
    "sequence_parallel_size",
    "vocabulary_size",
    "bfloat16",
)

# (section, constants module, the section's constant): the sections DeepSpeed still reads key by key
CONSTANT_SECTIONS = (
    ("flops_profiler", "deepspeed.profiling.constants", "FLOPS_PROFILER"),
    ("activation_checkpointing", "deepspeed.runtime.activation_checkpointing.config", "ACT_CHKPT"),
    ("aio", "deepspeed.runtime.swap_tensor.constants", "AIO"),
    ("comms_logger", "deepspeed.comm.constants", "COMMS_LOGGER"),
    ("timers", "deepspeed.utils.config", "TIMERS"),
    ("autotuning", "deepspeed.autotuning.constants", "AUTOTUNING"),
)


def _models(annotation) -> list[type]:
    """The pydantic models in a field's annotation (Optional[X], X | None, ...)."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def model_keys(model: type, prefix: str) -> set[str]:
    """Every key a pydantic config model accepts under `prefix`: each field's
    name and alias (DeepSpeed's models populate by either), nested models too."""
    out = set()
    for name, info in model.model_fields.items():
        for key in {name, info.alias} - {None}:
            out.add(prefix + key)
            for sub in _models(info.annotation):
                out |= model_keys(sub, f"{prefix}{key}.")
    return out


def constant_keys(section: str, module: str, base: str) -> set[str]:
    """The keys of a section DeepSpeed reads from constants: every string
    constant named ``<BASE>_<X>`` (not ``_DEFAULT``, ``_FORMAT`` or a value
    list) is the key ``section.<value>``."""
    mod = importlib.import_module(module)
    out = {section}
    for name, value in vars(mod).items():
        if not (name.startswith(base + "_") and isinstance(value, str) and value.isidentifier()):
            continue
        if name.endswith(("_DEFAULT", "_FORMAT")) or value.isupper():  # defaults and enum values, not keys
            continue
        out.add(f"{section}.{value}")
    return out


def deepspeed_keys() -> list[str]:
    """The dotted keys of the installed deepspeed's config, sorted."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.monitor.config import DeepSpeedMonitorConfig
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    keys = set(TOP_LEVEL)
    keys |= {"zero_optimization", "fp16", "bf16", "compile", "tensor_parallel", "hybrid_engine", "comms_logger"}
    keys |= model_keys(DeepSpeedZeroConfig, "zero_optimization.")
    keys |= model_keys(DeepSpeedFP16Config, "fp16.")
    keys |= model_keys(DeepSpeedBF16Config, "bf16.")
    keys |= model_keys(DeepSpeedMonitorConfig, "")
    keys |= model_keys(CommsLoggerConfig, "comms_logger.")
    keys |= model_keys(CompileConfig, "compile.")
    keys |= model_keys(TPTrainingConfig, "tensor_parallel.")
    keys |= model_keys(ds_config.HybridEngineConfig, "hybrid_engine.")
    for section, module, base in CONSTANT_SECTIONS:
        keys |= constant_keys(section, module, base)
    # the checkpoint section: its own keys, and the writer's (named CHECKPOINT_* too) under "writer"
    section = constant_keys("checkpoint", "deepspeed.runtime.model_checkpointing.constants", "CHECKPOINT")
    own = {"checkpoint", "checkpoint.tag_validation", "checkpoint.checkpoint_serialization", "checkpoint.writer"}
    keys |= {k if k in own else k.replace("checkpoint.", "checkpoint.writer.", 1) for k in section}
    # keys DeepSpeed now refuses as removed: still DeepSpeed keys that older configs carry
    keys |= set(getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}))
    keys |= {f"zero_optimization.{k}" for k in getattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS", {})}
    keys |= {f"optimizer.type={name}" for name in ds_config.DEEPSPEED_OPTIMIZERS}
    keys |= {f"optimizer.type={name}" for name in ("onebitadam", "zerooneadam", "onebitlamb")}  # the 1-bit family
    keys |= {f"scheduler.type={name}" for name in VALID_LR_SCHEDULES}
    return sorted(keys)


if __name__ == "__main__":
    import contextlib
    import sys

    with contextlib.redirect_stdout(sys.stderr):  # deepspeed's logger prints to stdout on import
        import deepspeed

        keys = deepspeed_keys()

    print(f"# DeepSpeed {deepspeed.__version__}'s config keys (python -m tests.deepspeed_config_keys); one dotted")
    print("# path a line, optimizer.type=<name> for the optimizer types, scheduler.type=<name> for the schedules")
    print("\n".join(keys))
