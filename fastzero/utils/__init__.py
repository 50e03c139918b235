"""Helpers under DeepSpeed's ``deepspeed.utils`` names, for scripts that
import them: :class:`RepeatingLoader`, ``logger`` and ``log_dist``, the
param-state helpers of :mod:`fastzero.utils.tensor_fragment`
(``safe_get_full_fp32_param``, ``safe_get_full_grad``, ... ), and
:mod:`fastzero.utils.zero_to_fp32` (an attribute on first use,
``deepspeed.utils.zero_to_fp32.get_fp32_...``, so that importing the package
stays light)."""

from fastzero.utils.logging import log_dist, logger
from fastzero.utils.repeating_loader import RepeatingLoader
from fastzero.utils.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)

__all__ = [
    "RepeatingLoader",
    "log_dist",
    "logger",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
    "zero_to_fp32",
]


def __getattr__(name: str):
    if name == "zero_to_fp32":
        import importlib

        return importlib.import_module(f"{__name__}.zero_to_fp32")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
