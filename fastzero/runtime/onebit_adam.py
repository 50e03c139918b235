r"""OneBitAdam: Adam whose momentum crosses the network as sign bits.

Warm-up (the first ``freeze_step`` steps) is ordinary AdamW on averaged
gradients: FusedAdam's kernels. Then the variance is frozen; each rank folds
its *local* gradient into the momentum and the momentum is averaged by the
1-bit compressed all-reduce with error feedback
(:func:`fastzero.comm.compressed_allreduce`), about 1/16 of an fp16
all-reduce's bytes. With the variance frozen the update is linear in the
momentum, which is why compressing it with error feedback converges like Adam
(Tang et al., 2021, "1-bit Adam").

It lives in the runtime, beside the engine, because it needs process groups
(as DeepSpeed keeps its 1-bit optimizers with its runtime); ``from
fastzero.ops import OneBitAdam`` still works, through a lazy re-export.

Bias correction, when on, is applied consistently: the momentum's keeps
advancing (``1 - beta1^t``), the frozen variance keeps the correction of the
step it was frozen at (``1 - beta2^freeze_step``), so the update does not jump
at the freeze. DeepSpeed's OneBitAdam accepts ``bias_correction`` but applies
none in either phase; ``bias_correction=False`` gives its math.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from fastzero.comm import Comm, compressed_allreduce
from fastzero.ops import FusedAdam
from fastzero.runtime.onebit_base import OneBitBase, check_count, trained


def check_freeze_step(freeze_step) -> int:
    return check_count(
        "OneBitAdam",
        "freeze_step",
        freeze_step,
        what=", the number of uncompressed warm-up steps whose variance is then frozen (a few percent of the "
        "run, as DeepSpeed recommends)",
    )


class OneBitAdam(OneBitBase, FusedAdam):
    r"""1-bit Adam (DeepSpeed's signature, less its backend flags: any
    ``torch.distributed`` backend works).

    ``OneBitAdam(params, lr, freeze_step, bias_correction, betas, eps,
    eps_inside_sqrt, weight_decay, max_grad_norm, amsgrad, process_group)``.
    Weight decay is decoupled (AdamW), as DeepSpeed's. ``max_grad_norm > 0``
    clips the gradient the step uses (in warm-up the averaged one; after
    ``freeze_step`` each rank's local one, by a factor every rank shares);
    under the engine its ``gradient_clipping`` does that instead.

    Under ``fastzero.initialize`` the engine reduces warm-up gradients and
    stops reducing them at the freeze (it calls :meth:`attach_engine`). Used
    on its own, do not wrap the model in DDP: during warm-up the optimizer
    averages the gradients itself (one flat all-reduce per group over
    `process_group`, or over `comm`, a :class:`fastzero.comm.Comm`, when
    given), and every rank must start from the same params.

    State: torch's ``exp_avg``/``exp_avg_sq`` (fp32) per param, plus each
    group's error-feedback buffers, which ``state_dict()`` saves under
    ``"onebit"`` and ``load_state_dict`` restores at the same world size
    (at another they restart from zero, with a warning).
    """

    _op_name = "OneBitAdam"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        amsgrad: bool = False,
        process_group=None,
        *,
        comm: Comm | None = None,
        master_weights: bool = False,
        backend: str | None = None,
    ) -> None:
        if amsgrad:
            raise ValueError("OneBitAdam does not implement amsgrad (neither does DeepSpeed's)")
        if eps_inside_sqrt:
            raise ValueError("OneBitAdam(eps_inside_sqrt=True) is not implemented: eps is added outside the sqrt")
        self.freeze_step = check_freeze_step(freeze_step)
        super().__init__(
            params, lr, bias_correction, betas, eps, True, weight_decay, master_weights=master_weights, backend=backend
        )
        self._init_onebit(process_group, comm, max_grad_norm)

    @property
    def compressing(self) -> bool:
        """Whether the next step is past the warm-up (variance frozen, momentum compressed)."""
        return self.steps_done >= self.freeze_step

    # -- the step -----------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float | Tensor | None = None, found_inf: float | Tensor | None = None):
        compressing = self.compressing
        loss, scale, skip = self._prepare(closure, grad_scale, found_inf, local=compressing)
        if skip:
            return loss  # an overflow on any rank: no rank steps, the errors stay as they are
        t = self.steps_done + 1  # before any group's counter advances
        if not compressing:
            super().step(grad_scale=scale)
        else:
            for gi, group in enumerate(self.param_groups):
                if trained(group):
                    self._compressed_step(gi, group, t, scale, self.comm)
        stepped = compressing or any(p.grad is not None for g in self.param_groups for p in g["params"])
        self._steps_cache = (t, self._step_objects()) if stepped else None  # a warm-up step without grads is none
        if compressing:
            self.sync_steps()  # state[p]["step"]: the compressed step advanced the counters itself
        return loss

    def _compressed_step(self, gi: int, group: dict, t: int, scale: float, comm) -> None:
        params = trained(group)
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        buf = self.momentum_buffer(gi)
        states = [self.state[p] for p in params]
        # m = beta1 m + (1 - beta1) g: each rank its local gradient (a missing one counts as zero)
        buf.mul_(beta1)
        with_grad = [(s["exp_avg"], p.grad) for s, p in zip(states, params) if p.grad is not None]
        if with_grad:
            avgs, grads = zip(*with_grad)
            torch._foreach_add_(list(avgs), list(grads), alpha=(1 - beta1) / scale)
        if self._exchange_momentum:
            worker, server = self.error_buffers(gi)
            compressed_allreduce(buf, worker, server, comm, tag="onebit", out=buf)
            buf[sum(p.numel() for p in params) :].zero_()  # the padding carries no momentum
        self.mask_unseen(states, "exp_avg")  # no warm-up gradient: frozen variance 0
        bc1 = 1 - beta1**t if group["bias_correction"] else 1.0
        bc2 = 1 - beta2**self.freeze_step if group["bias_correction"] else 1.0  # frozen with the variance
        masters = [s.get("master_param", p) for s, p in zip(states, params)]
        denom = torch._foreach_div([s["exp_avg_sq"] for s in states], bc2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        if wd:
            torch._foreach_mul_(masters, 1.0 - lr * wd)
        torch._foreach_addcdiv_(masters, [s["exp_avg"] for s in states], denom, value=-lr / bc1)
        self._finish(params, states, group)
