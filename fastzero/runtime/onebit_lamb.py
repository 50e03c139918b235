r"""OneBitLamb: 1-bit LAMB (Li et al., 2022, "1-bit LAMB: Communication
Efficient Large-Scale Large-Batch Training with LAMB's Convergence Speed",
arXiv:2104.06069), with DeepSpeed's signature and policies
(``deepspeed/runtime/fp16/onebit/lamb.py``).

Warm-up (the first ``freeze_step`` steps) is LAMB on averaged gradients,
FusedLamb's kernels, without bias correction; each param's trust ratio r
feeds an EMA, c = coeff_beta c + (1 - coeff_beta) r (when r != 1). At
``freeze_step`` the variance v is frozen and a copy, v', goes on. Then, per
step, each rank folds its *local* gradient into the momentum, which is
averaged by the 1-bit compressed all-reduce with error feedback, each param's
momentum scaled by s_p = mean_q(|m_q|) / |m_p| (|m| = RMS of m, taken at the
first compressed step) so that one compression scale suits every layer:

.. math::
    m_0 = m;\ m \leftarrow \text{allreduce}_{1\text{bit}}\big(s_p(\beta_1 m + (1-\beta_1) g)\big) / s_p;\
    \tilde g = \frac{m - \beta_1 m_0}{1-\beta_1};\ v' \leftarrow \beta_2 v' + (1-\beta_2)\tilde g^2 \\
    d_0 = \frac{m}{\sqrt v + \epsilon};\ d = d_0 + \text{wd}\, p;\
    f = \max \frac{\sqrt v + \epsilon}{\sqrt{v'} + \epsilon};\
    f \leftarrow f \rho + (1 - \rho),\ \rho = \min(1, \lVert d_0\rVert / \lVert d\rVert) \text{ (wd > 0)} \\
    f \leftarrow \text{clamp}(f, \text{factor\_min}, \text{factor\_max}),\ \text{then within}
    f_{-1} (1 \pm \text{factor\_threshold});\quad p \leftarrow p - \text{lr}\, c f\, d

where f_{-1} is the param's last factor (1 at first). Differences from
DeepSpeed's, on purpose: its first ``step()`` only allocates buffers and
discards the gradient (here every step trains); the momentum buffer is one
per param group, not one for all groups; a param whose momentum is zero at
the freeze gets s_p = 1 (DeepSpeed divides by zero); elements whose variance
is 0 keep no momentum (as DeepSpeed's ``exp_avg_mask``); no bias correction
(DeepSpeed accepts ``bias_correction`` and applies none: here True is refused).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from fastzero.comm import Comm, compressed_allreduce
from fastzero.ops import FusedLamb
from fastzero.runtime.onebit_base import OneBitBase, check_count, check_number, trained


class OneBitLamb(OneBitBase, FusedLamb):
    r"""1-bit LAMB (DeepSpeed's signature, less its ``deepspeed`` argument:
    the engine attaches itself).

    ``OneBitLamb(params, lr, freeze_step, bias_correction, betas, eps,
    eps_inside_sqrt, weight_decay, max_grad_norm, max_coeff, min_coeff,
    amsgrad, cuda_aware, comm_backend_name, coeff_beta, factor_max,
    factor_min, factor_threshold, process_group)``. ``cuda_aware`` and
    ``comm_backend_name``: accepted, no effect (any ``torch.distributed``
    backend works). ``bias_correction`` must be False (the default here).
    ``max_grad_norm > 0`` clips the gradient the step uses by one factor for
    all params when used without the engine (DeepSpeed's ignores it); under
    the engine its ``gradient_clipping`` does that.

    Under ``fastzero.initialize`` (ZeRO stage 0) the engine averages the
    warm-up gradients and leaves the later ones local. On its own, do not
    wrap the model in DDP: the optimizer averages them itself over
    `process_group` (or `comm`).

    State: ``exp_avg``, ``exp_avg_sq`` and, from ``freeze_step``,
    ``exp_avg_sq_fresh`` (v') per param, fp32; per group the lists
    ``lamb_coeff_freeze`` (c), ``last_factor`` and ``scaling_coeff`` (s_p)
    by trained param, and the error-feedback buffers. :meth:`get_lamb_coeffs`
    gives the last step's coefficients (r in warm-up, c f after).
    """

    _op_name = "OneBitLamb"
    _extra_state_keys = ("exp_avg_sq_fresh",)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = False,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        process_group=None,
        *,
        comm: Comm | None = None,
        master_weights: bool = False,
        backend: str | None = None,
    ) -> None:
        if amsgrad:
            raise ValueError("OneBitLamb does not implement amsgrad (neither does DeepSpeed's): set amsgrad=False")
        if eps_inside_sqrt:
            raise ValueError("OneBitLamb(eps_inside_sqrt=True) is not implemented: eps is added outside the sqrt")
        if bias_correction:
            raise ValueError(
                "OneBitLamb(bias_correction=True): 1-bit LAMB's math has no bias correction (DeepSpeed's accepts "
                "the flag and applies none); pass bias_correction=False"
            )
        self.freeze_step = check_count(
            "OneBitLamb", "freeze_step", freeze_step, what=", the uncompressed warm-up steps (LAMB's)"
        )
        self.coeff_beta = check_number("OneBitLamb", "coeff_beta", coeff_beta, 0.0, 1.0)
        self.factor_max = check_number("OneBitLamb", "factor_max", factor_max)
        self.factor_min = check_number("OneBitLamb", "factor_min", factor_min)
        self.factor_threshold = check_number("OneBitLamb", "factor_threshold", factor_threshold)
        if self.factor_min > self.factor_max:
            raise ValueError(
                f"OneBitLamb factor_min={factor_min!r} > factor_max={factor_max!r}: the factor's bounds; swap them"
            )
        self.cuda_aware, self.comm_backend_name = bool(cuda_aware), str(comm_backend_name)  # no effect here
        super().__init__(
            params,
            lr,
            False,
            betas,
            eps,
            False,
            weight_decay,
            0.0,  # clipping is done here (max_grad_norm) or by the engine, never again in the kernel
            max_coeff,
            min_coeff,
            master_weights=master_weights,
            backend=backend,
        )
        self._init_onebit(process_group, comm, max_grad_norm)
        self._fresh: dict[int, Tensor] = {}  # group -> flat padded v'; exp_avg_sq_fresh are views

    @property
    def compressing(self) -> bool:
        """Whether the next step is past the warm-up (variance frozen, momentum compressed)."""
        return self.steps_done >= self.freeze_step

    def _scalars(self, gi: int, key: str, default: float | None) -> list:
        """Group `gi`'s per-model-param list `key` (made with `default` when missing or stale)."""
        group, n = self.param_groups[gi], self.model_params(gi)
        values = group.get(key)
        if values is None or len(values) != n:
            values = [default] * n
        group[key] = values = list(values)  # a loaded checkpoint gives a tuple
        return values

    # -- the step -----------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float | Tensor | None = None, found_inf: float | Tensor | None = None):
        compressing = self.compressing
        loss, scale, skip = self._prepare(closure, grad_scale, found_inf, local=compressing)
        if skip:
            return loss  # an overflow on any rank: no rank steps, the errors stay as they are
        t = self.steps_done + 1
        if not compressing:
            if self._shards is None:
                super().step(grad_scale=scale)  # LAMB without bias correction: FusedLamb's kernels
            else:  # stage 1: the trust ratios need norms over every rank's pieces of each param
                for gi, group in enumerate(self.param_groups):
                    if trained(group):
                        self._sharded_lamb_step(gi, group, scale)
            for gi, group in enumerate(self.param_groups):
                if trained(group):
                    self._follow_coeffs(gi, group, t)
            stepped = any(p.grad is not None for g in self.param_groups for p in g["params"])
        else:
            if self._exchange_momentum and any(
                g.get("scaling_coeff") is None or None in g["scaling_coeff"] for g in self.param_groups
            ):
                self._freeze_scaling()
            for gi, group in enumerate(self.param_groups):
                if trained(group):
                    self._compressed_step(gi, group, scale)
            stepped = True
        self._steps_cache = (t, self._step_objects()) if stepped else None
        if compressing or self._shards is not None:
            self.sync_steps()  # state[p]["step"]: these steps advanced the counters themselves
        return loss

    def _sharded_lamb_step(self, gi: int, group: dict, scale: float) -> None:
        """A warm-up step at ZeRO stage 1: FusedLamb's math without bias
        correction on this rank's chunks, each param's trust ratio from the
        norms of all its pieces (summed over ranks)."""
        params = trained(group)
        states = [self.init_state(p) for p in params]
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        grads = [p.grad.float() / scale for p in params]
        avgs, sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        torch._foreach_mul_(avgs, beta1)
        torch._foreach_add_(avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(sqs, beta2)
        torch._foreach_addcmul_(sqs, grads, grads, value=1 - beta2)
        masters = [s.get("master_param", p) for s, p in zip(states, params)]
        update = self._directions(states, masters, eps, wd)[1]
        low, high = group["min_coeff"], group["max_coeff"]
        p_sq, u_sq = self._norms_squared(gi, masters, update)
        ratios = [
            1.0 if pn == 0.0 or un == 0.0 else min(max(math.sqrt(pn / un), low), high) for pn, un in zip(p_sq, u_sq)
        ]
        self._apply(gi, masters, update, [-lr * r for r in ratios])
        self._finish(params, states, group)
        self._coeffs[gi] = ratios

    def _directions(self, states: list[dict], masters: list[Tensor], eps: float, wd: float):
        """(sqrt(v) + eps, m / (sqrt(v) + eps) + wd p, m / (sqrt(v) + eps)) per tensor."""
        denom = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
        torch._foreach_add_(denom, eps)
        prelim = torch._foreach_div([s["exp_avg"] for s in states], denom)
        update = torch._foreach_add(prelim, masters, alpha=wd) if wd > 0 else prelim
        return denom, update, prelim

    def _norms_squared(self, gi: int, *tensor_lists: list[Tensor]) -> list[list[float]]:
        """Per model param, the squared L2 norm of each of `tensor_lists`
        (over every rank's pieces at stage 1: one all-reduce for all)."""
        n = self.model_params(gi)
        pieces = [
            (k * n + i, v.double().pow(2).sum()) for k, ts in enumerate(tensor_lists) for i, v in self.segments(gi, ts)
        ]
        sums = self.per_param(gi, pieces, "sum", width=len(tensor_lists))
        return [sums[k * n : (k + 1) * n] for k in range(len(tensor_lists))]

    def _apply(self, gi: int, masters: list[Tensor], update: list[Tensor], alphas: list[float]) -> None:
        """p += alpha_i update, per model param i's pieces."""
        for (i, m), (_, u) in zip(self.segments(gi, masters), self.segments(gi, update)):
            m.add_(u, alpha=alphas[i])

    def _follow_coeffs(self, gi: int, group: dict, t: int) -> None:
        """Warm-up: the EMA of each param's trust ratio; at freeze_step, v' starts as a copy of v."""
        ema = self._scalars(gi, "lamb_coeff_freeze", 0.0)
        self._scalars(gi, "last_factor", 1.0)
        coeffs = self._coeffs.get(gi)
        coeffs = coeffs.tolist() if isinstance(coeffs, Tensor) else list(coeffs or [])
        if self._shards is None:
            stepped = [i for i, p in enumerate(trained(group)) if p.grad is not None]
        else:
            stepped = list(range(self.model_params(gi)))  # the engine sets every chunk's grad
        for i, r in zip(stepped, coeffs):
            if r != 1.0:
                ema[i] = self.coeff_beta * ema[i] + (1 - self.coeff_beta) * r
        if t == self.freeze_step:
            self.flat_state(gi, "exp_avg_sq_fresh", self._fresh)
            for p in trained(group):
                self.state[p]["exp_avg_sq_fresh"].copy_(self.state[p]["exp_avg_sq"])

    def _freeze_scaling(self) -> None:
        """s_p = mean over params of RMS(m) / RMS(m_p), all groups together, from the momentum at the freeze."""
        rms = [
            [
                float(self.init_state(p)["exp_avg"].pow(2).sum().sqrt()) / math.sqrt(max(p.numel(), 1))
                for p in trained(g)
            ]
            for g in self.param_groups
        ]
        flat = [r for group in rms for r in group]
        united = sum(flat) / max(len(flat), 1)
        for gi, group_rms in enumerate(rms):
            self.param_groups[gi]["scaling_coeff"] = [united / r if r > 0 else 1.0 for r in group_rms]

    def _compressed_step(self, gi: int, group: dict, scale: float) -> None:
        """After the freeze. At stage 0 each rank folds its local gradient
        into the momentum, which is averaged compressed (scaled per param by
        s_p); at stage 1 the gradient arrives compressed-averaged (the
        engine's compressed reduce-scatter) and the momentum takes it as is.
        The factors and norms are per model param, over every rank's pieces."""
        params = trained(group)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        ema, last_factor = self._scalars(gi, "lamb_coeff_freeze", 0.0), self._scalars(gi, "last_factor", 1.0)
        momentum = self.momentum_buffer(gi)
        fresh = self.flat_state(gi, "exp_avg_sq_fresh", self._fresh)
        previous = momentum.clone()
        momentum.mul_(beta1)  # each rank its local gradient (a missing one counts as zero)
        with_grad = [(s["exp_avg"], p.grad) for s, p in zip(states, params) if p.grad is not None]
        if with_grad:
            avgs, grads = zip(*with_grad)
            torch._foreach_add_(list(avgs), list(grads), alpha=(1 - beta1) / scale)
        if self._exchange_momentum:
            avgs, scaling = [s["exp_avg"] for s in states], self._scalars(gi, "scaling_coeff", 1.0)
            torch._foreach_mul_(avgs, scaling)
            worker, server = self.error_buffers(gi)
            compressed_allreduce(momentum, worker, server, self.comm, tag="onebit_lamb", out=momentum)
            torch._foreach_div_(avgs, scaling)
        momentum[sum(p.numel() for p in params) :].zero_()  # the padding carries no momentum
        self.mask_unseen(states, "exp_avg")
        estimate = (momentum - beta1 * previous) / (1 - beta1)  # the averaged gradient, reconstructed
        fresh.mul_(beta2).addcmul_(estimate, estimate, value=1 - beta2)
        masters = [s.get("master_param", p) for s, p in zip(states, params)]
        denom, update, prelim = self._directions(states, masters, eps, wd)
        fresh_denom = torch._foreach_sqrt([s["exp_avg_sq_fresh"] for s in states])
        torch._foreach_add_(fresh_denom, eps)
        ratio = torch._foreach_div(denom, fresh_denom)
        factors = self.per_param(gi, [(i, v.max()) for i, v in self.segments(gi, ratio)], "max")
        if wd > 0:
            u_sq, d_sq = self._norms_squared(gi, update, prelim)
        coeffs = []
        for i, factor in enumerate(factors):
            if wd > 0:
                norm = math.sqrt(u_sq[i])
                shrink = min(1.0, math.sqrt(d_sq[i]) / norm) if norm > 0 else 1.0
                factor = factor * shrink + (1.0 - shrink)
            factor = min(max(factor, self.factor_min), self.factor_max)
            last = last_factor[i]
            factor = max(min(factor, last * (1 + self.factor_threshold)), last * (1 - self.factor_threshold))
            last_factor[i] = factor
            coeffs.append(ema[i] * factor)
        self._apply(gi, masters, update, [-lr * c for c in coeffs])
        self._finish(params, states, group)
        self._coeffs[gi] = coeffs

    # -- state -------------------------------------------------------------------------
    def _rank_state(self) -> dict:
        if not self._managed:
            return {}  # on its own, state_dict() carries exp_avg_sq_fresh per param
        fresh = {gi: self.flat_state(gi, "exp_avg_sq_fresh", self._fresh).cpu() for gi in self._fresh}
        return {"fresh": fresh} if fresh else {}

    def _load_rank_state(self, saved: dict | None) -> None:
        if not self._managed:
            return
        self._fresh.clear()
        fresh, restarted = (saved or {}).get("fresh", {}), False
        for gi, group in enumerate(self.param_groups):
            params = trained(group)
            if not params or self.steps_done < self.freeze_step:
                continue
            buf = self.flat_state(gi, "exp_avg_sq_fresh", self._fresh)
            if gi in fresh and fresh[gi].numel() == buf.numel():
                buf.copy_(fresh[gi])
            else:
                for p in params:
                    self.state[p]["exp_avg_sq_fresh"].copy_(self.state[p]["exp_avg_sq"])
                restarted = True
        if restarted:
            warnings.warn(
                "OneBitLamb: the checkpoint's fresh variance (exp_avg_sq_fresh) is per rank and for another "
                "world size (or missing); it restarts from the frozen variance",
                stacklevel=2,
            )
