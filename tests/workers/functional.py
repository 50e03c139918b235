"""One rank of tests/comm/test_functional.py: DeepSpeed's functional
collectives through ``import fastzero.comm as dist``; prints one JSON line."""

import json

import torch

import fastzero.comm as dist

dist.init_distributed(dist_backend="gloo", timeout=__import__("datetime").timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
out = {"rank": rank, "world": world, "local_rank": dist.get_local_rank(), "initialized": dist.is_initialized()}

t = torch.arange(4, dtype=torch.float32) + 10 * rank
dist.all_reduce(t)
out["all_reduce"] = t.tolist()
t = torch.full((2,), float(rank + 1))
dist.all_reduce(t, op=dist.ReduceOp.MAX)
out["all_reduce_max"] = t.tolist()

t = torch.full((3,), float(rank))
dist.broadcast(t, src=1)
out["broadcast"] = t.tolist()

parts = [torch.empty(2) for _ in range(world)]
dist.all_gather(parts, torch.full((2,), float(rank)))
out["all_gather"] = [p.tolist() for p in parts]

flat = torch.empty(2 * world)
dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
out["all_gather_into_tensor"] = flat.tolist()

shard = torch.empty(2)
dist.reduce_scatter_tensor(shard, torch.arange(2 * world, dtype=torch.float32) * (rank + 1))
out["reduce_scatter_tensor"] = shard.tolist()

outs = [torch.empty(2) for _ in range(world)]
dist.all_to_all(outs, [torch.full((2,), float(10 * rank + j)) for j in range(world)])
out["all_to_all"] = [o.tolist() for o in outs]
piece = torch.empty(2)
dist.reduce_scatter(piece, [torch.full((2,), float((rank + 1) * (j + 1))) for j in range(world)])
out["reduce_scatter"] = piece.tolist()
a, b = torch.full((2, 2), float(rank)), torch.full((3,), float(rank + 1))
dist.all_reduce_coalesced([a, b])
out["coalesced"] = [a.flatten().tolist(), b.tolist()]
a, b = torch.full((2,), 1.0), torch.full((1,), float(rank))
work = dist.all_reduce_coalesced([a, b], async_op=True)
while not work.is_completed():  # polling alone brings the result
    pass
out["coalesced_async"] = [a.tolist(), b.tolist()]
work.wait()
t = torch.full((2,), float(rank + 1))
dist.inference_all_reduce(t)
out["inference_all_reduce"] = t.tolist()
shard = torch.empty(1)
dist.reduce_scatter_fn(shard, torch.arange(2, dtype=torch.float32) + rank)
flat = torch.empty(world)
dist.allgather_fn(flat, torch.full((1,), float(rank)))
out["fns"] = [shard.tolist(), flat.tolist()]
dist.monitored_barrier(timeout=__import__("datetime").timedelta(seconds=60))
out["all_ranks"] = dist.get_all_ranks_from_group()
out["has"] = [dist.has_all_gather_into_tensor(), dist.has_reduce_scatter_tensor(), dist.has_all_reduce_coalesced()]

work = dist.all_reduce(torch.ones(1), async_op=True)
work.wait()
dist.barrier()
out["global_rank_of_1"] = dist.get_global_rank(None, 1)
dist.destroy_process_group()
out["after_destroy"] = dist.is_initialized()
print(json.dumps(out))
