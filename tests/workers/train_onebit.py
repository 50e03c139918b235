"""One rank of a 1-bit Adam training run (started by tests/dist.py). Argument:
a JSON file with a list of runs. A student MLP learns a fixed random teacher
(a task with a reachable low loss); each rank saves its losses, params and the
bytes its collectives sent after freeze_step to `out` + f".rank{rank}.pt".

Run keys: optimizer (a config optimizer type), params (more optimizer params), stage, dtype, scale_power
(fp16's initial loss scale), loss_mult (the loss backward sees), steps,
freeze, lr, gas, clip, standalone (OneBitAdam without the engine), rank_scale
(standalone: each rank scales its loss by its own power of two and passes it
as grad_scale), save_at/save, load/start."""

import json
import sys
import warnings

import torch

import fastzero
from fastzero.comm import Comm, init_distributed
from fastzero.runtime.onebit_adam import OneBitAdam

MICRO, DIM, OUT = 8, 32, 8


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, OUT)
    )


def teacher():
    gen = torch.Generator().manual_seed(99)
    w1, w2 = torch.randn(DIM, 32, generator=gen) / DIM**0.5, torch.randn(32, OUT, generator=gen) / 32**0.5
    return lambda x: torch.tanh(x @ w1) @ w2


def global_batch(step: int, rows: int, target):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(rows, DIM, generator=gen)
    return x, target(x)


def config(run: dict) -> dict:
    params = {"lr": run.get("lr", 3e-3), "weight_decay": 0.01}
    if run["optimizer"] == "OneBitAdam":
        params.update(freeze_step=run.get("freeze", 20), comm_backend_name="gloo")
    params.update(run.get("params", {}))  # ZeroOneAdam's, OneBitLamb's (tests/runtime/test_zero_one_adam.py ...)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": run.get("gas", 1),
        "optimizer": {"type": run["optimizer"], "params": params},
        "gradient_clipping": run.get("clip", 0.0),
        "zero_optimization": {"stage": run.get("stage", 0), "reduce_bucket_size": 3000},
        "steps_per_print": 100000,
    }
    if run.get("dtype") == "bf16":
        cfg["bf16"] = {"enabled": True}
    if run.get("dtype") == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": run.get("scale_power", 10)}
    return cfg


def train(run: dict) -> None:
    target = teacher()
    model = make_model()
    if run.get("standalone"):
        init_distributed()
        comm = Comm()
        # the same Comm, so its record shows the optimizer's collectives
        opt = OneBitAdam(
            model.parameters(), lr=run.get("lr", 3e-3), freeze_step=run.get("freeze", 20), weight_decay=0.01, comm=comm
        )
        rank, world, gas = comm.rank, comm.world_size, 1
        forward, record = model, comm.record

        rank_scale = 2.0 ** (rank + 3) if run.get("rank_scale") else 1.0  # as per-rank GradScalers could differ

        def backward_step(loss):
            opt.zero_grad()
            (loss * rank_scale).backward()
            opt.step(grad_scale=rank_scale)

        engine = None
    else:
        engine, *_ = fastzero.initialize(model=model, config=config(run))
        rank, world, gas = engine.comm.rank, engine.comm.world_size, engine.gradient_accumulation_steps()
        forward, record = engine, engine.comm.record

        def backward_step(loss):
            engine.backward(loss)
            engine.step()

    start, steps = run.get("start", 0), run.get("steps", 100)
    with warnings.catch_warnings(record=True) as load_warnings:
        warnings.simplefilter("always")
        if run.get("load"):
            engine.load_checkpoint(run["load"])
    losses, sent = [], {}
    for step in range(start, steps):
        if step == run.get("freeze", 20) + 1:
            record.clear()  # count what the steps after the freeze send
        x, y = global_batch(step, MICRO * gas * world, target)
        step_loss = 0.0
        for m in range(gas):
            rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
            loss = torch.nn.functional.mse_loss(forward(x[rows]).float(), y[rows])
            backward_step(loss * run.get("loss_mult", 1.0))
            step_loss += loss.item() / gas  # the task's loss, whatever loss_mult
        losses.append(step_loss)
        if run.get("save_at") == step + 1:
            engine.save_checkpoint(run["save"])
    for e in record:
        sent[e.op] = sent.get(e.op, 0) + e.wire_bytes
    if engine is not None:
        with engine.gathered() as module:
            params = {n: p.detach().float().clone() for n, p in module.named_parameters()}
    else:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    numel = sum(p.numel() for p in model.parameters())
    x, y = global_batch(-1, 1024, target)  # held out: no training batch has this seed
    evaluated = make_model()
    with torch.no_grad():
        for n, p in evaluated.named_parameters():
            p.copy_(params[n])
        eval_loss = torch.nn.functional.mse_loss(evaluated(x), y).item()
    memory = engine.memory_breakdown() if engine is not None else None
    result = dict(
        losses=losses,
        eval_loss=eval_loss,
        params=params,
        sent=sent,
        numel=numel,
        memory=memory,
        load_warnings=[str(w.message) for w in load_warnings],
    )
    torch.save(result, f"{run['out']}.rank{rank}.pt")


if __name__ == "__main__":
    for run in json.load(open(sys.argv[1])):
        train(run)
