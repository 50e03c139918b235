"""Helpers with DeepSpeed's names (``deepspeed.utils``)."""

from fastzero.utils.repeating_loader import RepeatingLoader

__all__ = ["RepeatingLoader"]
