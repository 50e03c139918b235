"""``deepspeed.runtime.activation_checkpointing.checkpointing``: the same
functions as :mod:`fastzero.checkpointing` (``configure``, ``checkpoint``,
``get_cuda_rng_tracker``, ``model_parallel_cuda_manual_seed``, ...), one
implementation under DeepSpeed's second path."""

from fastzero import checkpointing as _checkpointing
from fastzero.checkpointing import *  # noqa: F403 (its __all__)

__all__ = list(_checkpointing.__all__)
