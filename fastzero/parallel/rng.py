"""Named RNG states for tensor-parallel regions (Megatron's and DeepSpeed's
``CudaRNGStatesTracker``), on the CUDA generator when CUDA is in use, else on
the CPU one.

Dropout on activations that are replicated across the tensor group must draw
the same mask on every TP rank (the default generator, seeded alike), and
dropout on activations split across it must draw different masks (a named
state, seeded per rank). ``fork(name)`` runs its body on the named state and
leaves the default generator exactly as it was: the fork neither uses nor
advances it. Activation checkpointing saves :meth:`get_states` with each
checkpoint and restores them for the recompute, so the dropout replays.

    model_parallel_cuda_manual_seed(1234)      # default: 1234; "model-parallel-rng": 1234 + 2718 + tp_rank
    with get_cuda_rng_tracker().fork():
        y = F.dropout(x, 0.1)                  # differs across TP ranks, replays in recompute
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from fastzero.parallel.groups import group_rank, tensor_group

MODEL_PARALLEL_RNG = "model-parallel-rng"  # Megatron's and DeepSpeed's name for the per-TP-rank state
# DeepSpeed's offset (deepspeed/runtime/activation_checkpointing/checkpointing.py, 0.19): model-parallel seeds
# stay clear of the data-parallel seed and of each other
SEED_OFFSET = 2718


def _use_cuda() -> bool:
    """Whether the states live on the CUDA generator: CUDA present and already in use (a CPU run never
    initializes it, and a model on the CPU draws its dropout masks from the CPU generator)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def get_rng_state() -> Tensor:
    """The default generator's state: CUDA's (current device) when in use, else the CPU's."""
    return torch.cuda.get_rng_state() if _use_cuda() else torch.get_rng_state()


def set_rng_state(state: Tensor) -> None:
    """Sets the default generator's state (the one :func:`get_rng_state` reads)."""
    if _use_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states. :meth:`add` seeds a new one, :meth:`fork`
    runs a block on it (and keeps its advance), :meth:`get_states` /
    :meth:`set_states` copy them all (activation checkpointing)."""

    def __init__(self) -> None:
        self.states: dict[str, Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        """Forgets every state."""
        self.states = {}
        self.seeds = set()

    def get_states(self) -> dict[str, Tensor]:
        """A copy of the states (name -> generator state)."""
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, Tensor]) -> None:
        """Replaces the states (with copies of those given)."""
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """A new state `name` seeded with `seed`; the default generator is left as it was."""
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed = {seed!r}: must be an int")
        if seed in self.seeds:
            raise ValueError(f"seed {seed} is already used by another RNG state: give each state its own seed")
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists: call reset() first or pick another name")
        self.seeds.add(seed)
        saved = get_rng_state()
        torch.cuda.manual_seed(seed) if _use_cuda() else torch.manual_seed(seed)
        self.states[name] = get_rng_state()
        set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Runs the block on state `name`, keeps that state's advance and
        gives the default generator back unchanged."""
        if name not in self.states:
            raise KeyError(
                f"RNG state {name!r} is not added: call model_parallel_cuda_manual_seed(seed) (or "
                f"get_cuda_rng_tracker().add({name!r}, seed)) first"
            )
        saved = get_rng_state()
        set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = get_rng_state()
            set_rng_state(saved)


_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (DeepSpeed's name; on the CPU generator without CUDA)."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int, *, mpu=None) -> None:
    """Seeds the default generator with `seed` on every rank (replicated
    regions draw alike) and adds the tracker's ``model-parallel-rng`` state
    with ``seed + 2718 + tp_rank`` (split regions draw differently), as
    DeepSpeed does. The tensor group is `mpu`'s, the current topology's, or
    the whole world's; without torch.distributed, rank 0."""
    tp_rank = group_rank(tensor_group(mpu=mpu))
    _TRACKER.reset()
    torch.cuda.manual_seed(seed) if _use_cuda() else torch.manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + SEED_OFFSET + tp_rank)
