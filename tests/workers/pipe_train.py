"""Pipeline-parallel training against a single process (tests/pipe/test_pipe_engine.py).

Each run of the spec file builds a PipelineModule (a tied in/out projection
around small blocks), trains it with engine.train_batch on deterministic
micro-batches, and saves per rank: the returned losses, the gradient norms,
its local params by name, and (rank 0) the same run on one process:
PipelineModule.build_sequential with torch.optim.AdamW over every data
rank's micro-batches."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

D = 8  # width
MICRO = 2  # rows per micro-batch
LR = 1e-2


class Proj(nn.Module):
    """The tied layer: a square projection in, and its transpose out."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x):
        return x @ self.weight.t()


def proj_out(module: Proj, x):
    return x @ module.weight


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def layers(blocks: int, tied: bool) -> list:
    from fastzero.pipe import LayerSpec, TiedLayerSpec

    first = TiedLayerSpec("proj", Proj, D) if tied else LayerSpec(nn.Linear, D, D)
    last = TiedLayerSpec("proj", Proj, D, forward_fn=proj_out) if tied else LayerSpec(nn.Linear, D, D)
    return [first, *[LayerSpec(Block, D) for _ in range(blocks)], last]


def loss_fn(out, labels):
    return F.mse_loss(out.float(), labels.float())


def batch(step: int, micro: int, data_rank: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + data_rank)
    return torch.randn(MICRO, D, generator=g), torch.randn(MICRO, D, generator=g)


def dataset() -> list:
    """Samples for initialize(training_data=...): its loader splits them over the data ranks."""
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(D, generator=g), torch.randn(D, generator=g)) for _ in range(64)]


def loaders(data_ranks: int) -> list:
    """What initialize's loader gives each data rank (the same sampler), cycled."""
    from torch.utils.data import DataLoader, DistributedSampler

    def cycle(loader):
        while True:
            yield from loader

    data = dataset()
    return [
        cycle(
            DataLoader(
                data, batch_size=MICRO, sampler=DistributedSampler(data, data_ranks, r) if data_ranks > 1 else None
            )
        )
        for r in range(data_ranks)
    ]


def config(run: dict) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": run["micro_batches"],
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        # stage 3: every param partitioned (none kept whole as small), so the gathers are counted
        "zero_optimization": {
            "stage": run.get("zero", 0),
            "stage3_param_persistence_threshold": 0,
            **run.get("zeropp", {}),
        },
        "pipeline": {
            "schedule": run["schedule"],
            "p2p_timeout": run.get("timeout", 60),
            "p2p_groups": run.get("groups", "auto"),
        },
        "gradient_clipping": run.get("clip", 0.0),
    }
    if run.get("dtype") == "bf16":
        cfg["bf16"] = {"enabled": True}
    if run.get("dtype") == "bf16-nomaster":  # bf16 params without fp32 masters (tests/runtime/test_no_master.py)
        cfg["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True}
    if run.get("dtype") == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}  # one overflow halves the scale
    return cfg


def reference(run: dict, data_ranks: int) -> dict:
    """The same training on one process: every data rank's micro-batches, summed and averaged."""
    from fastzero.pipe import PipelineModule

    model = PipelineModule.build_sequential(
        layers(run["blocks"], run.get("tied", True)), loss_fn=loss_fn, seed_layers=True, base_seed=7
    )
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    m, losses, norms = run["micro_batches"], [], []
    feeds = loaders(data_ranks) if run.get("loader") else None
    for step in range(run["steps"]):
        total = 0.0
        for r in range(data_ranks):
            for k in range(m):
                x, y = next(feeds[r]) if feeds else batch(step, k, r)
                loss = loss_fn(model(x), y)
                (loss / (m * data_ranks)).backward()
                total += loss.item() / (m * data_ranks)
        losses.append(total)
        clip = run.get("clip", 0.0)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        held_out = sum(
            loss_fn(model(x), y).item() for r in range(data_ranks) for x, y in (batch(100, k, r) for k in range(m))
        )
    evaluated = held_out / (m * data_ranks)
    return {"losses": losses, "norms": norms, "initial": initial, "params": params, "eval": evaluated}


def train(run: dict) -> dict:
    import fastzero
    from fastzero.pipe import PipelineModule

    model = PipelineModule(
        layers(run["blocks"], run.get("tied", True)),
        num_stages=run["stages"],
        loss_fn=loss_fn,
        seed_layers=True,
        base_seed=7,
        partition_method="uniform",
        virtual_stages=run.get("virtual", 1),
    )
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    training_data = dataset() if run.get("loader") else None
    engine, *_ = fastzero.initialize(model=model, config=config(run), training_data=training_data)
    data_rank = engine.module.topology.get_coord(engine.global_rank).data
    losses, norms, skipped, scales, gathers, scatters = [], [], [], [], [], []
    engine.comm.record.clear()
    if run.get("fail") == "raise" and engine.stage_id == 1:  # a stage whose layer raises in the second step

        def fail(module, args):
            if engine.global_steps == 1:
                raise RuntimeError("injected failure in a stage-1 layer")

        engine.module.chunks[0].register_forward_pre_hook(fail)
    for step in range(run["steps"]):
        count = run["micro_batches"] - (run.get("fail") == "dry" and step == 1)  # one micro-batch short
        micro = iter([batch(step, k, data_rank) for k in range(count)])
        if run.get("inf_at") == step and engine.stage_id == run.get("inf_stage", 0):
            # a non-finite gradient on one stage only, after its reduction: every stage must skip the step
            reduce = engine._reduce_grads

            def poisoned(*args, reduce=reduce):
                reduce(*args)
                engine.groups[0].grads().view(-1)[0] = float("inf")

            engine._reduce_grads = poisoned
            losses.append(float(engine.train_batch(micro)))
            del engine._reduce_grads
        else:
            losses.append(float(engine.train_batch(None if run.get("loader") else micro)))
        norms.append(engine.get_global_grad_norm())
        skipped.append(engine.skipped_steps)
        scales.append(engine.loss_scale)
        # stage 3's param all-gathers in this step (tagged "param:<name>")
        gathers.append(sum(e.tag.startswith("param:") for e in engine.comm.events("all_gather")))
        # the gradients' (stages 1-2): reduce-scatters, or qgZ's all-to-alls
        scatters.append(sum(e.op in ("reduce_scatter", "all_to_all") for e in engine.comm.events(tag="grad")))
        engine.comm.record.clear()
    units = len(engine.fetcher.unit_of) if engine.fetcher is not None else 0
    evaluated = float(engine.eval_batch(iter([batch(100, k, data_rank) for k in range(run["micro_batches"])])))
    eval_gathers = sum(e.tag.startswith("param:") for e in engine.comm.events("all_gather"))
    with engine.gathered():  # stage 3: the partitioned params whole
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return {
        "losses": losses,
        "norms": norms,
        "skipped": skipped,
        "scales": scales,
        "gathers": gathers,
        "scatters": scatters,
        "transport": type(engine.p2p).__name__,
        "buckets": sum(len(g.layout.buckets) for g in engine.groups if hasattr(g, "layout")),
        "eval_gathers": eval_gathers,
        "units": units,
        "initial": initial,
        "params": params,
        "stage": engine.stage_id,
        "schedule": engine.schedule_name,
        "data_rank": data_rank,
        "dp_world_size": engine.dp_world_size,
        "bubble": engine.bubble,
        "eval": [evaluated],
        "master": engine.memory_breakdown()["master"],
    }


def main() -> None:
    import fastzero

    fastzero.init_distributed()
    rank = torch.distributed.get_rank()
    runs = json.load(open(sys.argv[1]))
    for run in runs:
        start = time.perf_counter()
        try:
            out = train(run)
        except Exception as exc:  # reported per run; the test decides what was expected
            if not run.get("expect_error"):
                raise
            out = {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - start}
        if rank == 0 and not run.get("expect_error"):
            out["reference"] = reference(run, torch.distributed.get_world_size() // run["stages"])
        torch.save(out, f"{run['out']}.rank{rank}.pt")
    if any(run.get("fail") for run in runs):
        # after a failure the ranks are out of step: no collective, and no teardown of the process group
        # under a receive still posted to the failed peer
        sys.stdout.flush()
        os._exit(0)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
