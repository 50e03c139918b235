"""One rank of a ``python -m bench.run --kernel zero`` job (started by
bench/kernels/zero.py with torchrun's variables, one thread per rank).

Argument: a JSON spec (provider, variant, model width and depth, micro-batch,
bucket size, warm-up and timed steps, output path). Each rank trains the same
MLP stack on its own fixed random batch: warm-up steps, then timed steps
(forward + backward + step, no barrier). Rank 0 writes per-step times,
per-rank model-state bytes and the provider's own figures to the output
path; a peer that cannot run here writes ``{"skipped": why}`` instead.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

HYPER = dict(lr=1e-3, weight_decay=0.01)


class Skip(Exception):
    """This provider cannot run here (a peer not installed, say)."""


def make_model(width: int, layers: int) -> torch.nn.Sequential:
    torch.manual_seed(0)  # every provider and rank starts from the same weights
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`: views and aliases
    count once, a DTensor by its local shard, a freed (resized) storage 0."""
    storages = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        s = t.untyped_storage()
        storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
    return sum(storages.values())


def tensors_in(obj, depth: int = 3) -> list:
    """The tensors in `obj` and its lists, tuples and dicts, `depth` levels down."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if depth == 0 or not isinstance(obj, (list, tuple)):
        return []
    return [t for item in obj for t in tensors_in(item, depth - 1)]


def optimizer_tensors(opt: torch.optim.Optimizer) -> list:
    out = [p for g in opt.param_groups for p in g["params"]]
    out += [p.grad for p in out]
    out += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


class Job:
    """A provider set up on this rank: ``step()`` is timed; ``before()`` and
    ``after()`` run around it, untimed, to read diagnostics."""

    extra: dict

    def before(self) -> None:
        pass

    def after(self) -> None:
        pass

    def memory(self) -> dict:
        raise NotImplementedError


class Fastzero(Job):
    def __init__(self, spec, x, y):
        import fastzero

        zero = {"stage": spec["variant"], "overlap_comm": True, "reduce_bucket_size": spec["bucket"]}
        cfg = {"train_micro_batch_size_per_gpu": spec["micro"], "steps_per_print": 10**9, "zero_optimization": zero,
               "optimizer": {"type": "AdamW", "params": HYPER}}  # fmt: skip
        self.engine, *_ = fastzero.initialize(model=make_model(spec["width"], spec["layers"]), config=cfg)
        self.x, self.y = x, y
        self.extra = {"hidden_frac": [], "step_ms": [], "allgather_ms": []}

    def before(self):
        self.engine.comm.record.clear()  # forward launches nothing: the record is this step's

    def step(self):
        e = self.engine
        loss = F.mse_loss(e(self.x), self.y)
        e.backward(loss)
        t0 = time.perf_counter()
        e.step()
        self.step_s = time.perf_counter() - t0

    def after(self):
        e = self.engine
        end = e.timers["backward_end"]
        grad = e.comm.events(tag="grad")
        total = sum(ev.done - ev.launched for ev in grad)
        hidden = sum(max(0.0, min(ev.done, end) - ev.launched) for ev in grad)
        self.extra["hidden_frac"].append(hidden / total if total > 0 else 0.0)
        self.extra["step_ms"].append(self.step_s * 1e3)
        param = e.comm.events(tag="param")  # all in flight together: their span is the all-gather's time
        span = max(ev.done for ev in param) - min(ev.launched for ev in param) if param else 0.0
        self.extra["allgather_ms"].append(span * 1e3)

    def memory(self):
        br = self.engine.memory_breakdown()
        total = sum(br.values())
        return {"model_state_bytes": total, "grad_bucket_bytes": br["grad_buckets"]}

    def kernel_ms(self, repeats: int = 7) -> float:
        """The optimizer kernel alone over fresh tensors of this rank's shard
        size: what engine.step() costs without the runtime around it."""
        from fastzero.ops import cpu_adam_step

        n = sum(p.numel() for g in self.engine.optimizer.param_groups for p in g["params"])
        p, g, m, v = (torch.randn(n) for _ in range(4))
        v.abs_()
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            cpu_adam_step([p], [g], [m], [v], step=i + 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.01, grad_scale=2.0)  # fmt: skip
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:]) * 1e3


class TorchJob(Job):
    """DDP or FSDP2 around the model, torch's AdamW."""

    def __init__(self, spec, x, y):
        model = make_model(spec["width"], spec["layers"])
        if spec["provider"] == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            # grads as views of DDP's buckets (no second copy); buckets the size of the others'
            self.model = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=spec["bucket"] * 4 / 2**20)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            reshard = spec["variant"] == "reshard"
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
            self.model = fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        self.opt = torch.optim.AdamW(self.model.parameters(), **HYPER, fused=True)  # at the memory wall, as ours
        self.x, self.y, self.extra = x, y, {}

    def step(self):
        self.opt.zero_grad()
        F.mse_loss(self.model(self.x), self.y).backward()
        self.opt.step()

    def memory(self):
        params = list(self.model.parameters())
        return {"model_state_bytes": held_bytes(params + [p.grad for p in params] + optimizer_tensors(self.opt))}


class DeepSpeedJob(Job):
    def __init__(self, spec, x, y):
        import logging

        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        model = make_model(spec["width"], spec["layers"])
        zero = {"stage": spec["variant"], "overlap_comm": True, "reduce_bucket_size": spec["bucket"],
                "allgather_bucket_size": spec["bucket"], "contiguous_gradients": True}  # fmt: skip
        cfg = {"train_micro_batch_size_per_gpu": spec["micro"], "steps_per_print": 10**9, "zero_optimization": zero,
               "zero_allow_untested_optimizer": True}  # fmt: skip
        opt = torch.optim.AdamW(model.parameters(), **HYPER, fused=True)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        self.x, self.y, self.extra = x, y, {}

    def step(self):
        e = self.engine
        e.backward(F.mse_loss(e(self.x), self.y))
        e.step()

    def memory(self):
        zero = self.engine.optimizer  # DeepSpeedZeroOptimizer: its flat buffers and partitions are attributes
        held = list(self.engine.module.parameters())
        held += [p.grad for p in held] + optimizer_tensors(zero.optimizer) + tensors_in(vars(zero))
        return {"model_state_bytes": held_bytes(held)}


JOBS = {"fastzero": Fastzero, "ddp": TorchJob, "fsdp2": TorchJob, "deepspeed": DeepSpeedJob}


def setup(spec) -> Job:
    """Imports the provider (a failure is a skip, decided before the
    process group exists, the same way on every rank) and builds its job."""
    if spec["provider"] == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            import deepspeed  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
            raise Skip(f"deepspeed not importable ({type(exc).__name__}: {exc})") from None
    else:
        dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(spec["micro"], spec["width"], generator=gen)
    y = torch.randn(spec["micro"], spec["width"], generator=gen)
    return JOBS[spec["provider"]](spec, x, y)


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    try:
        job = setup(spec)
    except Skip as exc:
        if os.environ["RANK"] == "0":
            with open(spec["out"], "w") as f:
                json.dump({"skipped": str(exc)}, f)
        return
    times = []
    for i in range(spec["warmup"] + spec["steps"]):
        job.before()
        t0 = time.perf_counter()
        job.step()
        dt = time.perf_counter() - t0
        if spec["provider"] == "fastzero" and spec.get("slowdown", 1.0) != 1.0:
            until = t0 + dt * spec["slowdown"]  # the gate's self-test: really slower steps
            while time.perf_counter() < until:
                pass
            dt = time.perf_counter() - t0
        if i >= spec["warmup"]:
            times.append(dt)
            job.after()
    result = {"times": times, **job.memory()}
    extra = {k: statistics.median(v) if isinstance(v, list) else v for k, v in job.extra.items()}
    if isinstance(job, Fastzero):
        extra["kernel_ms"] = job.kernel_ms()
    result["extra"] = extra
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, result["model_state_bytes"])  # after the timing: no barrier inside it
    result["model_state_bytes_per_rank"] = every
    if dist.get_rank() == 0:
        with open(spec["out"], "w") as f:
            json.dump(result, f)
    dist.barrier()  # rank 0's result is written
    # torch's teardown of Gloo now and then aborts ("terminate called without an active exception", seen with
    # FSDP2): the job is done, so leave without it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
