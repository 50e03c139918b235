"""Latency of one activation send over Gloo, 2 ranks (run by hand:
``python -c "from tests.dist import run_ranks; print(run_ranks('tests/workers/pipe_p2p_bench.py', 2)[0])"``).
Ping-pong of one fp32 tensor, receive posted before the send, shapes steady;
prints the median one-way time (half a round trip) for torch.distributed's
own isend/irecv and for P2P in its packed and split layouts, each receive
posted then waited as the raw one is ("packed", "split"), and, "ahead", with
the next receive posted before the current one is waited (a receive posted
behind an open one on its channel: P2P's receive thread)."""

import time

import torch
import torch.distributed as dist

import fastzero
from fastzero.pipe import p2p as p2p_module
from fastzero.pipe.p2p import P2P


def pingpong(send, recv, rank: int, iters: int) -> float:
    times = []
    for _ in range(iters):
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            send()
            recv()
        else:
            recv()
            send()
        times.append((time.perf_counter() - t) / 2)
    return sorted(times)[len(times) // 2] * 1e6


def raw(x: torch.Tensor, peer: int, rank: int, iters: int) -> float:
    def send():
        dist.isend(x, peer, tag=1).wait()

    def recv():
        dist.irecv(torch.empty_like(x), peer, tag=1).wait()

    return pingpong(send, recv, rank, iters)


def transport(x: torch.Tensor, peer: int, rank: int, iters: int, kind: str, ahead: bool) -> float:
    p2p = P2P(timeout=60)  # a channel (kind) per run: none sees another's receives
    pending = [p2p.irecv(peer, kind)] if ahead else []

    def send():
        p2p.isend(x, peer, kind).wait()

    def recv():
        pending.append(p2p.irecv(peer, kind))  # ahead: the next one posted before this one is taken
        assert pending.pop(0).wait().shape == x.shape

    send() if rank == 0 else recv()  # the first message carries the signature
    send() if rank == 1 else recv()
    result = pingpong(send, recv, rank, iters)
    if ahead:
        last = p2p.isend(x, peer, kind)  # for the receive each end still has posted
        pending.pop(0).wait()
        last.wait()
    p2p.close()
    return result


def main() -> None:
    fastzero.init_distributed(verbose=False)
    rank = dist.get_rank()
    peer = 1 - rank
    rows = []
    for nbytes in (4 << 10, 4 << 20):
        x = torch.randn(nbytes // 4)
        iters = 200 if nbytes < 1 << 20 else 50
        result = {"torch isend/irecv": raw(x, peer, rank, iters)}
        for name, limit, ahead in (("packed", 1 << 40, False), ("split", -1, False), ("ahead", 1 << 40, True)):
            p2p_module.PACK_LIMIT = limit
            result[name] = transport(x, peer, rank, iters, f"{name} {nbytes}", ahead)
        rows.append((nbytes, result))
    if rank == 0:
        for nbytes, result in rows:
            base = result["torch isend/irecv"]
            cells = [f"{k}: {v:.0f} us" + ("" if v is base else f" ({v / base:.2f}x)") for k, v in result.items()]
            print(f"{nbytes >> 10:>5} KiB  " + "  ".join(cells))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
