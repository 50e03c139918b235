"""``fastzero.checkpointing``: DeepSpeed's ``deepspeed.checkpointing`` API
(activation checkpointing and the tensor-parallel RNG tracker), plus the
selective policy and budget placement; the code lives in
:mod:`fastzero.parallel.checkpointing`, :mod:`fastzero.parallel.rng` and
:mod:`fastzero.parallel.placement`."""

from fastzero.parallel import checkpointing as _checkpointing
from fastzero.parallel.checkpointing import *  # noqa: F403 (its __all__)
from fastzero.parallel.checkpointing import SELECTIVE_SAVE
from fastzero.parallel.placement import Placement, unapply
from fastzero.parallel.rng import RNGStatesTracker

__all__ = [*_checkpointing.__all__, "SELECTIVE_SAVE", "Placement", "RNGStatesTracker", "unapply"]
