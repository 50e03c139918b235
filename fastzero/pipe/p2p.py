"""Point-to-point transport between pipeline stages: asynchronous sends and
receives of activations and gradients (a tensor, or tuples / lists / dicts
of tensors and picklable non-tensor values), over Gloo or NCCL.

Channels. A message travels on a channel ``(src, dst, kind)``; ``kind`` ("act",
"grad", ...) maps to a transport tag, so channels between the same two ranks
never mix, and messages on one channel arrive in the order they were sent.

Protocol. Each end of a channel keeps the channel's *signature*: the
structure of the object, its non-tensor leaves, and each tensor's shape,
dtype and ``requires_grad``. The sender remembers the last signature it sent,
which is, messages being ordered, the one the receiver holds. Every message is
a *frame* laid out by the signature both ends hold:

* packed (payload <= :data:`PACK_LIMIT` bytes): one uint8 buffer, every
  tensor's bytes at 16-byte aligned offsets, then an 8-byte control word;
* split (larger payloads): an 8-byte control word, then one message per
  non-empty tensor, sent from and received into the tensors themselves (no
  copy).

The control word is 0 for data. When the signature changes, the sender sends
one frame in the *old* layout whose control word is the length ``k`` of the
new pickled signature (its payload bytes are not read), then the signature
(``k`` bytes), then the data in the new layout. A channel starts with the
empty signature (a packed frame of just the control word). So the receiver
always knows the sizes of what it posts once the message before is in, and
never takes a payload under a stale signature. The send handle of a changed
message waits for the announcing frame only (the receiver's posted receive
takes it); the signature and the data (sent from a copy) go out behind it
and are waited by the channel's next send, or :meth:`P2P.close`: they need
the receiver to complete that receive, which its ``wait()`` or its channel's
thread does. The sender compares a cheap key of the message (types, shapes,
dtypes, simple values) with the last one and pickles only when it differs or
the message holds other values. Packed tensors arrive as views of one fresh
buffer per message.

Cost per message in steady state: one message on the wire with 8 extra bytes
(packed: plus one copy of the payload on each side, cheaper than a second
message below :data:`PACK_LIMIT` on Gloo), or one 8-byte message plus one per
tensor (split). A signature change costs one frame of the old size, plus one
message of the pickled signature. Non-tensor leaves belong to the signature:
a value that changes every message re-sends the signature every message.

Receiving. A receive posted while every earlier one on its channel is
complete is posted from the caller's thread (its layout is known) and its
``wait()`` completes it there, following a signature change through: no
thread, the cost of a plain irecv plus the frame's decoding. A receive posted
behind an open one goes to the channel's thread (started then), which
completes the open ones in order and posts each frame as soon as the one
before it is in, following signature changes without the callers' waits; so
any order of sends, receives and waits that works with
``torch.distributed.isend``/``irecv`` works here, at the price of one thread
hand-off per such receive. Use one P2P per process group: two share tags.

Order on NCCL. NCCL ignores tags and matches sends and receives between two
ranks in the order they are posted, so on NCCL the two ends must post the
messages of different channels in the same order (a pipeline schedule does).
Receives posted behind open ones are issued by the channel's thread, beside
the caller's operations on the same communicator: untested here (no GPU).

Failure. ``wait()`` waits at most ``timeout`` seconds, then raises
:class:`PipelineTimeout` naming the peer, the channel and what it waited for;
a peer whose process died raises :class:`PipelinePeerError` as soon as the
transport notices. After either, the :class:`P2P` object refuses further use.
Gloo closes the pair on a timed-out send or receive, so the peer's pending
operations with this rank then fail as a dead peer's would.
"""

from __future__ import annotations

import datetime
import pickle
import queue
import sys
import threading
import time
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

# Payloads up to this many bytes travel packed in one buffer with the control
# word: on Gloo a second message costs ~100 us, copying 64 KiB a few us.
PACK_LIMIT = 64 << 10
_ALIGN = 16  # tensor offsets in a packed frame: any dtype can view its bytes
_CONTROL = 8  # bytes of the control word (one int64)
_TAG_BITS = 0x3FFFFFFF  # tags stay positive int32
_HINT_TIMEOUT = (
    "The peer stage probably raised or died, or runs a schedule that does not match this one: "
    "check its log (a slow stage needs a larger P2P timeout)."
)


class PipelinePeerError(RuntimeError):
    """A pipeline send or receive failed because of the peer stage."""


class PipelineTimeout(PipelinePeerError):
    """A pipeline send or receive did not complete within the timeout."""


class _Slot:
    """Where a tensor sits in a message's structure (in the pickled signature)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __getstate__(self):
        return self.index

    def __setstate__(self, index):
        self.index = index


@dataclass(frozen=True)
class _Spec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class _Layout:
    """A signature's frame: packed offsets, or the split tensors."""

    def __init__(self, skeleton, specs: list[_Spec]) -> None:
        self.skeleton, self.specs = skeleton, specs
        self.payload = sum(s.nbytes for s in specs)
        self.packed = self.payload <= PACK_LIMIT
        self.offsets, end = [], 0
        for s in specs:
            end = _align(end, _ALIGN)
            self.offsets.append(end)
            end += s.nbytes
        self.frame = _align(end, _CONTROL) + _CONTROL  # packed frame bytes
        self.views = list(zip(self.offsets, specs))
        self.single = isinstance(skeleton, _Slot)  # a bare tensor


_EMPTY = _Layout(None, [])  # a channel before its first message


def _flatten(obj, tensors: list[Tensor], path: str):
    """The object's skeleton (tensors replaced by slots) and its tensors, in order."""
    if isinstance(obj, Tensor):
        tensors.append(obj)
        return _Slot(len(tensors) - 1)
    if type(obj) in (tuple, list):
        return type(obj)(_flatten(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj))
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_flatten(v, tensors, f"{path}.{f}") for f, v in zip(obj._fields, obj)))
    if type(obj) is dict:
        return {k: _flatten(v, tensors, f"{path}[{k!r}]") for k, v in obj.items()}
    return obj


def _check_picklable(obj, path: str) -> None:
    """Raises naming the first leaf of `obj` that pickle refuses."""
    if isinstance(obj, Tensor):
        return
    if isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _check_picklable(v, f"{path}[{i}]")
        return
    if type(obj) is dict:
        for k, v in obj.items():
            _check_picklable(v, f"{path}[{k!r}]")
        return
    try:
        pickle.dumps(obj)
    except Exception as exc:
        raise TypeError(
            f"p2p: the value at {path} ({type(obj).__name__}) cannot be pickled ({exc}); a message holds "
            "tensors in tuples, lists and dicts, and picklable non-tensor values: pass that value another way"
        ) from exc


def _build(skeleton, tensors: list[Tensor]):
    if isinstance(skeleton, _Slot):
        return tensors[skeleton.index]
    if type(skeleton) in (tuple, list):
        return type(skeleton)(_build(v, tensors) for v in skeleton)
    if isinstance(skeleton, tuple) and hasattr(skeleton, "_fields"):
        return type(skeleton)(*(_build(v, tensors) for v in skeleton))
    if type(skeleton) is dict:
        return {k: _build(v, tensors) for k, v in skeleton.items()}
    return skeleton


@dataclass
class ChannelBytes:
    """What one channel end moved: frames, tensor payload bytes, signature
    bytes (pickled signatures and the old-layout frames announcing them), and
    control-word bytes (8 per frame)."""

    messages: int = 0
    payload: int = 0
    meta: int = 0
    control: int = 0
    signatures: int = 0  # how many times the signature was (re)sent

    @property
    def total(self) -> int:
        return self.payload + self.meta + self.control


_SIMPLE = (type(None), bool, int, str)


def _key(obj):
    """A cheap stand-in for the pickled signature of a message made of
    tensors, tuples, lists, str-keyed dicts and None/bool/int/str leaves
    (equal keys mean equal signatures); None for anything else, which the
    sender then pickles to compare."""
    if isinstance(obj, Tensor):
        return (obj.shape, obj.dtype, obj.requires_grad)
    t = type(obj)
    if t in (tuple, list) or (t.__base__ is tuple and hasattr(obj, "_fields")):
        keys = tuple(_key(v) for v in obj)
        return None if None in keys else (t, keys)
    if t is dict:
        keys = tuple((type(k), k, _key(v)) for k, v in obj.items())
        return None if any(type(k[1]) not in _SIMPLE or k[2] is None for k in keys) else (t, keys)
    if t in _SIMPLE:
        return (t, obj)
    return None


class _SendChannel:
    def __init__(self, tag: int) -> None:
        self.tag = tag
        self.sig: bytes | None = None
        self.key = None  # _key of the last message sent, when it has one
        self.layout = _EMPTY
        self.followups: tuple[list, list] = ([], [])  # works and buffers of the last change, waited next send
        self.stats = ChannelBytes()


class _RecvChannel:
    """The receiving end of one channel. A receive posted while every
    earlier one on the channel is complete goes out from the caller's thread
    (the layout is known) and its ``wait()`` completes it there, following a
    signature change through. A receive posted while an earlier one is still
    out goes to the channel's thread, which completes the earlier ones and
    posts each frame as soon as the one before it is in: so any order of
    sends, receives and waits that works with torch's isend/irecv works."""

    def __init__(self, p2p: P2P, src: int, kind: str) -> None:
        self.p2p, self.src, self.kind = p2p, src, kind
        self.tag = p2p._tag(kind)
        self.layout = _EMPTY
        self.stats = p2p.stats.setdefault(("recv", src, kind), ChannelBytes())
        self.open = 0  # receives posted and not complete
        self.inline: RecvHandle | None = None  # the one posted from the caller's thread, if not complete
        self.state = threading.Lock()  # guards open/inline/layout between the caller and the thread
        self.completing = threading.Lock()  # held by whoever completes a receive (caller or thread)
        self.error: PipelinePeerError | None = None
        self.queue: queue.SimpleQueue[RecvHandle | None] | None = None
        self.thread: threading.Thread | None = None

    def post(self, handle: RecvHandle) -> None:
        with self.state:
            self.open += 1
            if self.open == 1 and self.error is None:  # nothing before it out: post it here
                handle.posted = self._post(handle, self.layout)
                self.inline = handle
                return
            handle.event = threading.Event()  # the thread completes it
            if self.inline is not None and self.inline.event is None:  # and, unless its caller is, the inline one
                self.inline.event = threading.Event()
        if self.thread is None:
            self.queue = queue.SimpleQueue()
            self.thread = threading.Thread(target=self._run, name=f"p2p-recv-{self.src}-{self.kind}", daemon=True)
            self.thread.start()
        self.queue.put(handle)

    def stop(self) -> None:
        if self.queue is not None:
            self.queue.put(None)

    def _run(self) -> None:
        while (handle := self.queue.get()) is not None:
            inline = self.inline
            if inline is not None:  # posted from the caller's thread: complete it first, unless its caller is
                with self.completing:
                    if not inline.done:
                        self.complete(inline, None)
            with self.completing:
                if self.error is None:
                    handle.posted = self._post(handle, self.layout)
                self.complete(handle, None)

    def complete(self, handle: RecvHandle, deadline: float | None) -> None:
        """Completes `handle` (its frame posted, or the channel failed),
        sets its value or error; the caller holds `completing`."""
        if self.error is None:
            try:
                handle.value = self._receive(handle, deadline)
            except PipelinePeerError as exc:
                self.error = exc
            except Exception as exc:  # a frame that does not decode: the ends are out of step
                self.error = PipelinePeerError(
                    f"rank {self.p2p.rank}: a message from rank {self.src} on channel {self.kind!r} did not "
                    f"decode ({type(exc).__name__}: {exc}); do both ends run the same schedule?"
                )
        handle.error = self.error
        with self.state:
            self.open -= 1
            if self.inline is handle:
                self.inline = None
        handle.done = True
        if handle.event is not None:
            handle.event.set()

    def _post(self, handle: RecvHandle, layout: _Layout) -> tuple:
        p = self.p2p
        handle.what = f"a message ({layout.frame if layout.packed else layout.payload} B) from rank {self.src}"
        if layout.packed:
            buffers = [torch.empty(layout.frame, dtype=torch.uint8, device=p.device)]
        else:
            control = torch.empty(1, dtype=torch.int64, device=p.device)
            buffers = [control, *(torch.empty(s.shape, dtype=s.dtype, device=p.device) for s in layout.specs)]
        return layout, buffers, [dist.irecv(b, self.src, group=p.group, tag=self.tag) for b in buffers if b.numel()]

    def _receive(self, handle: RecvHandle, deadline: float | None):
        p, stats = self.p2p, self.stats
        while True:
            layout, buffers, works = handle.posted
            for work in works:
                p._wait(work, deadline, self.src, self.kind, handle.what)
            head = buffers[0][-_CONTROL:] if layout.packed else buffers[0]
            if head.is_cpu:  # the control word's bytes, without tensor ops
                k = int.from_bytes(head.numpy().tobytes(), sys.byteorder, signed=True)
            else:
                k = int(head.view(torch.int64).item())
            p._count(stats, layout, data=k == 0)
            if k == 0:
                break
            handle.what = f"a signature of {k} B from rank {self.src}"
            sig = torch.empty(k, dtype=torch.uint8, device=p.device)
            p._wait(dist.irecv(sig, self.src, group=p.group, tag=self.tag), deadline, self.src, self.kind, handle.what)
            skeleton, specs = pickle.loads(sig.cpu().numpy().tobytes())
            with self.state:
                self.layout = _Layout(skeleton, specs)
            stats.meta += k
            stats.signatures += 1
            handle.posted = self._post(handle, self.layout)
        if layout.packed:
            frame = buffers[0]
            tensors = [frame[o : o + s.nbytes].view(s.dtype) for o, s in layout.views]
            tensors = [t if len(s.shape) == 1 else t.view(s.shape) for t, s in zip(tensors, layout.specs)]
        else:
            tensors = buffers[1:]
        for t, s in zip(tensors, layout.specs):
            if s.requires_grad:
                t.requires_grad_()
        handle.posted = None
        return tensors[0] if layout.single else _build(layout.skeleton, tensors)


class SendHandle:
    """An in-flight send; :meth:`wait` returns when the message has left.
    The sent tensors must not change until then (split frames send from them)."""

    def __init__(self, p2p: P2P, dst: int, kind: str, works: list, keep: list) -> None:
        self.p2p, self.dst, self.kind, self.works, self.keep = p2p, dst, kind, works, keep
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.p2p._check_usable()
        deadline = time.monotonic() + self.p2p.timeout
        for work in self.works:
            self.p2p._wait(work, deadline, self.dst, self.kind, f"rank {self.dst} to receive a message")
        self.done, self.works, self.keep = True, [], []

    def is_completed(self) -> bool:
        return self.done or all(w.is_completed() for w in self.works)


class RecvHandle:
    """A posted receive; :meth:`wait` returns the message."""

    def __init__(self, channel: _RecvChannel) -> None:
        self.channel = channel
        self.done = False
        self.event: threading.Event | None = None  # when the channel's thread may complete it
        self.what = f"the message before this one from rank {channel.src}"
        self.posted = None  # (layout, buffers, works) of the frame out for it
        self.value, self.error = None, None

    def is_completed(self) -> bool:
        return self.done

    def wait(self):
        c = self.channel
        p = c.p2p
        if not self.done:
            p._check_usable()
            # posted from the caller's thread: complete it here, unless the thread already is
            if c.inline is self and c.completing.acquire(blocking=False):
                try:
                    if not self.done:
                        c.complete(self, time.monotonic() + p.timeout)
                finally:
                    c.completing.release()
            elif not self.event.wait(p.timeout):
                p._failed = PipelineTimeout(
                    f"rank {p.rank} waiting for {self.what} on channel {c.kind!r}: "
                    f"nothing within {p.timeout:g} s. {_HINT_TIMEOUT}"
                )
                raise p._failed
        if self.error is not None:
            p._failed = self.error
            raise self.error
        return self.value


class P2P:
    """Sends and receives between pipeline stages over `group` (the world
    when None); ranks are global ranks. `device`: where received tensors are
    allocated and sent tensors travel from (default: the current CUDA device
    on NCCL, else the CPU). `timeout`: seconds a ``wait()`` may take."""

    def __init__(self, *, timeout: float = 300.0, device=None, group=None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("P2P needs torch.distributed initialized: call fastzero.init_distributed() first")
        if not timeout > 0:
            raise ValueError(f"P2P timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout, self.group = float(timeout), group
        self.rank = dist.get_rank()
        self.ranks = set(dist.get_process_group_ranks(group)) if group is not None else None
        self.nccl = dist.get_backend(group) == "nccl"
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self.nccl else torch.device("cpu")
        self.device = torch.device(device)
        self.stats: dict[tuple[str, int, str], ChannelBytes] = {}  # (direction, peer, kind) -> bytes
        self._send: dict[tuple[int, str], _SendChannel] = {}
        self._recv: dict[tuple[int, str], _RecvChannel] = {}
        self._zeros = torch.zeros(2 * _ALIGN, dtype=torch.uint8, device=self.device)  # frame padding
        self._tags: dict[int, str] = {}
        self._failed: PipelinePeerError | None = None

    # -- public -----------------------------------------------------------

    def isend(self, obj, dst: int, kind: str) -> SendHandle:
        """Sends `obj` to global rank `dst` on channel `kind`, without waiting."""
        self._check_usable()
        channel = self._send.get((dst, kind)) if type(dst) is int and type(kind) is str else None
        if channel is None:  # a new channel: its ends checked once
            self._check_peer(dst, kind, "dst")
            channel = self._send[(dst, kind)] = _SendChannel(self._tag(kind))
            self.stats[("send", dst, kind)] = channel.stats
        tensors: list[Tensor] = []
        skeleton = _flatten(obj, tensors, "obj")
        key, sig = _key(obj), None
        if key is None or key != channel.key:
            specs = [_Spec(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors]
            try:
                sig = pickle.dumps((skeleton, specs))
            except Exception:
                _check_picklable(obj, "obj")
                raise
        # the previous change's signature and data went out behind its handle's frame: waited before this one's
        works, keep = channel.followups
        channel.followups = ([], [])
        if sig is not None:
            channel.key = key
            if sig != channel.sig:
                return self._change(channel, dst, kind, sig, _Layout(skeleton, specs), tensors, works, keep)
        frame = self._frame(channel.layout, tensors, 0)
        works = works + [self._isend(b, dst, channel.tag) for b in frame if b.numel()]
        self._count(channel.stats, channel.layout, data=True)
        return SendHandle(self, dst, kind, works, keep + frame)

    def irecv(self, src: int, kind: str) -> RecvHandle:
        """Posts a receive from global rank `src` on channel `kind`."""
        self._check_usable()
        channel = self._recv.get((src, kind)) if type(src) is int and type(kind) is str else None
        if channel is None:
            self._check_peer(src, kind, "src")
            channel = self._recv[(src, kind)] = _RecvChannel(self, src, kind)
        handle = RecvHandle(channel)
        channel.post(handle)
        return handle

    def close(self) -> None:
        """Waits for the signature changes sent last on each channel (sent
        behind their messages' handles) and stops the receiving threads once
        the receives posted so far are in."""
        for channel in self._recv.values():
            channel.stop()
        self._recv = {}
        if self._failed is not None:  # the channels are out of step: nothing more to wait for
            return
        for (dst, kind), channel in self._send.items():
            works, keep = channel.followups
            SendHandle(self, dst, kind, works, keep).wait()
            channel.followups = ([], [])

    def totals(self, direction: str | None = None) -> ChannelBytes:
        """Bytes summed over channels (`direction` "send" or "recv", or both)."""
        out = ChannelBytes()
        for (d, _, _), c in self.stats.items():
            if direction in (None, d):
                out.messages += c.messages
                out.payload += c.payload
                out.meta += c.meta
                out.control += c.control
                out.signatures += c.signatures
        return out

    # -- internals ----------------------------------------------------------

    def _change(self, channel, dst, kind, sig: bytes, layout: _Layout, tensors, works, keep) -> SendHandle:
        """Sends a message whose signature changed: a frame in the layout the
        receiver holds announcing the signature, then the signature and the
        data in the new layout. The handle waits for the announcement only,
        which the receiver's posted receive takes; the rest waits for the
        receiver to complete that receive, so it is waited by the channel's
        next send (or close()), and the data goes from a copy."""
        stats = channel.stats
        announce = self._frame(channel.layout, None, len(sig))
        works = works + [self._isend(b, dst, channel.tag) for b in announce if b.numel()]
        self._count(stats, channel.layout, data=False)
        meta = torch.frombuffer(bytearray(sig), dtype=torch.uint8).to(self.device)
        frame = self._frame(layout, tensors, 0, copy=True)
        later = [self._isend(meta, dst, channel.tag), *(self._isend(b, dst, channel.tag) for b in frame if b.numel())]
        channel.followups = (later, [meta, *frame])
        stats.meta += len(sig)
        stats.signatures += 1
        self._count(stats, layout, data=True)
        channel.sig, channel.layout = sig, layout
        return SendHandle(self, dst, kind, works, keep + announce)

    def _frame(self, layout: _Layout, tensors: list[Tensor] | None, control: int, copy=False) -> list[Tensor]:
        """The buffers of one frame in `layout`; `tensors` None: an announcement
        whose payload bytes are not read. `copy`: never send from the tensors."""
        if layout.packed and tensors is not None:  # a data frame: the bytes and zero padding, one copy
            parts, end = [], 0
            for t, (o, s) in zip(tensors, layout.views):
                if o > end:
                    parts.append(self._zeros[: o - end])
                t = t.detach() if t.requires_grad else t
                t = t if t.dim() == 1 and t.is_contiguous() else t.reshape(-1)
                parts.append((t if t.device == self.device else t.to(self.device)).view(torch.uint8))
                end = o + s.nbytes
            parts.append(self._zeros[: layout.frame - end])  # the control word 0 included
            return [torch.cat(parts)]
        if layout.packed:
            frame = torch.empty(layout.frame, dtype=torch.uint8, device=self.device)
            frame[-_CONTROL:].view(torch.int64).fill_(control)
            return [frame]
        head = torch.full((1,), control, dtype=torch.int64, device=self.device)
        if tensors is None:
            return [head, *(torch.empty(s.nbytes, dtype=torch.uint8, device=self.device) for s in layout.specs)]
        return [head, *(t.detach().to(self.device, copy=copy).contiguous() for t in tensors)]

    def _tag(self, kind: str) -> int:
        tag = zlib.crc32(kind.encode()) & _TAG_BITS
        other = self._tags.setdefault(tag, kind)
        if other != kind:
            raise ValueError(f"p2p kinds {other!r} and {kind!r} map to the same tag {tag}: rename one")
        return tag

    def _isend(self, t: Tensor, dst: int, tag: int):
        return dist.isend(t, dst, group=self.group, tag=tag)

    @staticmethod
    def _count(stats: ChannelBytes, layout: _Layout, data: bool) -> None:
        stats.messages += 1
        stats.control += _CONTROL
        frame = layout.frame - _CONTROL if layout.packed else layout.payload
        if data:
            stats.payload += frame
        else:
            stats.meta += frame

    def _wait(self, work, deadline: float | None, peer: int, kind: str, what: str) -> None:
        """Waits for `work` until `deadline` (None: as long as the process
        group allows, in a receiving thread whose caller keeps the time)."""
        try:
            if self.nccl:  # NCCL's wait() only orders streams: poll for completion on the host
                while not work.is_completed():
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError
                    time.sleep(1e-4)
            elif deadline is None:
                work.wait()
            else:  # Gloo's p2p work reports completion only through wait(); past the deadline, a last look
                left = max(deadline - time.monotonic(), 1e-3)
                if not work.wait(datetime.timedelta(seconds=left)):
                    raise TimeoutError
        except Exception as exc:
            where = f"rank {self.rank} waiting for {what} on channel {kind!r}"
            if isinstance(exc, TimeoutError) or "timed out" in str(exc).lower():
                error = PipelineTimeout(f"{where}: nothing within {self.timeout:g} s. {_HINT_TIMEOUT}")
            else:
                error = PipelinePeerError(
                    f"{where}: the transport failed ({exc}). The peer stage probably raised or died: check its log."
                )
            self._failed = error
            raise error from (None if isinstance(exc, TimeoutError) else exc)

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise PipelinePeerError(f"this P2P failed earlier and its channels are out of step: {self._failed}")

    def _check_peer(self, peer, kind, name: str) -> None:
        if not isinstance(kind, str):
            raise TypeError(f"p2p kind must be a str channel name such as 'act' or 'grad', got {type(kind).__name__}")
        if not kind:
            raise ValueError("p2p kind must be a non-empty channel name such as 'act' or 'grad'")
        if isinstance(peer, bool) or not isinstance(peer, int):
            raise TypeError(f"p2p {name} must be a global rank (int), got {type(peer).__name__}")
        if peer == self.rank:
            raise ValueError(f"p2p {name}={peer} is this rank: a stage sends to and receives from other ranks only")
        world = dist.get_world_size()
        if not 0 <= peer < world or (self.ranks is not None and peer not in self.ranks):
            where = f"the group's ranks {sorted(self.ranks)}" if self.ranks is not None else f"0..{world - 1}"
            raise ValueError(f"p2p {name}={peer} is not a rank of {where}: pass a global rank in the group")
