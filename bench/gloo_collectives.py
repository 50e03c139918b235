"""Gloo's own reduce-scatter and all-gather against what fastzero's comm
layer uses over Gloo (an all-to-all plus a rank-order sum; sends and
receives), at a few sizes, one thread per rank, the variants alternated
call by call so machine noise hits both alike. Prints medians (ms) and
ratios on rank 0, then stage 3's pattern (all-gathers between the
matmuls that use them); the figures in docs/zero.md come from it:

    torchrun --nproc-per-node 2 -m bench.gloo_collectives [--sizes-mb 1 8 32] [--calls 33]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

from fastzero.comm.collectives import (  # _all_gather, _reduce_scatter: Gloo's own, by torch's current names
    _all_gather,
    _reduce_scatter,
    all_gather_by_send_recv,
    reduce_scatter_by_all_to_all,
)


def _median_ms(variants: dict, calls: int, warmup: int = 3) -> dict[str, float]:
    times = {name: [] for name in variants}
    for i in range(calls + warmup):
        for name, fn in variants.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 8, 32], help="fp32 bucket sizes, MB")
    parser.add_argument("--calls", type=int, default=33, help="timed calls per variant")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"{world} ranks, medians of {args.calls} alternated calls, ms")
        print("| bucket | Gloo reduce_scatter | all-to-all + sum | ratio | Gloo all_gather | sends/receives | ratio |")
        print("|---|---:|---:|---:|---:|---:|---:|")
    for mb in args.sizes_mb:
        n = int(mb * 2**20) // 4 // world * world
        bucket, shard = torch.randn(n), torch.randn(n // world)
        out_rs, out_ag = torch.empty(n // world), torch.empty(n)
        rs = _median_ms(
            {
                "gloo": partial(_reduce_scatter, out_rs, bucket),
                "ours": partial(reduce_scatter_by_all_to_all, out_rs, bucket),
            },
            args.calls,
        )
        ag = _median_ms(
            {"gloo": partial(_all_gather, out_ag, shard), "ours": partial(all_gather_by_send_recv, out_ag, shard)},
            args.calls,
        )
        if rank == 0:
            print(
                f"| {mb:g} MB | {rs['gloo']:.2f} | {rs['ours']:.2f} | {rs['gloo'] / rs['ours']:.2f}x "
                f"| {ag['gloo']:.2f} | {ag['ours']:.2f} | {ag['gloo'] / ag['ours']:.2f}x |",
                flush=True,
            )
    between_matmuls(args.calls, rank, world)
    dist.destroy_process_group()


def between_matmuls(calls: int, rank: int, world: int) -> None:
    """Stage 3's pattern: 8 all-gathers of a 4 MB param, each followed by
    the matmul that uses it (waited at once, or the next one launched first)."""
    x, weight, shard = torch.randn(64, 1024), torch.randn(1024, 1024), torch.randn(2**20 // world)
    outs = [torch.empty(2**20), torch.empty(2**20)]

    def run(gather, ahead: bool) -> None:
        y, work = x, gather(outs[0], shard, async_op=True) if ahead else None
        for i in range(8):
            if ahead:
                nxt = gather(outs[(i + 1) % 2], shard, async_op=True) if i < 7 else None
                work.wait()
                work = nxt
            else:
                gather(outs[0], shard)
            y = torch.nn.functional.gelu(y @ weight)

    ms = _median_ms(
        {
            "gloo": partial(run, _all_gather, False),
            "ours": partial(run, all_gather_by_send_recv, False),
            "gloo ahead": partial(run, _all_gather, True),
            "ours ahead": partial(run, all_gather_by_send_recv, True),
        },
        calls,
    )
    if rank == 0:
        print("\n8 x (all-gather of 4 MB, then a 64 x 1024 x 1024 matmul), ms:")
        print(f"| waited at once | Gloo {ms['gloo']:.2f} | ours {ms['ours']:.2f} | {ms['gloo'] / ms['ours']:.2f}x |")
        print(
            f"| next launched first | Gloo {ms['gloo ahead']:.2f} | ours {ms['ours ahead']:.2f} "
            f"| {ms['gloo ahead'] / ms['ours ahead']:.2f}x |"
        )


if __name__ == "__main__":
    main()
