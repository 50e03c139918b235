"""One rank of a ``python -m bench.run --kernel pipeline`` job, started by
bench/kernels/pipeline.py with torchrun's variables, one thread per rank.

Argument: a JSON spec (the layout: ``pipe`` stages x ``data`` replicas; the
micro-batch count ``m``; the GPT-like shape; the providers; warm-up and
timed steps; output path). Every provider trains the same stack of layers
(:func:`layers`: token + position embedding, pre-norm attention blocks, a
norm + vocabulary head), each layer seeded by its index so every framework
starts from the same weights, cut at the same boundaries (``pipe x v``
equal parts, pipe outermost: rank = stage x data + data rank), on the same
micro-batches, with AdamW:

* ``fastzero-<schedule>``: ``fastzero.pipe.PipelineModule`` +
  ``engine.train_batch`` (1f1b, interleaved at 2 virtual stages, zb-h1);
* ``deepspeed-1f1b``: ``deepspeed.pipe.PipelineModule`` +
  ``PipelineEngine.train_batch`` (its one schedule), where it imports;
* ``torch-<schedule>``: ``torch.distributed.pipelining`` ``PipelineStage``
  with ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B /
  ScheduleInterleavedZeroBubble (2 stages per rank for the last two), the
  gradients all-reduced over the data axis by hand (torch has no pipeline
  data parallelism of its own), ``torch.optim.AdamW``.

First each provider's first-step loss must equal the same model's loss on
the whole global batch in one process (rtol LOSS_RTOL): that step also
records each rank's peak saved-activation bytes. Then warm-up and timed
rounds, one ``train_batch`` of each provider per round. Per step and rank:
the step time and the time spent waiting for a neighbour (fastzero: its
``engine.bubble["measured"]``; DeepSpeed: its receive instructions; torch:
its point-to-point waits), whose ratio is the measured bubble.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import tiny_gpt
from .harness import stretch
from .jobs import finish_rank

HYPER = dict(lr=1e-3, weight_decay=0.01)
LOSS_RTOL = 1e-5
VIRTUAL = 2  # chunks per rank of the interleaved schedules
FASTZERO = ("1f1b", "interleaved", "zb-h1")
TORCH = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb": "ScheduleInterleavedZeroBubble",
}


# -- the model: a GPT-like stack, each layer seeded by its index ---------------------------------
class Seeded(nn.Module):
    """A layer whose params are drawn under ``torch.manual_seed(seed)`` (the global generator left as it was): the
    same weights in every framework, whichever rank builds it."""

    def init(self, seed: int) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for name, p in self.named_parameters():  # biases and norm scales random too: the check sees every one
                norm_scale = name.startswith("ln") and name.endswith("weight")
                nn.init.normal_(p, mean=1.0 if norm_scale else 0.0, std=0.02)


class Embed(Seeded):
    def __init__(self, vocab: int, seq: int, hidden: int, seed: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.init(seed)

    def forward(self, ids):
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1]))


class Block(tiny_gpt.Block, Seeded):
    """bench/tiny_gpt.py's pre-norm attention + MLP block, seeded."""

    def __init__(self, hidden: int, heads: int, seed: int) -> None:
        super().__init__(hidden, heads)
        self.init(seed)


class Head(Seeded):
    def __init__(self, hidden: int, vocab: int, seed: int) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(hidden), nn.Linear(hidden, vocab)
        self.init(seed)

    def forward(self, x):
        return self.out(self.ln(x))


def lm_loss(logits, labels):
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def layers(spec: dict) -> list[tuple[type, tuple]]:
    """(class, args) of each layer: the embedding, spec["blocks"] blocks, the head."""
    h, v = spec["hidden"], spec["vocab"]
    blocks = [(Block, (h, spec["heads"], 1 + i)) for i in range(spec["blocks"])]
    return [(Embed, (v, spec["seq"], h, 0)), *blocks, (Head, (h, v, 1 + spec["blocks"]))]


def bounds(spec: dict, parts: int) -> list[int]:
    n = len(layers(spec))
    assert n % parts == 0, f"{n} layers do not split into {parts} equal parts"
    return [i * n // parts for i in range(parts + 1)]


def micro_batch(spec: dict, step: int, k: int, data_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch k of data rank `data_rank` at `step`: token ids and the next-token labels."""
    g = torch.Generator().manual_seed(100_000 * step + 100 * k + data_rank)
    ids = torch.randint(0, spec["vocab"], (spec["micro"], spec["seq"] + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def reference_loss(spec: dict) -> float:
    """The whole model's mean loss over step 0's global batch (every data rank's micro-batches), in this process."""
    model = nn.Sequential(*[cls(*args) for cls, args in layers(spec)])
    with torch.no_grad():
        losses = [lm_loss(model(x), y).item() for r in range(spec["data"]) for x, y in batches(spec, 0, r)]
    return sum(losses) / len(losses)


def batches(spec: dict, step: int, data_rank: int) -> list:
    return [micro_batch(spec, step, k, data_rank) for k in range(spec["m"])]


# -- peak saved activations ----------------------------------------------------------------------
class SavedBytes:
    """Bytes of the tensors autograd saves for backward (storages counted once while any saved reference lives;
    params and their views left out): ``peak`` after a step run inside it is the stage's peak activation memory."""

    def __init__(self, params) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}
        self.now = self.peak = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.params or ptr == 0:
            return t
        entry = self.live.setdefault(ptr, [0, storage.nbytes()])
        if entry[0] == 0:
            self.now += entry[1]
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        held = _Held(t)
        weakref.finalize(held, self._drop, ptr)
        return held

    def _drop(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[ptr]

    @staticmethod
    def _unpack(held):
        return held.t if isinstance(held, _Held) else held

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self.hooks.__exit__(*exc)


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t) -> None:
        self.t = t


# -- the providers ---------------------------------------------------------------------------------
class Job:
    """A provider set up on this rank for the spec's layout and m: ``step(step)`` runs one ``train_batch`` and
    returns (loss on this rank or None, seconds waiting for a neighbour); ``params()`` are this rank's."""

    def step(self, step: int) -> tuple[float | None, float]:
        raise NotImplementedError

    def params(self) -> list[torch.Tensor]:
        raise NotImplementedError


def engine_config(spec: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": spec["micro"],
        "gradient_accumulation_steps": spec["m"],
        "train_batch_size": spec["micro"] * spec["m"] * spec["data"],
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0},
    }


class Fastzero(Job):
    def __init__(self, spec: dict, schedule: str) -> None:
        import fastzero
        from fastzero.pipe import LayerSpec, PipelineModule

        v = VIRTUAL if schedule == "interleaved" else 1
        model = PipelineModule(
            [LayerSpec(cls, *args) for cls, args in layers(spec)],
            num_stages=spec["pipe"],
            loss_fn=lm_loss,
            partition_method="uniform",
            virtual_stages=v,
        )
        assert model.partitions() == bounds(spec, spec["pipe"] * v), (
            model.partitions(),
            bounds(spec, spec["pipe"] * v),
        )
        cfg = engine_config(spec) | {
            "optimizer": {"type": "AdamW", "params": HYPER},
            "pipeline": {"schedule": schedule},
        }
        self.engine, *_ = fastzero.initialize(model=model, config=cfg)
        self.data_rank = model.topology.get_coord(self.engine.global_rank).data
        self.spec = spec

    def step(self, step):
        e = self.engine
        t0 = time.perf_counter()
        loss = float(e.train_batch(iter(batches(self.spec, step, self.data_rank))))
        total = time.perf_counter() - t0
        return loss, e.bubble["measured"] * total  # the engine's own idle time, over its schedule's run

    def params(self):
        return list(self.engine.module.parameters())


class DeepSpeed(Job):
    def __init__(self, spec: dict, schedule: str) -> None:
        import logging

        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        import deepspeed
        from deepspeed.pipe import LayerSpec, PipelineModule

        deepspeed.init_distributed(dist_backend="gloo")
        model = PipelineModule(
            [LayerSpec(cls, *args) for cls, args in layers(spec)],
            num_stages=spec["pipe"],
            loss_fn=lm_loss,
            partition_method="uniform",
        )
        assert list(model.parts) == bounds(spec, spec["pipe"]), (model.parts, bounds(spec, spec["pipe"]))
        opt = torch.optim.AdamW(model.parameters(), **HYPER)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=engine_config(spec))
        self.data_rank = self.engine.grid.get_data_parallel_id()
        self.spec, self.waited = spec, 0.0
        # its blocking receives are the idle time; it dispatches through a class-level map of functions
        from deepspeed.runtime.pipe import schedule

        table = dict(self.engine._INSTRUCTION_MAP)
        for instr in (schedule.RecvActivation, schedule.RecvGrad):
            table[instr] = self._timed(table[instr])
        self.engine._INSTRUCTION_MAP = table

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.waited += time.perf_counter() - t0

        return timed

    def step(self, step):
        self.waited = 0.0
        loss = float(self.engine.train_batch(iter(batches(self.spec, step, self.data_rank))))
        return loss, self.waited

    def params(self):
        return list(self.engine.module.parameters())


class _P2PClock:
    """Time in torch.distributed.pipelining's point-to-point waits (its schedules call the module's
    ``_wait_batch_p2p`` for every receive and send)."""

    waited = 0.0
    installed = False

    @classmethod
    def install(cls) -> None:
        from torch.distributed.pipelining import schedules

        if cls.installed:
            return
        inner = schedules._wait_batch_p2p

        def timed(work):
            t0 = time.perf_counter()
            try:
                return inner(work)
            finally:
                cls.waited += time.perf_counter() - t0

        schedules._wait_batch_p2p = timed
        cls.installed = True


class TorchPipelining(Job):
    def __init__(self, spec: dict, schedule: str, groups: dict) -> None:
        from torch.distributed import pipelining

        _P2PClock.install()
        p, rank = spec["pipe"], dist.get_rank()
        stage, self.data_rank = divmod(rank, spec["data"])
        v = VIRTUAL if schedule in ("interleaved", "zb") else 1
        cut = bounds(spec, p * v)
        built = layers(spec)
        self.stages, self.modules = [], []
        for c in range(v):
            part = stage + c * p
            module = nn.Sequential(*[cls(*args) for cls, args in built[cut[part] : cut[part + 1]]])
            self.modules.append(module)
            self.stages.append(pipelining.PipelineStage(module, part, p * v, torch.device("cpu"), group=groups["pipe"]))
        self.last = any(s.is_last for s in self.stages)
        self.first = any(s.is_first for s in self.stages)
        cls = getattr(pipelining, TORCH[schedule])
        target = self.stages if v > 1 else self.stages[0]
        self.schedule = cls(target, spec["m"], loss_fn=lm_loss)  # grads scaled by 1/m (scale_grads)
        self._params = [q for m in self.modules for q in m.parameters()]
        self.opt = torch.optim.AdamW(self._params, **HYPER)
        self.spec, self.data_group = spec, groups["data"]

    def step(self, step):
        mb = batches(self.spec, step, self.data_rank)
        x, y = torch.cat([b[0] for b in mb]), torch.cat([b[1] for b in mb])  # split back into m by the schedule
        _P2PClock.waited = 0.0
        self.opt.zero_grad()
        losses = []
        args = (x,) if self.first else ()
        kwargs = {"target": y, "losses": losses} if self.last else {}
        self.schedule.step(*args, **kwargs)
        waited = _P2PClock.waited
        if self.spec["data"] > 1:  # data parallelism by hand: one flat all-reduce of the mean gradient
            grads = [q.grad for q in self._params]
            flat = torch.cat([g.flatten() for g in grads]).div_(self.spec["data"])
            dist.all_reduce(flat, group=self.data_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        self.opt.step()
        if not self.last:
            return None, waited
        mean = torch.stack([loss.detach() for loss in losses]).mean().reshape(1)
        if self.spec["data"] > 1:
            dist.all_reduce(mean, group=self.data_group)
            mean /= self.spec["data"]
        return float(mean), waited

    def params(self):
        return self._params


def importable(provider: str) -> str | None:
    """Why `provider` cannot run here (None: it can); decided the same way on every rank."""
    if not provider.startswith("deepspeed"):
        return None
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
        from deepspeed.pipe import PipelineModule  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        return f"deepspeed not importable here ({type(exc).__name__}: {str(exc)[:120]}); run with a Python that has it"
    return None


def make(provider: str, spec: dict, groups: dict) -> Job:
    framework, _, schedule = provider.partition("-")
    if framework == "fastzero":
        return Fastzero(spec, schedule)
    if framework == "deepspeed":
        return DeepSpeed(spec, schedule)
    return TorchPipelining(spec, schedule, groups)


def check_loss(provider: str, every: list, want: float) -> None:
    """`every`: each rank's first-step loss (None where the rank does not see it)."""
    seen = [(rank, got) for rank, got in enumerate(every) if got is not None]
    if not seen:
        raise AssertionError(f"{provider}: no rank returned a loss")
    for rank, got in seen:
        if not math.isfinite(got) or abs(got - want) > LOSS_RTOL * abs(want):
            raise AssertionError(
                f"{provider} rank {rank}: first-step loss {got!r}, the single-process model's {want!r} (rtol "
                f"{LOSS_RTOL}): the pipeline does not compute the same function"
            )


def make_groups(spec: dict) -> dict:
    """This rank's pipe group (its data coordinate, every stage) and data group (its stage, every replica); every
    rank creates every group, as torch requires."""
    p, d, rank = spec["pipe"], spec["data"], dist.get_rank()
    out = {}
    for j in range(d):
        g = dist.new_group([s * d + j for s in range(p)])
        if rank % d == j:
            out["pipe"] = g
    for s in range(p):
        g = dist.new_group([s * d + j for j in range(d)])
        if rank // d == s:
            out["data"] = g
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    skipped = {p: why for p in spec["providers"] if (why := importable(p))}
    import fastzero

    fastzero.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == spec["pipe"] * spec["data"], (world, spec)
    groups = make_groups(spec)
    want = reference_loss(spec) if rank == 0 else None
    jobs = {}
    for name in spec["providers"]:
        if name in skipped:
            continue
        try:
            job, why = make(name, spec, groups), None
        except Exception as exc:  # noqa: BLE001 - a schedule a framework refuses here is reported, not fatal
            job, why = None, f"{type(exc).__name__}: {str(exc)[:200]}"
        every = [None] * world
        dist.all_gather_object(every, why)
        if any(every):
            skipped[name] = f"set-up failed on CPU/Gloo: {next(w for w in every if w)}"
        else:
            jobs[name] = job
    peaks = {}
    for name, job in jobs.items():  # checked before any timing; the same step measures the saved activations
        with SavedBytes(job.params()) as saved:
            loss, _ = job.step(0)
        every = [None] * world
        dist.all_gather_object(every, loss)
        if rank == 0:
            check_loss(name, every, want)
        peak = [None] * world
        dist.all_gather_object(peak, saved.peak)
        peaks[name] = peak
    times = {name: [] for name in jobs}
    waits = {name: [] for name in jobs}  # per timed step: [waited / step time per rank]
    for i in range(spec["warmup"] + spec["steps"]):
        for name, job in jobs.items():  # one step of each per round: a neighbour's burst hits them alike
            dist.barrier()
            t0 = time.perf_counter()
            _, waited = job.step(1 + i)
            dt = stretch(t0, spec.get("slowdown", 1.0) if name.startswith("fastzero") else 1.0)
            every = [None] * world
            dist.all_gather_object(every, (dt, waited))
            if i >= spec["warmup"]:
                times[name].append(max(t for t, _ in every))  # the step ends when the slowest rank's does
                waits[name].append([w / t for t, w in every])
    result = {"skipped": skipped, "reference_loss": want, "providers": {}}
    for name in jobs:
        result["providers"][name] = {"times": times[name], "idle": waits[name], "peak_saved_bytes": peaks[name]}
    finish_rank(result, spec["out"], rank, dist.barrier)


if __name__ == "__main__":
    main()
