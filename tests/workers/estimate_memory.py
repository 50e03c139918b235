"""One rank of a short bf16 run at stages 2 and 3 (started by tests/dist.py);
rank 0 saves each stage's ``memory_breakdown()`` to the path in argv[1]."""

import sys

import torch

import fastzero


def make_mlp() -> torch.nn.Module:
    """Two 131k-param layers (sharded at stage 3) and 17k params below the
    persistence threshold (kept whole)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
    )


def breakdown(stage: int, steps: int = 2, optimizer: dict | None = None, bf16: dict | None = None) -> dict[str, int]:
    """`optimizer`: more optimizer params (a state format); `bf16`: more bf16 keys (no fp32 master)."""
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": True, **(bf16 or {})},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, **(optimizer or {})}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = fastzero.initialize(model=make_mlp(), config=config)
    gen = torch.Generator().manual_seed(engine.comm.rank)
    for _ in range(steps):
        loss = engine(torch.randn(4, 256, generator=gen, dtype=torch.bfloat16)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    return engine.memory_breakdown()


if __name__ == "__main__":
    found = {stage: breakdown(stage) for stage in (2, 3)}
    if torch.distributed.get_rank() == 0:
        torch.save(found, sys.argv[1])
