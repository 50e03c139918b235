"""DeepSpeed's helpers for reading and writing one param's fp32 value,
optimizer state and gradient under ZeRO (``deepspeed.utils.safe_get_full_fp32_param``
and the rest, same names and arguments), on :mod:`fastzero.runtime.param_access`.

What they give, at every ZeRO stage (0-3), with or without offload, in
every optimizer state format:

* ``safe_get_full_*``: the whole param's value, fp32, shaped as the param.
  Every rank of the data-parallel group calls them (one all-reduce each at
  stages 1-3), as in DeepSpeed. None for a param no engine trains.
* ``safe_set_full_*``: every rank of the data-parallel group calls them
  with the same full value (the param's shape, or flat); each writes the
  elements it owns (for the fp32 param, the weights the model reads
  follow).
* ``safe_get_local_*`` / ``safe_set_local_*``: stage 3 only (as in
  DeepSpeed): this rank's own elements, 1-D; every rank calls the setters,
  each with its own elements (an empty tensor where it owns none).
* Gradients (``*_grad``): between ``engine.backward(loss)`` on the step's
  last micro-batch and ``engine.step()``, the average over ranks and
  micro-batches that the step will use (loss scale divided out, before
  clipping); a gradient set is the one the step and its norm use. Under
  fp16 the gradient buffer holds the sum times the loss scale: a value set
  beyond fp16's range that way becomes inf, and the step is skipped as for
  any overflow.

Where fastzero differs from DeepSpeed: the fp32 param is also there at
stage 0 and in fp32 training (DeepSpeed returns None where it keeps no
separate fp32 copy); ``safe_get_full_grad`` never returns a rank's local
``param.grad`` (at stage 1 that is the gradient before reduction) and
unscales fp16's loss scale; a setter of a param no engine trains, or of a
state key the optimizer does not keep, raises instead of doing nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import Tensor

__all__ = [
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
]


def _access():
    from fastzero.runtime import param_access  # on first use: importing fastzero.utils stays light

    return param_access


def safe_get_full_fp32_param(param: Tensor) -> Tensor | None:
    """The param's full fp32 value (collective over the data-parallel group)."""
    return _access().get_full(param)


def safe_set_full_fp32_param(param: Tensor, value: Tensor) -> None:
    """The param's fp32 value (and the weights the model reads) set to `value` on every rank."""
    _access().set_full(param, value)


def safe_get_full_optimizer_state(param: Tensor, optim_state_key: str) -> Tensor | None:
    """The param's full optimizer state `optim_state_key` (``"exp_avg"``, ``"exp_avg_sq"``...), fp32."""
    return _access().get_full(param, optim_state_key)


def safe_set_full_optimizer_state(param: Tensor, value: Tensor, optim_state_key: str) -> None:
    """The param's optimizer state `optim_state_key` set to `value` on every rank."""
    _access().set_full(param, value, optim_state_key)


def safe_get_full_grad(param: Tensor) -> Tensor | None:
    """The param's full gradient for the step: averaged, unscaled, fp32 (collective)."""
    return _access().get_full_grad(param)


def safe_set_full_grad(param: Tensor, value: Tensor) -> None:
    """The param's gradient for the step set to `value` (averaged, unscaled) on every rank."""
    _access().set_full_grad(param, value)


def safe_update_full_grad_vectorized(param_list: Iterable[Tensor], update_func: Callable[[Tensor, Tensor], Tensor]):
    """Each trained param's gradient becomes ``update_func(full_grad, param)``."""
    _access().update_full_grads(param_list, update_func)


def safe_get_local_fp32_param(param: Tensor) -> Tensor:
    """Stage 3: this rank's elements of the param's fp32 value (1-D)."""
    return _access().get_local(param)


def safe_set_local_fp32_param(param: Tensor, value: Tensor) -> None:
    """Stage 3: this rank's elements of the param's fp32 value set to `value`."""
    _access().set_local(param, value)


def safe_get_local_optimizer_state(param: Tensor, optim_state_key: str) -> Tensor:
    """Stage 3: this rank's elements of the param's optimizer state (1-D, fp32)."""
    return _access().get_local(param, optim_state_key)


def safe_set_local_optimizer_state(param: Tensor, value: Tensor, optim_state_key: str) -> None:
    """Stage 3: this rank's elements of the param's optimizer state set to `value`."""
    _access().set_local(param, value, optim_state_key)


def safe_get_local_grad(param: Tensor) -> Tensor:
    """Stage 3: this rank's elements of the param's gradient for the step (averaged, unscaled)."""
    return _access().get_local_grad(param)


def safe_set_local_grad(param: Tensor, value: Tensor) -> None:
    """Stage 3: this rank's elements of the param's gradient for the step set to `value`."""
    _access().set_local_grad(param, value)
