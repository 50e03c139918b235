"""Pipeline parallelism: the model cut into stages on different ranks
(``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``), schedules as data
(per-rank instruction lists, inspectable without a model), and the
point-to-point transport between stages. The engine that runs a schedule
lives in the runtime; this package knows nothing of ZeRO."""

from fastzero.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
