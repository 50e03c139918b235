"""One communicator per pipeline channel, so every schedule runs on NCCL.

NCCL matches a rank pair's sends and receives in the order they are posted,
whatever the tag. Interleaved and zero-bubble schedules post a pair's
channels (``act<k>``, ``grad<k>``) in different orders on its two ends, but
each channel's own messages in micro-batch order on both
(tests/pipe/test_schedule_order.py). A two-rank process group per channel,
each with its own :class:`~fastzero.pipe.p2p.P2P`, therefore makes every
schedule's posting order one NCCL can match. On Gloo, whose tags keep
channels apart, one shared P2P does the same with fewer groups; the
per-channel layout runs there too (``pipeline.p2p_groups``), which is how
it is tested without GPUs.
"""

from __future__ import annotations

import torch.distributed as dist

from fastzero.pipe.p2p import P2P, ChannelBytes, RecvHandle, SendHandle


def channels(parts: int) -> list[tuple[int, int, str]]:
    """(sending part, receiving part, kind) of every channel of a pipeline of
    `parts` parts (stages x virtual stages): activations forward, gradients
    back, the names the engine sends under."""
    out = []
    for part in range(1, parts):
        out.append((part - 1, part, f"act{part}"))
        out.append((part, part - 1, f"grad{part - 1}"))
    return out


class ChannelP2P:
    """:class:`P2P`'s ``isend``/``irecv`` over one two-rank group per channel.

    `pipelines`: every pipeline's ranks by stage (the topology's pipe-axis
    lists, the same on every rank); `parts`: stages x virtual stages. Every
    rank must build it, in the same order, as it makes process groups (a
    collective, as ``new_group`` is)."""

    def __init__(self, pipelines: list[list[int]], parts: int, *, timeout: float, device=None) -> None:
        me = dist.get_rank()
        self._p2p: dict[tuple[int, str], P2P] = {}
        for ranks in pipelines:
            stages = len(ranks)
            for src_part, dst_part, kind in channels(parts):
                src, dst = ranks[src_part % stages], ranks[dst_part % stages]
                if src == dst:  # one stage: nothing travels
                    continue
                group = dist.new_group(sorted((src, dst)))  # every rank makes every group, in one order
                if me in (src, dst):
                    self._p2p[(dst if me == src else src, kind)] = P2P(timeout=timeout, device=device, group=group)

    def _for(self, peer: int, kind: str) -> P2P:
        try:
            return self._p2p[(peer, kind)]
        except KeyError:
            have = sorted(self._p2p)
            raise ValueError(f"no pipeline channel {kind!r} with rank {peer} here (this rank's: {have})") from None

    def isend(self, obj, dst: int, kind: str) -> SendHandle:
        return self._for(dst, kind).isend(obj, dst, kind)

    def irecv(self, src: int, kind: str) -> RecvHandle:
        return self._for(src, kind).irecv(src, kind)

    @property
    def stats(self) -> dict[tuple[str, int, str], ChannelBytes]:
        return {key: c for p2p in self._p2p.values() for key, c in p2p.stats.items()}

    def totals(self, direction: str | None = None) -> ChannelBytes:
        out = ChannelBytes()
        for p2p in self._p2p.values():
            part = p2p.totals(direction)
            for field in vars(out):
                setattr(out, field, getattr(out, field) + getattr(part, field))
        return out

    def close(self) -> None:
        for p2p in self._p2p.values():
            p2p.close()
