"""DeepSpeed's config getters on the engine (``engine.zero_reduce_bucket_size()``,
``engine.fp16_enabled()``, ...), for scripts and integrations (Accelerate,
Hugging Face's Trainer) that read the config through the engine rather than
the config itself: a mixin of :class:`fastzero.runtime.engine.Engine`, which
provides ``_config`` (the parsed :class:`fastzero.config.Config`), ``stage``,
``comm``, ``tensor_comm`` and ``client_optimizer``."""

from __future__ import annotations


class ConfigGetters:
    def fp16_enabled(self) -> bool:
        return self._config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self._config.bf16.enabled

    def zero_optimization_stage(self) -> int:
        return self.stage

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def optimizer_name(self) -> str | None:
        """The client optimizer's class name, else the config's optimizer type (DeepSpeed's rule)."""
        if self.client_optimizer is not None:
            return type(self.client_optimizer).__name__
        return self._config.optimizer.type.lower() or None  # DeepSpeed lowercases the config's type

    def scheduler_name(self) -> str | None:
        return self._config.scheduler.type or None

    def zero_optimization(self) -> bool:
        return self.stage > 0

    def zero_offload_optimizer(self):
        """The offload_optimizer section when it offloads, else None (DeepSpeed's)."""
        offload = self._config.zero_optimization.offload_optimizer
        return offload if offload.device != "none" else None

    def zero_offload_param(self):
        """The offload_param section when it offloads, else None."""
        offload = self._config.zero_optimization.offload_param
        return offload if offload.device != "none" else None

    def zero_cpu_offload(self) -> bool:
        return self.zero_offload_optimizer() is not None

    def zero_optimization_partition_gradients(self) -> bool:
        return self.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.stage >= 3

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self._config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def zero_overlap_comm(self) -> bool:
        return self._config.zero_optimization.overlap_comm

    def zero_reduce_bucket_size(self) -> int:
        return self._config.zero_optimization.reduce_bucket_size

    def zero_allgather_bucket_size(self) -> int:
        return self._config.zero_optimization.allgather_bucket_size

    def zero_contiguous_gradients(self) -> bool:
        return self._config.zero_optimization.contiguous_gradients

    def zero_reduce_scatter(self) -> bool:
        return self._config.zero_optimization.reduce_scatter

    def zero_allgather_partitions(self) -> bool:
        return self._config.zero_optimization.allgather_partitions

    def zero_sub_group_size(self) -> int:
        return self._config.zero_optimization.sub_group_size

    def zero_prefetch_bucket_size(self) -> int:
        return self._config.zero_optimization.stage3_prefetch_bucket_size

    def zero_param_persistence_threshold(self) -> int:
        return self._config.zero_optimization.stage3_param_persistence_threshold

    def zero_max_live_parameters(self) -> int:
        return self._config.zero_optimization.stage3_max_live_parameters

    def zero_max_reuse_distance(self) -> int:
        return self._config.zero_optimization.stage3_max_reuse_distance

    def zero_ignore_unused_parameters(self) -> bool:
        return self._config.zero_optimization.ignore_unused_parameters

    def zero_round_robin_gradients(self) -> bool:
        return self._config.zero_optimization.round_robin_gradients

    def zero_elastic_checkpoint(self) -> bool:
        return self._config.zero_optimization.elastic_checkpoint

    def zero_load_from_fp32_weights(self) -> bool:
        return self._config.zero_optimization.load_from_fp32_weights

    def zero_quantized_weights(self) -> bool:
        return self._config.zero_optimization.zero_quantized_weights

    def zero_quantized_gradients(self) -> bool:
        return self._config.zero_optimization.zero_quantized_gradients

    def zero_quantized_nontrainable_weights(self) -> bool:
        return self._config.zero_optimization.zero_quantized_nontrainable_weights

    def zero_hpz_partition_size(self) -> int:
        return self._config.zero_optimization.zero_hpz_partition_size

    def zero_allow_untested_optimizer(self) -> bool:
        return self._config.zero_allow_untested_optimizer

    def postscale_gradients(self) -> bool:
        return not self._config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return self._config.gradient_predivide_factor

    def fp16_auto_cast(self) -> bool:
        return self._config.fp16.auto_cast

    def initial_dynamic_scale(self) -> float:
        return 2.0**self._config.fp16.initial_scale_power

    def bf16_master_weights_and_gradients(self) -> bool:
        return self._config.bf16.bf16_master_weights_and_grads

    def amp_enabled(self) -> bool:
        return False  # NVIDIA apex's amp: not supported (the config check refuses its section)

    def autotp_size(self) -> int:
        return self._config.tensor_parallel.autotp_size

    def get_data_parallel_rank(self) -> int:
        return self.comm.rank

    def get_tensor_parallel_rank(self) -> int:
        return 0 if self.tensor_comm is None else self.tensor_comm.rank

    get_model_parallel_rank = get_tensor_parallel_rank

    def steps_per_print(self) -> int:
        return self._config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self._config.wall_clock_breakdown

    def dynamic_loss_scale(self) -> bool:
        return self._config.fp16.loss_scale == 0

    def dataloader_drop_last(self) -> bool:
        return self._config.dataloader_drop_last
