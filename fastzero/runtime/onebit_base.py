"""What DeepSpeed's 1-bit optimizers share (OneBitAdam, ZeroOneAdam,
OneBitLamb): the process group and the engine hand-over, the step counter,
uncompressed gradient averaging and clipping when used without the engine,
flat padded per-group buffers for the compressed all-reduce, and their
error-feedback buffers with the state dicts that carry them.

The engine asks two things of such an optimizer (:class:`OneBitBase`):
``attach_engine(comm, exchange_momentum=)`` once, and ``compressing`` before
each step (the next step's gradients stay local: the engine neither reduces
them nor divides them by the world size)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor

from fastzero.comm import Comm, error_buffers, padded_numel
from fastzero.ops.norms import sum_of_squares


def trained(group: dict) -> list[Tensor]:
    """The group's params that train, the same list on every rank whichever got grads this step: those that
    require grad, and the engine's shard chunks (plain tensors whose .grad it sets)."""
    return [p for p in group["params"] if p.requires_grad or p.grad is not None]


def check_count(owner: str, name: str, value, low: int = 1, what: str = "") -> int:
    """`value` as a step count >= `low`, or a ValueError naming `owner`'s argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{owner} {name}={value!r}: must be an int >= {low}{what}")
    return value


def check_number(owner: str, name: str, value, low: float = 0.0, high: float | None = None) -> float:
    """`value` as a float in [low, high), or a ValueError naming `owner`'s argument."""
    ok = not isinstance(value, bool) and isinstance(value, int | float) and value >= low
    if not ok or (high is not None and not value < high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{owner} {name}={value!r}: must be a number {bounds}")
    return float(value)


class OneBitBase:
    """Mixin ahead of an :class:`fastzero.ops.optimizer_base.AdamFamilyOptimizer`
    (its ``init_state``, ``param_groups``, ``state``); a subclass calls
    :meth:`_init_onebit` after that optimizer's ``__init__`` and defines
    :attr:`compressing` and ``step``."""

    _extra_state_keys: tuple[str, ...] = ()  # per-param fp32 state beyond exp_avg/exp_avg_sq

    def _init_onebit(self, process_group, comm: Comm | None, max_grad_norm) -> None:
        name = type(self).__name__
        self.max_grad_norm = check_number(name, "max_grad_norm", max_grad_norm)  # 0 turns clipping off
        self.process_group = process_group
        self._group_comm = comm  # a Comm over process_group, made on first use when not given
        # Under the engine (attach_engine): it reduces uncompressed grads, agrees on overflows and clips
        # (gradient_clipping) itself; on its own the optimizer does those here.
        self._managed = False
        self._exchange_momentum = True  # False: grads arrive already compressed-averaged (the engine at stage 1)
        # stage 1: per group, (model params, per shard chunk the (param, start, stop) it holds); None: params whole
        self._shards: list[tuple[int, list[list[tuple[int, int, int]]]]] | None = None
        self._momentum: dict[int, Tensor] = {}  # group -> flat padded fp32 buffer; exp_avg are views of it
        self._errors: dict[int, tuple[Tensor, Tensor]] = {}  # group -> (worker error, server error)
        self._steps_cache: tuple[int, tuple] | None = None  # (steps done, _step_objects() then)

    def attach_engine(self, comm: Comm, *, exchange_momentum: bool, shards=None) -> None:
        """Hands the collectives around the step to an engine that runs them
        itself over `comm`: it averages the uncompressed gradients, agrees on
        overflows (a skipped step is skipped everywhere) and clips by its
        ``gradient_clipping`` (``max_grad_norm`` is then not applied here),
        so :meth:`step` only updates. While :attr:`compressing` the momentum
        is exchanged compressed when `exchange_momentum` (ZeRO stage 0: each
        rank steps on its local gradient); with False the gradients arrive
        already compressed-averaged (stage 1's compressed reduce-scatter) and
        the step is local. `shards` (stage 1), per param group: the number of
        model params and, per shard chunk the optimizer steps, the model
        params it holds as (param, start, stop) in the chunk, for optimizers
        that work per param (:meth:`segments`)."""
        self._group_comm = comm
        self._managed = True
        self._exchange_momentum = exchange_momentum
        self._shards = None if shards is None else [(int(n), [list(c) for c in chunks]) for n, chunks in shards]

    # -- per model param, whole or sharded -------------------------------------------
    def model_params(self, gi: int) -> int:
        """How many model params group `gi` steps (its trained tensors, or at stage 1 the params its chunks hold)."""
        return len(trained(self.param_groups[gi])) if self._shards is None else self._shards[gi][0]

    def segments(self, gi: int, tensors: list[Tensor]) -> list[tuple[int, Tensor]]:
        """(model param, flat view) of every piece of `tensors` (one per
        trained tensor of group `gi`, as its params or their state): each
        whole tensor, or at stage 1 each param's piece of each chunk."""
        if self._shards is None:
            return [(i, t.reshape(-1)) for i, t in enumerate(tensors)]
        return [(i, t.view(-1)[a:z]) for t, pieces in zip(tensors, self._shards[gi][1]) for i, a, z in pieces]

    def per_param(self, gi: int, pieces: list[tuple[int, Tensor]], op: str, width: int = 1) -> list[float]:
        """Per model param of group `gi`, the sum (`op` "sum") or max ("max")
        over `pieces` of their one-element values, over every rank's pieces
        at stage 1 (one tiny all-reduce). With `width` k, k quantities at
        once: piece index j * params + i is quantity j of param i."""
        n = self.model_params(gi) * width
        out = torch.zeros(n, dtype=torch.float64) if op == "sum" else torch.full((n,), -math.inf, dtype=torch.float64)
        if pieces:
            index = torch.tensor([i for i, _ in pieces])
            values = torch.stack([v.reshape(()) for _, v in pieces]).double().cpu()
            if op == "sum":
                out.index_add_(0, index, values)
            else:
                out.scatter_reduce_(0, index, values, "amax")
        if self._shards is None or self.comm.world_size == 1:
            return out.tolist()
        reduce = torch.distributed.ReduceOp.SUM if op == "sum" else torch.distributed.ReduceOp.MAX
        return self.comm.all_reduce_scalars(out.tolist(), op=reduce, tag="onebit_params")

    @property
    def comm(self) -> Comm:
        """The :class:`fastzero.comm.Comm` the optimizer's collectives use."""
        if self._group_comm is None:
            self._group_comm = Comm(self.process_group)
        return self._group_comm

    @property
    def compressing(self) -> bool:
        """Whether the next step's gradients stay local (exchanged compressed, or not at all)."""
        raise NotImplementedError

    # -- the step counter ---------------------------------------------------------
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

    def _advance(self, group: dict) -> None:
        step = group.get("step", 0)
        if isinstance(step, Tensor):
            step.add_(1)
        else:
            group["step"] = int(step) + 1

    def _finish(self, params: list[Tensor], states: list[dict], group: dict) -> None:
        """After a step the optimizer took itself: low-precision params from their fp32 masters, the counter on."""
        copies = [(p, s["master_param"]) for s, p in zip(states, params) if "master_param" in s]
        if copies:
            torch._foreach_copy_([p.data for p, _ in copies], [m for _, m in copies])
        self._advance(group)

    # -- around the step (without the engine) ---------------------------------------
    def _prepare(self, closure, grad_scale, found_inf, *, local: bool):
        """(loss, scale, skip) of a step whose gradients stay local (`local`)
        or are averaged here first (when no engine does it)."""
        loss, grad_scale, found_inf = self._step_inputs(closure, grad_scale, found_inf)
        scale = float(grad_scale) if grad_scale is not None else 1.0
        comm = self.comm
        if not local and not self._managed and comm.world_size > 1:
            self._average_grads(comm, scale)  # each rank unscales by its own scale (GradScalers may differ)
            scale = 1.0
        skip = found_inf is not None and bool(found_inf)
        if comm.world_size > 1 and not self._managed:
            (skip,) = comm.all_reduce_scalars([float(skip)], op=torch.distributed.ReduceOp.MAX, tag="onebit")
        if not skip and self.max_grad_norm > 0 and not self._managed:
            scale *= self._clip_factor(comm, scale, local=local)
        return loss, scale, bool(skip)

    def _average_grads(self, comm, scale: float) -> None:
        """One flat all-reduce per group of the grads / `scale` (a trainable
        param's missing grad counts as zeros, so every rank sends the same
        sizes)."""
        for group in self.param_groups:
            params = trained(group)
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
        with local gradients the norm is the RMS of the ranks' local norms."""
        sumsq = float(sum(sum_of_squares(p.grad) for g in self.param_groups for p in g["params"] if p.grad is not None))
        if local and comm.world_size > 1:
            (sumsq,) = comm.all_reduce_scalars([sumsq], tag="onebit")
            sumsq /= comm.world_size
        norm = sumsq**0.5 / scale
        return norm / self.max_grad_norm if norm > self.max_grad_norm else 1.0

    # -- flat buffers ---------------------------------------------------------------
    def padded_numel(self, gi: int) -> int:
        return padded_numel(sum(p.numel() for p in trained(self.param_groups[gi])), self.comm.world_size)

    def flat_state(self, gi: int, key: str, cache: dict[int, Tensor]) -> Tensor:
        """Group `gi`'s state `key` of every trained param as views of one
        flat fp32 buffer (kept in `cache`), padded for the compressed
        all-reduce; made again, keeping the values, when a load replaced them."""
        params = trained(self.param_groups[gi])
        padded = self.padded_numel(gi)
        buf = cache.get(gi)
        if buf is not None and buf.numel() == padded and buf.device == params[0].device:
            off, intact = 0, True
            for p in params:
                t = self.state[p].get(key)
                intact = intact and t is not None and t.data_ptr() == buf.data_ptr() + 4 * off
                off += p.numel()
            if intact:
                return buf
        buf = torch.zeros(padded, dtype=torch.float32, device=params[0].device)
        off = 0
        for p in params:
            state = self.init_state(p)
            view = buf[off : off + p.numel()].view(p.shape)
            if key in state:
                view.copy_(state[key])
            state[key] = view
            off += p.numel()
        cache[gi] = buf
        return buf

    def momentum_buffer(self, gi: int) -> Tensor:
        """Group `gi`'s momentum as one flat fp32 buffer, padded for the
        compressed all-reduce; every param's ``exp_avg`` is a view of it."""
        return self.flat_state(gi, "exp_avg", self._momentum)

    def flat_grads(self, gi: int, scale: float) -> Tensor:
        """Group `gi`'s local gradients / `scale` in a new flat padded fp32 buffer (a missing one is zeros)."""
        params = trained(self.param_groups[gi])
        flat = torch.zeros(self.padded_numel(gi), dtype=torch.float32, device=params[0].device)
        off = 0
        for p in params:
            if p.grad is not None:
                flat[off : off + p.numel()].view(p.shape).copy_(p.grad)
            off += p.numel()
        return flat.div_(scale) if scale != 1.0 else flat

    def error_buffers(self, gi: int) -> tuple[Tensor, Tensor]:
        padded = self.padded_numel(gi)
        device = trained(self.param_groups[gi])[0].device
        errors = self._errors.get(gi)
        if errors is None or errors[0].numel() != padded or errors[0].device != device:
            errors = self._errors[gi] = error_buffers(padded, self.comm.world_size, device=device)
        return errors

    def reset_errors(self) -> None:
        for worker, server in self._errors.values():
            worker.zero_()
            server.zero_()

    @staticmethod
    def mask_unseen(states: list[dict], key: str) -> None:
        """Compression gives every element +-scale, also those that never had a gradient (an embedding row no
        batch used, padding): with their variance 0 they would move by lr * scale / eps. As DeepSpeed's
        exp_avg_mask, they keep none of `key`."""
        for st in states:
            st[key].masked_fill_(st["exp_avg_sq"] == 0, 0.0)

    # -- state ------------------------------------------------------------------------
    def error_state(self) -> dict:
        """This rank's state outside the params' (the error-feedback buffers
        and what :meth:`_rank_state` adds), for the engine's checkpoints."""
        world = self._group_comm.world_size if self._group_comm is not None else None
        out = {"world_size": world, "errors": {gi: (w.cpu(), s.cpu()) for gi, (w, s) in self._errors.items()}}
        extra = self._rank_state()
        if extra:
            out["extra"] = extra
        return out

    def load_error_state(self, saved: dict | None) -> bool:
        """Restores :meth:`error_state`; at another world size (or without
        one) the errors restart from zero. Returns whether they were restored."""
        self._errors.clear()
        self._load_rank_state(saved.get("extra") if saved else None)
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

    def _rank_state(self) -> dict:
        """A subclass's per-rank state beyond the params' (saved with the errors)."""
        return {}

    def _load_rank_state(self, saved: dict | None) -> None:
        """Restores :meth:`_rank_state` (None: it is not in the checkpoint, or is for another world size)."""

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
        # torch.optim cast every state tensor to its param's dtype: take the extra ones again in fp32
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"]):
            for pid, p in zip(saved_group["params"], group["params"]):
                src = state_dict["state"].get(pid, {})
                for key in self._extra_state_keys:
                    if key in src:
                        self.state[p][key] = src[key].detach().to(device=p.device, dtype=torch.float32).clone()
        if not self.load_error_state(saved):
            warnings.warn(
                f"{type(self).__name__}: the checkpoint's error-feedback buffers are for another world size; they "
                "restart from zero (a one-time, bounded perturbation)",
                stacklevel=2,
            )
