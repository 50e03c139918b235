"""One rank of the activation-checkpointing tests (started by tests/dist.py).
Arguments: a mode and an output prefix; each rank saves what the test
compares to f"{prefix}.rank{rank}.pt".

- engine: a tiny model whose blocks hold dropout, trained 3 steps under
  fastzero.initialize at ZeRO 0-3 with every block checkpointed (the
  config's activation_checkpointing section) and without: losses and params;
- partition: checkpoint with partition_activations (tensor group = world),
  also with contiguous buffers and CPU-held inputs, and the non-reentrant
  form: saved bytes per rank and grads, against the unpartitioned run;
- tracker: dropout masks outside and inside a fork of the tracker, and
  grads of a checkpointed block that forks, against the un-checkpointed one.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fastzero
from fastzero import checkpointing
from fastzero.parallel import checkpointing as checkpointing_impl

WIDTH = 12


class Block(torch.nn.Module):
    def __init__(self, width: int = WIDTH, fork: bool = False):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)
        self.fork = fork

    def forward(self, x):
        h = F.dropout(F.gelu(self.a(x)), 0.25, self.training)
        if self.fork:  # a region split across the tensor group: its own RNG stream per rank
            with checkpointing.get_cuda_rng_tracker().fork():
                h = F.dropout(h, 0.25, self.training)
        return x + self.b(h)


class Net(torch.nn.Module):
    def __init__(self, ckpt: bool, fork: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block(fork=fork) for _ in range(3))
        self.head = torch.nn.Linear(WIDTH, 5)
        self.ckpt = ckpt

    def forward(self, x):
        for b in self.blocks:
            x = checkpointing.checkpoint(b, x) if self.ckpt else b(x)
        return self.head(x)


def engine_runs(rank: int, world: int) -> dict:
    out = {}
    for stage in (0, 1, 2, 3):
        for ckpt in (False, True):
            cfg = {
                "train_micro_batch_size_per_gpu": 4,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                "zero_optimization": {
                    "stage": stage,
                    "reduce_bucket_size": 200,
                    "stage3_param_persistence_threshold": 0,
                    "stage3_prefetch_bucket_size": 300,  # about one Linear ahead: the order matters
                    "stage3_max_reuse_distance": 0,  # released after each use: backward and recompute gather again
                },
                "steps_per_print": 1000,
            }
            if ckpt:  # no tensor group here (every rank is data parallel): inputs held on the CPU, not partitioned
                cfg["activation_checkpointing"] = {"cpu_checkpointing": True, "profile": True}
            checkpointing_impl._unconfigure()
            engine, *_ = fastzero.initialize(model=Net(ckpt), config=cfg)
            assert checkpointing.settings().checkpoint_in_cpu is ckpt and checkpointing.is_configured()
            torch.manual_seed(100 + rank)  # each rank its own dropout masks, alike in both runs
            losses = []
            for step in range(3):
                gen = torch.Generator().manual_seed(step * world + rank)
                x, y = torch.randn(4, WIDTH, generator=gen), torch.randn(4, 5, generator=gen)
                loss = F.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            with engine.gathered() as module:
                params = {n: p.detach().clone() for n, p in module.named_parameters()}
            out[(stage, ckpt)] = dict(losses=losses, params=params, timings=checkpointing.timings())
            if stage == 3:
                out[(stage, ckpt)]["stage3"] = stage3_gathers(engine, rank, world)
    cfg["activation_checkpointing"] = {"partition_activations": True}
    try:
        fastzero.initialize(model=Net(True), config=cfg)
    except ValueError as exc:
        out["partition_error"] = str(exc)
    return out


def stage3_gathers(engine, rank: int, world: int) -> dict:
    """One more micro-batch at stage 3, after the order was recorded: which
    all-gathers the fetcher's prefetch launched ahead and which a module had
    to wait for (on demand), in forward and in backward (where the
    recompute's forwards run); and whether the order had to be recorded again."""
    fetcher = engine.fetcher
    inside = [False]
    log = []
    prefetch = fetcher._prefetch

    def tracked_prefetch():
        inside[0] = True
        try:
            prefetch()
        finally:
            inside[0] = False

    fetcher._prefetch = tracked_prefetch
    phase = ["forward"]
    for unit in fetcher.unit_of.values():
        start = unit.start_gather

        def start_gather(start=start, unit=unit):
            log.append((phase[0], unit.name, "prefetch" if inside[0] else "demand"))
            start()

        unit.start_gather = start_gather
    gen = torch.Generator().manual_seed(99 + rank)
    x, y = torch.randn(4, WIDTH, generator=gen), torch.randn(4, 5, generator=gen)
    loss = F.mse_loss(engine(x), y)
    phase[0] = "backward"
    engine.backward(loss)
    engine.step()
    return dict(log=log, retraced=fetcher.retraced, trace=len(fetcher.trace or ()))


def run_blocks(blocks, x, how):
    """Forward through the blocks and backward; (saved bytes after forward, grads, input grad)."""
    for p in blocks.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    torch.manual_seed(3)
    with checkpointing.SavedBytes(blocks.parameters()) as meter:
        h = x
        for b in blocks:
            h = how(b, h)
        saved = meter.live
        (h * h).sum().backward()
    return saved, [p.grad.clone() for p in blocks.parameters()], x.grad.clone()


def partition_runs(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block(WIDTH) for _ in range(3))
    x = torch.randn(5, WIDTH)  # 60 elements, not a multiple of every world size: padded pieces
    out = {}
    checkpointing.configure(None)
    out["plain"] = run_blocks(blocks, x, lambda b, h: b(h))
    out["full"] = run_blocks(blocks, x, checkpointing.checkpoint)
    variants = {
        "partition": dict(partition_activations=True),
        "partition_cpu": dict(partition_activations=True, checkpoint_in_cpu=True),
        "contiguous": dict(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3),
    }
    for name, kw in variants.items():
        checkpointing.configure(None, **kw)
        out[name] = run_blocks(blocks, x, checkpointing.checkpoint)
    checkpointing.configure(None, partition_activations=True)
    out["non_reentrant"] = run_blocks(blocks, x, checkpointing.non_reentrant_checkpoint)
    checkpointing.configure(None)
    out["non_reentrant_plain"] = run_blocks(blocks, x, checkpointing.non_reentrant_checkpoint)
    return out


def tracker_runs(rank: int, world: int) -> dict:
    checkpointing.model_parallel_cuda_manual_seed(11)
    x = torch.ones(64)
    outside = F.dropout(x, 0.5)
    with checkpointing.get_cuda_rng_tracker().fork():
        inside = F.dropout(x, 0.5)
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block(WIDTH, fork=True) for _ in range(2))
    inp = torch.randn(4, WIDTH)
    runs = {}
    for name, how in (("plain", lambda b, h: b(h)), ("full", checkpointing.checkpoint)):
        checkpointing.model_parallel_cuda_manual_seed(11)
        runs[name] = run_blocks(blocks, inp, how)
    return dict(outside=outside, inside=inside, runs=runs)


if __name__ == "__main__":
    mode, prefix = sys.argv[1], sys.argv[2]
    fastzero.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"engine": engine_runs, "partition": partition_runs, "tracker": tracker_runs}[mode](rank, world)
    torch.save(result, f"{prefix}.rank{rank}.pt")
    dist.barrier()
