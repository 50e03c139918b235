"""fastzero's thin ZeRO runtime: the engine (stages 0-2), the loss scaler,
learning-rate schedules, checkpoints and monitoring."""

from fastzero.runtime.engine import Engine, initialize

__all__ = ["Engine", "initialize"]
