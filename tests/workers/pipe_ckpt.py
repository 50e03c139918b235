"""Pipeline checkpoints across layouts (tests/pipe/test_pipe_checkpoints.py).

Runs the spec file's runs in order on every rank. A "save" run trains the
pipe_train model (tied in/out projection around small blocks) for a few
steps, saves, and trains on (the uninterrupted run). A "load" run builds
the model at another layout (pipe, data, virtual stages, ZeRO stage), loads
that checkpoint and trains the same steps. Every layout sees the same
global batches: global micro-batch j of step s is pipe_train.batch(s, j, 0),
and data rank d of D, with G / D micro-batches each, takes j = d * G / D + k.
Each rank saves its losses, its params by name (at the save, and after the
load) or the error it raised.

A run with "tp" builds the tensor-parallel variant on Topology(pipe, tensor,
data): blocks of ColumnParallelLinear / RowParallelLinear under the plain
blocks' names (the same maths and init at tensor 1). Its params are each
rank's tensor slices, saved with their split dim and the rank's coordinates
so the test assembles them. "engine": "plain" trains that variant as a
plain nn.Module (TPModel, the pipeline's param names) on the plain engine,
pipe 1."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from pipe_train import D, Proj, batch, layers, loss_fn, proj_out  # noqa: E402

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


class TPBlock(nn.Module):
    """pipe_train.Block with its linears split over the tensor axis (column-split up, row-split down)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        from fastzero.parallel import ColumnParallelLinear, RowParallelLinear

        self.norm = nn.LayerNorm(d)
        self.up = ColumnParallelLinear(d, 2 * d, gather_output=False)
        self.down = RowParallelLinear(2 * d, d, input_is_parallel=True)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def tp_layers(blocks: int) -> list:
    from fastzero.pipe import LayerSpec, TiedLayerSpec

    return [
        TiedLayerSpec("proj", Proj, D),
        *[LayerSpec(TPBlock, D) for _ in range(blocks)],
        TiedLayerSpec("proj", Proj, D, forward_fn=proj_out),
    ]


class TPModel(nn.Module):
    """tp_layers as one plain module, under the PipelineModule's param names
    (tied_modules.proj.*, <layer index>.*), for the plain engine."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.tied_modules = nn.ModuleDict({"proj": Proj(D)})
        self.blocks = blocks
        for i in range(1, blocks + 1):
            self.add_module(str(i), TPBlock(D))

    def forward(self, x):
        proj = self.tied_modules["proj"]
        x = proj(x)
        for i in range(1, self.blocks + 1):
            x = self._modules[str(i)](x)
        return proj_out(proj, x)


class PlainTrainer:
    """train_batch for the plain engine: the micro-batches through forward / backward / step, and the mean
    micro-batch loss over the data ranks (as the pipeline engine returns it)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __call__(self, micro) -> float:
        total = torch.zeros(())
        for x, y in micro:
            loss = loss_fn(self.engine(x), y)
            self.engine.backward(loss)
            self.engine.step()
            total += loss.detach() / self.engine.gradient_accumulation_steps()
        torch.distributed.all_reduce(total)  # every tensor rank of a data rank has the same loss
        return float(total) / torch.distributed.get_world_size()


def build(run: dict, world: int):
    import fastzero
    from fastzero.parallel import Topology
    from fastzero.pipe import PipelineModule

    tensor = run.get("tensor", 1)
    data = world // (run["stages"] * tensor)
    cfg = config(run, data)
    if run.get("engine") == "plain":  # the tensor-parallel variant on the plain engine
        topo = Topology(pipe=1, tensor=tensor, data=data)
        topo.make_current()  # the parallel layers split over its tensor axis
        torch.manual_seed(run.get("seed", 7))  # replicated params alike on every rank
        del cfg["pipeline"]
        engine, *_ = fastzero.initialize(model=TPModel(run["blocks"]), config=cfg, topology=topo)
        return engine, topo, data
    where = {"topology": Topology(pipe=run["stages"], tensor=tensor, data=data)} if run.get("tp") else {}
    model = PipelineModule(
        tp_layers(run["blocks"]) if run.get("tp") else layers(run["blocks"], True),
        **(where or {"num_stages": run["stages"]}),
        loss_fn=loss_fn,
        seed_layers=True,
        base_seed=run.get("seed", 7),
        partition_method="uniform",
        virtual_stages=run.get("virtual", 1),
    )
    engine, *_ = fastzero.initialize(model=model, config=cfg)
    return engine, model.topology, data


def train_steps(engine, topo, data: int, steps: int) -> list[float]:
    from fastzero.runtime.pipe_engine import PipelineEngine

    data_rank = topo.get_coord(torch.distributed.get_rank()).data
    train_batch = engine.train_batch if isinstance(engine, PipelineEngine) else PlainTrainer(engine)
    m = GLOBAL_MICRO // data
    losses = []
    for _ in range(steps):
        step = engine.global_steps
        micro = iter([batch(step, data_rank * m + k, 0) for k in range(m)])
        losses.append(float(train_batch(micro)))
    return losses


def params(engine) -> dict:
    return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def splits(engine) -> dict:
    """The split dim of each param split over the tensor axis (its value is this rank's slice)."""
    from fastzero.parallel import is_tensor_parallel

    return {n: int(p.partition_dim) for n, p in engine.module.named_parameters() if is_tensor_parallel(p)}


def run_one(run: dict, world: int) -> dict:
    engine, topo, data = build(run, world)
    coord = topo.get_coord(torch.distributed.get_rank())
    out = {"stage": getattr(engine, "stage_id", 0), "data": data, "coord": coord._asdict(), "split": splits(engine)}
    if run["kind"] == "save":
        out["before"] = train_steps(engine, topo, data, run["steps"])
        engine.save_checkpoint(run["dir"], tag="ckpt")
        out["saved"] = params(engine)
        out["after"] = train_steps(engine, topo, data, run["steps"])
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
    out["after"] = train_steps(engine, topo, data, run["steps"])
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
