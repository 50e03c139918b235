"""``deepspeed.runtime.pipe.module``: the pipeline module classes of :mod:`fastzero.pipe`."""

from fastzero.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
