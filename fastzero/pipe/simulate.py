"""Run every rank's instruction list with unit costs, no model: checks a
schedule (order of each micro-batch's ops, sends matching receives,
deadlocks, buffer slots) and measures it (makespan, idle time, bubble, peak
in-flight activations). The engine reports the theoretical bubble from it and
``default_schedule`` picks the fastest schedule that fits the memory.

Execution model, the engine's: each rank runs its list in order; a send never
blocks (it is an isend); a receive waits until the matching send was issued,
plus the comm cost. Per (src, dst, activation|grad) channel, receives must
take the sends in the order they were issued.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from .schedule import (
    STEP_END,
    BackwardInput,
    BackwardPass,
    BackwardWeight,
    BufferOpInstruction,
    ForwardPass,
    LoadMicroBatch,
    PipeInstruction,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    make_schedule,
)

# Time of each op for one micro-batch on a whole stage (all its chunks); a
# chunk's op takes 1/v of it. B = BI + W; "comm" is a send's latency to its receive.
DEFAULT_COSTS = {"F": 1, "B": 2, "BI": 1, "W": 1, "comm": 0}

_COMPUTE = {ForwardPass: "F", BackwardPass: "B", BackwardInput: "BI", BackwardWeight: "W"}


class ScheduleError(ValueError):
    """An invalid schedule: its message names the rank, instruction and rule."""


@dataclass
class SimResult:
    """``timeline[s]``: (start, end, instruction) for every instruction of rank s
    in execution order; ``idle[s]`` = makespan - busy[s]; ``bubble_fraction``:
    idle time over all ranks / (p * makespan). ``peak_in_flight[s]``: most
    chunk forwards on rank s whose backward (B or BI) had not run;
    ``peak_held[s]``: the same until the last backward half (B or W)."""

    timeline: list[list[tuple[Fraction, Fraction, PipeInstruction]]]
    makespan: Fraction
    busy: list[Fraction]
    idle: list[Fraction]
    bubble_fraction: Fraction
    peak_in_flight: list[int]
    peak_held: list[int]


def _as_lists(schedules: Sequence) -> tuple[list[list[PipeInstruction]], int | None, int | None]:
    lists, m, v = [], None, None
    for s, sched in enumerate(schedules):
        if isinstance(sched, PipeSchedule):
            if sched.stages != len(schedules) or sched.stage_id != s:
                raise ScheduleError(
                    f"schedule {s} is for stage {sched.stage_id} of {sched.stages}; pass one schedule per stage, "
                    f"in stage order ({len(schedules)} given)"
                )
            if m is not None and (sched.micro_batches, sched.virtual_stages) != (m, v):
                raise ScheduleError(f"stage {s}'s schedule has other micro_batches / virtual_stages than stage 0's")
            m, v = sched.micro_batches, sched.virtual_stages
            lists.append(sched.instructions())
        else:
            lists.append(list(sched))
    return lists, m, v


def simulate(
    schedules: Sequence[PipeSchedule | Sequence[PipeInstruction]],
    costs: Mapping[str, float] | None = None,
    micro_batches: int | None = None,
    virtual_stages: int | None = None,
) -> SimResult:
    """Execute one schedule (or instruction list) per stage, in stage order.
    ``costs`` overrides ``DEFAULT_COSTS`` (keys F, B, BI, W, comm). For plain
    lists, m and v default to 1 + the largest micro-batch / chunk seen.
    Raises ``ScheduleError`` on a deadlock or an invalid schedule."""
    lists, m, v = _as_lists(schedules)
    p = len(lists)
    if p == 0:
        raise ScheduleError("no schedules given: pass one per pipeline stage")
    ops = [ins for lst in lists for ins in lst if isinstance(ins, BufferOpInstruction)]
    m = micro_batches or m or 1 + max((i.micro_batch for i in ops), default=-1)
    v = virtual_stages or v or 1 + max((i.chunk for i in ops), default=0)
    cost = dict(DEFAULT_COSTS)
    for key, value in (costs or {}).items():
        if key not in DEFAULT_COSTS:
            raise ValueError(f"unknown cost {key!r}; the keys are {sorted(DEFAULT_COSTS)}")
        if value < 0:
            raise ValueError(f"cost {key!r} must be >= 0, got {value}")
        cost[key] = value
    chunk_cost = {k: Fraction(cost[k]) / v for k in ("F", "B", "BI", "W")}
    comm = Fraction(cost["comm"])
    train = any(isinstance(i, (BackwardPass, BackwardInput, BackwardWeight)) for i in ops)
    last_part = p * v - 1

    # Buffer slots: a (micro-batch, chunk) holds its slot from its first to its last instruction.
    first_last = []
    for s, lst in enumerate(lists):
        span: dict[tuple[int, int], list[int]] = {}
        slot_of: dict[tuple[int, int], int] = {}
        for i, ins in enumerate(lst):
            if not isinstance(ins, BufferOpInstruction):
                continue
            if not (0 <= ins.micro_batch < m and 0 <= ins.chunk < v):
                raise ScheduleError(f"stage {s}: {ins!r} is outside micro-batches 0..{m - 1} / chunks 0..{v - 1}")
            key = (ins.micro_batch, ins.chunk)
            span.setdefault(key, [i, i])[1] = i
            if slot_of.setdefault(key, ins.buffer_id) != ins.buffer_id:
                raise ScheduleError(f"stage {s}: micro-batch {key} uses buffers {slot_of[key]} and {ins.buffer_id}")
        first_last.append(span)
        _check_step_end(s, lst, train)

    channels: dict[tuple[int, int, str], deque] = {}
    clock = [Fraction(0)] * p
    busy = [Fraction(0)] * p
    pc = [0] * p
    done: list[set] = [set() for _ in range(p)]
    timeline: list[list] = [[] for _ in range(p)]
    slots: list[dict[int, tuple[int, int]]] = [{} for _ in range(p)]
    in_flight, held = [0] * p, [0] * p
    peak_in_flight, peak_held = [0] * p, [0] * p

    def peer(s: int, c: int, step: int) -> tuple[int, int]:
        part = s + c * p + step
        return part % p, part // p

    def run(s: int) -> bool:
        """Advance rank s as far as it can go; False if it made no progress."""
        moved = False
        while pc[s] < len(lists[s]):
            ins = lists[s][pc[s]]
            start = clock[s]
            if isinstance(ins, BufferOpInstruction):
                mb, c = ins.micro_batch, ins.chunk
                part = s + c * p
                kind = type(ins)
                if (kind, mb, c) in done[s]:
                    raise ScheduleError(f"stage {s}: {ins!r} appears twice")
                if kind in (RecvActivation, RecvGrad):
                    if kind is RecvActivation and part == 0:
                        raise ScheduleError(f"stage {s}: {ins!r} on the first global part, which has no sender")
                    if kind is RecvGrad and part == last_part:
                        raise ScheduleError(f"stage {s}: {ins!r} on the last global part, which has no sender")
                    src, _ = peer(s, c, -1 if kind is RecvActivation else 1)
                    queue = channels.get((src, s, kind.__name__[4:]))
                    if not queue:
                        return moved
                    got_mb, got_c, sent = queue.popleft()
                    if (got_mb, got_c) != (mb, c):
                        raise ScheduleError(
                            f"stage {s}: {ins!r} expects micro-batch {mb} chunk {c} but the next "
                            f"{kind.__name__[4:]} from stage {src} is micro-batch {got_mb} chunk {got_c}: "
                            "sends and receives are out of order on that channel"
                        )
                    clock[s] = start = max(start, sent + comm)
                elif kind is LoadMicroBatch:
                    if part not in (0, last_part):
                        raise ScheduleError(f"stage {s}: {ins!r} on a middle global part ({part}) loads nothing")
                elif kind is ForwardPass:
                    if part > 0 and (RecvActivation, mb, c) not in done[s]:
                        raise ScheduleError(f"stage {s}: {ins!r} before its RecvActivation")
                    if part in (0, last_part) and (LoadMicroBatch, mb, c) not in done[s]:
                        raise ScheduleError(f"stage {s}: {ins!r} before its LoadMicroBatch")
                elif kind in (BackwardPass, BackwardInput):
                    if (ForwardPass, mb, c) not in done[s]:
                        raise ScheduleError(f"stage {s}: {ins!r}, a backward before its forward")
                    other = BackwardInput if kind is BackwardPass else BackwardPass
                    if (other, mb, c) in done[s]:
                        raise ScheduleError(f"stage {s}: {ins!r} after a {other.__name__} of the same micro-batch")
                    if part < last_part and (RecvGrad, mb, c) not in done[s]:
                        raise ScheduleError(f"stage {s}: {ins!r} before its RecvGrad")
                elif kind is BackwardWeight:
                    if (BackwardInput, mb, c) not in done[s]:
                        raise ScheduleError(f"stage {s}: {ins!r} before its BackwardInput")
                elif kind is SendActivation:
                    if part == last_part:
                        raise ScheduleError(f"stage {s}: {ins!r} on the last global part, which has no receiver")
                    if (ForwardPass, mb, c) not in done[s]:
                        raise ScheduleError(f"stage {s}: {ins!r} before its ForwardPass")
                elif kind is SendGrad:
                    if part == 0:
                        raise ScheduleError(f"stage {s}: {ins!r} on the first global part, which has no receiver")
                    if not {(BackwardPass, mb, c), (BackwardInput, mb, c)} & done[s]:
                        raise ScheduleError(f"stage {s}: {ins!r} before its backward")
                if kind in (SendActivation, SendGrad):
                    dst, dst_c = peer(s, c, 1 if kind is SendActivation else -1)
                    channels.setdefault((s, dst, kind.__name__[4:]), deque()).append((mb, dst_c, start))
                # buffer slot: taken at the first instruction, freed after the last
                key = (mb, c)
                first, last = first_last[s][key]
                holder = slots[s].get(ins.buffer_id)
                if holder is not None and holder != key:
                    raise ScheduleError(
                        f"stage {s}: {ins!r} takes buffer {ins.buffer_id} while micro-batch {holder[0]} "
                        f"chunk {holder[1]} still holds it"
                    )
                slots[s][ins.buffer_id] = key
                if pc[s] == last:
                    del slots[s][ins.buffer_id]
                op = _COMPUTE.get(kind)
                if op is not None:
                    clock[s] += chunk_cost[op]
                    busy[s] += chunk_cost[op]
                    in_flight[s] += {"F": 1, "B": -1, "BI": -1, "W": 0}[op]
                    held[s] += {"F": 1, "B": -1, "BI": 0, "W": -1}[op]
                    peak_in_flight[s] = max(peak_in_flight[s], in_flight[s])
                    peak_held[s] = max(peak_held[s], held[s])
                done[s].add((kind, mb, c))
            timeline[s].append((start, clock[s], ins))
            pc[s] += 1
            moved = True
        return moved

    while not all(pc[s] == len(lists[s]) for s in range(p)):
        if not any([run(s) for s in range(p)]):
            raise ScheduleError(_deadlock(lists, pc, p, v))
    for (src, dst, kind), queue in channels.items():
        if queue:
            mb, c, _ = queue[0]
            raise ScheduleError(
                f"stage {src} sent {kind} of micro-batch {mb} to stage {dst} (chunk {c}) and no receive took it"
            )
    for s in range(p):
        for c in range(v):
            for mb in range(m):
                need = [ForwardPass]
                if train:
                    need.append(BackwardPass if (BackwardPass, mb, c) in done[s] else BackwardInput)
                    if need[-1] is BackwardInput:
                        need.append(BackwardWeight)
                for kind in need:
                    if (kind, mb, c) not in done[s]:
                        raise ScheduleError(f"stage {s}: micro-batch {mb} chunk {c} has no {kind.__name__}")
    makespan = max(clock)
    idle = [makespan - b for b in busy]
    bubble = sum(idle, Fraction(0)) / (p * makespan) if makespan else Fraction(0)
    return SimResult(timeline, makespan, busy, idle, bubble, peak_in_flight, peak_held)


def _check_step_end(s: int, lst: list[PipeInstruction], train: bool) -> None:
    ends = [i for i in lst if isinstance(i, STEP_END)]
    if not ends:
        return
    if not train:
        raise ScheduleError(f"stage {s}: a forward-only schedule has {ends[0]!r}")
    if [type(i) for i in lst[-len(STEP_END) :]] != list(STEP_END) or len(ends) != len(STEP_END):
        raise ScheduleError(
            f"stage {s}: ReduceTiedGrads, ReduceGrads, OptimizerStep must end the batch, once each, in that order"
        )


def _deadlock(lists: list[list[PipeInstruction]], pc: list[int], p: int, v: int) -> str:
    waits = []
    for s in range(p):
        if pc[s] == len(lists[s]):
            continue
        ins = lists[s][pc[s]]
        part = s + ins.chunk * p
        src = (part - 1) % p if isinstance(ins, RecvActivation) else (part + 1) % p
        if pc[src] == len(lists[src]):
            return f"stage {s}: {ins!r} has no matching send: stage {src} finished without sending it"
        waits.append(f"stage {s} waits at {ins!r} for stage {src} (at {lists[src][pc[src]]!r})")
    return "deadlock: " + "; ".join(waits)


def timeline_table(result: SimResult) -> str:
    """One row per stage, one column per time unit (the gcd of the compute
    times): each compute op as its tag (F3 = forward of micro-batch 3, B, BI, W;
    ``.c`` the chunk when v > 1), an op spanning n units repeated n times, idle
    as ``.``."""
    spans = [(a, b, i) for row in result.timeline for a, b, i in row if b > a]
    unit = Fraction(0)
    for a, b, _ in spans:
        for x in (a, b - a):
            unit = Fraction(
                math.gcd(unit.numerator * x.denominator, x.numerator * unit.denominator),
                unit.denominator * x.denominator,
            )
    width = int(result.makespan / unit) if unit else 0
    chunked = any(i.chunk for _, _, i in spans)
    lines = []
    for s, row in enumerate(result.timeline):
        cells = ["."] * width
        for a, b, ins in row:
            tag = repr(ins).split("@")[0]
            tag = tag if chunked else tag.split(".")[0]
            for k in range(int(a / unit), int(b / unit)):
                cells[k] = tag
        lines.append(f"stage {s}: " + " ".join(f"{c:<5}" for c in cells).rstrip())
    return "\n".join(lines)


def simulate_schedule(
    name: str,
    micro_batches: int,
    stages: int,
    virtual_stages: int = 1,
    train: bool = True,
    costs: Mapping[str, float] | None = None,
) -> SimResult:
    """``simulate`` of the named schedule on all its stages."""
    return simulate(
        [make_schedule(name, micro_batches, stages, s, virtual_stages, train) for s in range(stages)], costs
    )


def default_schedule(
    micro_batches: int, stages: int, virtual_stages: int = 1, memory_limit_in_flight: float | None = None
) -> str:
    """The fastest schedule (least simulated makespan, ``DEFAULT_COSTS``) whose
    peak held activations (``peak_held``) fit ``memory_limit_in_flight``,
    counted in one micro-batch's activations for a whole stage (a chunk's
    count 1/v). Tries
    "1f1b", "zb-h1", and "interleaved" when virtual_stages >= 2 and valid; ties
    go to the earlier. "1f1b" and "zb-h1" run one chunk per rank."""
    names = ["1f1b", "zb-h1"]
    if virtual_stages >= 2:
        names.append("interleaved")
    best, needed = None, None
    for name in names:
        v = virtual_stages if name == "interleaved" else 1
        try:
            result = simulate_schedule(name, micro_batches, stages, v)
        except ValueError:
            if name == "interleaved":
                continue  # (m, p, v) it cannot run; the others can
            raise
        # activations held until the last backward half: ZB's W still needs its inputs
        memory = Fraction(max(result.peak_held), v)
        needed = memory if needed is None else min(needed, memory)
        if memory_limit_in_flight is not None and memory > memory_limit_in_flight:
            continue
        if best is None or result.makespan < best[0]:
            best = (result.makespan, name)
    if best is None:
        raise ValueError(
            f"no pipeline schedule fits memory_limit_in_flight={memory_limit_in_flight} micro-batches of "
            f"activations per stage; the least any needs is {float(needed):g}: raise the limit, or use more "
            "virtual_stages with 'interleaved' or fewer stages"
        )
    return best[1]


__all__ = [
    "DEFAULT_COSTS",
    "ScheduleError",
    "SimResult",
    "simulate",
    "simulate_schedule",
    "timeline_table",
    "default_schedule",
]
