"""One rank of a ZeRO training run (started by tests/dist.py). Argument: a
JSON file with a list of runs; each run trains the test model and saves what
the tests compare to `out` + f".rank{rank}.pt"."""

import json
import math
import sys

import torch

import fastzero

MICRO = 4


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.GELU(), torch.nn.Linear(65, 17),
                               torch.nn.LayerNorm(17))  # fmt: skip


def global_batch(step: int, rows: int):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, 33, generator=gen), torch.randn(rows, 17, generator=gen)


def config(run: dict) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": run.get("gas", 2),
        "optimizer": {"type": "AdamW", "params": {"lr": run.get("lr", 1e-2), "weight_decay": 0.1}},
        "gradient_clipping": run.get("clip", 0.5),
        "zero_optimization": {"stage": run["stage"], "overlap_comm": run.get("overlap", True),
                              "reduce_bucket_size": run.get("bucket", 640), "allgather_bucket_size": 100000},
        "steps_per_print": 1000,
    }  # fmt: skip
    if run.get("offload"):
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if run.get("dtype") == "bf16":
        cfg["bf16"] = {"enabled": True}
    if run.get("dtype") == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12, "hysteresis": 1}
    return cfg


def train(run: dict) -> None:
    engine, *_ = fastzero.initialize(model=make_model(), config=config(run))
    rank, world, gas = engine.comm.rank, engine.comm.world_size, engine.gradient_accumulation_steps()
    scales, losses = [], []
    start = run.get("start", 0)
    if run.get("load"):
        _, client_state = engine.load_checkpoint(run["load"])
        assert client_state == {"step": start}, client_state
    for step in range(start, run.get("steps", 10)):
        x, y = global_batch(step, MICRO * gas * world)
        for m in range(gas):
            rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
            loss = torch.nn.functional.mse_loss(engine(x[rows]).float(), y[rows])
            if run.get("inf_at") == [step, rank]:
                loss = loss * math.inf
            if step == run.get("steps", 10) - 1 and m == gas - 1:
                engine.comm.record.clear()  # keep the last backward's collectives
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        scales.append(engine.loss_scale)
        if run.get("save_at") == step + 1:
            engine.save_checkpoint(run["save"], client_state={"step": step + 1})
    backward_end = engine.timers["backward_end"]
    torch.save(
        dict(
            params={n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
            memory=engine.memory_breakdown(),
            layouts=[
                (g.layout.numel, g.layout.total, g.layout.shard_size, len(g.layout.buckets)) for g in engine.groups
            ],
            grad_launches=[e.launched - backward_end for e in engine.comm.events(tag="grad")],
            grad_ops=sorted({e.op for e in engine.comm.events(tag="grad")}),
            scales=scales,
            skipped=engine.skipped_steps,
            losses=losses,
        ),
        f"{run['out']}.rank{rank}.pt",
    )


if __name__ == "__main__":
    for run in json.load(open(sys.argv[1])):
        train(run)
