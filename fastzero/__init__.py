"""fastzero: fast kernels and a thin ZeRO runtime for training large models.

The kernels are in :mod:`fastzero.ops` (``from fastzero.ops import CPUAdam``);
``fastzero.initialize(model=..., config=...)`` builds the training engine
(DeepSpeed's API: ``import fastzero as deepspeed`` works for the common calls).
"""

from fastzero.arguments import add_config_arguments
from fastzero.version import __version__, __version_major__, __version_minor__, __version_patch__, version_info

__all__ = [
    "__version__",
    "__version_major__",
    "__version_minor__",
    "__version_patch__",
    "add_config_arguments",
    "init_distributed",
    "initialize",
    "version_info",
]


def initialize(*args, **kwargs):
    """See :func:`fastzero.runtime.engine.initialize`."""
    from fastzero.runtime.engine import initialize as _initialize

    return _initialize(*args, **kwargs)


def init_distributed(*args, **kwargs):
    """Joins the process group from the launcher's environment (DeepSpeed's
    ``deepspeed.init_distributed``, same parameters): see
    :func:`fastzero.comm.env.init_distributed`."""
    from fastzero.comm.env import init_distributed as _init

    return _init(*args, **kwargs)


def tp_model_init(*args, **kwargs):
    """Shards a model for tensor parallelism (DeepSpeed's AutoTP training
    entry): see :func:`fastzero.parallel.autotp.tp_model_init`."""
    from fastzero.parallel.autotp import tp_model_init as _tp_model_init

    return _tp_model_init(*args, **kwargs)


# Submodules a DeepSpeed script reaches as attributes (``deepspeed.comm.get_rank()``,
# ``deepspeed.zero.Init``, ``deepspeed.utils.RepeatingLoader``, ``deepspeed.checkpointing.checkpoint``,
# ``deepspeed.profiling.flops_profiler``), imported on first use so that
# ``import fastzero`` stays light.
_SUBMODULES = (
    "accelerator",
    "checkpoint",
    "checkpointing",
    "comm",
    "ops",
    "pipe",
    "profiling",
    "runtime",
    "utils",
    "zero",
)
# and the names DeepSpeed exports at its top level: (module, name)
_NAMES = {
    "PipelineModule": ("fastzero.pipe", "PipelineModule"),
    "DeepSpeedEngine": ("fastzero.runtime.engine", "Engine"),
    "PipelineEngine": ("fastzero.runtime.pipe_engine", "PipelineEngine"),
    "logger": ("fastzero.utils.logging", "logger"),
    "log_dist": ("fastzero.utils.logging", "log_dist"),
}


def __getattr__(name: str):
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _NAMES:
        module, attr = _NAMES[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
