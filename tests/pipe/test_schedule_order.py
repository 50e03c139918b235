"""The order in which the two ends of a stage pair post their messages.
NCCL matches a pair's sends and receives in posting order whatever the
channel, so a schedule runs on NCCL only if, for every pair of ranks, both
ends post the pair's messages in the same order. 1F1B does (the engine runs
it on NCCL); interleaved and zb-h1 do not (with one communicator per pair,
the engine refuses them there). Every schedule posts each channel's own
messages in micro-batch order on both ends, so a communicator per channel
(fastzero.pipe.channels) runs them all."""

import pytest

from fastzero.pipe import schedule as S
from fastzero.pipe.channels import channels


def posted(name: str, m: int, p: int, v: int, stage: int) -> list[tuple]:
    """(peer, channel, micro-batch) of each send and receive, in the order the rank posts them."""
    out = []
    for cmd in S.make_schedule(name, m, p, stage, virtual_stages=v).instructions():
        part = stage + getattr(cmd, "chunk", 0) * p
        if isinstance(cmd, S.SendActivation):
            out.append(((part + 1) % p, f"act{part + 1}", cmd.micro_batch))
        elif isinstance(cmd, S.RecvActivation):
            out.append(((part - 1) % p, f"act{part}", cmd.micro_batch))
        elif isinstance(cmd, S.SendGrad):
            out.append(((part - 1) % p, f"grad{part - 1}", cmd.micro_batch))
        elif isinstance(cmd, S.RecvGrad):
            out.append(((part + 1) % p, f"grad{part}", cmd.micro_batch))
    return out


def same_order(name: str, m: int, p: int, v: int) -> bool:
    lists = [posted(name, m, p, v, s) for s in range(p)]
    for a in range(p):
        for b in range(a + 1, p):
            ours = [(c, k) for peer, c, k in lists[a] if peer == b]
            theirs = [(c, k) for peer, c, k in lists[b] if peer == a]
            if ours != theirs:
                return False
    return True


@pytest.mark.parametrize("p", range(2, 7))
def test_1f1b_posts_every_pair_in_the_same_order_on_both_ends(p):
    for m in range(1, 17):
        assert same_order("1f1b", m, p, 1), (m, p)


def test_interleaved_and_zb_h1_do_not_which_is_why_nccl_refuses_them():
    assert not same_order("zb-h1", 4, 2, 1)
    assert not same_order("interleaved", 4, 2, 2)


def per_channel(name: str, m: int, p: int, v: int) -> dict[str, tuple[list, list]]:
    """Each channel's micro-batches in the order its sender and its receiver post them."""
    out: dict[str, tuple[list, list]] = {}
    for stage in range(p):
        for cmd in S.make_schedule(name, m, p, stage, virtual_stages=v).instructions():
            part = stage + getattr(cmd, "chunk", 0) * p
            kind, end = {
                S.SendActivation: (f"act{part + 1}", 0),
                S.RecvActivation: (f"act{part}", 1),
                S.SendGrad: (f"grad{part - 1}", 0),
                S.RecvGrad: (f"grad{part}", 1),
            }.get(type(cmd), (None, None))
            if kind is not None:
                out.setdefault(kind, ([], []))[end].append(cmd.micro_batch)
    return out


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_schedule_posts_each_channel_in_micro_batch_order_on_both_ends(name, v, p):
    for m in [p, 2 * p, 3 * p] if name == "interleaved" else range(1, 13):
        got = per_channel(name, m, p, v)
        # the channels the engine names (fastzero.pipe.channels), each carrying every micro-batch once
        assert sorted(got) == sorted(kind for _, _, kind in channels(p * v)), (m, sorted(got))
        for kind, (sent, received) in got.items():
            assert sent == received == list(range(m)), (name, m, p, v, kind, sent, received)
