"""One rank of a ``python -m bench.run --kernel zero`` (or ``zero3``,
``offload``) job, started by bench/kernels/zero.py with torchrun's
variables, one thread per rank.

Argument: a JSON spec (provider, variant: a dict of stage, prefetch, offload,
reshard; model width and depth, micro-batch, bucket size, stage-3 prefetch
and persistence, warm-up and timed steps, output path). Each rank trains the
same MLP stack on its own fixed random batch: warm-up steps, then timed steps
(forward + backward + step, no barrier). Rank 0 writes per-step times,
per-rank model-state bytes, the peak RSS growth and the provider's own
figures to the output path; a peer that cannot run here writes
``{"skipped": why}`` instead.
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

from .harness import paired, stretch
from .jobs import finish_rank, reset_peak_rss, rss_bytes

HYPER = dict(lr=1e-3, weight_decay=0.01)
ADAM_BYTES = 28  # per param, fp32 Adam: read p, g, m, v; write p, m, v


class Skip(Exception):
    """This provider cannot run here (a peer not installed, say)."""


def prime() -> None:
    """One tiny forward, backward and fused AdamW step: torch's lazy one-time
    set-up (about 150 MiB of RSS on the first backward here) is paid before
    the RSS baseline, so the peak RSS growth is the training's own."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    x = torch.randn(4, 8)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    F.mse_loss(model(x), x).backward()
    opt.step()


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

        v = spec["variant"]
        self.stage = v["stage"]
        zero = {
            "stage": self.stage,
            "overlap_comm": True,
            "overlap_param_gather": True,
            "reduce_bucket_size": spec["bucket"],
        }
        if self.stage == 3:
            zero.update(stage3_prefetch_bucket_size=v["prefetch"], stage3_param_persistence_threshold=spec["persist"])
        if v.get("offload"):
            zero["offload_optimizer"] = {"device": "cpu"}
        zero.update(v.get("zero", {}))  # more zero_optimization keys (ZeRO++)
        cfg = {
            "train_micro_batch_size_per_gpu": spec["micro"],
            "steps_per_print": 10**9,
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {**HYPER, **v.get("optimizer", {})}},  # e.g. a state format
        }
        self.engine, *_ = fastzero.initialize(model=make_model(spec["width"], spec["layers"]), config=cfg)
        self.x, self.y = x, y
        self.extra = {"hidden_frac": [], "step_ms": [], "allgather_ms": [], "adam_in_step_ms": [], "param_wait_ms": []}
        self.launched = []  # stages 1-2: the param all-gathers the previous step() left in flight
        self.adam_s = 0.0
        if v.get("offload"):  # time the CPU Adam part of the offloaded step: the kernel calls inside it
            import fastzero.runtime.offload as offload

            kernel = offload.cpu_adam_step

            def timed(*args, **kwargs):
                t0 = time.perf_counter()
                kernel(*args, **kwargs)
                self.adam_s += time.perf_counter() - t0

            offload.cpu_adam_step = timed

    def before(self):
        self.launched = self.engine.comm.events(tag="param")  # the previous step's, waited for by this forward
        self.engine.comm.record.clear()  # the record is this step's
        self.adam_s = 0.0

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
        self.extra["adam_in_step_ms"].append(self.adam_s * 1e3)
        # stages 1-2: all in flight together after the step, their span is the all-gather's time (stage 3 gathers
        # each param when a module needs it: tagged "param:NAME", not counted here). With overlap_comm step()
        # returns with them in flight and the next forward waits per bucket: read them one step later, when
        # done, with the time that forward's pre-hooks blocked on them (CommEvent.waited). Over Gloo an all-gather's
        # `done` is when it was waited on (its sends and receives have no completion callback): an upper bound
        prev = self.launched
        span = max(ev.done for ev in prev) - min(ev.launched for ev in prev) if prev else 0.0
        self.extra["allgather_ms"].append(span * 1e3)
        self.extra["param_wait_ms"].append(sum(ev.waited for ev in prev) * 1e3)

    def memory(self):
        e = self.engine
        e.wait_params()  # the end of training: the last step's all-gathers
        br = e.memory_breakdown()
        out = {
            "model_state_bytes": sum(br.values()),
            "grad_bucket_bytes": br["grad_buckets"],
            "offloaded_bytes": sum(v for k, v in br.items() if k.startswith("offload_")),
            "staging_bytes": br.get("offload_staging", 0),
        }
        if e.fetcher is not None:
            size = e.dtype.itemsize
            units = [u for g in e.groups for u in g.units]
            out["persistent_bytes"] = sum(u.numel for u in units if u.persistent) * size
            out["peak_gathered_bytes"] = e.fetcher.peak_live * size  # the runtime's own peak of gathered params
        return out

    def shard_numel(self) -> int:
        """Elements this rank's optimizer updates (its shard, padded)."""
        return sum(p.numel() for g in self.engine.optimizer.param_groups for p in g["params"])


def kernel_vs_roofline(n: int, rounds: int, roofline: bool) -> dict:
    """fastzero's CPU Adam kernel alone over fresh fp32 tensors of `n`
    elements (what the optimizer step costs without the runtime around it),
    and with `roofline` the streaming probe of Adam's bytes over the same
    sizes, timed in interleaved rounds in this process (bench.run's
    cpu_adam roofline)."""
    from fastzero.ops import cpu_adam_step

    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    state = {"step": 0}
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_scale=2.0)

    def adam():
        state["step"] += 1
        cpu_adam_step([p], [g], [m], [v], step=state["step"], **hyper)

    calls = {"kernel": adam}
    if roofline:
        from .kernels.common import stream_roofline

        probe = stream_roofline([n])  # kept: its step writes through raw pointers into arrays the runner holds
        calls["roofline"] = probe.step
    times = {k: [] for k in calls}
    for _ in range(rounds + 1):  # the first round warms up
        for k, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[k].append(time.perf_counter() - t0)
    times = {k: t[1:] for k, t in times.items()}
    out = {"kernel_ms": statistics.median(times["kernel"]) * 1e3}
    if roofline:
        out["roofline_ms"] = statistics.median(times["roofline"]) * 1e3
        # the same bytes: the fraction is the time ratio, round by round (drifts of the machine cancel)
        out["kernel_of_roofline"] = paired(times["roofline"], times["kernel"])
        out["kernel_gbps"] = ADAM_BYTES * n / (out["kernel_ms"] / 1e3) / 1e9
        out["roofline_gbps"] = ADAM_BYTES * n / (out["roofline_ms"] / 1e3) / 1e9
    return out


class TorchJob(Job):
    """DDP or FSDP2 (resharding after forward or not, CPU offload or not)
    around the model, torch's AdamW."""

    def __init__(self, spec, x, y):
        model = make_model(spec["width"], spec["layers"])
        v = spec["variant"]
        if spec["provider"] == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            # grads as views of DDP's buckets (no second copy); buckets the size of the others'
            self.model = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=spec["bucket"] * 4 / 2**20)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            policy = CPUOffloadPolicy(pin_memory=False) if v.get("offload") else OffloadPolicy()  # pinning needs CUDA
            kw = dict(mesh=mesh, reshard_after_forward=v["reshard"], offload_policy=policy)
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, **kw)
            self.model = fully_shard(model, **kw)
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
        v = spec["variant"]
        zero = {
            "stage": v["stage"],
            "overlap_comm": True,
            "reduce_bucket_size": spec["bucket"],
            "allgather_bucket_size": spec["bucket"],
            "contiguous_gradients": True,
        }
        if v["stage"] == 3:
            zero.update(stage3_prefetch_bucket_size=v["prefetch"], stage3_param_persistence_threshold=spec["persist"])
        cfg = {"train_micro_batch_size_per_gpu": spec["micro"], "steps_per_print": 10**9, "zero_optimization": zero}
        if v.get("offload"):  # its own DeepSpeedCPUAdam, built from the config's optimizer section
            zero["offload_optimizer"] = {"device": "cpu"}
            cfg["optimizer"] = {"type": "AdamW", "params": HYPER}
            self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        else:
            cfg["zero_allow_untested_optimizer"] = True
            opt = torch.optim.AdamW(model.parameters(), **HYPER, fused=True)
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        self.x, self.y, self.extra = x, y, {}

    def step(self):
        e = self.engine
        e.backward(F.mse_loss(e(self.x), self.y))
        e.step()

    def memory(self):
        zero = self.engine.optimizer  # DeepSpeed's ZeRO optimizer: its flat buffers and partitions are attributes
        held = list(self.engine.module.parameters())
        held += [getattr(p, "ds_tensor", None) for p in held]  # stage 3: the param's partition
        held += [p.grad for p in held if p is not None] + optimizer_tensors(zero.optimizer) + tensors_in(vars(zero))
        return {"model_state_bytes": held_bytes(held)}


JOBS = {"fastzero": Fastzero, "ddp": TorchJob, "fsdp2": TorchJob, "deepspeed": DeepSpeedJob}


def setup(spec) -> tuple[Job, int]:
    """Imports the provider (a failure is a skip, decided before the
    process group exists, the same way on every rank) and builds its job;
    returns it with the RSS before the model was made."""
    if spec["provider"] == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            import deepspeed  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
            raise Skip(f"deepspeed not importable ({type(exc).__name__}: {exc})") from None
    else:
        if spec["provider"] == "fastzero":
            import fastzero  # noqa: F401 - imported before the RSS baseline, as deepspeed is
        dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(spec["micro"], spec["width"], generator=gen)
    y = torch.randn(spec["micro"], spec["width"], generator=gen)
    prime()
    base = rss_bytes()
    return JOBS[spec["provider"]](spec, x, y), base


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    try:
        job, rss_base = setup(spec)
    except Skip as exc:
        if os.environ["RANK"] == "0":
            with open(spec["out"], "w") as f:
                json.dump({"skipped": str(exc)}, f)
        return
    times = []
    for i in range(spec["warmup"] + spec["steps"]):
        if i == spec["warmup"]:
            reset_peak_rss()  # the peak of the timed steps (set-up's transients, e.g. the whole model, left out)
        job.before()
        t0 = time.perf_counter()
        job.step()
        dt = stretch(t0, spec.get("slowdown", 1.0) if spec["provider"] == "fastzero" else 1.0)  # the gate's self-test
        if i >= spec["warmup"]:
            times.append(dt)
            job.after()
    peak_rss = rss_bytes("VmHWM")
    result = {
        "times": times,
        **job.memory(),
        "peak_rss_growth_bytes": max(0, peak_rss - rss_base) if peak_rss else None,
    }
    extra = {k: statistics.median(v) if isinstance(v, list) else v for k, v in job.extra.items()}
    if isinstance(job, Fastzero):
        extra.update(kernel_vs_roofline(job.shard_numel(), spec.get("kernel_rounds", 7), spec.get("roofline", False)))
    result["extra"] = extra
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, result["model_state_bytes"])  # after the timing: no barrier inside it
    result["model_state_bytes_per_rank"] = every
    finish_rank(result, spec["out"], dist.get_rank(), dist.barrier)


if __name__ == "__main__":
    main()
