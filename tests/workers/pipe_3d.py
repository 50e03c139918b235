"""Pipe x tensor x data training against a single process (tests/pipe/test_pipe_3d.py).

Each run of the spec file builds a PipelineModule on Topology(pipe=2,
tensor=..., data=...) from tensor-parallel layers (ColumnParallelLinear /
RowParallelLinear blocks, a tied replicated projection on the first and last
stages), trains it with engine.train_batch, and saves per rank: the losses,
the gradient norms, its local params (tensor shards) with their tensor
coordinate and split dim. Rank 0 also runs the reference: the unsplit model
(nn.Linear in place of each parallel layer) whose weights are assembled from
every rank's initial shards, trained by torch.optim.AdamW on every data
rank's micro-batches."""

from __future__ import annotations

import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.workers.pipe_train import LR, MICRO, Proj, batch, loss_fn, proj_out

D = 8  # width (the blocks' hidden width is 2 * D, split over the tensor ranks)


class Block(nn.Module):
    """A Megatron MLP block: column-split up, row-split down (`tp`), or plain
    nn.Linear for the reference, under the same names."""

    def __init__(self, d: int, tp: bool) -> None:
        super().__init__()
        from fastzero.parallel import ColumnParallelLinear, RowParallelLinear

        self.norm = nn.LayerNorm(d)
        self.up = ColumnParallelLinear(d, 2 * d, gather_output=False) if tp else nn.Linear(d, 2 * d)
        self.down = RowParallelLinear(2 * d, d, input_is_parallel=True) if tp else nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def layers(blocks: int, tp: bool) -> list:
    from fastzero.parallel import ColumnParallelLinear, RowParallelLinear
    from fastzero.pipe import LayerSpec, TiedLayerSpec

    first = LayerSpec(ColumnParallelLinear, D, D, gather_output=True) if tp else LayerSpec(nn.Linear, D, D)
    last = LayerSpec(RowParallelLinear, D, D) if tp else LayerSpec(nn.Linear, D, D)
    return [
        TiedLayerSpec("proj", Proj, D),
        first,
        *[LayerSpec(Block, D, tp) for _ in range(blocks)],
        last,
        TiedLayerSpec("proj", Proj, D, forward_fn=proj_out),
    ]


def config(run: dict) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": run["micro_batches"],
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": run["zero"], "stage3_param_persistence_threshold": 0},
        "pipeline": {"schedule": run["schedule"], "p2p_timeout": 120},
        "gradient_clipping": run["clip"],
    }
    if run.get("dtype") == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def split_dim(p) -> int | None:
    from fastzero.parallel import is_tensor_parallel

    return p.partition_dim if is_tensor_parallel(p) else None


def assemble(shards: list[dict], name: str) -> torch.Tensor:
    """The whole param `name` from every rank's (tensor rank, split dim, shard)."""
    pieces = {}
    for rank_shards in shards:
        if name in rank_shards:
            t, dim, value = rank_shards[name]
            pieces[t] = (dim, value)
    dim = pieces[0][0]
    if dim is None:
        return pieces[0][1]
    return torch.cat([pieces[t][1] for t in sorted(pieces)], dim=dim)


def reference(run: dict, shards: list[dict], data_ranks: int) -> dict:
    from fastzero.pipe import PipelineModule

    model = PipelineModule.build_sequential(layers(run["blocks"], tp=False), loss_fn=loss_fn)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(assemble(shards, n))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    m, losses, norms = run["micro_batches"], [], []
    for step in range(run["steps"]):
        total = 0.0
        for r in range(data_ranks):
            for k in range(m):
                x, y = batch(step, k, r)
                loss = loss_fn(model(x), y)
                (loss / (m * data_ranks)).backward()
                total += loss.item() / (m * data_ranks)
        losses.append(total)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), run["clip"])))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def train(run: dict) -> dict:
    import fastzero
    from fastzero.parallel import Topology
    from fastzero.pipe import PipelineModule

    world = torch.distributed.get_world_size()
    topo = Topology(pipe=2, tensor=run["tensor"], data=world // (2 * run["tensor"]))
    model = PipelineModule(
        layers(run["blocks"], tp=True),
        topology=topo,
        loss_fn=loss_fn,
        seed_layers=True,
        base_seed=11,
        partition_method="uniform",
    )
    coord = topo.get_coord(torch.distributed.get_rank())
    initial = {n: (coord.model, split_dim(p), p.detach().clone()) for n, p in model.named_parameters()}
    engine, *_ = fastzero.initialize(model=model, config=config(run))
    losses, norms = [], []
    for step in range(run["steps"]):
        micro = iter([batch(step, k, coord.data) for k in range(run["micro_batches"])])
        losses.append(float(engine.train_batch(micro)))
        norms.append(engine.get_global_grad_norm())
    with engine.gathered():  # stage 3: the data-partitioned shards whole (each still its tensor slice)
        named = engine.module.named_parameters()
        params = {n: (coord.model, split_dim(p), p.detach().float().clone()) for n, p in named}
    everyone = engine.world_comm.all_gather_objects(initial)
    out = {
        "losses": losses,
        "norms": norms,
        "params": params,
        "coord": coord._asdict(),
        "stage": engine.stage_id,
        "mp_world_size": engine.mp_world_size,
        "dp_world_size": engine.dp_world_size,
    }
    if torch.distributed.get_rank() == 0:
        out["reference"] = reference(run, everyone, topo.get_dim("data"))
    return out


def main() -> None:
    import fastzero

    fastzero.init_distributed()
    rank = torch.distributed.get_rank()
    for run in json.load(open(sys.argv[1])):
        torch.save(train(run), f"{run['out']}.rank{rank}.pt")
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
