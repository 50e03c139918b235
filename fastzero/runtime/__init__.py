"""fastzero's thin ZeRO runtime: the engine (stages 0-3), its ZeRO groups, the
loss scaler, learning-rate schedules, checkpoints, monitoring, and the
optimizers that need process groups (the 1-bit family)."""

from fastzero.runtime.engine import Engine, initialize

__all__ = ["Engine", "initialize"]
