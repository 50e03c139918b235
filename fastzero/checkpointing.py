"""``fastzero.checkpointing``: DeepSpeed's ``deepspeed.checkpointing`` API
(activation checkpointing and the tensor-parallel RNG tracker), plus the
selective policy and budget placement; the code lives in
:mod:`fastzero.parallel.checkpointing`, :mod:`fastzero.parallel.rng` and
:mod:`fastzero.parallel.placement`."""

from fastzero.parallel.checkpointing import (
    SELECTIVE_SAVE,
    SavedBytes,
    apply,
    checkpoint,
    configure,
    is_configured,
    non_reentrant_checkpoint,
    reset,
    selective_checkpoint,
    settings,
    timings,
)
from fastzero.parallel.placement import Placement, unapply
from fastzero.parallel.rng import RNGStatesTracker, get_cuda_rng_tracker, model_parallel_cuda_manual_seed

__all__ = [
    "SELECTIVE_SAVE",
    "Placement",
    "RNGStatesTracker",
    "SavedBytes",
    "apply",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "reset",
    "selective_checkpoint",
    "settings",
    "timings",
    "unapply",
]
