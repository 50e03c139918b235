"""One rank of a ``python -m bench.run --kernel zeropp`` job (bench/kernels/zeropp.py
starts WORLD of these over Gloo as 2 simulated nodes of 2: LOCAL_RANK and
LOCAL_WORLD_SIZE as torchrun sets them on each node; one thread each).
argv[1]: a JSON spec (provider, variant: the ZeRO++ keys, the model's hidden
size and depth, micro-batch, dtype, warm-up and timed steps, out).

Every rank trains the same bench/tiny_gpt.py model at ZeRO stage 3 on its
slice of the same synthetic batches: warm-up steps, then timed steps
(forward + backward + step). For one step after the timed ones, every
collective is counted with its bytes: fastzero's from the comm records of
every group its engine has (``engine.comms()``), the peer's from its own
counter (bench/zeropp_deepspeed.py); bytes sent by this rank with the
bandwidth-optimal algorithm (``CommEvent.wire_bytes``) and bytes received
from other nodes with the direct one (``fastzero.comm.cross_node_bytes``).
Rank 0 writes times, bytes, the loss and the model-state bytes; a provider
that cannot run here writes ``{"skipped": why}``."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from .jobs import finish_rank
from .tiny_gpt import lm_loss, make_model, sequences

LR = 3e-3


class Skip(Exception):
    """This provider cannot run here (a peer not installed, or refusing the setting)."""


def config(spec: dict) -> dict:
    """The DeepSpeed config both providers train with (fastzero's own keys only for fastzero)."""
    zero = {
        "stage": 3,
        "overlap_comm": True,
        "reduce_bucket_size": spec["bucket"],
        "allgather_bucket_size": spec["bucket"],
        "stage3_prefetch_bucket_size": spec["bucket"],
        "stage3_param_persistence_threshold": spec["persist"],
        "stage3_max_reuse_distance": 0,  # released after each use: backward gathers again, as in a big model
        **spec["variant"],
    }
    cfg = {
        "train_micro_batch_size_per_gpu": spec["micro"],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if spec.get("dtype") == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def batch(spec: dict, step: int, rank: int, world: int) -> torch.Tensor:
    ids = sequences(spec["micro"] * world, 1000 + step)
    return ids[rank * spec["micro"] : (rank + 1) * spec["micro"]]


def node_map() -> dict[int, int]:
    """Global rank -> simulated node, from every rank's RANK - LOCAL_RANK."""
    keys = [None] * dist.get_world_size()
    dist.all_gather_object(keys, int(os.environ["RANK"]) - int(os.environ.get("LOCAL_RANK", "0")))
    order = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    return {r: order[k] for r, k in enumerate(keys)}


def kind(tag: str) -> str:
    """What a collective moved: param (gathers), grad, or other (norms, agreement, persistent params)."""
    if tag == "grad":
        return "grad"
    return "param" if tag.startswith("param:") and tag != "param:persistent" else "other"


def fastzero_job(spec: dict):
    import fastzero
    from fastzero.comm import cross_node_bytes

    engine, *_ = fastzero.initialize(model=make_model(spec["hidden"], spec["layers"]), config=config(spec))
    rank, world = engine.comm.rank, engine.comm.world_size

    def step(i: int) -> float:
        ids = batch(spec, i, rank, world)
        loss = lm_loss(engine(ids[:, :-1]), ids)
        engine.backward(loss)
        engine.step()
        return loss.item()

    def counted(i: int, nodes: dict[int, int]) -> tuple[float, dict]:
        comms = engine.comms()
        for c in comms:
            c.record.clear()
        loss = step(i)
        sums = {}
        for e in (e for c in comms for e in c.record):
            k = kind(e.tag)
            wire, cross = sums.setdefault(f"wire_{k}", 0.0), sums.setdefault(f"cross_{k}", 0.0)
            sums[f"wire_{k}"], sums[f"cross_{k}"] = wire + e.wire_bytes, cross + cross_node_bytes(e, nodes)
            sums["collectives"] = sums.get("collectives", 0) + 1
        return loss, sums

    return step, counted, lambda: sum(engine.memory_breakdown().values())


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    try:
        if spec["provider"] == "fastzero":
            step, counted, state_bytes = fastzero_job(spec)
        else:
            from .zeropp_deepspeed import deepspeed_job

            step, counted, state_bytes = deepspeed_job(spec, config(spec), Skip)
    except Skip as exc:
        if os.environ["RANK"] == "0":
            with open(spec["out"], "w") as f:
                json.dump({"skipped": str(exc)}, f)
        return
    nodes = node_map()
    losses, times = [], []
    for i in range(spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        losses.append(step(i))
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
    loss, sums = counted(spec["warmup"] + spec["steps"], nodes)
    losses.append(loss)
    result = dict(times=times, losses=losses, model_state_bytes=state_bytes(), **sums)
    finish_rank(result, spec["out"], dist.get_rank(), dist.barrier)


if __name__ == "__main__":
    main()
