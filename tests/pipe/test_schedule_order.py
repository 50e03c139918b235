"""The order in which the two ends of a stage pair post their messages.
NCCL matches a pair's sends and receives in posting order whatever the
channel, so a schedule runs on NCCL only if, for every pair of ranks, both
ends post the pair's messages in the same order. 1F1B does (the engine runs
it on NCCL); interleaved and zb-h1 do not (the engine refuses them there,
until each channel has a communicator of its own)."""

import pytest

from fastzero.pipe import schedule as S


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
