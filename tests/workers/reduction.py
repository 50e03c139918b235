"""One rank of the gradient-reduction option tests (communication dtype,
pre-scale): argv[1] is the output path. Every case reduces the same grads,
rank r's made from seed r, and saves what lands where."""

import sys

import torch

from fastzero.comm import Comm, FlatLayout, GradReducer, init_distributed

NUMELS = [37, 100, 13]  # three params over several buckets, ragged
BUCKET = 48


def grads(seed: int) -> list[torch.Tensor]:
    """Multiples of 1/64 up to 4: exact in bf16, and their sums over a few
    ranks are exact in fp32, so a test can know the one rounding to expect."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(-255, 256, (n,), generator=gen).float() / 64).bfloat16() for n in NUMELS]


def run(comm: Comm, mode: str, copy: bool, comm_dtype, pre_scale: float, micro: int) -> torch.Tensor:
    """`micro` backward passes (accumulating after the first, stage 2's
    way); returns the flat result (stage 0) or this rank's shard."""
    rank, world = comm.rank, comm.world_size
    lay = FlatLayout(NUMELS, world if mode == "reduce_scatter" else 1, BUCKET)
    flat = None if copy else torch.zeros(lay.total, dtype=torch.bfloat16)
    shard = torch.zeros(lay.shard_size, dtype=torch.bfloat16) if mode == "reduce_scatter" else None
    reducer = GradReducer(comm, lay, mode, shard=shard, flat=flat, comm_dtype=comm_dtype, pre_scale=pre_scale)
    for m in range(micro):
        gs = grads(100 * m + rank)
        if flat is not None:
            flat.zero_()
            for i, g in enumerate(gs):
                flat[lay.offsets[i] : lay.offsets[i] + g.numel()].copy_(g)
        reducer.begin(accumulate=m > 0)
        for i in reversed(range(len(gs))):  # backward order
            reducer.ready(i, gs[i] if copy else None)
        reducer.finish()
    return flat.clone() if mode == "all_reduce" else shard.clone()


if __name__ == "__main__":
    init_distributed(timeout_s=120)
    comm = Comm()
    out = {}
    for mode, copy, micro in (("all_reduce", False, 1), ("reduce_scatter", False, 1), ("reduce_scatter", True, 2)):
        for dtype in (None, torch.float32):
            for pre in (1.0, 0.25):
                out[(mode, copy, micro, dtype, pre)] = run(comm, mode, copy, dtype, pre, micro)
    torch.save(dict(out=out, layout=(NUMELS, BUCKET)), f"{sys.argv[1]}.rank{comm.rank}.pt")
