"""DeepSpeed's ``deepspeed.runtime.pipe`` path: the pipeline module classes
(:mod:`fastzero.pipe`, also as :mod:`.module`), the process topologies
(:mod:`.topology`) and the pipeline engine (:mod:`.engine`, imported when
used)."""

from fastzero.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from fastzero.runtime.pipe import module, topology
from fastzero.runtime.pipe.topology import ProcessTopology

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec", "module", "topology"]


def __getattr__(name: str):
    if name == "engine":  # it builds on the whole runtime
        import importlib

        return importlib.import_module(f"{__name__}.engine")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
