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
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": run.get("lr", 1e-2), "weight_decay": 0.1, **run.get("opt", {})},
        },
        "gradient_clipping": run.get("clip", 0.5),
        "zero_optimization": {
            "stage": run["stage"],
            "overlap_comm": run.get("overlap", True),
            "overlap_param_gather": run.get("overlap", True),
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
    for name, p in model.named_parameters():  # "freeze": these train no more (after Init: the adapter pattern)
        p.requires_grad_(name not in run.get("freeze", ()))
    engine, *_ = fastzero.initialize(model=model, config=config(run))
    if run.get("chunk"):  # ZeRO-Offload: the pipelined step's pieces
        engine.optimizer.chunk = run["chunk"]
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
            state_numels=[t.numel() for g in engine.optimizer.param_groups for t in g["params"]],
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


class OutsideUse(torch.nn.Module):
    """The root's forward reads `head`'s params without calling `head`."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = torch.nn.Linear(33, 65), torch.nn.Linear(65, 17)

    def forward(self, x):
        return torch.nn.functional.gelu(self.body(x)) @ self.head.weight.t() + self.head.bias


def postgather(run: dict) -> None:
    """Stages 1-2 with overlap_comm: after each step() the param all-gathers
    are still in flight (nobody waited for them) and each is waited for by a
    module's forward pre-hook; at every forward the module's params equal a
    plain single-process AdamW's after as many steps; gathered() and
    state_dict() right after step() see the updated params. Stage 3: what
    step() gathers is one all_gather. `outside`: the OutsideUse model
    (`register`: with head's params registered for the root)."""
    model = OutsideUse() if run.get("outside") else make_model()
    ref = OutsideUse() if run.get("outside") else make_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=run.get("lr", 1e-2), weight_decay=0.1)
    engine, *_ = fastzero.initialize(model=model, config=config(run))
    if run.get("register"):
        for p in model.head.parameters():
            engine.register_external_parameter(engine.module, p)
    rank, world, gas = engine.comm.rank, engine.comm.world_size, engine.gradient_accumulation_steps()
    want = dict(ref.named_parameters())
    names = {m: n for n, m in model.named_modules()}
    checked, worst = [], 0.0

    # what each module's forward reads (OutsideUse's root: head's params)
    reads = {m: [(f"{names[m]}.{n}".lstrip("."), p) for n, p in m.named_parameters(recurse=False)] for m in names}
    if run.get("outside"):
        reads[model] = [(f"head.{n}", p) for n, p in model.head.named_parameters()]

    def check(m, _args):  # registered after the engine's pre-hook: runs after its wait
        nonlocal worst
        for full, p in reads[m]:
            worst = max(worst, (p.detach().float() - want[full].detach()).abs().max().item())
            checked.append(full)

    hooks = [m.register_forward_pre_hook(check) for m in model.modules() if reads[m]]
    in_flight, sites, persistent, after_step = [], [], [], {}
    for step in range(run.get("steps", 6)):
        x, y = global_batch(step, MICRO * gas * world)
        for m in range(gas):
            rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
            loss = torch.nn.functional.mse_loss(engine(x[rows]).float(), y[rows])
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.comm.record.clear()
            engine.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x).float(), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), run.get("clip", 0.5))
        opt.step()
        assert boundary
        gathers = engine.comm.events(op="all_gather")
        if engine.stage == 3:
            persistent.append(sorted(e.tag for e in gathers))
            continue
        # launched by this step, nobody waited for them yet, still held by the groups
        in_flight.append((len(gathers), sum(e.wait_site == "" for e in gathers), engine._params_in_flight))
        reader = run.get("read_at", {}).get(str(step))
        if reader == "gathered":
            with engine.gathered() as module:
                after_step[step] = {n: p.detach().clone() for n, p in module.named_parameters()}
        elif reader == "state_dict":
            after_step[step] = {n: t.clone() for n, t in engine.state_dict().items()}
        if reader is not None:
            worst_read = max((after_step[step][n] - want[n].detach()).abs().max().item() for n in want)
            after_step[step] = (reader, worst_read, sorted({e.wait_site for e in gathers}))
        else:
            loss = engine(x[:1])  # an eval-style forward (no backward): the hooks wait as for training
            sites.append(sorted({e.wait_site for e in gathers}))
    for h in hooks:
        h.remove()
    engine.wait_params()
    with engine.gathered() as module:
        params = {n: p.detach().float().clone() for n, p in module.named_parameters()}
    torch.save(
        dict(
            params=params,
            want={n: p.detach().clone() for n, p in want.items()},
            worst=worst,
            checked=sorted(set(checked)),
            in_flight=in_flight,
            sites=sites,
            after_step=after_step,
            persistent=persistent,
            buckets=[len(g.layout.buckets) for g in engine.groups if hasattr(g, "layout")],
        ),
        f"{run['out']}.rank{rank}.pt",
    )


if __name__ == "__main__":
    for run in json.load(open(sys.argv[1])):
        postgather(run) if run.get("postgather") else train(run)
