"""Pipeline schedules as data: per-rank lists of instructions, built without a
model or a process group, run by one interpreter in the engine.

A schedule for ``stages`` = p ranks, ``micro_batches`` = m and
``virtual_stages`` = v cuts the model into p*v global parts; rank s holds the
parts s, s+p, s+2p, ... (Megatron's interleaving) as its local chunks 0..v-1,
so (stage s, chunk c) is global part ``s + c*p``.

Instruction semantics (what the engine implements):

* ``LoadMicroBatch(mb, c)``: on global part 0 loads the inputs, on the last
  global part the labels (a rank that is both loads both).
* ``ForwardPass(mb, c)``: runs chunk c on its input (received or loaded); on
  the last global part it includes the loss.
* ``BackwardPass(mb, c)``: the whole backward of chunk c. ``BackwardInput``
  computes only the grad of chunk c's input; ``BackwardWeight`` the deferred
  weight grads of the same micro-batch.
* ``SendActivation(mb, c)`` sends chunk c's output to the next global part;
  ``RecvActivation(mb, c)`` receives chunk c's input from the previous one.
  ``SendGrad(mb, c)`` sends the grad of chunk c's input to the previous part;
  ``RecvGrad(mb, c)`` receives the grad of chunk c's output.
* ``ReduceTiedGrads``, ``ReduceGrads``, ``OptimizerStep``: once, at the end of
  a training batch, in that order.

Sends are asynchronous and receives block until the matching send was issued;
every schedule here is deadlock-free under that rule (``simulate`` checks it).

``buffer_id`` is a slot in a ring of ``num_pipe_buffers()`` slots on the rank:
the (micro-batch, chunk) takes its slot at its first instruction and frees it
after its last (the send of its input grad, or its weight-grad half). 1F1B uses
DeepSpeed's slots (``mb % max(2, min(p - s, m))``); the other schedules use the
fewest ring slots that never hand a live slot to another micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


class PipeInstruction:
    """Base of every instruction; ``name`` is the class name, as in DeepSpeed."""

    @property
    def name(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class _StepInstruction(PipeInstruction):
    """An instruction that acts once per batch (no micro-batch)."""

    def __repr__(self) -> str:
        return f"{self.name}()"


@dataclass(frozen=True)
class ReduceTiedGrads(_StepInstruction):
    """Sum the grads of tied weights across the stages that hold them."""


@dataclass(frozen=True)
class ReduceGrads(_StepInstruction):
    """Reduce the grads across the data-parallel ranks of this stage."""


@dataclass(frozen=True)
class OptimizerStep(_StepInstruction):
    """Step the optimizer and zero the grads."""


@dataclass(frozen=True)
class BufferOpInstruction(PipeInstruction):
    """An instruction on one micro-batch of one local chunk, in one buffer slot."""

    micro_batch: int
    chunk: int = 0
    buffer_id: int = field(kw_only=True)

    _tag = "?"

    def __post_init__(self) -> None:
        for key in ("micro_batch", "chunk", "buffer_id"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{self.name}: {key} must be an int >= 0, got {value!r}")

    def __repr__(self) -> str:
        # e.g. F3.1@0: forward of micro-batch 3, chunk 1, buffer 0
        return f"{self._tag}{self.micro_batch}.{self.chunk}@{self.buffer_id}"


class LoadMicroBatch(BufferOpInstruction):
    _tag = "L"


class ForwardPass(BufferOpInstruction):
    _tag = "F"


class BackwardPass(BufferOpInstruction):
    _tag = "B"


class BackwardInput(BufferOpInstruction):
    _tag = "BI"


class BackwardWeight(BufferOpInstruction):
    _tag = "W"


class SendActivation(BufferOpInstruction):
    _tag = "SA"


class RecvActivation(BufferOpInstruction):
    _tag = "RA"


class SendGrad(BufferOpInstruction):
    _tag = "SG"


class RecvGrad(BufferOpInstruction):
    _tag = "RG"


# The subclasses add no fields; make each a frozen dataclass of its own so
# equality compares the class too (F1.0 != B1.0).
for _cls in (
    LoadMicroBatch,
    ForwardPass,
    BackwardPass,
    BackwardInput,
    BackwardWeight,
    SendActivation,
    RecvActivation,
    SendGrad,
    RecvGrad,
):
    dataclass(frozen=True, repr=False)(_cls)

STEP_END = (ReduceTiedGrads, ReduceGrads, OptimizerStep)


def _check_ints(**sizes: int) -> None:
    for key, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{key} must be an int, got {type(value).__name__} {value!r}")


class PipeSchedule:
    """Instructions for one stage (rank) of a pipeline, DeepSpeed's form:
    ``steps()`` yields lists of instructions; ``instructions()`` is them flat."""

    virtual_stages = 1
    train = True

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        _check_ints(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        if stages < 1:
            raise ValueError(f"stages must be >= 1, got {stages}")
        if not 0 <= stage_id < stages:
            raise ValueError(f"stage_id must be in 0..{stages - 1} for stages={stages}, got {stage_id}")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def steps(self) -> Iterator[list[PipeInstruction]]:
        raise NotImplementedError

    def instructions(self) -> list[PipeInstruction]:
        return [ins for step in self.steps() for ins in step]

    def num_pipe_buffers(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return self.steps()

    def __repr__(self) -> str:
        v = f", virtual_stages={self.virtual_stages}" if self.virtual_stages > 1 else ""
        name = type(self).__name__
        return f"{name}(micro_batches={self.micro_batches}, stages={self.stages}, stage_id={self.stage_id}{v})"


class TrainSchedule(PipeSchedule):
    """1F1B, step for step DeepSpeed's ``TrainSchedule``
    (deepspeed/runtime/pipe/schedule.py): 2(m + p - 1) steps; stage s runs a
    forward on the steps t with t = s (mod 2), of micro-batch (t - s)/2, and a
    backward on the others, of micro-batch (t + s + 1)/2 - p. The activation of
    a forward is sent, and the input grad of a backward is sent, at the start
    of the step after it. Peak in-flight forwards on stage s: min(m, p - s).
    """

    def steps(self) -> Iterator[list[PipeInstruction]]:
        m, p, s = self.micro_batches, self.stages, self.stage_id
        has_prev, has_next = s > 0, s < p - 1
        total = 2 * (m + p - 1)
        prev = -1
        for t in range(total):
            forward = (t - s) % 2 == 0
            mb = (t - s) // 2 if forward else (t + s + 1) // 2 - p
            cur_ok, prev_ok = 0 <= mb < m, 0 <= prev < m
            cmds: list[PipeInstruction] = []
            if forward:
                if prev_ok and has_prev:
                    cmds.append(SendGrad(prev, buffer_id=self._buffer(prev)))
                if cur_ok and has_prev:
                    cmds.append(RecvActivation(mb, buffer_id=self._buffer(mb)))
            else:
                if cur_ok and has_next:
                    cmds.append(RecvGrad(mb, buffer_id=self._buffer(mb)))
                if prev_ok and has_next:
                    cmds.append(SendActivation(prev, buffer_id=self._buffer(prev)))
            if forward and cur_ok and (s == 0 or s == p - 1):
                cmds.append(LoadMicroBatch(mb, buffer_id=self._buffer(mb)))
            if cur_ok:
                cls = ForwardPass if forward else BackwardPass
                cmds.append(cls(mb, buffer_id=self._buffer(mb)))
            if t == total - 1:
                cmds.extend(step() for step in STEP_END)
            prev = mb
            yield cmds

    def num_pipe_buffers(self) -> int:
        # DeepSpeed's count, kept so the buffer ids are its own: the in-flight
        # forwards, at least 2 (one would do on the last stage).
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def _buffer(self, mb: int) -> int:
        return mb % self.num_pipe_buffers()


class _OrderedSchedule(PipeSchedule):
    """A schedule given as each rank's order of compute ops
    (kind, micro-batch, chunk), kind in F / B / BI / W; the receives go just
    before and the sends just after the op that needs or makes the data, one
    step per compute op."""

    def _order(self) -> list[tuple[str, int, int]]:
        raise NotImplementedError

    def _build(self) -> list[list[PipeInstruction]]:
        if getattr(self, "_built", None) is not None:
            return self._built
        p, s, v = self.stages, self.stage_id, self.virtual_stages
        last = p * v - 1
        steps: list[list[tuple[type, int, int]]] = []
        for kind, mb, c in self._order():
            part = s + c * p
            cmds: list[tuple[type, int, int]] = []
            if kind == "F":
                if part > 0:
                    cmds.append((RecvActivation, mb, c))
                if part == 0 or part == last:
                    cmds.append((LoadMicroBatch, mb, c))
                cmds.append((ForwardPass, mb, c))
                if part < last:
                    cmds.append((SendActivation, mb, c))
            elif kind in ("B", "BI"):
                if part < last:
                    cmds.append((RecvGrad, mb, c))
                cmds.append((BackwardPass if kind == "B" else BackwardInput, mb, c))
                if part > 0:
                    cmds.append((SendGrad, mb, c))
            else:
                cmds.append((BackwardWeight, mb, c))
            steps.append(cmds)
        slots = _ring_slots([(mb, c) for step in steps for _, mb, c in step])
        self._num_buffers = max(slots.values(), default=0) + 1
        built: list[list[PipeInstruction]] = [
            [cls(mb, c, buffer_id=slots[(mb, c)]) for cls, mb, c in step] for step in steps
        ]
        if self.train:
            built[-1].extend(step() for step in STEP_END)
        self._built = built
        return built

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step in self._build():
            yield list(step)

    def num_pipe_buffers(self) -> int:
        self._build()
        return self._num_buffers


def _ring_slots(uses: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """Slots in the smallest ring that never reuses a live slot: keys get
    k % n in order of first use, live from their first use to their last."""
    first: dict[tuple[int, int], int] = {}
    lastuse: dict[tuple[int, int], int] = {}
    for i, key in enumerate(uses):
        first.setdefault(key, i)
        lastuse[key] = i
    keys = sorted(first, key=first.__getitem__)
    for n in range(1, len(keys) + 1):
        # a ring of n fits if each key's slot is freed before the key n later takes it
        if all(lastuse[keys[k]] < first[keys[k + n]] for k in range(len(keys) - n)):
            return {key: k % n for k, key in enumerate(keys)}
    return {}


def _interleaved_order(m: int, p: int, s: int, v: int, train: bool) -> list[tuple[str, int, int]]:
    """Megatron's interleaved 1F1B (megatron/core/pipeline_parallel/schedules.py,
    forward_backward_pipelining_with_interleaving): virtual micro-batch k runs
    chunk (k // p) % v forward (v - 1 - that backward) of micro-batch
    (k // (p v)) p + k % p; stage s runs min(mv, 2(p - s - 1) + (v - 1)p)
    warm-up forwards, then one forward and one backward in turn. (Megatron
    makes every forward warm-up when m == p; under asynchronous sends the
    formula needs no such exception: the simulator finds no deadlock.)"""
    total = m * v

    def mb_of(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def fwd(k: int) -> tuple[str, int, int]:
        return ("F", mb_of(k), (k // p) % v)

    def bwd(k: int) -> tuple[str, int, int]:
        return ("B", mb_of(k), v - 1 - (k // p) % v)

    if not train:
        return [fwd(k) for k in range(total)]
    warmup = min(total, 2 * (p - s - 1) + (v - 1) * p)
    order = [fwd(k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [fwd(warmup + i), bwd(i)]
    order += [bwd(k) for k in range(total - warmup, total)]
    return order


def interleaved_in_flight_bound(micro_batches: int, stages: int, stage_id: int, virtual_stages: int) -> int:
    """Megatron's bound on stage s's in-flight chunk forwards: its warm-up
    forwards plus one, at most m*v. Each holds a chunk's activations, about
    1/v of a 1F1B stage's."""
    m, p, s, v = micro_batches, stages, stage_id, virtual_stages
    return min(m * v, 2 * (p - s - 1) + (v - 1) * p + 1)


def _check_interleaving(micro_batches: int, stages: int, virtual_stages: int) -> None:
    _check_ints(virtual_stages=virtual_stages)
    if virtual_stages < 2:
        raise ValueError(
            f"interleaved needs virtual_stages >= 2, got {virtual_stages}; with one chunk per rank use '1f1b'"
        )
    if stages < 2:
        raise ValueError(f"interleaved needs stages >= 2, got {stages}; on one stage use '1f1b'")
    if micro_batches % stages:
        raise ValueError(
            f"interleaved needs micro_batches to be a multiple of stages (Megatron's constraint), got "
            f"micro_batches={micro_batches}, stages={stages}; use a multiple of {stages}, or '1f1b' / 'zb-h1'"
        )


class InterleavedSchedule(_OrderedSchedule):
    """Megatron's interleaved 1F1B: each rank holds ``virtual_stages`` chunks.
    Needs v >= 2, p >= 2 and m % p == 0. Bubble (F=1, B=2 per stage, each
    chunk 1/v of that): (p - 1)/v of the 1F1B bubble's (p - 1) per rank."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, virtual_stages: int) -> None:
        super().__init__(micro_batches, stages, stage_id)
        _check_interleaving(micro_batches, stages, virtual_stages)
        self.virtual_stages = virtual_stages

    def _order(self) -> list[tuple[str, int, int]]:
        return _interleaved_order(self.micro_batches, self.stages, self.stage_id, self.virtual_stages, True)


def _zb_h1_order(m: int, p: int, s: int) -> list[tuple[str, int, int]]:
    """ZB-H1 ("Zero Bubble Pipeline Parallelism", Qi et al. 2023, sec. 3.1):
    1F1B with the backward split in two. Stage s runs min(m, p - s) warm-up
    forwards, then for k = 0, 1, ...: BI(k), W(k - s), the next forward; the
    last s weight halves close the batch. The input grads travel back one
    BI-time per stage instead of a whole backward's, and the deferred W's fill
    what 1F1B leaves idle: with F = BI = W and m >= p the idle time per rank is
    (p - 1)(F + BI - W), against 1F1B's (p - 1)(F + BI + W). Forwards awaiting
    their BI stay <= p - s as in 1F1B, and those awaiting their W <= p (1F1B's
    peak, on stage 0)."""
    warmup = min(m, p - s)
    order = [("F", k, 0) for k in range(warmup)]
    for k in range(m):
        order.append(("BI", k, 0))
        if k >= s:
            order.append(("W", k - s, 0))
        if warmup + k < m:
            order.append(("F", warmup + k, 0))
    order += [("W", k, 0) for k in range(max(0, m - s), m)]
    return order


class ZeroBubbleH1Schedule(_OrderedSchedule):
    """ZB-H1: 1F1B with the backward split into ``BackwardInput`` (its grad sent
    on at once) and ``BackwardWeight``, which stage s defers by s micro-batches
    into what would be bubble. Peak in-flight forwards (awaiting their BI)
    min(m, p - s), as in 1F1B; awaiting their W, at most min(m, p)."""

    def _order(self) -> list[tuple[str, int, int]]:
        return _zb_h1_order(self.micro_batches, self.stages, self.stage_id)


class InferenceSchedule(PipeSchedule):
    """Forward only (eval_batch). With one chunk per rank, DeepSpeed's
    ``InferenceSchedule`` step for step: m + p - 1 steps, stage s forwards
    micro-batch t - s at step t and sends it at step t + 1, in two alternating
    buffers. With ``virtual_stages`` > 1 (m % p == 0), Megatron's interleaved
    forward order, one step per forward."""

    train = False

    def __init__(self, micro_batches: int, stages: int, stage_id: int, virtual_stages: int = 1) -> None:
        super().__init__(micro_batches, stages, stage_id)
        _check_ints(virtual_stages=virtual_stages)
        if virtual_stages < 1:
            raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
        if virtual_stages > 1:
            _check_interleaving(micro_batches, stages, virtual_stages)
            self._interleaved = _InterleavedInference(micro_batches, stages, stage_id, virtual_stages)
        self.virtual_stages = virtual_stages

    def steps(self) -> Iterator[list[PipeInstruction]]:
        if self.virtual_stages > 1:
            yield from self._interleaved.steps()
            return
        m, p, s = self.micro_batches, self.stages, self.stage_id
        for t in range(m + p - 1):
            mb = t - s
            cmds: list[PipeInstruction] = []
            if (s == 0 or s == p - 1) and 0 <= mb < m:
                cmds.append(LoadMicroBatch(mb, buffer_id=mb % 2))
            send = [SendActivation(mb - 1, buffer_id=(mb - 1) % 2)] if s < p - 1 and 0 <= mb - 1 < m else []
            recv = [RecvActivation(mb, buffer_id=mb % 2)] if s > 0 and 0 <= mb < m else []
            # DeepSpeed's order: even stages send first, odd stages receive first
            cmds += send + recv if s % 2 == 0 else recv + send
            if 0 <= mb < m:
                cmds.append(ForwardPass(mb, buffer_id=mb % 2))
            yield cmds

    def num_pipe_buffers(self) -> int:
        return self._interleaved.num_pipe_buffers() if self.virtual_stages > 1 else 2


class _InterleavedInference(_OrderedSchedule):
    train = False

    def __init__(self, micro_batches: int, stages: int, stage_id: int, virtual_stages: int) -> None:
        super().__init__(micro_batches, stages, stage_id)
        self.virtual_stages = virtual_stages

    def _order(self) -> list[tuple[str, int, int]]:
        return _interleaved_order(self.micro_batches, self.stages, self.stage_id, self.virtual_stages, False)


SCHEDULES = {"1f1b": TrainSchedule, "interleaved": InterleavedSchedule, "zb-h1": ZeroBubbleH1Schedule}


def make_schedule(
    name: str, micro_batches: int, stages: int, stage_id: int, virtual_stages: int = 1, train: bool = True
) -> PipeSchedule:
    """The schedule ``name`` ("1f1b", "interleaved", "zb-h1") for one stage; with
    ``train=False`` the forward-only ``InferenceSchedule`` (interleaved when
    ``virtual_stages`` > 1), whatever the name."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    _check_ints(virtual_stages=virtual_stages)
    if name != "interleaved" and virtual_stages != 1:
        raise ValueError(
            f"schedule {name!r} runs one chunk per rank, got virtual_stages={virtual_stages}; "
            "use 'interleaved' or virtual_stages=1"
        )
    if not train:
        return InferenceSchedule(micro_batches, stages, stage_id, virtual_stages)
    if name == "interleaved":
        return InterleavedSchedule(micro_batches, stages, stage_id, virtual_stages)
    return SCHEDULES[name](micro_batches, stages, stage_id)


__all__ = [
    "PipeInstruction",
    "BufferOpInstruction",
    "LoadMicroBatch",
    "ForwardPass",
    "BackwardPass",
    "BackwardInput",
    "BackwardWeight",
    "SendActivation",
    "RecvActivation",
    "SendGrad",
    "RecvGrad",
    "ReduceTiedGrads",
    "ReduceGrads",
    "OptimizerStep",
    "PipeSchedule",
    "TrainSchedule",
    "InterleavedSchedule",
    "ZeroBubbleH1Schedule",
    "InferenceSchedule",
    "SCHEDULES",
    "make_schedule",
    "interleaved_in_flight_bound",
]
