"""``deepspeed.runtime.activation_checkpointing.checkpointing``: the names
of :mod:`fastzero.checkpointing` (``configure``, ``checkpoint``,
``get_cuda_rng_tracker``, ``model_parallel_cuda_manual_seed``, ...), one
implementation under DeepSpeed's second path, taken from the parallel layer
below (``fastzero.checkpointing`` is an entry point, above the runtime)."""

from fastzero.parallel import checkpointing as _checkpointing
from fastzero.parallel.checkpointing import *  # noqa: F403 (its __all__)
from fastzero.parallel.checkpointing import SELECTIVE_SAVE
from fastzero.parallel.placement import Placement, unapply
from fastzero.parallel.rng import RNGStatesTracker

__all__ = [*_checkpointing.__all__, "SELECTIVE_SAVE", "Placement", "RNGStatesTracker", "unapply"]
