"""The functional optimizer steps on CPU tensors (``cpu_adam_step``,
``cpu_lamb_step``): checks, then the family's cpu or reference backend."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from fastzero.checks import check_grad_scale, check_optimizer_lists, check_state_format, check_step
from fastzero.ops.backend import Family
from fastzero.ops.hyperparams import Hyperparams


def host_step(
    family: Family,
    op: str,
    tensors: tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]],
    *,
    step: int,
    hp: Hyperparams,
    grad_scale: float | None,
    param_copies: list[Tensor] | None,
    backend: str | None,
    hint: str = "",
    **formats: Any,
) -> tuple[str, Any]:
    """(the backend that ran, its result) of one step over checked lists.
    ``formats``: the family's ``state_format=``, ``seed=`` and, for int8
    states, ``exp_avg_absmax=``, ``exp_avg_sq_absmax=`` and ``block_size=``
    (Adam), checked and passed on when given (None values are dropped)."""
    formats = {k: v for k, v in formats.items() if v is not None}
    if formats:
        check_state_format(
            op,
            formats.get("state_format"),
            formats.get("seed"),
            formats.get("block_size"),
            formats.get("bf16_stochastic_round"),
        )
    check_optimizer_lists(
        op,
        *tensors,
        param_copies,
        hint=hint,
        state_format=formats.get("state_format"),
        exp_avg_absmax=formats.get("exp_avg_absmax"),
        exp_avg_sq_absmax=formats.get("exp_avg_sq_absmax"),
        block_size=formats.get("block_size"),
    )
    check_grad_scale(grad_scale)
    check_step(op, step)
    which = family.choose("cpu", backend).backend
    if which not in ("cpu", "reference"):
        raise ValueError(f"{op} runs the cpu or reference backend, not {which!r}; use the optimizer class for others")
    run = family.impl(which)
    return which, run(*tensors, step=step, hp=hp, grad_scale=grad_scale, param_copies=param_copies, **formats)
