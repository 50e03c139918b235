"""One rank of a run with every monitor on (started by tests/dist.py):
memory_breakdown, the flops profiler and wandb (offline). Argument: the ZeRO
stage. What a rank logs goes to its stdout, which the test reads."""

import logging
import sys

import torch

import fastzero
from tests.workers.train_zero import make_model

if __name__ == "__main__":
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
    logging.getLogger("fastzero").setLevel(logging.INFO)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": int(sys.argv[1])},
        "steps_per_print": 1,
        "memory_breakdown": True,
        "flops_profiler": {"enabled": True, "profile_step": 1, "detailed": False},
        "wandb": {"enabled": True, "project": "fz-test"},
    }
    engine, *_ = fastzero.initialize(model=make_model(), config=config)
    gen = torch.Generator().manual_seed(engine.global_rank)
    for _ in range(3):
        x, y = torch.randn(4, 33, generator=gen), torch.randn(4, 17, generator=gen)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    engine.monitor.close()
    print(f"rank {engine.global_rank} done", flush=True)
