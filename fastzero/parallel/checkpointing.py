"""Activation checkpointing, DeepSpeed's ``deepspeed.checkpointing`` API
(0.19), plus a selective policy and placement under a memory budget.

A checkpointed function runs twice: once in forward without keeping its
intermediate activations, and once more (the recompute) just before its
backward. The recompute starts from the generator states the forward
started from (CPU, CUDA when in use, and the tracker's named states,
:mod:`fastzero.parallel.rng`), so dropout replays exactly and the gradients
equal an un-checkpointed run's bit for bit.

What is kept of the function's tensor inputs until the recompute
(:func:`configure`, or the config's ``activation_checkpointing`` section):

- ``partition_activations``: rank r of the tensor group keeps the r-th of
  tp equal pieces of every floating-point input (flattened, zero-padded to a
  multiple of tp) and the pieces are all-gathered just before the recompute;
- ``contiguous_checkpointing`` (with partitioning): the pieces are copied
  into one preallocated buffer of ``num_checkpoints`` slots per input
  position, so that many layers' pieces do not fragment the allocator;
  dropped at the next backward (DeepSpeed's lifetime; :func:`reset` drops it
  after forwards without backward);
- ``checkpoint_in_cpu``: inputs (or their pieces) are held in CPU memory,
  pinned when CUDA is present, and copied back to their device on a side
  stream one checkpoint ahead of the recompute that needs them. Inputs
  already on the CPU stay where they are;
- ``synchronize``: the device is synchronized at each checkpoint's forward
  and recompute boundaries (nothing to do on the CPU);
- ``profile``: forward, recompute, gather and copy times are summed,
  :func:`timings`.

Beyond DeepSpeed: ``checkpoint(fn, *args, policy="selective")`` (or
``policy=SelectivePolicy(max_kept_ratio=...)``) keeps the op outputs whose
recompute costs the most FLOPs per byte, up to a byte limit relative to the
block's inputs, and recomputes the rest (:mod:`fastzero.parallel.selective`);
a list of aten ops or a ``torch.utils.checkpoint`` policy function keeps
what it names (torch's selective-checkpoint contexts); and :func:`apply`
places checkpoints under a byte budget on a model's blocks
(:mod:`fastzero.parallel.placement`).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils import checkpoint as _torch_cp
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from fastzero.parallel.groups import group_rank, group_size, tensor_group
from fastzero.parallel.rng import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from fastzero.parallel.selective import Miss, Record, Replay, SelectivePolicy, block_key

__all__ = [
    "SavedBytes",
    "SelectivePolicy",
    "apply",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "reset",
    "selective_checkpoint",
    "settings",
    "timings",
]


@dataclass(frozen=True)
class Settings:
    """What :func:`checkpoint` does with the inputs it keeps (module docstring)."""

    mpu: Any = None  # None: the current topology's tensor group, else the whole world
    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: int | None = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False


_settings = Settings()
_configured = False


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """DeepSpeed's ``configure``: starts from the defaults, then the
    ``activation_checkpointing`` section of `deepspeed_config` (a path, a
    dict or a :class:`fastzero.config.Config`), then each argument that is
    not None. `mpu_` gives the tensor group for partitioning (None: the
    current topology's, else the whole world)."""
    global _settings, _configured
    from fastzero.config import load_section  # the config layer sits below this one

    new = Settings(mpu=mpu_)
    if deepspeed_config is not None:
        sec = load_section(deepspeed_config, "activation_checkpointing")
        new = replace(
            new,
            partition_activations=sec.partition_activations,
            contiguous_checkpointing=sec.contiguous_memory_optimization,
            num_checkpoints=sec.number_checkpoints,
            checkpoint_in_cpu=sec.cpu_checkpointing,
            synchronize=sec.synchronize_checkpoint_boundary,
            profile=sec.profile,
        )
    given = dict(
        partition_activations=partition_activations,
        contiguous_checkpointing=contiguous_checkpointing,
        num_checkpoints=num_checkpoints,
        checkpoint_in_cpu=checkpoint_in_cpu,
        synchronize=synchronize,
        profile=profile,
    )
    for name, value in given.items():
        if value is None:
            continue
        if name == "num_checkpoints":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"num_checkpoints = {value!r}: must be an integer >= 1 (the number of layers)")
        elif not isinstance(value, bool):
            raise TypeError(f"{name} = {value!r}: must be True or False")
        new = replace(new, **{name: value})
    if new.contiguous_checkpointing and not new.partition_activations:
        raise ValueError(
            "contiguous_checkpointing copies the partitioned activations into one buffer: it needs "
            "partition_activations=True (activation_checkpointing.partition_activations in the config)"
        )
    if new.contiguous_checkpointing and new.num_checkpoints is None:
        raise ValueError(
            "contiguous_checkpointing needs num_checkpoints (activation_checkpointing.number_checkpoints): the "
            "number of checkpoints per forward, the buffer's slots"
        )
    _settings, _configured = new, True
    _CONTIGUOUS.release()


def is_configured() -> bool:
    """Whether :func:`configure` was called (DeepSpeed's)."""
    return _configured


def settings() -> Settings:
    """The settings :func:`checkpoint` uses now."""
    return _settings


def reset() -> None:
    """DeepSpeed's ``reset``: drops the contiguous buffers, for forwards run
    without a backward (evaluation) that would otherwise fill them."""
    _CONTIGUOUS.release()


def _unconfigure() -> None:
    """Back to the defaults, not configured (tests)."""
    global _settings, _configured
    _settings, _configured = Settings(), False
    _CONTIGUOUS.release()
    _TIMES.clear()


# -- timings and boundaries -------------------------------------------------------------------------------

_TIMES: dict[str, float] = defaultdict(float)


def timings() -> dict[str, float]:
    """Seconds spent in each phase since the last call (``profile``): forward,
    recompute, gather (partitioned inputs), to_device (CPU-held inputs)."""
    out = dict(_TIMES)
    _TIMES.clear()
    return out


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@contextlib.contextmanager
def _phase(name: str) -> Iterator[None]:
    s = _settings
    if s.synchronize and _cuda_in_use():
        torch.cuda.synchronize()
    start = time.perf_counter() if s.profile else 0.0
    try:
        yield
    finally:
        if s.synchronize and _cuda_in_use():
            torch.cuda.synchronize()
        if s.profile:
            if _cuda_in_use():
                torch.cuda.synchronize()  # device work is asynchronous: time it, not its launch
            _TIMES[name] += time.perf_counter() - start


# -- the generator states a recompute replays ---------------------------------------------------------------


@dataclass
class _RNGSnapshot:
    cpu: Tensor
    cuda: Tensor | None
    tracker: dict[str, Tensor]

    @classmethod
    def take(cls) -> _RNGSnapshot:
        cuda = torch.cuda.get_rng_state() if _cuda_in_use() else None
        return cls(torch.get_rng_state(), cuda, get_cuda_rng_tracker().get_states())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        get_cuda_rng_tracker().set_states(self.tracker)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Runs the block from these states and gives the current ones back after."""
        now = _RNGSnapshot.take()
        self.restore()
        try:
            yield
        finally:
            now.restore()


# -- what is kept of an input: partitioned, in a contiguous buffer, on the CPU ----------------------------------


class _ContiguousBuffers:
    """One preallocated buffer of ``num_checkpoints`` slots per (input
    position, piece size, dtype, device); each checkpoint's piece takes the
    next slot. Dropped at the next backward: the pieces saved stay alive
    through their own references until their recompute."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, Tensor] = {}
        self.used: dict[tuple, int] = {}

    def place(self, position: int, piece: Tensor, slots: int, device: torch.device) -> Tensor:
        """`piece` copied into the next slot of its buffer on `device` (queued on the current stream)."""
        key = (position, piece.numel(), piece.dtype, device)
        if key not in self.buffers:
            pin = device.type == "cpu" and torch.cuda.is_available()
            self.buffers[key] = torch.empty((slots, piece.numel()), dtype=piece.dtype, device=device, pin_memory=pin)
            self.used[key] = 0
        slot = self.used[key]
        if slot >= slots:
            raise RuntimeError(
                f"more than num_checkpoints={slots} checkpoints kept since the last backward: raise num_checkpoints "
                "(activation_checkpointing.number_checkpoints), or call fastzero.checkpointing.reset() after "
                "forwards that have no backward"
            )
        self.used[key] = slot + 1
        # .data: a version counter of its own, so that writing the next slot does not mark this saved one as
        # modified in place (views of one buffer share the buffer's counter)
        out = self.buffers[key][slot].data
        out.copy_(piece, non_blocking=True)
        return out

    def release(self) -> None:
        self.buffers, self.used = {}, {}


_CONTIGUOUS = _ContiguousBuffers()


def _keep_this(t: Tensor, tp: int) -> bool:
    """DeepSpeed's rule for the inputs it partitions or moves: floating point, at least one element per rank."""
    return t.is_floating_point() and t.numel() >= tp


def _to_cpu(t: Tensor) -> Tensor:
    if t.device.type == "cpu":
        return t  # already in CPU memory
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


class _Kept:
    """One kept input: the tensor that is saved (`saved`, the whole input,
    its piece or a CPU copy) and how to rebuild the input from it."""

    def __init__(self, saved: Tensor, *, shape=None, numel=0, group=None, tp=1, device=None, dtype=None) -> None:
        self.saved = saved
        self.shape, self.numel, self.group, self.tp = shape, numel, group, tp
        self.device, self.dtype = device, dtype
        self.ahead: tuple[Tensor, Any] | None = None  # (the device copy, its event), launched by prefetch()

    def prefetch(self, saved: Tensor) -> None:
        """Launches the copy back to the device on a side stream (CUDA only)."""
        if self.device is None or self.device.type != "cuda" or saved.device.type != "cpu" or self.ahead:
            return
        stream = _side_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the copy to the CPU was queued there
        with torch.cuda.stream(stream):
            out = saved.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self.ahead = (out, event)

    def rebuild(self, saved: Tensor) -> Tensor:
        if self.device is None:
            return saved
        if self.ahead is not None:
            out, event = self.ahead
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            out.record_stream(current)  # made on the side stream, used on this one
            self.ahead = None
        else:
            with _phase("to_device"):
                out = saved.to(self.device, non_blocking=True)
        if self.group is False:  # moved to the CPU only
            return out
        if self.tp == 1:  # a whole input in a buffer slot: copied out, as a slot's alignment can change results
            return out[: self.numel].clone().view(self.shape)
        with _phase("gather"):
            full = torch.empty(out.numel() * self.tp, dtype=out.dtype, device=out.device)
            dist.all_gather(list(full.chunk(self.tp)), out, group=self.group)
        return full[: self.numel].view(self.shape)


_STREAMS: dict[Any, Any] = {}


def _side_stream(device: torch.device):
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def _keep(t: Tensor, position: int, s: Settings) -> _Kept:
    """What to keep of input `t` under settings `s`."""
    tp = 1
    group = None
    if s.partition_activations:
        group = tensor_group(mpu=s.mpu)
        tp = group_size(group)
    if not (s.partition_activations or s.checkpoint_in_cpu) or not _keep_this(t, tp):
        return _Kept(t)
    if not s.partition_activations or (tp == 1 and not s.contiguous_checkpointing):  # nothing to split
        return _Kept(_to_cpu(t.detach()), group=False, device=t.device) if s.checkpoint_in_cpu else _Kept(t)
    flat = t.detach().reshape(-1)
    chunk = -(-flat.numel() // tp)
    rank = group_rank(group)
    lo, hi = min(rank * chunk, flat.numel()), min((rank + 1) * chunk, flat.numel())
    piece = flat[lo:hi].clone() if hi - lo == chunk else torch.cat([flat[lo:hi], flat.new_zeros(chunk - (hi - lo))])
    if s.contiguous_checkpointing:  # the buffer lives where the piece is kept: the CPU with checkpoint_in_cpu
        where = torch.device("cpu") if s.checkpoint_in_cpu else piece.device
        piece = _CONTIGUOUS.place(position, piece, s.num_checkpoints, where)
    elif s.checkpoint_in_cpu:
        piece = _to_cpu(piece)
    return _Kept(piece, shape=t.shape, numel=t.numel(), group=group, tp=tp, device=t.device, dtype=t.dtype)


# CPU-held inputs in forward order, so a recompute can start the copy of the one before it (weak: evaluation
# forwards without backward must not keep them)
_CPU_ORDER: list[weakref.ref] = []


class _KeptGroup:
    """The kept inputs of one checkpoint call."""

    def __init__(self, kept: list[_Kept]) -> None:
        self.kept = kept
        self.saved: tuple[Tensor, ...] = ()

    def prefetch(self) -> None:
        for k, t in zip(self.kept, self.saved):
            k.prefetch(t)


def _register_cpu(group: _KeptGroup) -> None:
    if any(k.device is not None and k.device.type == "cuda" for k in group.kept):
        _CPU_ORDER[:] = [r for r in _CPU_ORDER if r() is not None]  # forwards without backward leave dead ones
        _CPU_ORDER.append(weakref.ref(group))


def _prefetch_before(group: _KeptGroup) -> None:
    """Starts bringing back the CPU-held inputs of the checkpoint run before
    `group` in forward: the next recompute of a backward."""
    while _CPU_ORDER and (_CPU_ORDER[-1]() is None or _CPU_ORDER[-1]() is group):
        _CPU_ORDER.pop()
    if _CPU_ORDER:
        previous = _CPU_ORDER[-1]()
        if previous is not None:
            previous.prefetch()


# -- DeepSpeed's checkpoint: a reentrant autograd function ---------------------------------------------------------


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    kinds = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds]


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function: Callable, policy: SelectivePolicy | None, anchor: Tensor, *args: Any) -> Any:
        ctx.run_function = run_function
        ctx.set_materialize_grads(False)  # an output the loss leaves out gets no grad: its params' stay None
        ctx.rng = _RNGSnapshot.take()
        ctx.autocast = _autocast_state()
        s = _settings
        meter = _METER
        keeps = policy is not None and policy.max_kept_ratio > 0
        key = block_key(run_function, args, policy) if keeps else None
        record = Record(meter.count if meter is not None else None, key) if keeps else None
        with _phase("forward"), torch.no_grad(), record or contextlib.nullcontext():
            outputs = run_function(*args)
        ctx.kept = None
        ctx.skip_unread = keeps and policy.skip_unread
        if record is not None:  # the limit is relative to the inputs, which the checkpoint keeps anyway
            inputs = sum(a.numel() * a.element_size() for a in args if torch.is_tensor(a))
            ctx.kept = record.choose(policy.max_kept_ratio * inputs, outputs)
            if meter is not None and meter.tag is not None:
                meter.kept_flops[meter.tag] += ctx.kept.flops
        ctx.positions, tensors, kept = [], [], []
        for i, a in enumerate(args):
            if torch.is_tensor(a):
                k = _keep(a, len(kept), s)
                ctx.positions.append((i, a.requires_grad))
                tensors.append(k.saved)
                kept.append(k)
        ctx.args = [None if torch.is_tensor(a) else a for a in args]
        ctx.group = _KeptGroup(kept)
        ctx.save_for_backward(*tensors)
        _register_cpu(ctx.group)
        single = torch.is_tensor(outputs)
        ctx.single = single
        outs = (outputs,) if single else tuple(outputs)
        ctx.mark_non_differentiable(*[o for o in outs if torch.is_tensor(o) and not o.is_floating_point()])
        return outputs if single else outs

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "checkpoint() (reentrant, as DeepSpeed's) works with .backward() only, not torch.autograd.grad(): use "
                "non_reentrant_checkpoint for autograd.grad"
            )
        _CONTIGUOUS.release()  # DeepSpeed's: the next forward fills fresh buffers
        saved = ctx.saved_tensors
        group = ctx.group
        group.saved = saved
        _prefetch_before(group)
        args = list(ctx.args)
        for (i, needs_grad), k, t in zip(ctx.positions, group.kept, saved):
            args[i] = k.rebuild(t).detach().requires_grad_(needs_grad)
        replay = Replay(ctx.kept, learn=ctx.skip_unread, use_plan=ctx.skip_unread) if ctx.kept is not None else None
        try:
            outputs = _recompute(ctx, args, replay)
        except Exception as e:
            # the recompute left its plan or masks (Miss), or failed on a stand-in's NaN: again, plainly (the
            # generator replays); a plain recompute's own error is the user's
            if replay is None or not (isinstance(e, Miss) or replay.planned):
                raise
            replay = replay.fallback()
            outputs = _recompute(ctx, args, replay)
        ctx.kept = None  # kept outputs the recompute did not take back go now
        outs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        pairs = [(o, g) for o, g in zip(outs, grads) if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        inputs = [args[i].grad if needs else None for i, needs in ctx.positions]
        out: list[Any] = [None] * len(args)
        for (i, _), g in zip(ctx.positions, inputs):
            out[i] = g
        return (None, None, None, *out)


def _recompute(ctx, args: list, replay: Replay | None) -> Any:
    """Runs the block again under its forward's generator and autocast states (and the selective policy's
    `replay`, which a planned run can leave by raising :class:`Miss` at any op, or after the last)."""
    with _phase("recompute"), ctx.rng.replay(), contextlib.ExitStack() as stack:
        for kind, enabled, dtype in ctx.autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
        if replay is not None:
            stack.enter_context(replay)
        with torch.enable_grad():
            outputs = ctx.run_function(*args)
    if replay is not None:
        replay.finish(outputs)
    return outputs


# A leaf that requires grad, passed to every reentrant checkpoint: without one, a call whose inputs need no grad
# (the first layer, fed data) would return outputs that need none, and its params would silently get no grads.
def _anchor() -> Tensor:
    return torch.empty(0, requires_grad=True)


def checkpoint(function: Callable, *args: Any, policy: Any = None) -> Any:
    """DeepSpeed's ``checkpoint(function, *args)``: runs `function` without
    keeping its activations and recomputes it before its backward (once per
    call in each direction), with the RNG replayed and the configured
    treatment of its inputs. ``policy="selective"`` or a
    :class:`SelectivePolicy` keeps the op outputs that cost the most to
    recompute per byte, up to its limit (:mod:`fastzero.parallel.selective`);
    a list of aten ops to keep, or a ``torch.utils.checkpoint`` policy
    function, goes through :func:`selective_checkpoint`."""
    if policy is not None and policy != "full":
        return selective_checkpoint(function, *args, policy=policy)
    if not torch.is_grad_enabled():
        return function(*args)  # nothing will be saved: nothing to recompute
    return _CheckpointFunction.apply(function, None, _anchor(), *args)


def _cost_ranked(policy: Any) -> SelectivePolicy | None:
    if isinstance(policy, SelectivePolicy):
        return policy
    return SelectivePolicy() if isinstance(policy, str) and policy == "selective" else None


# -- the non-reentrant forms: torch.utils.checkpoint with fastzero's RNG, inputs and policies ---------------------

_aten = torch.ops.aten
# Every matmul and attention output: ``policy=SELECTIVE_SAVE`` keeps them all (the most memory of the selective
# choices; "selective" keeps the best of them under a limit).
SELECTIVE_SAVE = tuple(
    getattr(_aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if hasattr(_aten, name)
)


def _policy_fn(policy: Any) -> Callable:
    if isinstance(policy, (list, tuple, set)):
        ops = set(policy)
        for op in ops:
            if not isinstance(op, torch._ops.OpOverload):
                raise TypeError(f"policy op {op!r}: give aten overloads such as torch.ops.aten.mm.default")
    elif callable(policy):
        return policy
    else:
        raise ValueError(
            f"policy = {policy!r}: use None or 'full' (recompute everything), 'selective' or a SelectivePolicy (keep "
            "the outputs that cost the most to recompute per byte, up to a limit), a list of aten ops to keep, or a "
            "torch.utils.checkpoint policy function"
        )

    def keep_listed(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return keep_listed


@contextlib.contextmanager
def _entered(*managers) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for m in managers:
            stack.enter_context(m)
        yield


def _context_fn(policy: Any) -> Callable:
    """torch.utils.checkpoint's context_fn: the tracker's states replayed in
    the recompute, and the selective policy's caching modes."""

    def make():
        snapshot: dict[str, dict] = {}

        @contextlib.contextmanager
        def forward_ctx():
            snapshot["states"] = get_cuda_rng_tracker().get_states()
            yield

        @contextlib.contextmanager
        def recompute_ctx():
            tracker = get_cuda_rng_tracker()
            now = tracker.get_states()
            tracker.set_states(snapshot["states"])
            try:
                yield
            finally:
                tracker.set_states(now)

        if policy is None:
            return forward_ctx(), recompute_ctx()
        fn = _policy_fn(policy)
        meter = _METER
        held: list[Any] = []  # the meter's handles of the cached outputs (each storage once, as every count)
        if meter is not None:
            inner = fn

            def fn(ctx, op, *args, **kwargs):  # noqa: F811 - counts what the policy keeps
                decision = inner(ctx, op, *args, **kwargs)
                keep = decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE, True)
                if keep and not ctx.is_recompute:
                    outs = ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else (ctx.op_output,)
                    held.extend(meter.count(t) for t in outs if torch.is_tensor(t))
                return decision

            @contextlib.contextmanager
            def recompute_and_release(base=recompute_ctx):
                with base():
                    yield
                held.clear()  # the cached outputs are consumed by the recompute

            recompute_ctx = recompute_and_release
        fwd_mode, rec_mode = create_selective_checkpoint_contexts(fn)
        return _entered(forward_ctx(), fwd_mode), _entered(recompute_ctx(), rec_mode)

    return make


def _input_hooks():
    """Saved-tensor hooks that partition / move the inputs torch.utils.checkpoint keeps, per the settings."""
    s = _settings
    if not (s.partition_activations or s.checkpoint_in_cpu):
        return contextlib.nullcontext()
    position = [0]
    meter = _METER

    def pack(t: Tensor):
        k = _keep(t, position[0], s)
        position[0] += 1
        return k, k.saved, meter.count(k.saved) if meter is not None else None

    def unpack(packed):
        k, saved, _ = packed
        return k.rebuild(saved)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _run_torch_checkpoint(function: Callable, args: tuple, kwargs: dict, policy: Any) -> Any:
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    with _phase("forward"), _input_hooks():
        return _torch_checkpoint(
            function, *args, use_reentrant=False, context_fn=_context_fn(policy), preserve_rng_state=True, **kwargs
        )


def non_reentrant_checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's ``non_reentrant_checkpoint``: :func:`checkpoint` built on
    saved-tensor hooks (``torch.utils.checkpoint(use_reentrant=False)``):
    works with ``torch.autograd.grad``, keyword arguments and inputs that
    need no grad; same RNG replay and input treatment."""
    return _run_torch_checkpoint(function, args, kwargs, None)


def selective_checkpoint(function: Callable, *args: Any, policy: Any = "selective", **kwargs: Any) -> Any:
    """Checkpoints `function` keeping the outputs of the ops the policy
    picks and recomputing the others. ``"selective"`` or a
    :class:`SelectivePolicy`: the outputs that cost the most to recompute
    per byte, up to its limit, on the reentrant :func:`checkpoint`
    (keyword arguments are passed to it positionally, so keyword tensors
    get their grads; ``torch.autograd.grad`` is not supported, as for
    :func:`checkpoint`). A list of aten overloads keeps those; a function
    is ``torch.utils.checkpoint``'s policy function: both on
    ``torch.utils.checkpoint`` (non-reentrant)."""
    ranked = _cost_ranked(policy)
    if ranked is None:
        _policy_fn(policy)  # a bad policy raises here, before any work
        return _run_torch_checkpoint(function, args, kwargs, policy)
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    names, n = list(kwargs), len(args)

    def positional(*all_args: Any) -> Any:
        return function(*all_args[:n], **dict(zip(names, all_args[n:])))

    return _CheckpointFunction.apply(positional if names else function, ranked, _anchor(), *args, *kwargs.values())


def apply(model: Any, budget_bytes: int, **kwargs: Any) -> Any:
    """Checkpoints the fewest blocks of `model` that keep its saved
    activations under `budget_bytes`: :func:`fastzero.parallel.placement.apply`."""
    from fastzero.parallel.placement import apply as _apply  # placement builds on this module

    return _apply(model, budget_bytes, **kwargs)


# -- measuring saved activations -----------------------------------------------------------------------------------

_METER: SavedBytes | None = None


def _storage_key(t: Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


class SavedBytes:
    """Counts the bytes of tensors autograd keeps for backward while it is
    active (saved-tensor hooks), each storage once, leaving out `exclude`
    (the model's params): ``live`` now, ``peak`` the most at any time, and
    per ``tag`` (set with :meth:`tagged`) the bytes first saved under it.
    Tensors kept by a checkpoint (its inputs, pieces, CPU copies, the
    selective policy's kept outputs) are counted where they are kept, and
    so is what a recompute saves, when the backward runs inside the block:
    fastzero's reentrant recompute saves through these hooks, and the
    tensors ``torch.utils.checkpoint`` (non-reentrant) recomputes are counted
    from its recompute until autograd takes them back (its recompute hook is
    wrapped while the meter is active). ``peak`` over a forward and backward
    is thus the peak of saved activations, recompute transients included.

        with SavedBytes(model.parameters()) as m:
            loss = model(x).sum()
            loss.backward()
        m.peak, m.after_forward
    """

    def __init__(self, exclude: Any = ()) -> None:
        self.exclude = {_storage_key(p)[0] for p in exclude}
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self.by_tag: dict[str, int] = defaultdict(int)
        self.kept_flops: dict[str, int] = defaultdict(int)  # per tag: recompute FLOPs the selective policy saves
        self.tag: str | None = None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedBytes:
        global _METER
        self._previous = _METER, _torch_cp._recomputation_hook
        _METER = self
        _torch_cp._recomputation_hook = _metered_recomputation_hook(self)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        global _METER
        self._hooks.__exit__(*exc)
        _METER, _torch_cp._recomputation_hook = self._previous

    @contextlib.contextmanager
    def tagged(self, tag: str) -> Iterator[None]:
        previous, self.tag = self.tag, tag
        try:
            yield
        finally:
            self.tag = previous

    def count(self, t: Tensor) -> Any:
        """Counts `t` until the returned handle is dropped."""
        ptr, nbytes = _storage_key(t)
        if ptr in self.exclude or nbytes == 0:
            return None
        if self.refs.get(ptr, 0) == 0:
            self.sizes[ptr] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            if self.tag is not None:
                self.by_tag[self.tag] += nbytes
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        return _Handle(self, ptr)

    def _drop(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            self.live -= self.sizes.pop(ptr)

    def _pack(self, t: Tensor):
        return t, self.count(t)

    @staticmethod
    def _unpack(packed):
        return packed[0]


def _metered_recomputation_hook(meter: SavedBytes) -> type:
    """torch.utils.checkpoint's recompute hook, also counting what it saves:
    each tensor stays counted while torch holds it (until the handle that
    keys it in the frame goes, when autograd unpacks it)."""
    base = _torch_cp._recomputation_hook

    class Metered(base):
        def __init__(self, target_frame_ref: Any, gid: Any) -> None:
            super().__init__(target_frame_ref, gid)
            inner = self.pack_hook

            def pack_hook(x: Tensor) -> Any:
                frame = target_frame_ref()
                index = frame.recomp_counter[gid] if frame is not None else None
                try:
                    return inner(x)  # the last one of an early-stopped recompute raises after storing x
                finally:
                    stored = index is not None and index < len(frame.weak_holders)
                    holder = frame.weak_holders[index]() if stored else None
                    key = holder.handles.get(gid) if holder is not None else None
                    if key is not None:
                        key.fastzero_meter = meter.count(x)  # dropped with the key

            self.pack_hook = pack_hook

    return Metered


class _Handle:
    """Held beside a counted tensor; its storage stops counting when the last handle goes."""

    def __init__(self, meter: SavedBytes, ptr: int) -> None:
        weakref.finalize(self, meter._drop, ptr)
