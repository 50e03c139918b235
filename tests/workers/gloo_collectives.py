"""One rank of the Gloo collectives test (argv[1]: an output path):
Comm.reduce_scatter, an all-to-all and a sum in rank order over Gloo,
against the sum of the all-gathered inputs taken in rank order, bit for
bit, for each dtype and a few sizes; Comm.all_gather, sends and receives
over Gloo, against torch's all-gather, several in flight at once, in place
and not, on the world and on a group of other ranks; mismatched sizes
refused."""

import gc
import sys

import torch
import torch.distributed as dist

from fastzero.comm import Comm, init_distributed
from fastzero.comm.collectives import all_gather_by_send_recv, reduce_scatter_by_all_to_all


def rank_order_sum(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    everyone = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(everyone, x)
    chunks = [e.view(world, -1)[rank] for e in everyone]
    total = chunks[0] + chunks[1]
    for c in chunks[2:]:
        total = total + c
    return total


def check_all_gather(comm: Comm, rank: int, world: int) -> int:
    """Three all-gathers in flight before any wait (each lands in its own
    output), for each dtype; the third sends its chunk of the output itself."""
    checked = 0
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.float64):
        pending = []
        for chunk in (1, 40_003, 7):
            gen = torch.Generator().manual_seed(1000 * rank + chunk)
            x = (torch.randn(chunk, generator=gen) * 100).to(dtype)
            out = torch.zeros(world * chunk, dtype=dtype)
            inp = x
            if chunk == 7:
                inp = out.view(world, -1)[rank]
                inp.copy_(x)
            pending.append((comm.all_gather(out, inp, "test"), out, x))
        for handle, out, x in pending:
            handle.wait()
            handle.wait()  # a second wait returns at once (a Gloo receive waited again would wait for more)
            everyone = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(everyone, x, group=comm.group)
            assert torch.equal(out, torch.cat(everyone)), (dtype, x.numel())
            checked += 1
    # a handle dropped unwaited (an engine discarded with its gathers in flight) still delivers, and the next
    # all-gather on the group gets its own bytes, not the dropped one's
    dropped_out, next_out = torch.zeros(world * 1000), torch.zeros(world * 1000)
    comm.all_gather(dropped_out, torch.full((1000,), float(rank + 1)), "test")
    gc.collect()
    comm.all_gather(next_out, torch.full((1000,), float(-rank - 1)), "test").wait()
    ranks = torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(1000)
    assert torch.equal(dropped_out, ranks) and torch.equal(next_out, -ranks)
    checked += 1
    comm.all_gather(torch.empty(0), torch.empty(0), "test").wait()  # nothing to move: no error
    assert comm.events("all_gather")[-1].wire_bytes == 0
    try:
        all_gather_by_send_recv(torch.empty(world * 5 + 1), torch.zeros(5), comm.group)
    except ValueError as e:
        assert "must be" in str(e)
    else:
        raise AssertionError("a mismatched all-gather size was not refused")
    return checked


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
    checked += check_all_gather(comm, rank, world)
    sub_ranks = list(range(1, world))  # group rank g is global rank g + 1: peers named by their global rank
    sub = dist.new_group(sub_ranks)
    if rank in sub_ranks:
        checked += check_all_gather(Comm(sub), rank - 1, world - 1)
    with open(f"{sys.argv[1]}.rank{rank}", "w") as f:
        f.write(str(checked))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
