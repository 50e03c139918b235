"""Helpers under DeepSpeed's ``deepspeed.utils`` names, for scripts that
import them: :class:`RepeatingLoader`, ``logger`` and ``log_dist``, the
param-state helpers of :mod:`fastzero.utils.tensor_fragment`
(``safe_get_full_fp32_param``, ``safe_get_full_grad``, ... ), and
:mod:`fastzero.utils.zero_to_fp32` (an attribute on first use,
``deepspeed.utils.zero_to_fp32.get_fp32_...``, so that importing the package
stays light)."""

from fastzero.utils import tensor_fragment
from fastzero.utils.logging import log_dist, logger
from fastzero.utils.repeating_loader import RepeatingLoader
from fastzero.utils.tensor_fragment import *  # noqa: F403  (DeepSpeed's safe_get_full_fp32_param & co.)

# zero_to_fp32: a submodule, imported on first use (__getattr__)
__all__ = ["RepeatingLoader", "log_dist", "logger", "zero_to_fp32", *tensor_fragment.__all__]  # noqa: F405


def __getattr__(name: str):
    if name == "zero_to_fp32":
        import importlib

        return importlib.import_module(f"{__name__}.zero_to_fp32")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
