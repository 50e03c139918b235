"""Pipeline point-to-point transport over Gloo (tests/workers/pipe_p2p.py
runs the ranks and checks every received element against the sender's
message)."""

import json
import random
import time

import pytest

from tests.dist import run_ranks, start_ranks
from tests.paths import WORKERS

SCRIPT = WORKERS / "pipe_p2p.py"


def outputs(lines: list[str]) -> list[dict]:
    return [json.loads(out.strip().splitlines()[-1]) for out in lines]


@pytest.mark.parametrize("world", [2, 4])
def test_roundtrip(world):
    seed = random.randrange(1 << 20)
    for rank, out in enumerate(outputs(run_ranks(SCRIPT, world, ["roundtrip", seed], timeout=240))):
        # 12 messages on each of two channels in, 21 ping-pong steps each way, 12 sent before received
        assert out["messages"] == 2 * 12 + 2 * 21 + 12, (rank, out)
        assert out["tensors"] == 3 * (7 + 4 + 6 + 2), (rank, out)
        first, steady, changed, big, big_steady = out["phases"]
        assert steady["meta"] == big_steady["meta"] == 0 and first["meta"] > 0 and changed["meta"] > 0
        assert "init_distributed" in out["before_init"]


def test_timeout_names_peer_and_channel():
    out0, out1 = outputs(run_ranks(SCRIPT, 2, ["timeout", 0], timeout=120))
    assert out0["error"].startswith("rank 0 waiting for a message (8 B) from rank 1 on channel 'act': "), out0
    assert out1["error"].startswith("rank 1 waiting for rank 0 to receive a message on channel 'never': "), out1
    # Gloo closes the pair on a timeout: the rank that times out second may see the closed connection first
    assert out0["timed_out"] or out1["timed_out"], (out0, out1)
    for out in (out0, out1):
        if out["timed_out"]:
            assert "nothing within 2 s" in out["error"] and "check its log" in out["error"], out
        else:
            assert "the transport failed" in out["error"] and "check its log" in out["error"], out
        assert 1.9 < out["elapsed"] < 6, out
        assert "failed earlier" in out["after"]


@pytest.mark.parametrize("how", ["die", "raise"])
def test_dead_peer_raises_no_hang(how):
    t = time.monotonic()
    procs = start_ranks(SCRIPT, 2, [how, 0])
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 0, outs[0][1][-3000:]
    assert procs[1].returncode != 0
    if how == "raise":
        assert "stage 1 failed on purpose" in outs[1][1]
    out = json.loads(outs[0][0].strip().splitlines()[-1])
    # Gloo sees the closed connection: an error naming the peer well before the 5 s timeout
    assert out["error"].startswith("PipelinePeerError: rank 0 waiting for a message (32 B) from rank 1"), out
    assert "channel 'act': the transport failed" in out["error"] and "raised or died: check its log" in out["error"]
    assert out["elapsed"] < 5 and time.monotonic() - t < 90


def test_bad_input():
    for rank, out in enumerate(outputs(run_ranks(SCRIPT, 2, ["bad", 0], timeout=120))):
        assert out["dst_self"].startswith("ValueError") and f"dst={rank} is this rank" in out["dst_self"]
        assert out["src_self"].startswith("ValueError") and "is this rank" in out["src_self"]
        assert out["dst_range"].startswith("ValueError") and "not a rank of 0..1" in out["dst_range"]
        assert out["dst_type"].startswith("TypeError") and "global rank (int)" in out["dst_type"]
        assert out["kind_type"].startswith("TypeError") and "kind must be a str" in out["kind_type"]
        assert out["kind_empty"].startswith("ValueError") and "non-empty" in out["kind_empty"]
        assert out["unpicklable"].startswith("TypeError") and "obj['f'][0]" in out["unpicklable"]
        assert out["timeout"].startswith("ValueError") and "positive" in out["timeout"]


@pytest.mark.parametrize("run", range(2))
def test_random_orders_both_directions(run):
    """Sends, receives and waits in random orders (any that torch's own
    isend/irecv completes), signatures changing at random."""
    seed = random.randrange(1 << 20)
    try:
        outs = outputs(run_ranks(SCRIPT, 2, ["random", seed], timeout=240))
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}: {exc}") from None
    for out in outs:
        assert out["checked"] == out["want"] > 2 * 40, out  # every message of both channels in, each tensor compared
        assert out["signatures"] > 4, out


def test_exit_with_a_receive_pending():
    """A receive posted from the caller's thread and never matched: no
    thread is left inside Gloo, both ranks exit 0 (run_ranks checks)."""
    out0, _ = outputs(run_ranks(SCRIPT, 2, ["exit", 1], timeout=120))
    assert out0["pending"] == 1
