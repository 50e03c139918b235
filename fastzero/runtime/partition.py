"""One param group flattened for ZeRO: the model's params become views of one
padded buffer (so the all-gather writes them in place), and this rank gets
its shard of the gradient, the fp32 master and the optimizer state.

* stage 0: gradients are views of a flat buffer, all-reduced per bucket;
  the optimizer updates the model's params (every rank, everything).
* stage 1: the same flat gradient buffer, reduce-scattered into the rank's
  gradient shard once per step; the optimizer updates the rank's chunks of
  the flat param buffer; an all-gather brings everyone's chunks back.
* stage 2: no full gradient buffer; each gradient is copied into a pooled
  bucket as backward produces it and freed, and the bucket reduce-scattered
  (accumulating over micro-batches) into the shard. With `reduce_once`
  (the pipeline engine) the micro-batches' gradients accumulate on the
  params instead and are reduce-scattered once, during the step's last
  backward: one collective per bucket per step, for a full gradient's memory
  between the micro-batches.

Stages 1-2, after the step: :meth:`FlatGroup.gather` launches one all-gather
per bucket and keeps the handles; with ``overlap_comm`` the engine returns
from ``step()`` with them in flight and waits per bucket
(:meth:`FlatGroup.wait_gather`) in the forward pre-hook of each module whose
params the bucket holds, so the next forward starts when its first bucket
lands. A bucket nobody waited for by the next backward is waited there, and a
param of it that then gets a gradient was read by a forward before it landed
(its module's forward never ran: used from outside): that raises, naming it.

It implements :class:`~fastzero.runtime.groups.ZeroGroup` (and, for 1-bit
Adam, :class:`~fastzero.runtime.groups.CompressingGroup`).
"""

from __future__ import annotations

import bisect
from typing import Any

import torch
from torch import Tensor

from fastzero.comm import (
    Comm,
    FlatLayout,
    GradQuant,
    GradReducer,
    Handle,
    QuantFormat,
    compressed_reduce_scatter,
    gather_chunks,
)
from fastzero.runtime.groups import CompressingGroup, Piece


class FlatGroup(CompressingGroup):
    def __init__(
        self,
        params: list[Tensor],
        names: list[str],
        *,
        stage: int,
        comm: Comm,
        bucket_size: int,
        overlap: bool,
        comm_dtype: torch.dtype | None = None,
        pre_scale: float = 1.0,
        reduce_once: bool = False,
        weight_quant: QuantFormat | None = None,
        grad_quant: GradQuant | None = None,
        key: int = 0,
    ) -> None:
        """`comm_dtype` and `pre_scale`: the gradient reduction's (see
        fastzero.comm.buckets); `reduce_once`: stage 2 reduces on the
        boundary backward only (module docstring). ZeRO++ (stages 1-2):
        `weight_quant`, the post-step all-gather in int8 codes (qwZ);
        `grad_quant`, the reduce-scatter as an all-to-all of codes (qgZ),
        `key` telling this group's stochastic rounding from other groups'."""
        self.params, self.names, self.stage, self.comm = params, names, stage, comm
        self.reduce_once = reduce_once and stage == 2
        self.shapes = [p.shape for p in params]
        world, self.rank = (comm.world_size, comm.rank) if stage >= 1 else (1, 0)
        self.layout = FlatLayout([p.numel() for p in params], world, bucket_size)
        first = params[0]
        self.dtype, self.device = first.dtype, first.device
        self.flat = torch.zeros(self.layout.total, dtype=self.dtype, device=self.device)
        for i, p in enumerate(params):
            view = self._view(self.flat, i)
            view.copy_(p.detach())
            p.data = view
        # the flat gradient buffer (stages 0-1) or the gradient shard (1-2)
        self.flat_grad = torch.zeros_like(self.flat) if stage <= 1 else None
        self.grad_shard = (
            None if stage == 0 else torch.zeros(self.layout.shard_size, dtype=self.dtype, device=self.device)
        )
        mode = "all_reduce" if stage == 0 else "reduce_scatter"
        self.reducer = GradReducer(
            comm,
            self.layout,
            mode,
            shard=self.grad_shard,
            flat=self.flat_grad,
            overlap=overlap,
            comm_dtype=comm_dtype,
            pre_scale=pre_scale,
            quant=grad_quant if stage >= 1 else None,
            key=key,
        )
        self._compress_error: Tensor | None = None  # 1-bit Adam at stage 1: this rank's worker error, rank-major
        self._reduced = False  # the gradients hold a reduction since they were zeroed
        self._carry: Tensor | None = None  # stage 0, a second backward: the sum reduced by the first
        self._gathering: dict[int, Handle] = {}  # the post-step all-gathers still in flight, by bucket
        self._suspect: set[int] = set()  # params whose bucket landed only at backward (module docstring)
        # qwZ: every rank's params become the dequantized codes, its own chunks too (the ranks' replicas stay
        # equal), so what the optimizer updates is a shard of its own, `own`, exact; gathered() brings it back
        self.weight_quant = weight_quant if stage >= 1 else None
        self.own: Tensor | None = None
        if self.weight_quant is not None:
            self.own = torch.empty(self.layout.shard_size, dtype=self.dtype, device=self.device)
            for b in self.layout.buckets:
                lo, hi = b.owned(self.rank)
                self.own[b.shard_start : b.shard_start + b.chunk].copy_(self.flat[lo:hi])
        self.attach_grads()

    def _view(self, flat: Tensor, i: int) -> Tensor:
        lo = self.layout.offsets[i]
        return flat[lo : lo + self.params[i].numel()].view_as(self.params[i])

    def attach_grads(self) -> None:
        """Stages 0-1: each param's .grad is its view of the flat gradient
        buffer, so autograd accumulates into it in place."""
        if self.flat_grad is None:
            return
        for i, p in enumerate(self.params):
            view = self._view(self.flat_grad, i)
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                if p.grad is not None:  # someone replaced it (set_to_none): keep what it holds
                    view.copy_(p.grad)
                p.grad = view

    # -- what the engine calls around backward ---------------------------------------
    def begin_backward(self, first: bool, boundary: bool) -> None:
        """Before a micro-batch's backward: stage 2 reduces every micro-batch
        (accumulating after the first), stages 0-1 and stage 2 with
        `reduce_once` only on the boundary. A
        second backward on the boundary accumulates, as PyTorch does: stage 1
        reduce-scatters the local sum again; stage 0, whose all-reduce works
        in place, sets the sum it already has aside and adds it back after."""
        self.attach_grads()
        if self._gathering:  # buckets nobody waited for: their params' forwards did not run yet
            late = {b for b, h in self._gathering.items() if not h.event.wait_site}
            self.wait_gather(site="backward")
            self._suspect = {
                i for i, touched in enumerate(self.layout.param_buckets) if any(b in late for b, _ in touched)
            }
        if self.stage == 2 and not self.reduce_once:
            self.reducer.begin(accumulate=not first)
        elif boundary:
            if self.stage == 0 and self._reduced:
                self._carry = self.flat_grad.clone()
                self.flat_grad.zero_()
            self.reducer.begin(accumulate=self.reduce_once and self._reduced)

    def grad_ready(self, i: int, p: Tensor) -> None:
        """Param i's gradient is final for this backward (its post-accumulate-grad hook)."""
        if i in self._suspect:
            raise RuntimeError(
                f"{self.names[i]} got a gradient, but its post-step all-gather was still in flight when the "
                "forward used it: the forward of the module that owns it never ran, so nothing waited for it "
                "(overlap_comm overlaps that all-gather with the next forward). Register it for the module whose "
                "forward uses it (engine.register_external_parameter(module, param)), call engine.wait_params() "
                "before the forward, or set zero_optimization.overlap_comm: false"
            )
        if self.stage == 2:
            if self.reducer.active:
                self.reducer.ready(i, p.grad)
                p.grad = None  # this rank keeps only its shard
        else:
            self.reducer.ready(i)

    def end_backward(self) -> None:
        reduced = self.reducer.active
        if self.reduce_once and reduced:  # a param whose gradient came from earlier micro-batches only
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    self.grad_ready(i, p)
        self.reducer.finish()
        self._reduced = self._reduced or reduced
        if self._carry is not None:
            self.flat_grad.add_(self._carry)
            self._carry = None

    def unreduced(self) -> bool:
        """Stage 2: gradients that a plain loss.backward() left on the params."""
        return self.stage == 2 and any(p.grad is not None for p in self.params)

    def memory(self) -> dict[str, int]:
        nbytes = lambda t: t.numel() * t.element_size()
        grads = self.flat_grad if self.flat_grad is not None else self.grad_shard
        out = dict(params=nbytes(self.flat), grads=nbytes(grads), grad_buckets=self.reducer.buffer_bytes())
        if self.own is not None:  # qwZ: the exact shard the optimizer updates
            out["params"] += nbytes(self.own)
        if self._compress_error is not None:
            out["compression_errors"] = nbytes(self._compress_error)
        return out

    def optimizer_params(self) -> list[Tensor]:
        """What the optimizer updates, each with its ``.grad`` set: the model's
        params (stage 0) or this rank's chunks of the flat buffer."""
        if self.stage == 0:
            return list(self.params)
        out = []
        for b in self.layout.buckets:
            lo, hi = b.owned(self.rank)
            chunk = self.flat[lo:hi] if self.own is None else self.own[b.shard_start : b.shard_start + b.chunk]
            chunk.grad = self.grad_shard[b.shard_start : b.shard_start + b.chunk]
            out.append(chunk)
        return out

    def shard_map(self) -> tuple[int, list[list[tuple[int, int, int]]]]:
        """Stages 1-2: the number of params and, per chunk of
        :meth:`optimizer_params`, the params it holds as (param, start, stop)
        offsets in the chunk."""
        return len(self.params), self.layout.chunk_segments(self.rank)

    def grads(self) -> Tensor:
        """This rank's reduced gradient (summed over ranks, not yet averaged)."""
        return self.flat_grad if self.stage == 0 else self.grad_shard

    def reduced_grads(self) -> list[Tensor]:
        """Per tensor of :meth:`optimizer_params` (in order), this rank's
        reduced gradient of it: each param's view of the flat gradient
        (stage 0) or the shard's chunk of each bucket (stages 1-2)."""
        if self.stage == 0:
            return [self._view(self.flat_grad, i) for i in range(len(self.params))]
        return [self.grad_shard[b.shard_start : b.shard_start + b.chunk] for b in self.layout.buckets]

    def set_whole(self, i: int, value: Tensor) -> None:
        """Param i as the model reads it set to `value` (every rank holds it whole)."""
        self._view(self.flat, i).copy_(value.reshape(self.shapes[i]))

    def local_grads(self) -> Tensor:
        """Stages 0-1: this rank's own gradients, before any reduction."""
        return self.flat_grad

    def compressed_reduce(self, divisor: float) -> None:
        """Stage 1 past 1-bit Adam's freeze_step: the grad shard becomes the
        average over ranks of the local gradients, 1-bit compressed on the
        way with error feedback. The flat gradient is laid out rank-major
        first (rank r's chunks of every bucket back to back), so the exchange
        is one all-to-all; the owner keeps the exact average of what it
        receives (no second compression). What is compressed is the gradient
        / `divisor` in fp32 (so the error does not depend on the loss scale);
        the shard gets the average times `divisor` back, in the units of an
        uncompressed reduction (an fp16 shard keeps the loss scale's range)."""
        world, shard = self.comm.world_size, self.layout.shard_size
        send = torch.empty(world * shard, dtype=torch.float32, device=self.device)
        rows = send.view(world, shard)
        for b in self.layout.buckets:
            rows[:, b.shard_start : b.shard_start + b.chunk].copy_(
                self.flat_grad[b.start : b.start + b.size].view(world, b.chunk)
            )
        send.mul_(1.0 / divisor)
        if self._compress_error is None:
            self._compress_error = torch.zeros_like(send)
        average = compressed_reduce_scatter(send, self._compress_error, self.comm, tag="onebit")
        self.grad_shard.copy_(average.mul_(divisor))

    def zero_grads(self) -> None:
        if self.flat_grad is not None:
            self.flat_grad.zero_()
        self._reduced = False

    def gather(self, exact: bool = False) -> list[Handle]:
        """Stages 1-2, after the step: every bucket's all-gather launched and
        kept (wait with :meth:`wait_gather`); also returned. With qwZ the
        buckets travel as int8 codes, unless `exact` (the exact shards, for
        a reader of the weights: ``engine.gathered()``)."""
        if self.stage == 0:
            return []
        self.wait_gather(site="gather")  # never two all-gathers writing one bucket
        # last bucket first: the layout is in backward's order, so it holds the params the forward reads first,
        # and the collectives run in launch order
        self._gathering = {}
        fmt = None if exact else self.weight_quant
        for b in reversed(self.layout.buckets):
            lo, hi = b.owned(self.rank)
            mine = self.flat[lo:hi] if self.own is None else self.own[b.shard_start : b.shard_start + b.chunk]
            self._gathering[b.index] = gather_chunks(
                self.comm, self.flat[b.start : b.start + b.size], mine, "param", fmt
            )
        self._suspect = set()
        return list(self._gathering.values())

    def gathering(self) -> bool:
        """A post-step all-gather is still in flight (not waited for)."""
        return bool(self._gathering)

    def buckets_of(self, indices: list[int]) -> list[int]:
        """The buckets that hold params `indices`, in bucket order."""
        return sorted({b for i in indices for b, _ in self.layout.param_buckets[i]})

    def wait_gather(self, buckets: list[int] | None = None, site: str = "", seen: list[int] = ()) -> None:
        """Waits for the post-step all-gather of `buckets` (None: all),
        recording the time blocked and `site` on each bucket's comm event;
        `seen`: params whose module's forward starts now (they are read after
        this wait, so fine)."""
        for b in list(self._gathering) if buckets is None else buckets:
            handle = self._gathering.pop(b, None)
            if handle is not None:
                handle.wait(site)
        if seen and self._suspect:
            self._suspect.difference_update(seen)

    # -- state ---------------------------------------------------------------------------
    def owned(self, opt_params: list[Tensor]) -> list[Piece]:
        """Stage 0: every param whole (one optimizer tensor each); stages
        1-2: the rank's segments of the flat buffer, within the chunk of each
        bucket that it owns (one optimizer tensor per bucket)."""
        if self.stage == 0:
            return [Piece(self.names[i], 0, p.numel(), opt_params[i], 0) for i, p in enumerate(self.params)]
        starts = [b.shard_start for b in self.layout.buckets]
        out = []
        for s in self.layout.segments(self.rank):
            b = self.layout.buckets[bisect.bisect_right(starts, s.shard_offset) - 1]
            out.append(Piece(self.names[s.param], s.lo, s.hi, opt_params[b.index], s.shard_offset - b.shard_start))
        return out

    def reload_from_params(
        self, optimizer: torch.optim.Optimizer, opt_params: list[Tensor], params: list[Tensor]
    ) -> None:
        """As :meth:`ZeroGroup.reload_from_params`; a param whose ``.data``
        was replaced (``p.data = t``) is copied back into its view of the
        flat buffer and made that view again (the step and the all-gather
        write there)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        with torch.no_grad():
            for p in params:
                i = index[id(p)]
                view = self._view(self.flat, i)
                if p.data_ptr() != view.data_ptr() and p.shape == view.shape:
                    view.copy_(p.detach())
                    p.data = view
        super().reload_from_params(optimizer, opt_params, params)

    def rank_state(self) -> Any:
        """1-bit Adam at stage 1: this rank's error-feedback buffer (on the CPU), else None."""
        return None if self._compress_error is None else self._compress_error.cpu()

    def load_rank_state(self, state: Any) -> None:
        self._compress_error = None if state is None else state.to(self.device)
