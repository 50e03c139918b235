"""A training script as a user writes it, for the launcher tests: four
fastzero stage-2 steps on the same global batches whatever the world size;
rank 0 saves the params to argv[1] (after the launcher's --local_rank=N)."""

import sys

import torch

import fastzero

argv = [a for a in sys.argv if not a.startswith("--local_rank=")]

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
config = {
    "train_batch_size": 16,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 256, "overlap_comm": True},
}
engine, *_ = fastzero.initialize(model=model, config=config)
rank, world, mbs = engine.comm.rank, engine.comm.world_size, engine.train_micro_batch_size_per_gpu()
for step in range(4):
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 16, generator=gen), torch.randn(16, 8, generator=gen)
    for m in range(engine.gradient_accumulation_steps()):
        rows = slice((m * world + rank) * mbs, (m * world + rank + 1) * mbs)
        engine.backward(torch.nn.functional.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
if rank == 0:
    torch.save({n: p.detach() for n, p in model.named_parameters()}, argv[1])
print(f"rank {rank} of {world} done", flush=True)
