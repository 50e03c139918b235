"""Helpers under DeepSpeed's ``deepspeed.utils`` names, for scripts that
import them: :class:`RepeatingLoader`, ``logger`` and ``log_dist``, and :mod:`fastzero.utils.zero_to_fp32`
(an attribute on first use, ``deepspeed.utils.zero_to_fp32.get_fp32_...``,
so that importing the package stays light)."""

from fastzero.utils.logging import log_dist, logger
from fastzero.utils.repeating_loader import RepeatingLoader

__all__ = ["RepeatingLoader", "log_dist", "logger", "zero_to_fp32"]


def __getattr__(name: str):
    if name == "zero_to_fp32":
        import importlib

        return importlib.import_module(f"{__name__}.zero_to_fp32")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
