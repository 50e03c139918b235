"""Pipeline checkpoints across layouts (tests/pipe/test_pipe_checkpoints.py).

Runs the spec file's runs in order on every rank. A "save" run trains the
pipe_train model (tied in/out projection around small blocks) for a few
steps, saves, and trains on (the uninterrupted run). A "load" run builds
the model at another layout (pipe, data, virtual stages, ZeRO stage), loads
that checkpoint and trains the same steps. Every layout sees the same
global batches: global micro-batch j of step s is pipe_train.batch(s, j, 0),
and data rank d of D, with G / D micro-batches each, takes j = d * G / D + k.
Each rank saves its losses, its params by name (at the save, and after the
load) or the error it raised."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from pipe_train import batch, layers, loss_fn  # noqa: E402

GLOBAL_MICRO = 8  # micro-batches per step, over all data ranks
LR = 1e-2


def config(run: dict, data: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GLOBAL_MICRO // data,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": run["zero"]},
        "pipeline": {"schedule": run.get("schedule", "1f1b"), "p2p_timeout": 60},
        "gradient_clipping": 0.05,
    }


def build(run: dict, world: int):
    import fastzero
    from fastzero.pipe import PipelineModule

    model = PipelineModule(
        layers(run["blocks"], True),
        num_stages=run["stages"],
        loss_fn=loss_fn,
        seed_layers=True,
        base_seed=run.get("seed", 7),
        partition_method="uniform",
        virtual_stages=run.get("virtual", 1),
    )
    data = world // run["stages"]
    engine, *_ = fastzero.initialize(model=model, config=config(run, data))
    return engine, data


def train_steps(engine, data: int, steps: int) -> list[float]:
    data_rank = engine.module.topology.get_coord(engine.global_rank).data
    m = GLOBAL_MICRO // data
    losses = []
    for _ in range(steps):
        step = engine.global_steps
        micro = iter([batch(step, data_rank * m + k, 0) for k in range(m)])
        losses.append(float(engine.train_batch(micro)))
    return losses


def params(engine) -> dict:
    return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def run_one(run: dict, world: int) -> dict:
    engine, data = build(run, world)
    out = {"stage": engine.stage_id, "data": data}
    if run["kind"] == "save":
        out["before"] = train_steps(engine, data, run["steps"])
        engine.save_checkpoint(run["dir"], tag="ckpt")
        out["saved"] = params(engine)
        out["after"] = train_steps(engine, data, run["steps"])
        return out
    try:
        engine.load_checkpoint(run["dir"], tag="ckpt")
    except Exception as exc:
        if not run.get("expect_error"):
            raise
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    out["global_steps"] = engine.global_steps
    out["loaded"] = params(engine)
    out["after"] = train_steps(engine, data, run["steps"])
    return out


def main() -> None:
    import fastzero

    fastzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for run in json.load(open(sys.argv[1])):
        torch.save(run_one(run, world), f"{run['out']}.rank{rank}.pt")
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
