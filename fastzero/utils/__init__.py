"""Helpers under DeepSpeed's ``deepspeed.utils`` names, for scripts that
import them: :class:`RepeatingLoader` and :mod:`fastzero.utils.zero_to_fp32`."""

from fastzero.utils.repeating_loader import RepeatingLoader

__all__ = ["RepeatingLoader"]
