"""Activation checkpointing: saved-activation bytes and step time of one
forward + backward of a small pre-LayerNorm transformer (L blocks of
attention (SDPA) + 4x GELU MLP, dropout 0.1), fp32, on the CPU, for:

* ``none``: no checkpointing (the time and memory the others are relative to);
* ``torch_every_block``: ``torch.utils.checkpoint`` (non-reentrant) on every block;
* ``torch_every_2nd``: the same on every second block (the uniform interval
  the budget placement is compared with);
* ``fastzero_full``: ``fastzero.checkpointing.checkpoint`` on every block;
* ``fastzero_selective``: the selective policy on every block (matmul and
  attention outputs kept, elementwise ops recomputed);
* ``fastzero_budget``: ``fastzero.checkpointing.apply`` with the budget set to
  ``torch_every_2nd``'s saved bytes;
* ``deepspeed``: ``deepspeed.checkpointing.checkpoint`` on every block, where
  deepspeed imports (an optional extra: skipped otherwise).

Every provider's grads are checked bit for bit against ``none``'s (same
seed, dropout included) before timing; the providers are then timed in
interleaved rounds. Bytes are what autograd keeps after the forward
(saved-tensor hooks, each storage once, params left out): the recompute of
one block adds its own activations on top, briefly, for every checkpointing
provider. Nothing here is gated (``in_all`` is off): step times of a 2-core
shared machine are reported, the targets are read from the table.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from fastzero import checkpointing

from ..family import Family, Settings
from ..harness import Case, Provider, Rows, Runner, Timing, Unavailable
from ..tables import fmt, row, skipped_lines

# (layers, width, heads, sequence, batch): quick runs in seconds on 2 cores
SHAPES = {"quick": (4, 32, 2, 32, 2), "full": (8, 256, 8, 128, 8)}
MiB = 1 << 20


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, w)
        x = x + F.dropout(self.proj(a), 0.1, self.training)
        return x + F.dropout(self.down(F.gelu(self.up(self.ln2(x)))), 0.1, self.training)


class Model(nn.Module):
    def __init__(self, layers: int, width: int, heads: int):
        super().__init__()
        self.layers = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, width)
        self.wrap = None  # (block, x) -> y: how a block is run

    def forward(self, x):
        for i, block in enumerate(self.layers):
            x = self.wrap(i, block, x) if self.wrap else block(x)
        return self.head(x)


def _torch_every(n: int):
    from torch.utils.checkpoint import checkpoint

    return lambda i, b, x: checkpoint(b, x, use_reentrant=False) if i % n == 0 else b(x)


def _deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before the import: DeepSpeed picks its accelerator once
    try:
        import deepspeed
        from deepspeed.runtime.activation_checkpointing import checkpointing as ds
    except ImportError:
        raise Unavailable("deepspeed is not installed (an optional extra)") from None
    # No configure(): with no arguments it only restores these module defaults (already set at import), then calls
    # dist.get_rank() for a log line, which asserts without a process group (this bench is one process).
    if ds.PARTITION_ACTIVATIONS or ds.CPU_CHECKPOINT or ds.CONTIGUOUS_CHECKPOINTING:
        raise Unavailable("deepspeed.checkpointing was configured away from its defaults in this process")

    def run(i, block, x):
        # A reentrant checkpoint (as torch's use_reentrant=True): its output needs grad only if an input does, so
        # the first block's input (the batch) is made a leaf that needs grad, or block 0's params got no grads.
        y = deepspeed.checkpointing.checkpoint(block, x if x.requires_grad else x.detach().requires_grad_())
        return _Kept.apply(y, *(t for t in y.grad_fn.deepspeed_saved_tensors if torch.is_tensor(t)))

    return run


class _Kept(torch.autograd.Function):
    """Identity on `y` that saves `kept` for backward. DeepSpeed's checkpoint keeps its inputs on its ctx
    (``ctx.deepspeed_saved_tensors``), not through ``save_for_backward``, so saved-tensor hooks (the bytes metric)
    never see them; saved here, the same storages are counted, with no extra memory, and freed a node earlier in
    backward than DeepSpeed frees them."""

    @staticmethod
    def forward(ctx, y, *kept):
        ctx.save_for_backward(*kept)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, *(None for _ in ctx.saved_tensors)


PROVIDERS = (
    ("none", "peer"),
    ("torch_every_block", "peer"),
    ("torch_every_2nd", "peer"),
    ("fastzero_full", "ours"),
    ("fastzero_selective", "ours"),
    ("fastzero_budget", "ours"),
    ("deepspeed", "peer"),
)


class Bench:
    """One case's model (a copy per provider, its checkpointing set up once), input and reference grads."""

    def __init__(self, shape: tuple[int, ...]):
        layers, width, heads, seq, batch = shape
        torch.manual_seed(0)
        self.base = Model(layers, width, heads)
        self.x = torch.randn(batch, seq, width)
        self.want = self.step(self.base)
        every_2nd = self.model("torch_every_2nd", budget=0)
        self.budget = self.saved(every_2nd)  # the budget placement gets the uniform interval's memory

    def model(self, name: str, budget: int | None = None) -> Model:
        """A copy of the model with provider `name`'s checkpointing."""
        model = copy.deepcopy(self.base)
        checkpointing.configure(None)
        if name == "torch_every_block":
            model.wrap = _torch_every(1)
        elif name == "torch_every_2nd":
            model.wrap = _torch_every(2)
        elif name == "fastzero_full":
            model.wrap = lambda i, b, h: checkpointing.checkpoint(b, h)
        elif name == "fastzero_selective":
            model.wrap = lambda i, b, h: checkpointing.checkpoint(b, h, policy="selective")
        elif name == "fastzero_budget":
            checkpointing.apply(model, self.budget if budget is None else budget, sample_input=self.x)
        elif name == "deepspeed":
            model.wrap = _deepspeed()
        return model

    def step(self, model: Model) -> list[torch.Tensor]:
        """One forward + backward; the grads."""
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        model(self.x).square().mean().backward()
        return [p.grad for p in model.parameters()]

    def saved(self, model: Model) -> int:
        """Bytes autograd keeps after the forward."""
        with checkpointing.SavedBytes(model.parameters()) as meter:
            torch.manual_seed(1)
            out = model(self.x)
            kept = meter.live  # before the graph goes with `out`
        del out
        return kept

    def runner(self, name: str) -> Runner:
        model = self.model(name)

        def check():
            got = self.step(model)
            for g, w in zip(got, self.want, strict=True):
                assert torch.equal(g, w), f"{name}: grads differ from the un-checkpointed run"

        runner = Runner(step=lambda: self.step(model), check=check)
        runner.saved = lambda: self.saved(model)
        return runner


@functools.cache
def _bench(shape: tuple[int, ...]) -> Bench:
    return Bench(shape)


def cases(sizes=None, dtypes=None, quick=False, device="cpu") -> list[Case]:
    if dtypes and "fp32" not in dtypes:
        return []
    shape = SHAPES["quick" if quick else "full"]
    layers, width, heads, seq, batch = shape
    provs = [Provider(n, k, functools.partial(_make, shape, n)) for n, k in PROVIDERS]
    desc = (
        f"{layers} x (LN + SDPA attention, {heads} heads + LN + 4x GELU MLP), width {width}, sequence {seq}, "
        f"batch {batch}, dropout 0.1, fp32: one forward + backward"
    )
    n_params = layers * 12 * width * width
    return [Case("act_ckpt", f"gpt{layers}x{width}", n_params, 0, provs, desc)]


def _make(shape: tuple[int, ...], name: str) -> Runner:
    return _bench(shape).runner(name)


@contextlib.contextmanager
def _one_thread():
    """Intra-op threads spin against the neighbours of a shared 2-core machine (a 16 ms step took seconds with
    2 threads at load 12): one thread, as the ZeRO workers run."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure(case: Case, settings: Settings, say) -> tuple[list[dict], dict[str, str]]:
    """Checks each provider, measures its saved bytes, then times all in interleaved rounds, on one thread."""
    with _one_thread():
        return _measure(case, settings, say)


def _measure(case: Case, settings: Settings, say) -> tuple[list[dict], dict[str, str]]:
    runners, saved, skipped = {}, {}, {}
    for prov in case.providers:
        try:
            say(f"{case.name}: {prov.name} (check)")
            runner = prov.make()
        except Unavailable as exc:
            skipped[prov.name] = str(exc)
            continue
        runner.check()
        saved[prov.name] = runner.saved()
        runners[prov.name] = runner
    timings = {n: Timing(n, "ours" if n.startswith("fastzero") else "peer") for n in runners}
    for r in range(settings.warmup + settings.repeats):
        say(f"{case.name}: round {r + 1}")
        for name, runner in runners.items():
            t0 = time.perf_counter()
            runner.step()
            t = time.perf_counter() - t0
            if r >= settings.warmup:
                timings[name].times.append(t)
    return _rows(case, timings, saved, _bench(_shape_of(case)).budget), skipped


def _shape_of(case: Case) -> tuple[int, ...]:
    return next(s for s in SHAPES.values() if case.name == f"gpt{s[0]}x{s[1]}")


def _rows(case: Case, timings: dict[str, Timing], saved: dict[str, int], budget: int) -> list[dict]:
    out = Rows(case, gated=False)
    base = timings["none"].median
    for name, t in timings.items():
        out.add(name, "median_ms", t.median * 1e3)
        out.add(name, "spread", t.spread)
        out.add(name, "overhead", t.median / base - 1.0)
        out.add(name, "saved_bytes", saved[name])
        out.add(name, "saved_of_none", saved[name] / saved["none"])
    full, sel = timings.get("fastzero_full"), timings.get("fastzero_selective")
    if full and sel and full.median > base:
        # the targets: selective at <= 60% of full recompute's overhead, <= 1.5x its memory
        out.add("fastzero_selective", "overhead_of_full", (sel.median - base) / (full.median - base))
        out.add("fastzero_selective", "memory_of_full", saved["fastzero_selective"] / saved["fastzero_full"])
    if "fastzero_budget" in timings and "torch_every_2nd" in timings:
        # budget placement against the uniform interval at the same memory: target within 10%
        out.add(
            "fastzero_budget", "time_of_uniform", timings["fastzero_budget"].median / timings["torch_every_2nd"].median
        )
        out.add("fastzero_budget", "budget_bytes", budget)
    return out


COLUMNS = [
    ("ms/step", "median_ms", ".1f", 1.0),
    ("spread", "spread", ".1%", 1.0),
    ("overhead", "overhead", "+.0%", 1.0),
    ("saved MiB", "saved_bytes", ".2f", MiB),
    ("of none", "saved_of_none", ".0%", 1.0),
]


def table(case_info: dict, provs: dict[str, dict[str, float]]) -> list[str]:
    lines = [row(["provider", *(c[0] for c in COLUMNS)]), "|---|" + "---:|" * len(COLUMNS)]
    for prov, m in provs.items():
        lines.append(row([prov, *(fmt(m.get(key), spec, scale) for _, key, spec, scale in COLUMNS)]))
    lines += skipped_lines(case_info, len(COLUMNS) + 1)
    sel = provs.get("fastzero_selective", {})
    bud = provs.get("fastzero_budget", {})
    lines.append("")
    if "overhead_of_full" in sel:
        lines.append(
            f"Selective: {fmt(sel['overhead_of_full'], '.0%')} of full recompute's time overhead (target <= 60%) at "
            f"{fmt(sel['memory_of_full'], '.2f')}x its saved bytes (target <= 1.5x)."
        )
    if "time_of_uniform" in bud:
        lines.append(
            f"Budget placement ({fmt(bud['budget_bytes'], '.2f', MiB)} MiB, the bytes of every 2nd block "
            f"checkpointed): {fmt(bud['time_of_uniform'], '.2f')}x the uniform interval's time (target <= 1.10x)."
        )
    return lines


FAMILY = Family(
    name="act_ckpt",
    description="activation checkpointing: saved bytes and step time, fastzero full/selective/budget vs "
    "torch.utils.checkpoint (and DeepSpeed where installed)",
    cases=cases,
    peers=("none", "torch_every_block", "torch_every_2nd", "deepspeed"),
    roofline=None,
    in_all=False,  # step times on a shared 2-core machine: reported, not gated
    measure=measure,
    table=table,
)
