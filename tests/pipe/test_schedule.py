"""Schedules as data (issue 16): every schedule, for p = 1..8 stages, m = 1..16
micro-batches and v = 1..3 chunks where valid, checked by scans of its
instruction lists written here (order, counts, channels, in-flight) and by
the simulator (deadlock, timing, bubble); 1F1B and inference against
DeepSpeed's own step lists; the simulator shown to catch each kind of broken
schedule; bad inputs raising."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from fractions import Fraction

import pytest

from fastzero.pipe.schedule import (
    BackwardInput,
    BackwardPass,
    BackwardWeight,
    BufferOpInstruction,
    ForwardPass,
    InferenceSchedule,
    InterleavedSchedule,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
    ZeroBubbleH1Schedule,
    interleaved_in_flight_bound,
    make_schedule,
)
from fastzero.pipe.simulate import (
    ScheduleError,
    default_schedule,
    simulate,
    simulate_schedule,
    timeline_table,
)

# DeepSpeed's step lists, printed from deepspeed/runtime/pipe/schedule.py
# (TrainSchedule / InferenceSchedule, deepspeedai/DeepSpeed master, Dec 2026) run
# with these (m, p, stage): instruction and buffer_id, steps split by "|".
DS_TRAIN = {
    (4, 3, 0): "L0 F0 | SA0 | L1 F1 | SA1 | L2 F2 | RG0 SA2 B0 | L0 F0 | RG1 SA0 B1 |  | RG2 B2 |  | RG0 B0 RT RD OS",
    (4, 3, 1): " | RA0 F0 | SA0 | RA1 F1 | RG0 SA1 B0 | SG0 RA0 F0 | RG1 SA0 B1 | SG1 RA1 F1 | RG0 SA1 B0 | SG0 "
    "| RG1 B1 | SG1 RT RD OS",
    (4, 3, 2): " |  | RA0 L0 F0 | B0 | SG0 RA1 L1 F1 | B1 | SG1 RA0 L0 F0 | B0 | SG0 RA1 L1 F1 | B1 | SG1 | RT RD OS",
    (2, 4, 0): "L0 F0 | SA0 | L1 F1 | SA1 |  |  |  | RG0 B0 |  | RG1 B1 RT RD OS",
    (2, 4, 1): " | RA0 F0 | SA0 | RA1 F1 | SA1 |  | RG0 B0 | SG0 | RG1 B1 | SG1 RT RD OS",
    (2, 4, 2): " |  | RA0 F0 | SA0 | RA1 F1 | RG0 SA1 B0 | SG0 | RG1 B1 | SG1 | RT RD OS",
    (2, 4, 3): " |  |  | RA0 L0 F0 | B0 | SG0 RA1 L1 F1 | B1 | SG1 |  | RT RD OS",
    (5, 2, 0): "L0 F0 | SA0 | L1 F1 | RG0 SA1 B0 | L0 F0 | RG1 SA0 B1 | L1 F1 | RG0 SA1 B0 | L0 F0 | RG1 SA0 B1 "
    "|  | RG0 B0 RT RD OS",
    (5, 2, 1): " | RA0 L0 F0 | B0 | SG0 RA1 L1 F1 | B1 | SG1 RA0 L0 F0 | B0 | SG0 RA1 L1 F1 | B1 | SG1 RA0 L0 F0 "
    "| B0 | SG0 RT RD OS",
    (1, 1, 0): "L0 F0 | B0 RT RD OS",
}
DS_INFERENCE = {
    (3, 2, 0): "L0 F0 | L1 SA0 F1 | L0 SA1 F0 | SA0",
    (3, 2, 1): " | L0 RA0 F0 | L1 RA1 F1 | L0 RA0 F0",
    (2, 3, 0): "L0 F0 | L1 SA0 F1 | SA1 | ",
    (2, 3, 1): " | RA0 F0 | RA1 SA0 F1 | SA1",
    (2, 3, 2): " |  | L0 RA0 F0 | L1 RA1 F1",
}
ABBREV = {
    "LoadMicroBatch": "L",
    "ForwardPass": "F",
    "BackwardPass": "B",
    "SendActivation": "SA",
    "RecvActivation": "RA",
    "SendGrad": "SG",
    "RecvGrad": "RG",
    "ReduceTiedGrads": "RT",
    "ReduceGrads": "RD",
    "OptimizerStep": "OS",
}


def ds_form(schedule) -> str:
    return " | ".join(
        " ".join(ABBREV[ins.name] + (str(ins.buffer_id) if hasattr(ins, "buffer_id") else "") for ins in step)
        for step in schedule.steps()
    )


@pytest.mark.parametrize("key", sorted(DS_TRAIN))
def test_1f1b_is_deepspeeds_train_schedule(key):
    m, p, s = key
    sched = TrainSchedule(m, p, s)
    assert ds_form(sched) == DS_TRAIN[key]
    # DeepSpeed's ring: micro-batch mb in slot mb % num_pipe_buffers()
    assert sched.num_pipe_buffers() == max(2, min(p - s, m))
    for ins in sched.instructions():
        if isinstance(ins, BufferOpInstruction):
            assert ins.buffer_id == ins.micro_batch % sched.num_pipe_buffers()


@pytest.mark.parametrize("key", sorted(DS_INFERENCE))
def test_inference_is_deepspeeds_inference_schedule(key):
    m, p, s = key
    sched = InferenceSchedule(m, p, s)
    assert ds_form(sched) == DS_INFERENCE[key]
    assert sched.num_pipe_buffers() == 2


def test_1f1b_against_installed_deepspeed():
    ds = pytest.importorskip("deepspeed.runtime.pipe.schedule")

    def ds_steps(sched):
        return [[(type(i).__name__, getattr(i, "buffer_id", None)) for i in step] for step in sched.steps()]

    for p in range(1, 6):
        for m in range(1, 9):
            for s in range(p):
                assert ds_steps(TrainSchedule(m, p, s)) == ds_steps(ds.TrainSchedule(m, p, s)), (m, p, s)
                assert ds_steps(InferenceSchedule(m, p, s)) == ds_steps(ds.InferenceSchedule(m, p, s)), (m, p, s)


def cases(p: int) -> list[tuple[str, int, int, bool]]:
    """(name, m, v, train) for every valid combination with p stages."""
    out = []
    for m in range(1, 17):
        out += [("1f1b", m, 1, True), ("zb-h1", m, 1, True), ("1f1b", m, 1, False)]
        for v in (2, 3):
            if p >= 2 and m % p == 0:
                out += [("interleaved", m, v, True), ("interleaved", m, v, False)]
    return out


def check_lists(name, m, p, v, train, lists):
    """The rules of issue 16, checked on the lists themselves, not by the simulator."""
    last = p * v - 1
    sends, recvs = defaultdict(list), defaultdict(list)
    for s, lst in enumerate(lists):
        pos = {}
        for i, ins in enumerate(lst):
            if isinstance(ins, BufferOpInstruction):
                key = (type(ins), ins.micro_batch, ins.chunk)
                assert key not in pos, (s, ins)
                pos[key] = i
                part = s + ins.chunk * p
                if isinstance(ins, SendActivation):
                    sends[(s, (part + 1) % p, "act")].append((ins.micro_batch, (part + 1) // p))
                if isinstance(ins, SendGrad):
                    sends[(s, (part - 1) % p, "grad")].append((ins.micro_batch, (part - 1) // p))
                if isinstance(ins, RecvActivation):
                    recvs[((part - 1) % p, s, "act")].append((ins.micro_batch, ins.chunk))
                if isinstance(ins, RecvGrad):
                    recvs[((part + 1) % p, s, "grad")].append((ins.micro_batch, ins.chunk))
        counts = defaultdict(int)
        for cls, _, c in pos:
            counts[(cls, c)] += 1
        for c in range(v):
            part = s + c * p
            assert counts[(ForwardPass, c)] == m
            assert counts[(LoadMicroBatch, c)] == (m if part in (0, last) else 0)
            assert counts[(RecvActivation, c)] == (m if part > 0 else 0)
            assert counts[(SendActivation, c)] == (m if part < last else 0)
            if not train:
                assert not any(counts[(k, c)] for k in (BackwardPass, BackwardInput, BackwardWeight, RecvGrad))
                continue
            if name == "zb-h1":
                assert counts[(BackwardInput, c)] == counts[(BackwardWeight, c)] == m
                assert counts[(BackwardPass, c)] == 0
            else:
                assert counts[(BackwardPass, c)] == m
                assert counts[(BackwardInput, c)] == counts[(BackwardWeight, c)] == 0
            assert counts[(RecvGrad, c)] == (m if part < last else 0)
            assert counts[(SendGrad, c)] == (m if part > 0 else 0)
            for mb in range(m):
                f = pos[(ForwardPass, mb, c)]
                back = pos.get((BackwardPass, mb, c), pos.get((BackwardInput, mb, c)))
                assert f < back, (s, mb, c)
                if name == "zb-h1":
                    assert back < pos[(BackwardWeight, mb, c)]
                if part > 0:
                    assert pos[(RecvActivation, mb, c)] < f < back < pos[(SendGrad, mb, c)]
                if part < last:
                    assert f <= pos[(SendActivation, mb, c)]
                    assert pos[(RecvGrad, mb, c)] < back
        ends = [type(i) for i in lst if isinstance(i, (ReduceTiedGrads, ReduceGrads, OptimizerStep))]
        if train:
            assert ends == [ReduceTiedGrads, ReduceGrads, OptimizerStep]
            assert [type(i) for i in lst[-3:]] == ends
        else:
            assert ends == []
    # every channel's receives take its sends in the order sent
    assert set(sends) == set(recvs)
    for chan in sends:
        assert sends[chan] == recvs[chan], chan


def in_flight_peaks(lists):
    peaks = []
    for lst in lists:
        n = peak = 0
        for ins in lst:
            n += isinstance(ins, ForwardPass) - isinstance(ins, (BackwardPass, BackwardInput))
            peak = max(peak, n)
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("p", range(1, 9))
def test_every_schedule_on_the_grid(p):
    for name, m, v, train in cases(p):
        scheds = [make_schedule(name, m, p, s, v, train) for s in range(p)]
        for s, sched in enumerate(scheds):
            assert (sched.num_micro_batches, sched.stages, sched.stage_id, sched.virtual_stages) == (m, p, s, v)
            assert sched.instructions() == [i for step in sched.steps() for i in step]
            assert all(
                i.buffer_id < sched.num_pipe_buffers()
                for i in sched.instructions()
                if isinstance(i, BufferOpInstruction)
            )
        lists = [sched.instructions() for sched in scheds]
        check_lists(name, m, p, v, train, lists)
        result = simulate(scheds)  # no deadlock, buffers never shared while live
        peaks = in_flight_peaks(lists)
        assert result.peak_in_flight == peaks
        if not train:
            assert peaks == [m * v] * p
            assert result.bubble_fraction == Fraction(p - 1, v) / (m + Fraction(p - 1, v))
            continue
        if name == "interleaved":
            assert peaks == [interleaved_in_flight_bound(m, p, s, v) for s in range(p)]
            # Megatron's bubble: (p - 1)/v per rank, against 1F1B's p - 1
            assert result.bubble_fraction == Fraction(p - 1, v) / (m + Fraction(p - 1, v))
        else:
            assert peaks == [min(m, p - s) for s in range(p)], name
        if name == "1f1b":
            assert result.bubble_fraction == Fraction(p - 1, m + p - 1)
            assert result.makespan == 3 * (m + p - 1)
        one_f_one_b = Fraction(p - 1, m + p - 1)
        if name == "zb-h1":
            assert max(result.peak_held) <= min(m, p)
            if m >= p:
                # idle (p - 1)(F + BI - W) = p - 1 of 3m + p - 1 per rank
                assert result.bubble_fraction == Fraction(p - 1, 3 * m + p - 1)
            assert result.bubble_fraction <= one_f_one_b
        if p > 1 and m >= p and name != "1f1b":
            assert result.bubble_fraction < one_f_one_b


def test_simulated_timeline_of_1f1b():
    # p=2, m=2, F=1, B=2: stage 0 F0 F1 . . B0 . B1 ., stage 1 . F0 B0 . F1 B1
    result = simulate_schedule("1f1b", 2, 2)
    compute = [
        [(int(a), repr(i)) for a, b, i in row if isinstance(i, (ForwardPass, BackwardPass))] for row in result.timeline
    ]
    assert compute == [
        [(0, "F0.0@0"), (1, "F1.0@1"), (4, "B0.0@0"), (7, "B1.0@1")],
        [(1, "F0.0@0"), (2, "B0.0@0"), (4, "F1.0@1"), (5, "B1.0@1")],
    ]
    assert result.makespan == 9 and result.idle == [3, 3] and result.bubble_fraction == Fraction(1, 3)
    assert timeline_table(result).splitlines() == [
        "stage 0: F0    F1    .     .     B0    B0    .     B1    B1",
        "stage 1: .     F0    B0    B0    F1    B1    B1    .     .",
    ]
    half = simulate_schedule("interleaved", 2, 2, 2)  # chunks take 1/2: F = 1/2, B = 1
    assert timeline_table(half).splitlines()[0].startswith("stage 0: F0.0  F1.0  F0.1  F1.1  .     .     B0.1  B0.1")
    with_comm = simulate_schedule("1f1b", 2, 2, costs={"comm": 1})
    assert with_comm.makespan > result.makespan


def _replace(lst, i, **changes):
    lst = list(lst)
    lst[i] = dataclasses.replace(lst[i], **changes)
    return lst


def _lists(name, m, p, v=1):
    return [make_schedule(name, m, p, s, v).instructions() for s in range(p)]


def test_simulator_rejects_broken_schedules():
    base = _lists("1f1b", 2, 2)
    simulate(base)

    def idx(lst, cls, mb=0):
        return next(i for i, ins in enumerate(lst) if isinstance(ins, cls) and ins.micro_batch == mb)

    s0, s1 = base
    # a backward before its forward
    f, b = idx(s1, ForwardPass), idx(s1, BackwardPass)
    bad = list(s1)
    bad[f], bad[b] = bad[b], bad[f]
    with pytest.raises(ScheduleError, match="backward before its forward"):
        simulate([s0, bad])
    # a send nobody receives
    with pytest.raises(ScheduleError, match="no receive took it"):
        e0, e1 = (InferenceSchedule(2, 2, s).instructions() for s in range(2))
        simulate([e0, [i for i in e1 if i.micro_batch != 1]], micro_batches=2)
    # a receive nobody sends
    with pytest.raises(ScheduleError, match="no matching send"):
        simulate([[i for i in e0 if not (isinstance(i, SendActivation) and i.micro_batch == 1)], e1])
    # receives out of the channel's order
    r0, r1 = idx(s1, RecvActivation, 0), idx(s1, RecvActivation, 1)
    swapped = list(s1)
    swapped[r0], swapped[r1] = swapped[r1], swapped[r0]
    with pytest.raises(ScheduleError, match="out of order"):
        simulate([s0, swapped])
    # stage 0 waits for a grad before sending the activation that makes it
    one = _lists("1f1b", 1, 2)
    a, g = idx(one[0], SendActivation), idx(one[0], RecvGrad)
    cyc = list(one[0])
    cyc[a], cyc[g] = cyc[g], cyc[a]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([cyc, one[1]])
    # a micro-batch missing
    with pytest.raises(ScheduleError, match="micro-batch 2 chunk 0 has no ForwardPass"):
        simulate(base, micro_batches=3)
    # two live micro-batches in one buffer
    with pytest.raises(ScheduleError, match="still holds it"):
        simulate([[dataclasses.replace(i, buffer_id=0) if hasattr(i, "buffer_id") else i for i in s0], s1])
    # the step's end out of order
    with pytest.raises(ScheduleError, match="in that order"):
        simulate([s0[:-3] + [s0[-2], s0[-3], s0[-1]], s1])
    # a duplicate
    with pytest.raises(ScheduleError, match="appears twice"):
        simulate([s0[:1] + s0, s1])
    # W before its BI, BI and B mixed
    zb = _lists("zb-h1", 2, 1)[0]
    w, bi = idx(zb, BackwardWeight), idx(zb, BackwardInput)
    early = list(zb)
    early[w], early[bi] = early[bi], early[w]
    with pytest.raises(ScheduleError, match="before its BackwardInput"):
        simulate([early])
    mixed = zb[: bi + 1] + [BackwardPass(0, buffer_id=zb[bi].buffer_id)] + zb[bi + 1 :]
    with pytest.raises(ScheduleError, match="after a BackwardInput of the same micro-batch"):
        simulate([mixed])
    # an interleaved chunk out of range for the declared v
    with pytest.raises(ScheduleError, match="outside"):
        simulate(_lists("interleaved", 2, 2, 2), virtual_stages=1)
    with pytest.raises(ScheduleError, match="one schedule per stage"):
        simulate([TrainSchedule(2, 2, 1), TrainSchedule(2, 2, 0)])
    with pytest.raises(ValueError, match="unknown cost"):
        simulate(base, costs={"X": 1})


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'gpipe'"):
        make_schedule("gpipe", 4, 2, 0)
    with pytest.raises(ValueError, match="use 'interleaved' or virtual_stages=1"):
        make_schedule("1f1b", 4, 2, 0, virtual_stages=2)
    with pytest.raises(ValueError, match="virtual_stages >= 2"):
        make_schedule("interleaved", 4, 2, 0, virtual_stages=1)
    with pytest.raises(ValueError, match="multiple of stages"):
        InterleavedSchedule(6, 4, 0, 2)
    with pytest.raises(ValueError, match="stages >= 2"):
        InterleavedSchedule(2, 1, 0, 2)
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        TrainSchedule(0, 2, 0)
    with pytest.raises(ValueError, match="stages must be >= 1"):
        ZeroBubbleH1Schedule(2, 0, 0)
    with pytest.raises(ValueError, match="stage_id must be in 0..1"):
        TrainSchedule(2, 2, 2)
    with pytest.raises(TypeError, match="micro_batches must be an int"):
        TrainSchedule(2.0, 2, 0)
    with pytest.raises(ValueError, match="micro_batch must be an int >= 0"):
        ForwardPass(-1, buffer_id=0)
    with pytest.raises(ValueError, match="virtual_stages must be >= 1"):
        InferenceSchedule(2, 2, 0, 0)


def test_instructions_are_frozen_readable_data():
    f = ForwardPass(3, 1, buffer_id=0)
    assert repr(f) == "F3.1@0" and f.name == "ForwardPass"
    assert f == ForwardPass(3, 1, buffer_id=0) and f != BackwardPass(3, 1, buffer_id=0)
    assert repr(BackwardWeight(2, buffer_id=1)) == "W2.0@1" and repr(OptimizerStep()) == "OptimizerStep()"
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.micro_batch = 4
    assert (
        repr(InterleavedSchedule(4, 2, 1, 2))
        == "InterleavedSchedule(micro_batches=4, stages=2, stage_id=1, virtual_stages=2)"
    )


def test_default_schedule_is_the_fastest_that_fits():
    assert default_schedule(8, 4) == "zb-h1"  # idle 3 per rank against 1F1B's 9
    assert default_schedule(8, 1) == "1f1b"  # one stage: no bubble, ties go to 1F1B
    assert default_schedule(8, 4, virtual_stages=4) == "interleaved"  # idle 9/4
    # interleaved holds up to 19 chunk activations (4.75 stages' worth) on stage 0; ZB-H1 4
    assert default_schedule(8, 4, virtual_stages=4, memory_limit_in_flight=4) == "zb-h1"
    assert default_schedule(6, 4, virtual_stages=4) == "zb-h1"  # interleaved needs m % p == 0
    with pytest.raises(ValueError, match="the least any needs is 4"):
        default_schedule(8, 4, memory_limit_in_flight=3)
