"""Bucketed, asynchronous gradient reduction and parameter gathering over a
:class:`~fastzero.comm.layout.FlatLayout`.

:class:`GradReducer` is told as each param's gradient becomes ready (from a
post-accumulate-grad hook) and launches a bucket's collective as soon as the
bucket is complete, in bucket order on every rank (so the ranks' collectives
always match), while backward goes on. Three modes:

* ``all_reduce`` (stage 0): the grads are views of one flat buffer, each
  bucket is all-reduced in place.
* ``reduce_scatter`` from the flat buffer (stage 1): each bucket is
  reduce-scattered into the rank's shard.
* ``reduce_scatter`` with copies (stage 2): no full gradient buffer; each
  grad is copied into a pooled bucket buffer (then freed by the caller), and
  the bucket is reduce-scattered into the shard, added to it when
  accumulating. Buffers are reused across buckets and steps.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor

from fastzero.comm.collectives import Comm, Handle
from fastzero.comm.layout import FlatLayout


class GradReducer:
    def __init__(self, comm: Comm, layout: FlatLayout, mode: str, *, shard: Tensor | None = None,
                 flat: Tensor | None = None, overlap: bool = True, tag: str = "grad") -> None:  # fmt: skip
        if mode not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"mode {mode!r}: 'all_reduce' or 'reduce_scatter'")
        if mode == "all_reduce" and flat is None:
            raise ValueError("all_reduce needs the flat gradient buffer")
        if mode == "reduce_scatter" and shard is None:
            raise ValueError("reduce_scatter needs the shard to reduce into")
        self.comm, self.layout, self.mode = comm, layout, mode
        self.shard, self.flat, self.overlap, self.tag = shard, flat, overlap, tag
        self.dtype = (flat if flat is not None else shard).dtype
        self.device = (flat if flat is not None else shard).device
        self._free: list[Tensor] = []  # bucket buffers ready for reuse
        self._scratch: dict[int, Tensor] = {}  # per buffer, a chunk for results to accumulate (made when first needed)
        self.buffers_allocated = 0
        self.active = False

    # -- one reduction --------------------------------------------------------------
    def begin(self, accumulate: bool = False) -> None:
        """Starts a reduction; with `accumulate` (stage 2, not the first
        micro-batch) results are added to the shard instead of replacing it."""
        self.accumulate = accumulate
        self.pending = list(self.layout.bucket_numel)
        self.arrived = [False] * len(self.layout.numels)
        self.assigned: dict[int, Tensor] = {}
        self.next_launch = 0
        self.in_flight: deque[tuple[int, Handle]] = deque()
        self.active = True

    def ready(self, i: int, grad: Tensor | None = None) -> None:
        """Param i's gradient is final for this reduction. In copy mode (no
        flat buffer) `grad` is copied into its buckets and may be freed."""
        if not self.active or self.arrived[i]:
            return
        self.arrived[i] = True
        lo = self.layout.offsets[i]
        for b, n in self.layout.param_buckets[i]:
            if self.flat is None:
                bucket = self.layout.buckets[b]
                a = max(lo, bucket.start)
                buf = self._buffer(b)
                buf[a - bucket.start : a - bucket.start + n].copy_(grad.reshape(-1)[a - lo : a - lo + n])
            self.pending[b] -= n
        if self.overlap:
            self._launch_ready()

    def finish(self) -> None:
        """Launches what is left (buckets of params that got no gradient,
        which count as zeros) and waits for every collective."""
        if not self.active:
            return
        for i, arrived in enumerate(self.arrived):
            if not arrived:
                if self.flat is None:
                    self._zero_param(i)
                self.arrived[i] = True
                for b, n in self.layout.param_buckets[i]:
                    self.pending[b] -= n
        self._launch_ready()
        while self.in_flight:
            self._complete_oldest()
        self.active = False

    # -- internals ---------------------------------------------------------------------
    def _launch_ready(self) -> None:
        buckets = self.layout.buckets
        while self.next_launch < len(buckets) and self.pending[self.next_launch] == 0:
            b = buckets[self.next_launch]
            chunk = slice(b.shard_start, b.shard_start + b.chunk)
            if self.mode == "all_reduce":
                handle = self.comm.all_reduce(self.flat[b.start : b.start + b.size], self.tag)
            else:
                src = (
                    self.flat[b.start : b.start + b.size] if self.flat is not None else self._buffer(b.index)[: b.size]
                )
                out = self._scratch_for(b.index)[: b.chunk] if self.accumulate else self.shard[chunk]
                handle = self.comm.reduce_scatter(out, src, self.tag)
            self.in_flight.append((b.index, handle))
            self.next_launch += 1

    def _complete_oldest(self) -> None:
        index, handle = self.in_flight.popleft()
        handle.wait()
        if index in self.assigned:
            buf = self.assigned.pop(index)
            if self.accumulate:
                b = self.layout.buckets[index]
                self.shard[b.shard_start : b.shard_start + b.chunk].add_(self._scratch_for(index, buf)[: b.chunk])
            self._free.append(buf)

    def _buffer(self, index: int) -> Tensor:
        """Bucket `index`'s buffer: a free one, else the oldest in flight once
        it completes, else a new one (the pool settles at what one backward
        needs and is reused from then on)."""
        if index not in self.assigned:
            if not self._free and self.in_flight:
                self._complete_oldest()
            if self._free:
                buf = self._free.pop()
            else:
                buf = torch.empty(max(b.size for b in self.layout.buckets), dtype=self.dtype, device=self.device)
                self.buffers_allocated += 1
            b = self.layout.buckets[index]
            buf[self.layout.bucket_numel[index] : b.size].zero_()  # padding (params fill buckets from the start)
            self.assigned[index] = buf
        return self.assigned[index]

    def _scratch_for(self, index: int, buf: Tensor | None = None) -> Tensor:
        """The chunk-sized scratch of bucket `index`'s buffer, where an
        accumulating reduce-scatter lands before it is added to the shard."""
        key = (buf if buf is not None else self.assigned[index]).data_ptr()
        if key not in self._scratch:
            cap = max(b.chunk for b in self.layout.buckets)
            self._scratch[key] = torch.empty(cap, dtype=self.dtype, device=self.device)
        return self._scratch[key]

    def _zero_param(self, i: int) -> None:
        lo = self.layout.offsets[i]
        for b, n in self.layout.param_buckets[i]:
            bucket = self.layout.buckets[b]
            a = max(lo, bucket.start) - bucket.start
            self._buffer(b)[a : a + n].zero_()

    def buffer_bytes(self) -> int:
        """Bytes of the pooled bucket buffers and their scratch (copy mode)."""
        tensors = [*self._free, *getattr(self, "assigned", {}).values(), *self._scratch.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


def gather_params(comm: Comm, layout: FlatLayout, flat: Tensor, tag: str = "param") -> list[Handle]:
    """Launches one all-gather per bucket: every rank's updated chunk into
    the full flat buffer, all in flight together. Wait on the handles."""
    handles = []
    for b in layout.buckets:
        lo, hi = b.owned(comm.rank)
        handles.append(comm.all_gather(flat[b.start : b.start + b.size], flat[lo:hi], tag))
    return handles
