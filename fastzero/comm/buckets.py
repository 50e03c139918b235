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
from fastzero.comm.quantized import GradQuant, QuantFormat, QuantizedGather, mix_seed


class BufferPool:
    """Bucket buffers for copy-mode reducers, shared by several of them
    (stage 3 has one reducer per param): a free buffer that is big enough,
    else the oldest reduction in flight (of any reducer) once it completes,
    else a new one. The pool settles at what one backward needs."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.free: list[Tensor] = []
        self.scratch: dict[int, Tensor] = {}  # per buffer, a chunk for accumulating results (made when needed)
        self.in_flight: deque[tuple[GradReducer, int]] = deque()

    def take(self, numel: int) -> Tensor:
        while True:
            for k, buf in enumerate(self.free):
                if buf.numel() >= numel:
                    return self.free.pop(k)
            if not self.in_flight:
                break
            reducer, index = self.in_flight.popleft()
            reducer.complete(index)
        return torch.empty(numel, dtype=self.dtype, device=self.device)

    def prune(self) -> None:
        """Forgets reductions that completed (waited for by their reducer)."""
        self.in_flight = deque((r, i) for r, i in self.in_flight if i in r.in_flight)

    def scratch_for(self, buf: Tensor, numel: int) -> Tensor:
        key = buf.data_ptr()
        if key not in self.scratch or self.scratch[key].numel() < numel:
            self.scratch[key] = torch.empty(numel, dtype=self.dtype, device=self.device)
        return self.scratch[key]

    def nbytes(self, held: list[Tensor] = ()) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.free, *held, *self.scratch.values()])


class GradReducer:
    def __init__(
        self,
        comm: Comm,
        layout: FlatLayout,
        mode: str,
        *,
        shard: Tensor | None = None,
        flat: Tensor | None = None,
        overlap: bool = True,
        tag: str = "grad",
        pool: BufferPool | None = None,
        comm_dtype: torch.dtype | None = None,
        pre_scale: float = 1.0,
        quant: GradQuant | None = None,
        key: int = 0,
    ) -> None:
        """`quant`: reduce-scatters travel quantized (qgZ, an all-to-all of
        codes; see fastzero.comm.quantized), `key` telling this reducer's
        stochastic rounding apart from other reducers'."""
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
        self.comm_dtype, self.pre_scale = comm_dtype or self.dtype, float(pre_scale)
        if quant is not None and (mode != "reduce_scatter" or self.comm_dtype != self.dtype):
            raise ValueError("a quantized reduction is a reduce_scatter whose input is in the gradients' dtype")
        self.quant, self.key = quant, key
        self.pool = pool or BufferPool(self.comm_dtype, self.device)
        if self.pool.dtype != self.comm_dtype:
            raise ValueError(f"the buffer pool holds {self.pool.dtype}; the reduction is in {self.comm_dtype}")
        self.assigned: dict[int, Tensor] = {}
        self.in_flight: dict[int, Handle] = {}  # launch order
        # a bucket whose result lands apart from where it belongs (another dtype, or accumulated): what it
        # reduces (kept alive while in flight), where the result lands, where that goes and whether it is added
        self.staged: dict[int, tuple[Tensor, Tensor, Tensor, bool]] = {}
        self.active = False

    # -- one reduction --------------------------------------------------------------
    def begin(self, accumulate: bool = False) -> None:
        """Starts a reduction; with `accumulate` (stage 2, not the first
        micro-batch) results are added to the shard instead of replacing it."""
        self.accumulate = accumulate
        self.pending = list(self.layout.bucket_numel)
        self.arrived = [False] * len(self.layout.numels)
        self.next_launch = 0
        self.active = True

    @property
    def launched(self) -> bool:
        """Every bucket's collective is launched."""
        return self.next_launch == len(self.layout.buckets)

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
        if self.quant is not None:  # hierarchical reductions whose node phase landed go on across nodes
            self.quant.advance()

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
        for index in list(self.in_flight):
            self.complete(index)
        self.pool.prune()
        self.active = False

    # -- internals ---------------------------------------------------------------------
    def _launch_ready(self) -> None:
        buckets = self.layout.buckets
        while self.next_launch < len(buckets) and self.pending[self.next_launch] == 0:
            b = buckets[self.next_launch]
            if self.mode == "all_reduce":
                handle = self._all_reduce(b.index, self.flat[b.start : b.start + b.size])
            else:
                handle = self._reduce_scatter(b)
            self.in_flight[b.index] = handle
            self.next_launch += 1

    def _all_reduce(self, index: int, part: Tensor) -> Handle:
        """Stage 0: in place, or through a copy in the communication dtype."""
        if self.comm_dtype == self.dtype:
            if self.pre_scale != 1.0:
                part.mul_(self.pre_scale)
            return self.comm.all_reduce(part, self.tag)
        wire = part.to(self.comm_dtype).mul_(self.pre_scale)
        self.staged[index] = (wire, wire, part, False)
        return self.comm.all_reduce(wire, self.tag)

    def _reduce_scatter(self, b) -> Handle:
        chunk = self.shard[b.shard_start : b.shard_start + b.chunk]
        if self.flat is not None:  # stage 1: the flat buffer keeps the local sum (a second backward adds to it)
            src = self.flat[b.start : b.start + b.size]
            if self.comm_dtype != self.dtype or self.pre_scale != 1.0:
                src = src.to(self.comm_dtype, copy=True).mul_(self.pre_scale)
        else:
            src = self._buffer(b.index)[: b.size]
            if self.pre_scale != 1.0:
                src.mul_(self.pre_scale)
        if not self.accumulate and self.comm_dtype == self.dtype:
            out = chunk
        else:
            out = self._scratch(b.index)[: b.chunk] if self.flat is None else src.new_empty(b.chunk)
            self.staged[b.index] = (src, out, chunk, self.accumulate)
        if self.quant is not None:
            handle = self.quant.reduce_scatter(self.comm, out, src, self.tag, mix_seed(self.key, b.index))
        else:
            handle = self.comm.reduce_scatter(out, src, self.tag)
        if self.flat is None:
            self.pool.in_flight.append((self, b.index))
        return handle

    def complete(self, index: int) -> None:
        """Waits for bucket `index`'s collective (if still in flight) and
        gives its buffer back to the pool."""
        handle = self.in_flight.pop(index, None)
        if handle is None:
            return
        handle.wait()
        staged = self.staged.pop(index, None)
        if staged is not None:
            _, landed, dest, add = staged
            if add:
                dest.add_(landed)  # accumulated in the shard's dtype, as without staging
            else:
                dest.copy_(landed)
        if index in self.assigned:
            self.pool.free.append(self.assigned.pop(index))

    def _buffer(self, index: int) -> Tensor:
        """Bucket `index`'s buffer: a free one, else the oldest in flight once
        it completes, else a new one (the pool settles at what one backward
        needs and is reused from then on)."""
        if index not in self.assigned:
            buf = self.pool.take(max(b.size for b in self.layout.buckets))
            b = self.layout.buckets[index]
            buf[self.layout.bucket_numel[index] : b.size].zero_()  # padding (params fill buckets from the start)
            self.assigned[index] = buf
        return self.assigned[index]

    def _scratch(self, index: int) -> Tensor:
        """The chunk-sized scratch of bucket `index`'s buffer, where a
        reduce-scatter lands before it is added (accumulating) or copied
        (another dtype) to the shard."""
        return self.pool.scratch_for(self.assigned[index], max(b.chunk for b in self.layout.buckets))

    def _zero_param(self, i: int) -> None:
        lo = self.layout.offsets[i]
        for b, n in self.layout.param_buckets[i]:
            bucket = self.layout.buckets[b]
            a = max(lo, bucket.start) - bucket.start
            self._buffer(b)[a : a + n].zero_()

    def buffer_bytes(self) -> int:
        """Bytes of the pooled bucket buffers and their scratch (copy mode)."""
        return self.pool.nbytes(list(self.assigned.values()))


def gather_params(comm: Comm, layout: FlatLayout, flat: Tensor, tag: str = "param") -> list[Handle]:
    """Launches one all-gather per bucket: every rank's updated chunk into
    the full flat buffer, all in flight together. Wait on the handles."""
    handles = []
    for b in layout.buckets:
        lo, hi = b.owned(comm.rank)
        handles.append(comm.all_gather(flat[b.start : b.start + b.size], flat[lo:hi], tag))
    return handles


def gather_chunks(comm: Comm, out: Tensor, inp: Tensor, tag: str, fmt: QuantFormat | None = None):
    """``comm.all_gather(out, inp)``, through `fmt`'s codes when given (qwZ:
    :class:`~fastzero.comm.quantized.QuantizedGather`) and there are other
    ranks; either way a handle to wait on."""
    if fmt is None or comm.world_size == 1:
        return comm.all_gather(out, inp, tag)
    return QuantizedGather(comm, out, inp, fmt, tag)
