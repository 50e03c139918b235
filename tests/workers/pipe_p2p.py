"""One rank of the pipeline point-to-point tests (started by tests/dist.py).
Arguments: a scenario and a seed. Prints one JSON line of what it saw.

* ``roundtrip`` (2 or 4 ranks): every rank sends a stream of messages to the
  next rank on "act" and to the previous one on "grad" (with 2 ranks both go
  to the same peer), all isends posted before any wait, receives posted in
  another order; every received element, dtype, shape, structure and
  requires_grad is checked against the sender's message regenerated from the
  seed; the byte counters show the signature sent exactly when it changed.
  Then a ping-pong phase: one message at a time each way; then a stream
  whose sends are all waited before any of its receives.
* ``timeout``: rank 0 waits for a message rank 1 never sends, and rank 1
  sends one rank 0 never receives; after ~2 s each raises PipelineTimeout,
  or PipelinePeerError when Gloo closed the pair on the other's timeout first.
* ``die`` / ``raise``: rank 1 sends one message, then exits (os._exit) or
  raises; rank 0's next receive must fail with a PipelinePeerError.
* ``bad``: bad arguments raise clear errors.
* ``random`` (2 ranks): both directions at once on two channels, each
  rank posting sends and receives in random order and waiting random
  subsets of them (only what torch's own isend/irecv could complete at that
  point), messages changing signature at random (packed and split);
  every received element checked.
* ``exit``: rank 0 posts a receive rank 1 never sends (the second
  argument: how many, 1 from the caller's thread, more through the
  channel's thread) and both exit normally.
"""

import json
import os
import sys
import time
from collections import namedtuple

import torch

import fastzero
from fastzero.pipe.p2p import P2P, PACK_LIMIT, PipelinePeerError, PipelineTimeout

Meta = namedtuple("Meta", "step name")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool)


def tensor(g: torch.Generator, shape, dtype, requires_grad=False) -> torch.Tensor:
    if dtype == torch.bool:
        t = torch.rand(shape, generator=g) > 0.5
    elif dtype == torch.int64:
        t = torch.randint(-(2**40), 2**40, shape, generator=g)
    else:
        t = torch.randn(shape, generator=g).to(dtype)
    return t.requires_grad_(requires_grad)


def message(seed: int, src: int, dst: int, kind: str, i: int):
    """Message i on channel (src, dst, kind): signature groups change mid-stream
    (0-2 one shape, 3-4 another, 5-6 back, 7 nested, 8-9 large, 10-11 small again)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + src * 1009 + dst * 101 + (kind == "grad") * 7 + i)
    dtype = DTYPES[(i + src) % len(DTYPES)] if i >= 10 else torch.float32
    if i < 3 or 5 <= i < 7:
        return tensor(g, (4, 7), torch.float32, requires_grad=kind == "act")
    if i < 5:
        return tensor(g, (3, 0, 5) if i == 4 else (2, 3, 5), torch.float32)
    if i == 7:
        return (
            tensor(g, (5,), torch.bfloat16, True),
            {"mask": tensor(g, (2, 3), torch.bool), "ids": tensor(g, (0,), torch.int64), "none": None},
            [Meta(step=3, name="mb"), "tag", 17, tensor(g, (3, 1), torch.float16)],
        )
    if i < 10:  # over PACK_LIMIT: the split layout, a zero-size tensor among them
        big = PACK_LIMIT // 4 + 13
        return (tensor(g, (big,), torch.float32, True), tensor(g, (0, 2), torch.float16), tensor(g, (9,), torch.int64))
    return tensor(g, (3, 5), dtype, requires_grad=dtype.is_floating_point)


N = 12


def signature_changes(seed, src, dst, kind) -> int:
    prev, changes = None, 0
    for i in range(N):
        m = message(seed, src, dst, kind, i)
        flat = m if isinstance(m, tuple) else (m,)
        sig = repr(
            [
                (tuple(t.shape), t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else type(t).__name__
                for t in flat
            ]
        )
        sig += repr(type(m))
        changes += sig != prev
        prev = sig
    return changes


def same(got, want, path="obj") -> int:
    """Asserts `got` equals `want` in structure, leaves and tensors; returns tensors checked."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: got {type(got)}"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{path}: {got.dtype}{got.shape} vs {want.shape}"
        assert torch.equal(got, want.detach()), f"{path}: values differ"
        assert got.requires_grad == want.requires_grad and got.is_leaf, f"{path}: requires_grad/leaf"
        assert got.is_contiguous(), path
        return 1
    assert type(got) is type(want), f"{path}: {type(got)} vs {type(want)}"
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want), path
        return sum(same(a, b, f"{path}[{i}]") for i, (a, b) in enumerate(zip(got, want)))
    if isinstance(want, dict):
        assert list(got) == list(want), path
        return sum(same(got[k], want[k], f"{path}[{k!r}]") for k in want)
    assert got == want, f"{path}: {got!r} vs {want!r}"
    return 0


def roundtrip(seed: int) -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    p2p = P2P(timeout=60)
    # every send posted before any receive: no deadlock, in-flight messages queue
    sends = []
    for i in range(N):
        sends.append(p2p.isend(message(seed, rank, nxt, "act", i), nxt, "act"))
        sends.append(p2p.isend(message(seed, rank, prv, "grad", i), prv, "grad"))
    # receives posted grads first, then acts; waited interleaved
    grads = [p2p.irecv(nxt, "grad") for _ in range(N)]
    acts = [p2p.irecv(prv, "act") for _ in range(N)]
    tensors = messages = 0
    for i in range(N):
        tensors += same(acts[i].wait(), message(seed, prv, rank, "act", i))
        tensors += same(grads[i].wait(), message(seed, nxt, rank, "grad", i))
        messages += 2
    for s in sends:
        s.wait()
    stats = {f"{d}:{peer}:{kind}": vars(c).copy() for (d, peer, kind), c in p2p.stats.items()}
    want = {
        "send:act": signature_changes(seed, rank, nxt, "act"),
        "send:grad": signature_changes(seed, rank, prv, "grad"),
        "recv:act": signature_changes(seed, prv, rank, "act"),
        "recv:grad": signature_changes(seed, nxt, rank, "grad"),
    }
    got = {
        "send:act": p2p.stats[("send", nxt, "act")].signatures,
        "send:grad": p2p.stats[("send", prv, "grad")].signatures,
        "recv:act": p2p.stats[("recv", prv, "act")].signatures,
        "recv:grad": p2p.stats[("recv", nxt, "grad")].signatures,
    }
    assert got == want, (got, want)

    # ping-pong on one channel pair, shapes steady then changed: the signature
    # bytes move only at the change, and both ends count the same bytes
    def pingpong(shape, steps):
        before = p2p.totals()
        for step in range(steps):
            g = torch.Generator().manual_seed(seed + 7919 * step + rank)
            x = torch.randn(shape, generator=g)
            h = p2p.irecv(prv, "act")
            p2p.isend(x, nxt, "act").wait()
            g = torch.Generator().manual_seed(seed + 7919 * step + prv)
            assert torch.equal(h.wait(), torch.randn(shape, generator=g))
        after = p2p.totals()
        return {k: getattr(after, k) - getattr(before, k) for k in ("messages", "payload", "meta", "signatures")}

    first = pingpong((8, 16), 5)  # a new signature on this channel: sent once
    steady = pingpong((8, 16), 5)
    changed = pingpong((8, 17), 5)
    big = pingpong((PACK_LIMIT // 16, 8), 3)  # split layout
    big_steady = pingpong((PACK_LIMIT // 16, 8), 3)
    messages += 2 * (5 + 5 + 5 + 3 + 3)
    assert steady["meta"] == 0 and steady["signatures"] == 0, steady
    assert big_steady["meta"] == 0 and big_steady["signatures"] == 0, big_steady
    for phase in (first, changed, big):
        assert phase["signatures"] == 2 and phase["meta"] > 0, phase  # one send + one receive
    assert steady["payload"] == 2 * 5 * 8 * 16 * 4 and steady["messages"] == 2 * 5, steady
    # every send waited before any receive is, across signature changes: the
    # receiving end follows the changes through without its caller's wait
    late = [p2p.irecv(prv, "late") for _ in range(N)]
    for s in [p2p.isend(message(seed, rank, nxt, "late", i), nxt, "late") for i in range(N)]:
        s.wait()
    for i in range(N):
        tensors += same(late[i].wait(), message(seed, prv, rank, "late", i))
        messages += 1
    return dict(messages=messages, tensors=tensors, stats=stats, phases=[first, steady, changed, big, big_steady])


def timeout() -> dict:
    rank = torch.distributed.get_rank()
    out = {}
    p2p = P2P(timeout=2)
    t = time.monotonic()
    try:
        if rank == 0:
            p2p.irecv(1, "act").wait()
        else:
            p2p.isend(torch.ones(PACK_LIMIT), 0, "never").wait()  # rank 0 never receives it
        out["error"] = None
    except PipelinePeerError as exc:  # a timeout, or the pair Gloo closed on the peer's timeout
        out["error"], out["timed_out"] = str(exc), isinstance(exc, PipelineTimeout)
    out["elapsed"] = time.monotonic() - t
    try:
        p2p.irecv(1 - rank, "grad")
    except PipelinePeerError as exc:
        out["after"] = str(exc)
    time.sleep(3)  # both alive until both have timed out (Gloo closes the pair on a timeout: no barrier)
    return out


def dies(how: str) -> dict:
    rank = torch.distributed.get_rank()
    p2p = P2P(timeout=5)
    if rank == 1:
        p2p.isend(torch.arange(5.0), 0, "act").wait()
        time.sleep(0.5)
        if how == "die":
            os._exit(3)
        raise RuntimeError("stage 1 failed on purpose")
    first = p2p.irecv(1, "act").wait()
    assert torch.equal(first, torch.arange(5.0))
    t = time.monotonic()
    try:
        p2p.irecv(1, "act").wait()
        error = None
    except PipelinePeerError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return dict(error=error, elapsed=time.monotonic() - t)


def bad() -> dict:
    rank = torch.distributed.get_rank()
    p2p = P2P(timeout=5)
    out = {}
    cases = {
        "dst_self": lambda: p2p.isend(torch.ones(1), rank, "act"),
        "src_self": lambda: p2p.irecv(rank, "act"),
        "dst_range": lambda: p2p.isend(torch.ones(1), 5, "act"),
        "dst_type": lambda: p2p.isend(torch.ones(1), "1", "act"),
        "kind_type": lambda: p2p.isend(torch.ones(1), 1 - rank, 3),
        "kind_empty": lambda: p2p.irecv(1 - rank, ""),
        "unpicklable": lambda: p2p.isend({"x": torch.ones(1), "f": [lambda: 0]}, 1 - rank, "act"),
        "timeout": lambda: P2P(timeout=0),
    }
    for name, call in cases.items():
        try:
            call()
            out[name] = None
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    # nothing went out: the channel still works
    h = p2p.irecv(1 - rank, "act")
    p2p.isend((torch.full((3,), float(rank)), "ok"), 1 - rank, "act").wait()
    got = h.wait()
    assert torch.equal(got[0], torch.full((3,), float(1 - rank))) and got[1] == "ok"
    return out


def random_message(seed: int, src: int, kind: str, i: int):
    """Runs of one signature, changed at random, packed or split, at times a tuple."""
    g = torch.Generator().manual_seed(seed * 7919 + src * 131 + (kind == "grad") * 17 + i)
    run = torch.Generator().manual_seed(seed * 7919 + src * 131 + (kind == "grad") * 17 + i // 3 * 1000003)
    shape = (int(torch.randint(1, 5, (), generator=run)), int(torch.randint(1, 9, (), generator=run)))
    if torch.rand((), generator=run) < 0.25:  # split layout
        shape = (shape[0], PACK_LIMIT // 4)
    dtype = DTYPES[int(torch.randint(0, len(DTYPES), (), generator=run))]
    x = tensor(g, shape, dtype, requires_grad=dtype.is_floating_point and kind == "act")
    if torch.rand((), generator=run) < 0.3:
        return (x, {"i": int(torch.randint(0, 3, (), generator=run))}, tensor(g, (3,), torch.int64))
    return x


def random_plan(seed: int, rank: int, n: int) -> list[list]:
    """Per phase: the ops this rank posts (shuffled), then the ones it waits."""
    rng = __import__("random").Random(seed * 31 + rank)
    posted = {("send", "act"): 0, ("send", "grad"): 0, ("recv", "act"): 0, ("recv", "grad"): 0}
    phases = []
    while min(posted.values()) < n:
        ops = []
        for op in posted:
            k = min(rng.randint(0, 3), n - posted[op])
            ops += [(*op, posted[op] + j) for j in range(k)]
            posted[op] += k
        mixed, queues = [], {}  # a channel's ops in order, channels interleaved at random
        for o in ops:
            queues.setdefault(o[:2], []).append(o)
        while queues:
            key = rng.choice(sorted(queues))
            mixed.append(queues[key].pop(0))
            if not queues[key]:
                del queues[key]
        phases.append([mixed, dict(posted), rng.random()])
    return phases


def randomized(seed: int) -> dict:
    rank = torch.distributed.get_rank()
    peer = 1 - rank
    p2p = P2P(timeout=60)
    n = 40
    mine, theirs = random_plan(seed, rank, n), random_plan(seed, peer, n)
    # the kinds: "act" goes rank 0 -> 1 and "grad" 1 -> 0 in the peer's naming; here both directions of each kind
    sends, recvs, checked = {}, {}, 0
    rng = __import__("random").Random(seed * 17 + rank)
    for p, (ops, _, frac) in enumerate(mine):
        for direction, kind, i in ops:
            if direction == "send":
                sends[(kind, i)] = p2p.isend(random_message(seed, rank, kind, i), peer, kind)
            else:
                recvs[(kind, i)] = p2p.irecv(peer, kind)
        # what torch's isend/irecv could complete now: the peer posted its counterpart by its phase p
        peer_posted = theirs[min(p, len(theirs) - 1)][1]
        ready = [("send", k) for k in sends if k[1] < peer_posted[("recv", k[0])]]
        ready += [("recv", k) for k in recvs if k[1] < peer_posted[("send", k[0])]]
        rng.shuffle(ready)
        for direction, k in ready[: int(len(ready) * frac)]:
            if direction == "send":
                sends.pop(k).wait()
            else:
                checked += same(recvs.pop(k).wait(), random_message(seed, peer, k[0], k[1]), f"{k}")
    for k in sorted(recvs):
        checked += same(recvs.pop(k).wait(), random_message(seed, peer, k[0], k[1]), f"{k}")
    for h in sends.values():
        h.wait()
    p2p.close()
    want = sum(
        len([t for t in (m if isinstance(m, tuple) else (m,)) if isinstance(t, torch.Tensor)])
        for m in (random_message(seed, peer, kind, i) for kind in ("act", "grad") for i in range(n))
    )
    return dict(checked=checked, want=want, phases=len(mine), signatures=p2p.totals("recv").signatures)


def unmatched(count: int) -> dict:
    rank = torch.distributed.get_rank()
    p2p = P2P(timeout=5)
    # one exchange first, so the channel has a signature
    h = p2p.irecv(1 - rank, "act")
    p2p.isend(torch.arange(3.0), 1 - rank, "act").wait()
    assert torch.equal(h.wait(), torch.arange(3.0))
    if rank == 0:
        pending = [p2p.irecv(1, "act") for _ in range(count)]
        time.sleep(0.5)  # the thread, if any, inside Gloo's wait
        return dict(pending=sum(not h.is_completed() for h in pending))
    time.sleep(0.5)
    return {}


if __name__ == "__main__":
    scenario, seed = sys.argv[1], int(sys.argv[2])
    try:
        P2P()
        before_init = None
    except RuntimeError as exc:
        before_init = str(exc)
    fastzero.init_distributed(verbose=False)
    if scenario == "roundtrip":
        out = roundtrip(seed)
    elif scenario == "timeout":
        out = timeout()
    elif scenario in ("die", "raise"):
        out = dies(scenario)
    elif scenario == "random":
        out = randomized(seed)
    elif scenario == "exit":
        out = unmatched(seed)
    else:
        out = bad()
    out["before_init"] = before_init
    print(json.dumps(out), flush=True)
    torch.distributed.destroy_process_group()
