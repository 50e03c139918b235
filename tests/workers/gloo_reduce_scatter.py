"""One rank of the Gloo reduce-scatter test (argv[1]: an output path):
Comm.reduce_scatter, an all-to-all and a sum in rank order over Gloo,
against the sum of the all-gathered inputs taken in rank order, bit for
bit, for each dtype and a few sizes; and a mismatched size refused."""

import sys

import torch
import torch.distributed as dist

from fastzero.comm import Comm, init_distributed
from fastzero.comm.collectives import reduce_scatter_by_all_to_all


def rank_order_sum(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    everyone = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(everyone, x)
    chunks = [e.view(world, -1)[rank] for e in everyone]
    total = chunks[0] + chunks[1]
    for c in chunks[2:]:
        total = total + c
    return total


def main() -> None:
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Comm()
    assert comm.gloo
    checked = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for chunk in (1, 7, 40_003):
            gen = torch.Generator().manual_seed(1000 * rank + chunk)
            x = (torch.randn(world * chunk, generator=gen) * 100).to(dtype)
            out = torch.full((chunk,), float("nan"), dtype=dtype)
            handle = comm.reduce_scatter(out, x, "test")
            handle.wait()
            handle.wait()  # a second wait sums nothing again
            assert torch.equal(out, rank_order_sum(x, rank, world)), (dtype, chunk)
            checked += 1
    empty = torch.empty(0)
    comm.reduce_scatter(empty, torch.empty(0), "test").wait()  # nothing to move: no collective, no error
    event = comm.events("reduce_scatter")[-2]
    assert event.done is not None and event.wire_bytes == event.nbytes * (world - 1) / world
    out = torch.empty(5)
    try:
        reduce_scatter_by_all_to_all(out, torch.zeros(world * 5 + 1))
    except ValueError as e:
        assert "must be" in str(e)
    else:
        raise AssertionError("a mismatched size was not refused")
    with open(f"{sys.argv[1]}.rank{rank}", "w") as f:
        f.write(str(checked))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
