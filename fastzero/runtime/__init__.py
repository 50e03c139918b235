"""fastzero's thin ZeRO runtime: the engine (stages 0-3), its ZeRO groups, the
loss scaler, learning-rate schedules, checkpoints, monitoring, and the
optimizers that need process groups (the 1-bit family)."""

from fastzero.runtime.engine import Engine, initialize

__all__ = ["Engine", "initialize"]

# DeepSpeed's module paths that scripts reach as attributes (``deepspeed.runtime.utils.see_memory_usage``,
# ``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES``), imported on first use
_SUBMODULES = ("activation_checkpointing", "lr_schedules", "pipe", "utils")


def __getattr__(name: str):
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
