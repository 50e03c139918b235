r"""ZeroOneAdam: 0/1 Adam (Lu et al., 2022, "Maximizing Communication
Efficiency for Large-scale Training via 0/1 Adam", arXiv:2202.06009), with
DeepSpeed's signature and policies (``deepspeed/runtime/fp16/onebit/zoadam.py``).

Two phases, with t the step (from 1):

* **Variance updates** (t <= ``var_freeze_step``). The variance is updated
  only at steps t = 0 mod I, whose gradients the engine averages
  uncompressed: there the step is AdamW's. I starts at 1 and doubles after
  every ``var_update_scaler`` such steps. At the other steps each rank's
  local gradient is averaged by the 1-bit compressed all-reduce with error
  feedback (:func:`fastzero.comm.compressed_allreduce`) and only the
  momentum takes it.
* **Local steps** (t > ``var_freeze_step``; the variance is frozen, the
  error buffers restart from zero). Each rank steps on its local gradient and
  sums its updates in an accumulator u; at steps t = 0 mod H the ranks
  agree: each undoes its local updates, the accumulated momenta
  u (sqrt(v) + eps) are averaged compressed, the momentum becomes their mean
  over the interval's learning rates and the params take the averaged
  update. H starts at 1 and doubles every ``local_step_scaler`` steps, up to
  ``local_step_clipper``.

Per step, with p the param, lr, wd and eps the group's, g the gradient the
step uses (the average, the compressed average, or the local one):

.. math::
    m \leftarrow \beta_1 m + (1-\beta_1) g;\quad
    v \leftarrow \beta_2 v + (1-\beta_2) g^2 \ \text{(variance steps)};\quad
    d = \frac{m}{\sqrt v + \epsilon} + \text{wd}\, p;\quad
    p \leftarrow p - \text{lr}\, d

and in the local phase also u -= lr d; at a sync, with L the sum of lr
since the last one: p -= u; u = allreduce_1bit(u (sqrt v + eps));
m = -u / L; p += u / (sqrt v + eps); u = 0. Here u is kept as p minus the
params at the last sync (``synced_param``, the same memory as DeepSpeed's
accumulator), so p -= u restores them bit for bit and the ranks agree
exactly after every sync (DeepSpeed's ranks keep their own rounding).

Differences from DeepSpeed's, on purpose: its first ``step()`` only
allocates buffers and discards the gradient, so its step counter runs one
ahead of the steps taken (t here is the steps taken); elements whose
variance is 0 (no gradient at a variance step: an unused embedding row, the
padding) keep no momentum, as DeepSpeed's ``exp_avg_mask`` would; and there
is no bias correction (DeepSpeed accepts ``bias_correction`` and applies
none: here True is refused).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from fastzero.comm import Comm, compressed_allreduce
from fastzero.config import ConfigNotSupported, zero_one_adam_local_steps
from fastzero.ops import FusedAdam
from fastzero.runtime.onebit_base import OneBitBase, check_count, trained


def is_variance_step(t: int, var_freeze_step: int, var_update_scaler: int) -> bool:
    """Whether step `t` (from 1) updates the variance (its gradients are
    averaged uncompressed): t <= var_freeze_step and t = 0 mod I, where the
    interval I starts at 1 and doubles after each `var_update_scaler` such steps."""
    if t > var_freeze_step:
        return False
    last, interval = 0, 1  # the last variance step of the intervals before
    while True:
        end = (last // interval + var_update_scaler) * interval  # this interval's last variance step
        if t <= end:
            return t % interval == 0
        last, interval = end, interval * 2


def local_step_interval(t: int, var_freeze_step: int, local_step_scaler: int, local_step_clipper: int) -> int:
    """H at step `t` > var_freeze_step: 1, doubled every `local_step_scaler` steps, at most `local_step_clipper`."""
    doublings = (t - var_freeze_step - 1) // local_step_scaler
    return (
        local_step_clipper if doublings >= local_step_clipper.bit_length() else min(local_step_clipper, 1 << doublings)
    )


class ZeroOneAdam(OneBitBase, FusedAdam):
    r"""0/1 Adam (DeepSpeed's signature, less its ``deepspeed`` argument: the
    engine attaches itself).

    ``ZeroOneAdam(params, lr, bias_correction, betas, eps, eps_inside_sqrt,
    weight_decay, max_grad_norm, var_freeze_step, var_update_scaler,
    local_step_scaler, local_step_clipper, amsgrad, cuda_aware,
    comm_backend_name, process_group)``. ``cuda_aware`` and
    ``comm_backend_name`` are DeepSpeed's backend choice: accepted, no effect
    (any ``torch.distributed`` backend works). ``bias_correction`` must be
    False (the default here; DeepSpeed's defaults to True and applies none).
    ``max_grad_norm > 0`` clips, as :class:`OneBitAdam`'s, when used without
    the engine.

    Under ``fastzero.initialize`` (ZeRO stage 0) the engine averages the
    variance steps' gradients and leaves the others local (it reads
    :attr:`compressing`). Used on its own, do not wrap the model in DDP: the
    optimizer averages them itself over `process_group` (or `comm`).

    State: ``exp_avg``, ``exp_avg_sq`` and ``synced_param`` (the params at
    the last sync, so u = p - synced_param) per param, fp32; the error-feedback buffers and the sum of lr since the last
    sync per group, which ``state_dict()`` saves under ``"onebit"``. An
    engine checkpoint holds rank 0's params and momentum: loading one in the
    local phase makes them the ranks' common sync point (u and L restart from
    zero), so every rank continues from the same params.
    """

    _op_name = "ZeroOneAdam"
    _extra_state_keys = ("synced_param",)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = False,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        process_group=None,
        *,
        comm: Comm | None = None,
        master_weights: bool = False,
        backend: str | None = None,
    ) -> None:
        if amsgrad:
            raise ValueError("ZeroOneAdam does not implement amsgrad (neither does DeepSpeed's): set amsgrad=False")
        if eps_inside_sqrt:
            raise ValueError("ZeroOneAdam(eps_inside_sqrt=True) is not implemented: eps is added outside the sqrt")
        if bias_correction:
            raise ValueError(
                "ZeroOneAdam(bias_correction=True): 0/1 Adam's math has no bias correction (DeepSpeed's accepts the "
                "flag and applies none); pass bias_correction=False"
            )
        self.var_freeze_step = check_count("ZeroOneAdam", "var_freeze_step", var_freeze_step)
        self.var_update_scaler = check_count("ZeroOneAdam", "var_update_scaler", var_update_scaler)
        self.local_step_scaler = check_count("ZeroOneAdam", "local_step_scaler", local_step_scaler)
        self.local_step_clipper = check_count("ZeroOneAdam", "local_step_clipper", local_step_clipper)
        self.cuda_aware, self.comm_backend_name = bool(cuda_aware), str(comm_backend_name)  # no effect here
        super().__init__(
            params, lr, False, betas, eps, True, weight_decay, master_weights=master_weights, backend=backend
        )
        self._init_onebit(process_group, comm, max_grad_norm)
        self._synced: dict[int, Tensor] = {}  # group -> flat padded params at the last sync; synced_param are views
        self._lrs: dict[int, float] = {}  # group -> sum of lr since the last sync

    def attach_engine(self, comm: Comm, *, exchange_momentum: bool, shards=None) -> None:
        if not exchange_momentum and self.local_step_clipper != 1:
            raise ConfigNotSupported(zero_one_adam_local_steps(self.local_step_clipper))
        super().attach_engine(comm, exchange_momentum=exchange_momentum, shards=shards)

    def is_variance_step(self, t: int) -> bool:
        return is_variance_step(t, self.var_freeze_step, self.var_update_scaler)

    def local_step_interval(self, t: int) -> int:
        return local_step_interval(t, self.var_freeze_step, self.local_step_scaler, self.local_step_clipper)

    @property
    def compressing(self) -> bool:
        """Whether the next step's gradients stay local: all but the variance steps."""
        return not self.is_variance_step(self.steps_done + 1)

    # -- the step -----------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float | Tensor | None = None, found_inf: float | Tensor | None = None):
        t = self.steps_done + 1
        variance = self.is_variance_step(t)
        loss, scale, skip = self._prepare(closure, grad_scale, found_inf, local=not variance)
        if skip:
            return loss  # an overflow on any rank: no rank steps, the errors stay as they are
        if t == self.var_freeze_step + 1:
            self.reset_errors()  # from here they are errors of accumulated updates, not of gradients
        if variance:
            super().step(grad_scale=scale)  # AdamW without bias correction: FusedAdam's kernels
        for gi, group in enumerate(self.param_groups):
            if variance or not trained(group):
                continue
            if t <= self.var_freeze_step or not self._exchange_momentum:  # stage 1 takes no local steps
                self._momentum_step(gi, group, scale)
            else:
                self._local_step(gi, group, t, scale)
        stepped = not variance or any(p.grad is not None for g in self.param_groups for p in g["params"])
        self._steps_cache = (t, self._step_objects()) if stepped else None
        if not variance:
            self.sync_steps()  # state[p]["step"]: these steps advanced the counters themselves
        return loss

    def _exchange(self, gi: int, flat: Tensor, n: int) -> None:
        """`flat` (padded, `n` real elements) becomes its compressed average over ranks, in place."""
        if self._exchange_momentum:
            worker, server = self.error_buffers(gi)
            compressed_allreduce(flat, worker, server, self.comm, tag="zero_one_adam", out=flat)
        flat[n:].zero_()  # the padding carries nothing

    def _apply(self, params: list[Tensor], states: list[dict], group: dict) -> list[Tensor]:
        """d = m / (sqrt(v) + eps) + wd p; p -= lr d. Returns sqrt(v) + eps."""
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        masters = [s.get("master_param", p) for s, p in zip(states, params)]
        denom = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div([s["exp_avg"] for s in states], denom)
        if wd:
            torch._foreach_add_(update, masters, alpha=wd)
        torch._foreach_add_(masters, update, alpha=-lr)
        return denom

    def _momentum_step(self, gi: int, group: dict, scale: float) -> None:
        """A step between variance steps: m takes the compressed average of the local gradients."""
        params = trained(group)
        states = [self.state[p] for p in params]
        beta1 = group["betas"][0]
        grads = self.flat_grads(gi, scale)
        self._exchange(gi, grads, sum(p.numel() for p in params))
        self.momentum_buffer(gi).mul_(beta1).add_(grads, alpha=1 - beta1)
        self.mask_unseen(states, "exp_avg")
        self._apply(params, states, group)
        self._finish(params, states, group)

    def synced_params(self, gi: int) -> Tensor:
        """Group `gi`'s params at the last sync, flat (``synced_param`` per
        param are views), taken from the params when there are none yet."""
        params = trained(self.param_groups[gi])
        fresh = any("synced_param" not in self.state[p] for p in params)
        buf = self.flat_state(gi, "synced_param", self._synced)
        if fresh:
            for p in params:
                st = self.state[p]
                st["synced_param"].copy_(st.get("master_param", p))
        return buf

    def _local_step(self, gi: int, group: dict, t: int, scale: float) -> None:
        """A step past var_freeze_step: local, and every H steps the sync.
        The accumulated updates u are p - (p at the last sync): the same
        memory as DeepSpeed's accumulator, and after a sync every rank holds
        the same params bit for bit (undoing the local updates by subtracting
        their sum would leave each rank its own rounding)."""
        params = trained(group)
        synced = self.synced_params(gi)
        momentum = self.momentum_buffer(gi)
        states = [self.state[p] for p in params]
        beta1 = group["betas"][0]
        momentum.mul_(beta1)  # each rank its local gradient (a missing one counts as zero)
        with_grad = [(s["exp_avg"], p.grad) for s, p in zip(states, params) if p.grad is not None]
        if with_grad:
            avgs, grads = zip(*with_grad)
            torch._foreach_add_(list(avgs), list(grads), alpha=(1 - beta1) / scale)
        self.mask_unseen(states, "exp_avg")  # else m / eps would move them, compounding, until the sync
        self._lrs[gi] = self._lrs.get(gi, 0.0) + group["lr"]
        denom = self._apply(params, states, group)
        if t % self.local_step_interval(t) == 0:
            masters = [s.get("master_param", p) for s, p in zip(states, params)]
            anchors = [s["synced_param"] for s in states]
            accumulated = torch.zeros_like(synced)  # u (sqrt(v) + eps): the sum of -lr m since the last sync
            views, off = [], 0
            for p in params:
                views.append(accumulated[off : off + p.numel()].view(p.shape))
                off += p.numel()
            torch._foreach_copy_(views, torch._foreach_sub(masters, anchors))
            torch._foreach_mul_(views, denom)
            self._exchange(gi, accumulated, off)
            for view, st in zip(views, states):
                view.masked_fill_(st["exp_avg_sq"] == 0, 0.0)  # as mask_unseen: no variance, no update
            momentum.copy_(accumulated).div_(-self._lrs[gi])
            torch._foreach_copy_(masters, anchors)
            torch._foreach_addcdiv_(masters, views, denom)
            torch._foreach_copy_(anchors, masters)  # the new sync point
            self._lrs[gi] = 0.0
        self._finish(params, states, group)

    # -- state -------------------------------------------------------------------------
    def _rank_state(self) -> dict:
        return {"lrs": dict(self._lrs)}

    def _load_rank_state(self, saved: dict | None) -> None:
        if self._managed or saved is None:
            # the engine's checkpoint holds rank 0's params and momentum: they are the new sync point
            for st, p in ((self.state[p], p) for g in self.param_groups for p in trained(g)):
                if "synced_param" in st:
                    st["synced_param"].copy_(st.get("master_param", p))
            self._lrs = {}
        else:
            self._lrs = {int(gi): float(v) for gi, v in saved.get("lrs", {}).items()}
