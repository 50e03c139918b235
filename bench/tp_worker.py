"""One rank of a ``python -m bench.run --kernel tp`` job, started by
bench/kernels/tp.py with torchrun's variables, one thread per rank.

Argument: a JSON spec (the providers; the GPT-2 shape: hidden, heads,
layers, seq, vocab, micro-batch; warm-up and timed steps; output path).
Every rank of the one tensor group of 2 builds each provider's copy of the
same Hugging Face ``GPT2LMHeadModel`` (dropout off) and trains it on the
same fixed batch (data-parallel size 1):

* ``fastzero``: ``fastzero.initialize`` with ``tensor_parallel.autotp_size``
  (AutoTP shards the unmodified model), ZeRO stage 0, its AdamW;
* ``torch_tp``: PyTorch's ``parallelize_module`` with ``ColwiseParallel`` on
  ``attn.c_attn`` and ``mlp.c_fc`` and ``RowwiseParallel`` on ``attn.c_proj``
  and ``mlp.c_proj`` (GPT-2's ``Conv1D`` turned into ``nn.Linear`` first, the
  fused q/k/v rows ordered so each rank's chunk holds its heads of each, as
  Megatron's stride-3 split does), ``torch.optim.AdamW``;
* ``deepspeed``: DeepSpeed's AutoTP training (``tensor_parallel.autotp_size``
  and a ``partition_config`` for the four projections, GPT-2's ``Conv1D``
  turned into ``nn.Linear`` first), DeepSpeed's torch AdamW, where it
  imports (a provider that does not is reported skipped, with why).

First each provider's first CHECK_STEPS losses must equal those of the
unsharded model trained by ``torch.optim.AdamW`` in one process (fp32,
rtol LOSS_RTOL). Then warm-up and timed rounds, one step (forward + backward
+ optimizer step, no barrier) of each provider per round, and per provider
one more step, untimed, under a dispatch mode that records every collective
(:class:`CommCount`). Rank 0 writes the step times, and every rank's
model-state bytes, split layers' param bytes and collectives, to the output
path.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .harness import stretch
from .jobs import finish_rank
from .zero_worker import held_bytes, optimizer_tensors

HYPER = dict(lr=1e-3, weight_decay=0.01)
CHECK_STEPS = 2
LOSS_RTOL = 1e-5
# the projections every provider splits: column-parallel (output features split) and row-parallel (input features)
COLWISE = ("attn.c_attn", "mlp.c_fc")
ROWWISE = ("attn.c_proj", "mlp.c_proj")
SHARDED = re.compile(r"\.h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)$")


def make_model(spec: dict) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_embd=spec["hidden"],
        n_head=spec["heads"],
        n_layer=spec["layers"],
        n_positions=spec["seq"],
        vocab_size=spec["vocab"],
        resid_pdrop=0.0,  # no dropout: every provider and the reference compute the same function
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)  # every provider and rank starts from the same weights
    return GPT2LMHeadModel(cfg)


def batch(spec: dict) -> torch.Tensor:
    """The fixed token ids every rank trains on (the tensor ranks of one data rank see the same samples)."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, spec["vocab"], (spec["micro"], spec["seq"]), generator=gen)


def reference_losses(spec: dict, ids: torch.Tensor, steps: int) -> list[float]:
    """The unsharded model's losses over `steps` steps of torch.optim.AdamW in this process."""
    model = make_model(spec)
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def sharded_layer_bytes(model: torch.nn.Module) -> int:
    """Bytes this rank holds of the split projections' params (weights and biases; a DTensor's local shard)."""
    return sum(
        local(p).numel() * p.element_size()
        for name, mod in model.named_modules()
        if SHARDED.search(name)
        for p in mod.parameters()
    )


class CommCount(TorchDispatchMode):
    """Records every collective issued inside it: torch.distributed's (the
    ``c10d`` ops fastzero's layers call) and the functional ones DTensor
    issues (``_c10d_functional``). A DTensor op is handed back to DTensor
    first (NotImplemented, as torch's CommDebugMode does), so the
    collectives it lowers to come through here too; one over a group of one
    rank moves nothing and is left out. Per op: calls and bytes, an
    all-reduce's tensors, an all-gather's output, a reduce-scatter's input
    (the largest tensor in its arguments)."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not isinstance(func, torch._ops.HigherOrderOperator) and any(
            getattr(t, "__name__", "") == "DTensor" for t in types
        ):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        ns = getattr(func, "namespace", "")
        name = getattr(func, "_overloadpacket", func).__name__
        if ns in ("c10d", "_c10d_functional") and "wait" not in name and "barrier" not in name and not _solo(args):
            nbytes = lambda ts: [t.numel() * t.element_size() for t in ts]
            entry = self.ops.setdefault(name, [0, 0])
            entry[0] += 1
            if "reduce" in name and "scatter" not in name:
                entry[1] += sum(nbytes(_tensors(args)))
            else:  # the whole tensor: a functional all-gather's is its result, not an argument
                entry[1] += max(nbytes(_tensors(args) + _tensors(out)), default=0)
        return out


def _solo(args) -> bool:
    """A c10d op's process group has one rank: nothing moves (DeepSpeed all-reduces its flat grads over its
    data-parallel group, of 1 here)."""
    for a in args:
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            return dist.ProcessGroup.unbox(a).size() == 1
    return False


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


class Job:
    """A provider set up on this rank: ``step()`` (timed) runs forward, backward and the optimizer step and returns
    the loss."""

    model: torch.nn.Module

    def step(self) -> torch.Tensor:
        raise NotImplementedError

    def memory(self) -> int:
        """Model-state bytes: the distinct storages of the params, grads and optimizer state this rank holds."""
        raise NotImplementedError


def engine_config(spec: dict) -> dict:
    """The ds_config both engine providers (fastzero, DeepSpeed) train under: AutoTP at spec["tp"], ZeRO stage 0."""
    return {
        "train_micro_batch_size_per_gpu": spec["micro"],
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0},
        "gradient_clipping": 0.0,  # off, as the reference: DeepSpeed 0.19's default is 1.0 (fastzero's 0)
        "optimizer": {"type": "AdamW", "params": HYPER},
        "tensor_parallel": {"autotp_size": spec["tp"]},
    }


class EngineJob(Job):
    """A provider that trains through a DeepSpeed-style engine (``self.engine``)."""

    engine: Any

    def step(self):
        e = self.engine
        loss = e(input_ids=self.ids, labels=self.ids).loss
        e.backward(loss)
        e.step()
        return loss


class Fastzero(EngineJob):
    def __init__(self, spec, ids):
        import fastzero

        cfg = engine_config(spec)
        self.engine, *_ = fastzero.initialize(model=make_model(spec), config=cfg)
        assert self.engine.dp_world_size == 1 and self.engine.mp_world_size == spec["tp"]
        self.model, self.ids = self.engine.module, ids

    def memory(self):
        return sum(self.engine.memory_breakdown().values())  # the engine's own tensors: flat params, grads, state


def to_linear(conv, rows: torch.Tensor | None = None) -> torch.nn.Linear:
    """A Hugging Face Conv1D (weight [in, out]) as an nn.Linear (weight [out, in]), its output features reordered
    by `rows`."""
    w, b = conv.weight.detach().t(), conv.bias.detach()
    if rows is not None:
        w, b = w[rows], b[rows]
    lin = torch.nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    return lin


def qkv_rows(hidden: int, tp: int) -> torch.Tensor:
    """c_attn's output features ordered [q_0, k_0, v_0, q_1, k_1, v_1, ...] (x_r: rank r's heads of x), so that
    ColwiseParallel's contiguous chunk r holds rank r's heads of q, k and v."""
    per = hidden // tp
    return torch.cat(
        [torch.arange(part * hidden + r * per, part * hidden + (r + 1) * per) for r in range(tp) for part in range(3)]
    )


class TorchTP(Job):
    def __init__(self, spec, ids):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp = spec["tp"]
        model = make_model(spec)
        for block in model.transformer.h:
            attn, mlp = block.attn, block.mlp
            attn.c_attn = to_linear(attn.c_attn, qkv_rows(spec["hidden"], tp))
            attn.c_proj, mlp.c_fc, mlp.c_proj = to_linear(attn.c_proj), to_linear(mlp.c_fc), to_linear(mlp.c_proj)
            attn.split_size //= tp  # each rank's c_attn output is its q, k and v heads: hidden / tp each
            attn.num_heads //= tp
            attn.embed_dim //= tp
        mesh = init_device_mesh("cpu", (tp,))
        plan = {}
        for i in range(len(model.transformer.h)):
            plan |= {f"transformer.h.{i}.{n}": ColwiseParallel() for n in COLWISE}
            plan |= {f"transformer.h.{i}.{n}": RowwiseParallel() for n in ROWWISE}
        self.model = parallelize_module(model, mesh, plan)
        self.opt = torch.optim.AdamW(self.model.parameters(), **HYPER)
        self.ids = ids

    def step(self):
        self.opt.zero_grad()
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.opt.step()
        return loss

    def memory(self):
        params = list(self.model.parameters())
        return held_bytes(params + [p.grad for p in params] + optimizer_tensors(self.opt))


class DeepSpeedJob(EngineJob):
    """DeepSpeed's AutoTP training: ``tensor_parallel.autotp_size`` with a ``partition_config`` naming the four
    projections. Its heuristic AutoTP refuses GPT-2 (``AutoTP.tp_parser`` asserts ``AutoTP.supported(model)``,
    which lists "gpt2" as unsupported, deepspeed/module_inject/auto_tp.py in 0.19.8), and its
    partition_config layers are ``nn.Linear``-only (Conv1D's [in, out] weight would be split on the wrong
    dimension): so GPT-2's Conv1D are turned into ``nn.Linear`` first, as for torch_tp. c_attn's spec has
    shape (3, -1): each of q, k and v split in 2, Megatron's stride-3 split. ``tp_model_init`` is not called:
    in 0.19 it only records the arguments the config already gives."""

    def __init__(self, spec, ids):
        import logging

        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        model = make_model(spec)
        for block in model.transformer.h:
            attn, mlp = block.attn, block.mlp
            attn.c_attn, attn.c_proj = to_linear(attn.c_attn), to_linear(attn.c_proj)
            mlp.c_fc, mlp.c_proj = to_linear(mlp.c_fc), to_linear(mlp.c_proj)
            # DeepSpeed divides the attention's num_heads and embed_dim by tp, not split_size (what GPT-2 splits
            # c_attn's output by)
            attn.split_size //= spec["tp"]
        cfg = engine_config(spec)
        cfg["optimizer"]["params"] = dict(HYPER, torch_adam=True)  # torch's AdamW, the reference's (not its Adam op)
        cfg["tensor_parallel"]["partition_config"] = {
            "use_default_specs": False,
            "layer_specs": [
                {"patterns": [r".*\.attn\.c_attn\.weight$"], "partition_type": "column", "shape": [3, -1]},
                {"patterns": [r".*\.mlp\.c_fc\.weight$"], "partition_type": "column"},
                {"patterns": [r".*\.(attn|mlp)\.c_proj\.weight$"], "partition_type": "row"},
            ],
        }
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        self.model, self.ids = self.engine.module, ids

    def memory(self):
        params = list(self.engine.module.parameters())
        return held_bytes(params + [p.grad for p in params] + optimizer_tensors(self.engine.optimizer))


JOBS = {"fastzero": Fastzero, "torch_tp": TorchTP, "deepspeed": DeepSpeedJob}
COLLECTIVES = ("reduce", "gather", "scatter", "broadcast", "all_to_all", "alltoall")


def importable(provider: str) -> str | None:
    """Why `provider` cannot run here (None: it can). Decided before the process group exists, the same way on
    every rank."""
    if provider != "deepspeed":
        return None
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        return f"deepspeed not installed here ({type(exc).__name__}: {exc})"
    try:
        from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig

        has = "partition_config" in TPTrainingConfig.model_fields
    except ImportError:
        has = False
    if not has:  # AutoTP's training config without layer specs: its heuristic refuses GPT-2
        return f"deepspeed {deepspeed.__version__} has no tensor_parallel.partition_config (measured with 0.19.8)"
    return None


def check_losses(provider: str, every: list[list[float]], want: list[float]) -> None:
    for rank, got in enumerate(every):
        for step, (g, w) in enumerate(zip(got, want)):
            if abs(g - w) > LOSS_RTOL * abs(w):
                raise AssertionError(
                    f"{provider} rank {rank} step {step}: loss {g!r}, the unsharded model's with torch AdamW {w!r} "
                    f"(rtol {LOSS_RTOL}): the tensor-parallel model does not train the same function"
                )


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    skipped = {p: why for p in spec["providers"] if (why := importable(p))}
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ids = batch(spec)
    want = reference_losses(spec, ids, CHECK_STEPS) if rank == 0 else None
    whole = make_model(spec)
    unsharded = {
        "unsharded_layer_bytes": sharded_layer_bytes(whole),
        "unsharded_param_bytes": sum(p.numel() * p.element_size() for p in whole.parameters()),
    }
    del whole
    jobs = {p: JOBS[p](spec, ids) for p in spec["providers"] if p not in skipped}
    for name, job in jobs.items():  # checked before any timing: a provider that trains another function fails here
        losses = [job.step().item() for _ in range(CHECK_STEPS)]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, losses)
        if rank == 0:
            check_losses(name, every, want)
    # interleaved rounds, one step of each provider per round: a neighbour's burst hits them alike
    times = {name: [] for name in jobs}
    for i in range(spec["warmup"] + spec["steps"]):
        for name, job in jobs.items():
            t0 = time.perf_counter()
            job.step()
            dt = stretch(t0, spec.get("slowdown", 1.0) if name == "fastzero" else 1.0)  # the gate's self-test
            if i >= spec["warmup"]:
                times[name].append(dt)
    result = {"skipped": skipped, "reference_losses": want, **unsharded, "providers": {}}
    for name, job in jobs.items():
        with CommCount() as comm:  # one more step, untimed: the dispatch mode slows it
            job.step()
        mine = {
            "model_state_bytes": job.memory(),
            "sharded_layer_bytes": sharded_layer_bytes(job.model),
            "param_bytes": sum(local(p).numel() * p.element_size() for p in job.model.parameters()),
            "comm": {op: v for op, v in comm.ops.items() if any(c in op for c in COLLECTIVES)},
        }
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        result["providers"][name] = {"times": times[name], "per_rank": every}
    finish_rank(result, spec["out"], rank, dist.barrier)


if __name__ == "__main__":
    main()
