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

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from fastzero.comm import Comm, compressed_allreduce, error_buffers, padded_numel
from fastzero.ops import FusedAdam
from fastzero.ops.norms import sum_of_squares


def _trained(group: dict) -> list[Tensor]:
    """The group's params that train, the same list on every rank whichever got grads this step: those that
    require grad, and the engine's shard chunks (plain tensors whose .grad it sets)."""
    return [p for p in group["params"] if p.requires_grad or p.grad is not None]


def check_freeze_step(freeze_step) -> int:
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
        raise ValueError(
            f"OneBitAdam freeze_step={freeze_step!r}: must be an int >= 1, the number of uncompressed warm-up steps "
            "whose variance is then frozen (a few percent of the run, as DeepSpeed recommends)"
        )
    return freeze_step


class OneBitAdam(FusedAdam):
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
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, int | float) or not max_grad_norm >= 0:
            raise ValueError(
                f"OneBitAdam max_grad_norm={max_grad_norm!r}: must be a number >= 0 (0 turns clipping off)"
            )
        self.freeze_step = check_freeze_step(freeze_step)
        self.max_grad_norm = float(max_grad_norm)
        super().__init__(
            params, lr, bias_correction, betas, eps, True, weight_decay, master_weights=master_weights, backend=backend
        )
        self.process_group = process_group
        self._group_comm = comm  # a Comm over process_group, made on first use when not given
        # Under the engine (attach_engine): it reduces warm-up grads, agrees on overflows and clips
        # (gradient_clipping) itself; on its own the optimizer does those here.
        self._managed = False
        self._exchange_momentum = True  # False: grads arrive already compressed-averaged (the engine at stage 1)
        self._momentum: dict[int, Tensor] = {}  # group -> flat padded fp32 buffer; exp_avg are views of it
        self._errors: dict[int, tuple[Tensor, Tensor]] = {}  # group -> (worker error, server error)
        self._steps_cache: tuple[int, tuple] | None = None  # (steps done, _step_objects() then)

    def attach_engine(self, comm: Comm, *, exchange_momentum: bool) -> None:
        """Hands the collectives around the step to an engine that runs them
        itself over `comm`: it averages the warm-up gradients, agrees on
        overflows (a skipped step is skipped everywhere) and clips by its
        ``gradient_clipping`` (``max_grad_norm`` is then not applied here),
        so :meth:`step` only updates. After ``freeze_step`` the momentum is
        exchanged compressed when `exchange_momentum` (ZeRO stage 0: each
        rank steps on its local gradient); with False the gradients arrive
        already compressed-averaged (stage 1's compressed reduce-scatter) and
        the step is local."""
        self._group_comm = comm
        self._managed = True
        self._exchange_momentum = exchange_momentum

    @property
    def comm(self) -> Comm:
        """The :class:`fastzero.comm.Comm` the optimizer's collectives use."""
        if self._group_comm is None:
            self._group_comm = Comm(self.process_group)
        return self._group_comm

    # -- phases -------------------------------------------------------------------
    def _step_objects(self) -> tuple:
        """What identifies the groups' step counters: a device tensor by
        identity (steps advance it in place), a host int by value."""
        steps = (g.get("step", 0) for g in self.param_groups)
        return tuple((id(t), None) if isinstance(t, Tensor) else (None, t) for t in steps)

    @property
    def steps_done(self) -> int:
        """Steps taken. Cached after each step, so that asking (the engine
        does, every micro-batch) reads no device counter, which would wait
        for the GPU; a load that replaces the counters is seen."""
        if self._steps_cache is not None and self._steps_cache[1] == self._step_objects():
            return self._steps_cache[0]
        done = max((int(float(g.get("step", 0))) for g in self.param_groups), default=0)
        self._steps_cache = (done, self._step_objects())
        return done

    @property
    def compressing(self) -> bool:
        """Whether the next step is past the warm-up (variance frozen, momentum compressed)."""
        return self.steps_done >= self.freeze_step

    # -- the step -----------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float | Tensor | None = None, found_inf: float | Tensor | None = None):
        loss, grad_scale, found_inf = self._step_inputs(closure, grad_scale, found_inf)
        scale = float(grad_scale) if grad_scale is not None else 1.0
        comm = self.comm
        compressing = self.compressing
        if not compressing and not self._managed and comm.world_size > 1:
            self._average_grads(comm, scale)  # each rank unscales by its own scale (GradScalers may differ)
            scale = 1.0
        skip = found_inf is not None and bool(found_inf)
        if comm.world_size > 1 and not self._managed:
            (skip,) = comm.all_reduce_scalars([float(skip)], op=torch.distributed.ReduceOp.MAX, tag="onebit")
        if skip:
            return loss  # an overflow on any rank: no rank steps, the errors stay as they are
        if self.max_grad_norm > 0 and not self._managed:
            scale *= self._clip_factor(comm, scale, local=compressing)
        t = self.steps_done + 1  # before any group's counter advances
        if not compressing:
            super().step(grad_scale=scale)
        else:
            for gi, group in enumerate(self.param_groups):
                if _trained(group):
                    self._compressed_step(gi, group, t, scale, comm)
        stepped = compressing or any(p.grad is not None for g in self.param_groups for p in g["params"])
        self._steps_cache = (t, self._step_objects()) if stepped else None  # a warm-up step without grads is none
        if compressing:
            self.sync_steps()  # state[p]["step"]: the compressed step advanced the counters itself
        return loss

    def _average_grads(self, comm, scale: float) -> None:
        """Warm-up without the engine: one flat all-reduce per group of the
        grads / `scale` (a trainable param's missing grad counts as zeros, so
        every rank sends the same sizes)."""
        for group in self.param_groups:
            params = _trained(group)
            if not params:
                continue
            flat = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params]
            )
            flat /= scale  # this rank's scale, before the sum
            comm.all_reduce(flat, tag="onebit_warmup").wait()
            flat /= comm.world_size
            off = 0
            for p in params:
                g = flat[off : off + p.numel()].view(p.shape)
                off += p.numel()
                if p.grad is None:
                    p.grad = g.to(p.dtype)
                else:
                    p.grad.copy_(g)

    def _clip_factor(self, comm, scale: float, local: bool) -> float:
        """1/coef so that the gradient the step uses has norm <= max_grad_norm;
        after the freeze the norm is the RMS of the ranks' local norms."""
        sumsq = float(sum(sum_of_squares(p.grad) for g in self.param_groups for p in g["params"] if p.grad is not None))
        if local and comm.world_size > 1:
            (sumsq,) = comm.all_reduce_scalars([sumsq], tag="onebit")
            sumsq /= comm.world_size
        norm = sumsq**0.5 / scale
        return norm / self.max_grad_norm if norm > self.max_grad_norm else 1.0

    def momentum_buffer(self, gi: int) -> Tensor:
        """Group `gi`'s momentum as one flat fp32 buffer, padded for the
        compressed all-reduce; every param's ``exp_avg`` is a view of it (made
        again when a load replaced them)."""
        params = _trained(self.param_groups[gi])
        numel = sum(p.numel() for p in params)
        padded = padded_numel(numel, self.comm.world_size)
        buf = self._momentum.get(gi)
        if buf is not None and buf.numel() == padded and buf.device == params[0].device:
            off, intact = 0, True
            for p in params:
                ea = self.state[p].get("exp_avg")
                intact = intact and ea is not None and ea.data_ptr() == buf.data_ptr() + 4 * off
                off += p.numel()
            if intact:
                return buf
        buf = torch.zeros(padded, dtype=torch.float32, device=params[0].device)
        off = 0
        for p in params:
            state = self.init_state(p)
            view = buf[off : off + p.numel()].view(p.shape)
            view.copy_(state["exp_avg"])
            state["exp_avg"] = view
            off += p.numel()
        self._momentum[gi] = buf
        return buf

    def error_buffers(self, gi: int) -> tuple[Tensor, Tensor]:
        buf = self.momentum_buffer(gi)
        errors = self._errors.get(gi)
        if errors is None or errors[0].numel() != buf.numel() or errors[0].device != buf.device:
            world = self.comm.world_size
            errors = self._errors[gi] = error_buffers(buf.numel(), world, device=buf.device)
        return errors

    def _compressed_step(self, gi: int, group: dict, t: int, scale: float, comm) -> None:
        params = _trained(group)
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
        # Compression gives every element +-scale, also those that never had a gradient (an embedding row no
        # batch used in the warm-up, padding): with their frozen variance 0 they would move by lr * scale / eps.
        # As DeepSpeed's exp_avg_mask, they keep no momentum.
        for st in states:
            st["exp_avg"].masked_fill_(st["exp_avg_sq"] == 0, 0.0)
        bc1 = 1 - beta1**t if group["bias_correction"] else 1.0
        bc2 = 1 - beta2**self.freeze_step if group["bias_correction"] else 1.0  # frozen with the variance
        masters = [s.get("master_param", p) for s, p in zip(states, params)]
        denom = torch._foreach_div([s["exp_avg_sq"] for s in states], bc2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        if wd:
            torch._foreach_mul_(masters, 1.0 - lr * wd)
        torch._foreach_addcdiv_(masters, [s["exp_avg"] for s in states], denom, value=-lr / bc1)
        copies = [(p, s["master_param"]) for s, p in zip(states, params) if "master_param" in s]
        if copies:
            torch._foreach_copy_([p.data for p, _ in copies], [m for _, m in copies])
        step = group.get("step", 0)
        if isinstance(step, Tensor):
            step.add_(1)
        else:
            group["step"] = int(step) + 1

    # -- state -------------------------------------------------------------------------
    def error_state(self) -> dict:
        """The error-feedback buffers (this rank's), for checkpoints."""
        world = self._group_comm.world_size if self._group_comm is not None else None
        return {"world_size": world, "errors": {gi: (w.cpu(), s.cpu()) for gi, (w, s) in self._errors.items()}}

    def load_error_state(self, saved: dict | None) -> bool:
        """Restores :meth:`error_state`; at another world size (or without
        one) the errors restart from zero. Returns whether they were restored."""
        self._errors.clear()
        if not saved or not saved.get("errors"):
            return True
        if saved.get("world_size") != self.comm.world_size:
            return False
        for gi, (w, s) in saved["errors"].items():
            worker, server = self.error_buffers(int(gi))
            if worker.numel() != w.numel() or server.numel() != s.numel():
                self._errors.clear()
                return False
            worker.copy_(w)
            server.copy_(s)
        return True

    def error_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self._errors.values() for t in pair)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["onebit"] = self.error_state()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop("onebit", None)
        super().load_state_dict(state_dict)
        if not self.load_error_state(saved):
            warnings.warn(
                "OneBitAdam: the checkpoint's error-feedback buffers are for another world size; they "
                "restart from zero (a one-time, bounded perturbation)",
                stacklevel=2,
            )
