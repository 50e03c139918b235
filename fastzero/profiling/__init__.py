"""Profiling: DeepSpeed's flops profiler (``fastzero.profiling.flops_profiler``),
FLOPs counted by ``torch.utils.flop_counter.FlopCounterMode``. Runtime layer:
the engine's monitor drives it when the ``flops_profiler`` section is enabled."""

from fastzero.profiling.flops_profiler import FlopsProfiler, get_model_profile

__all__ = ["FlopsProfiler", "get_model_profile"]
