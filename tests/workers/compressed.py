"""One rank of the compressed all-reduce tests: argv[1] is the output path."""

import sys

import torch
import torch.distributed as dist

from fastzero.comm import Comm, init_distributed
from fastzero.comm.compressed import compressed_allreduce, error_buffers

init_distributed(timeout_s=120)
comm = Comm()
rank, world = comm.rank, comm.world_size
numel = 1000 * 8 * world  # whole bytes per chunk: no padding, so the byte count is exact
out = {}

# identical on every rank; with error feedback the running sums stay close; without, they drift
for feedback in (True, False):
    we, se = error_buffers(numel, world)
    cum_out, cum_true, drift, same = torch.zeros(numel), torch.zeros(numel), [], True
    for step in range(60):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(numel, generator=gen) + 0.3  # a bias: what error feedback must not lose
        if not feedback:
            we.zero_()
            se.zero_()
        y = compressed_allreduce(x, we, se, comm)
        true = x.clone()
        dist.all_reduce(true)
        gathered = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(gathered, y)
        same = same and all(torch.equal(g, y) for g in gathered)
        cum_out += y
        cum_true += true / world
        drift.append(float((cum_out - cum_true).norm() / numel**0.5))
    out[f"feedback={feedback}"] = dict(same=same, drift=drift)

# exact for inputs that are already +-scale (the same on every rank) with zero errors
we, se = error_buffers(numel, world)
signs = torch.where(torch.randn(numel, generator=torch.Generator().manual_seed(7)) >= 0, 1.0, -1.0)
x = 0.25 * signs
out["exact"] = bool(torch.equal(compressed_allreduce(x, we, se, comm), x))

# bytes on the wire against an fp16 all-reduce of the same tensor
comm.record.clear()
compressed_allreduce(torch.randn(numel), *error_buffers(numel, world), comm)
events = comm.events(tag="compressed")
scale_bytes = sum(e.wire_bytes for e in events if e.nbytes <= 4 * world)
sign_bytes = sum(e.wire_bytes for e in events) - scale_bytes
comm.record.clear()
comm.all_reduce(torch.randn(numel).half(), "fp16").wait()
out["bytes"] = dict(signs=sign_bytes, scales=scale_bytes, fp16=comm.events(tag="fp16")[0].wire_bytes)
torch.save(out, f"{sys.argv[1]}.rank{rank}.pt")
