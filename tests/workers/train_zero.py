"""One rank of a ZeRO training run (started by tests/dist.py). Argument: a
JSON file with a list of runs; each run trains the test model and saves what
the tests compare to `out` + f".rank{rank}.pt"."""

import json
import math
import sys
import time

import torch

import fastzero
import fastzero.zero

MICRO = 4


class Branchy(torch.nn.Module):
    """A forward that takes a data-dependent branch (the same on every rank)."""

    def __init__(self):
        super().__init__()
        self.a, self.b1, self.b2 = torch.nn.Linear(33, 65), torch.nn.Linear(65, 65), torch.nn.Linear(65, 65)
        self.c, self.norm = torch.nn.Linear(65, 17), torch.nn.LayerNorm(17)

    def forward(self, x, step):
        h = torch.nn.functional.gelu(self.a(x))
        h = torch.nn.functional.gelu(self.b1(h) if step % 3 else self.b2(h))
        return self.norm(self.c(h))


def make_model(kind: str = "mlp"):
    torch.manual_seed(0)
    if kind == "branchy":
        return Branchy()
    return torch.nn.Sequential(
        torch.nn.Linear(33, 65), torch.nn.GELU(), torch.nn.Linear(65, 17), torch.nn.LayerNorm(17)
    )


def global_batch(step: int, rows: int):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, 33, generator=gen), torch.randn(rows, 17, generator=gen)


def config(run: dict) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": run.get("gas", 2),
        "optimizer": {"type": "AdamW", "params": {"lr": run.get("lr", 1e-2), "weight_decay": 0.1}},
        "gradient_clipping": run.get("clip", 0.5),
        "zero_optimization": {
            "stage": run["stage"],
            "overlap_comm": run.get("overlap", True),
            "reduce_bucket_size": run.get("bucket", 640),
            "allgather_bucket_size": 100000,
        },
        "steps_per_print": 1000,
    }
    cfg["zero_optimization"].update(run.get("zero", {}))
    cfg.update(run.get("top", {}))  # top-level keys (communication_data_type, prescale_gradients, ...)
    if run.get("offload"):
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if run.get("offload_param"):
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if run.get("dtype") == "bf16":
        cfg["bf16"] = {"enabled": True}
    if run.get("dtype") == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12, "hysteresis": 1}
    return cfg


def train(run: dict) -> None:
    if run.get("init"):  # partitioned as it is built
        with fastzero.zero.Init():
            model = make_model(run.get("model", "mlp"))
        assert all(p.numel() == 0 and hasattr(p, "_fz_shard") for p in model.parameters())
    else:
        model = make_model(run.get("model", "mlp"))
    engine, *_ = fastzero.initialize(model=model, config=config(run))
    fetcher = engine.fetcher
    if fetcher is not None:
        fetcher.record_timeline = True
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
            args = (x[rows], step) if run.get("model") == "branchy" else (x[rows],)
            if fetcher is not None and step == run.get("steps", 10) - 1 and m == 0:
                engine.comm.record.clear()  # the last step's first forward: its all-gathers and module ends
                fetcher.timeline.clear()
                forward_start = time.perf_counter()
            loss = torch.nn.functional.mse_loss(engine(*args).float(), y[rows])
            if fetcher is not None and step == run.get("steps", 10) - 1 and m == 0:
                gathers = [(e.launched - forward_start, e.tag) for e in engine.comm.events(op="all_gather")]
                ends = [(t - forward_start, name) for t, _, name in fetcher.timeline]
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
    with engine.gathered() as module:
        params = {n: p.detach().float().clone() for n, p in module.named_parameters()}
    torch.save(
        dict(
            params=params,
            memory=engine.memory_breakdown(),
            layouts=[
                (g.layout.numel, g.layout.total, g.layout.shard_size, len(g.layout.buckets))
                for g in engine.groups
                if hasattr(g, "layout")
            ],
            grad_launches=[e.launched - backward_end for e in engine.comm.events(tag="grad")],
            grad_ops=sorted({e.op for e in engine.comm.events(tag="grad")}),
            scales=scales,
            stage3=None
            if fetcher is None
            else dict(peak_live=fetcher.peak_live, retraced=fetcher.retraced, gathers=gathers, ends=ends),
            skipped=engine.skipped_steps,
            losses=losses,
        ),
        f"{run['out']}.rank{rank}.pt",
    )


if __name__ == "__main__":
    for run in json.load(open(sys.argv[1])):
        train(run)
