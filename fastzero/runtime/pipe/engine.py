"""``deepspeed.runtime.pipe.engine``: the pipeline engine, :class:`fastzero.runtime.pipe_engine.PipelineEngine`."""

from fastzero.runtime.pipe_engine import PipelineEngine

__all__ = ["PipelineEngine"]
