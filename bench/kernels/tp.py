"""Tensor-parallel training at TP=2 over Gloo (2 processes, one thread
each, data-parallel size 1): a Hugging Face ``GPT2LMHeadModel`` of GPT-2
small's shape (hidden 768, 12 heads, vocabulary 50257) cut to 2 layers,
sequence 128, micro-batch 2, fp32, AdamW, dropout off. ``--quick``: hidden
256, 4 heads, 1 layer, sequence 32, vocabulary 1024. ``--sizes`` are hidden
sizes (heads: hidden / 64, at least 2).

Providers, in one 2-process job (bench/tp_worker.py), timed in interleaved
rounds of one step each:

* ``fastzero``: ``fastzero.initialize`` with ``{"tensor_parallel":
  {"autotp_size": 2}}`` on the unmodified model (AutoTP), ZeRO stage 0;
* ``torch_tp``: PyTorch's ``parallelize_module`` (``ColwiseParallel`` on
  ``attn.c_attn`` and ``mlp.c_fc``, ``RowwiseParallel`` on ``attn.c_proj``
  and ``mlp.c_proj``, GPT-2's ``Conv1D`` turned into ``nn.Linear`` first),
  ``torch.optim.AdamW``;
* ``deepspeed``: DeepSpeed's AutoTP training (``tensor_parallel.autotp_size``
  with a ``partition_config`` for the same four projections, GPT-2's
  ``Conv1D`` turned into ``nn.Linear`` first: its heuristic AutoTP refuses
  GPT-2), where it imports (``DS_ACCELERATOR=cpu``).

Each provider's first two losses must equal the unsharded model's trained
by ``torch.optim.AdamW`` in one process (rtol 1e-5) before anything is timed.

Reported per provider: median ms/step (rank 0's timed steps), tokens/s,
model-state bytes per rank (the largest rank's) beside the unsharded
model's 16 bytes per param, the split projections' param bytes per rank
against 1/tp of the unsharded ones (target: within 5%), and the bytes handed
to collectives in one step (recorded by a dispatch mode) against Megatron's
formula: per layer and micro-batch, 4 all-reduces of b x s x h elements (2
forward, after the row-parallel attention output and MLP output projections;
2 backward, of the column-parallel layers' input grads).

Not in ``--all`` (CI's quick gate): a 2-process job that fills both cores
for 30 s even in quick mode (most of it importing transformers twice). The
one gated figure, for a baseline of its own, is fastzero's speedup over
``torch_tp``: a median of per-round ratios of the same run.
"""

from __future__ import annotations

from ..family import Family, Settings
from ..harness import Case, Provider, Rows, Timing, paired, self_timed
from ..jobs import run_ranks
from ..tables import fmt, row, skipped_lines

TP = 2
WORKER = "tp_worker"
PROVIDERS = ("fastzero", "torch_tp", "deepspeed")
FULL = dict(hidden=768, layers=2, seq=128, vocab=50257, micro=2)
QUICK = dict(hidden=256, layers=1, seq=32, vocab=1024, micro=2)
TARGET = 0.05  # the split layers' bytes per rank within 5% of 1/tp of the unsharded ones
ADAM_FP32 = 16  # model-state bytes per param: fp32 param, grad, exp_avg, exp_avg_sq
MiB = 1 << 20


def heads(hidden: int) -> int:
    return max(2, hidden // 64)


def shape(hidden: int | None, quick: bool) -> dict:
    base = QUICK if quick else FULL
    return dict(base, hidden=hidden or base["hidden"], heads=heads(hidden or base["hidden"]))


def _allreduce(op: str) -> bool:
    """torch.distributed's ``allreduce_`` or a functional ``all_reduce`` (coalesced too), not a reduce-scatter."""
    return op.replace("_", "").startswith("allreduce")


def megatron_bytes(layers: int, micro: int, seq: int, hidden: int, itemsize: int = 4) -> int:
    """Bytes all-reduced per step by Megatron's tensor parallelism: per layer and micro-batch, 2 all-reduces of
    b x s x h elements in forward and 2 in backward (each all-reduce's tensor; a ring all-reduce sends 2 (tp - 1)
    / tp times that per rank)."""
    return 4 * layers * micro * seq * hidden * itemsize


def cases(sizes=None, dtypes=None, quick=False, device="cpu") -> list[Case]:
    """One case per hidden size (fp32 only)."""
    out = []
    timed_here = self_timed("a multi-process job: timed by python -m bench.run --kernel tp, not per call")
    for h in sizes or [None]:
        s = shape(h, quick)
        if s["hidden"] % s["heads"] or s["heads"] % TP:
            raise SystemExit(f"--sizes {s['hidden']}: the hidden size must split into heads of 64 (or 2 heads)")
        provs = [Provider(p, "ours" if p == "fastzero" else "peer", timed_here) for p in PROVIDERS]
        desc = (
            f"GPT-2 {s['layers']} layer(s), hidden {s['hidden']}, {s['heads']} heads, vocab {s['vocab']}, seq "
            f"{s['seq']}, micro-batch {s['micro']}, fp32 AdamW, TP={TP} (2 ranks, Gloo, data 1)"
        )
        name = f"gpt2-h{s['hidden']}-L{s['layers']}-s{s['seq']}-v{s['vocab']}"
        out.append(Case("tp", name, 0, 0, provs, desc))
    return out


def _spec(case: Case, settings: Settings) -> dict:
    h, layers, seq, vocab = (int(part[1:]) for part in case.name.split("-")[1:])
    base = QUICK if settings.quick else FULL
    return dict(
        tp=TP,
        hidden=h,
        heads=heads(h),
        layers=layers,
        seq=seq,
        vocab=vocab,
        micro=base["micro"],
        warmup=settings.warmup,
        steps=settings.repeats,
        slowdown=settings.slowdown,
    )


def measure(case: Case, settings: Settings, say) -> tuple[list[dict], dict]:
    """Runs the case's providers (those not skipped) in one 2-process job; returns (rows, skipped)."""
    spec = _spec(case, settings)
    spec["providers"] = [p.name for p in case.providers if p.name not in settings.skip]
    say(f"{case.name}: {', '.join(spec['providers'])} ({TP} processes)")
    # one job runs every provider: any rank's failure (a peer's wrong loss too) fails the case, with its log
    res = run_ranks(WORKER, spec, TP, timeout=240 if settings.quick else 1800)
    return rows(case, spec, res), res["skipped"]


def rows(case: Case, spec: dict, res: dict) -> list[dict]:
    out = Rows(case)
    formula = megatron_bytes(spec["layers"], spec["micro"], spec["seq"], spec["hidden"])
    unsharded_states = ADAM_FP32 // 4 * res["unsharded_param_bytes"]
    times = {}
    for name, got in res["providers"].items():
        t = Timing(name, "ours" if name == "fastzero" else "peer", got["times"])
        times[name] = got["times"]
        ranks = got["per_rank"]
        states = max(r["model_state_bytes"] for r in ranks)
        split = max(r["sharded_layer_bytes"] for r in ranks)
        comm = max(sum(b for _, b in r["comm"].values()) for r in ranks)
        of_tp = split * TP / res["unsharded_layer_bytes"]
        out.add(name, "median_ms", t.median * 1e3)
        out.add(name, "spread", t.spread)
        out.add(name, "tokens_per_s", spec["micro"] * spec["seq"] / t.median)
        out.add(name, "timed_steps", len(got["times"]))
        out.add(name, "model_state_bytes", states)
        out.add(name, "unsharded_state_bytes", unsharded_states)
        out.add(name, "of_unsharded_states", states / unsharded_states)
        out.add(name, "split_layer_bytes", split)
        out.add(name, "unsharded_split_layer_bytes", res["unsharded_layer_bytes"])
        out.add(name, "split_layers_of_1_over_tp", of_tp)
        out.add(name, "split_target_met", float(abs(of_tp - 1.0) <= TARGET))
        out.add(name, "comm_bytes", comm)
        out.add(name, "collectives", max(sum(c for c, _ in r["comm"].values()) for r in ranks))
        out.add(
            name, "allreduce_bytes", max(sum(b for op, (_, b) in r["comm"].items() if _allreduce(op)) for r in ranks)
        )
        out.add(name, "megatron_bytes", formula)
        out.add(name, "comm_of_megatron", comm / formula)
    if "fastzero" in times:
        for peer in [n for n in times if n != "fastzero"]:
            # the gated figure where torch's: per-round ratios (both stepped in the same round)
            ratio = paired(times[peer], times["fastzero"])
            out.add("fastzero", f"speedup_vs_{peer}", ratio, gated=peer == "torch_tp")
    return out


def table(case_info: dict, provs: dict[str, dict[str, float]]) -> list[str]:
    cols = [
        ("ms/step", "median_ms", ".1f", 1.0),
        ("spread", "spread", ".1%", 1.0),
        ("tokens/s", "tokens_per_s", ".0f", 1.0),
        ("model states MiB/rank", "model_state_bytes", ".1f", MiB),
        ("of unsharded 16 B/param", "of_unsharded_states", ".3f", 1.0),
        ("split layers MiB/rank", "split_layer_bytes", ".2f", MiB),
        ("x tp / unsharded", "split_layers_of_1_over_tp", ".4f", 1.0),
        ("comm MiB/step", "comm_bytes", ".3f", MiB),
        ("collectives", "collectives", ".0f", 1.0),
        ("Megatron MiB", "megatron_bytes", ".3f", MiB),
        ("of Megatron", "comm_of_megatron", ".4f", 1.0),
    ]
    lines = [row(["provider", *(c[0] for c in cols), "1/tp target"]), "|---|" + "---:|" * (len(cols) + 1)]
    for prov, m in provs.items():
        met = m.get("split_target_met")
        cells = [fmt(m.get(key), spec, scale) for _, key, spec, scale in cols]
        lines.append(row([prov, *cells, "" if met is None else ("met" if met else "MISSED")]))
    lines += skipped_lines(case_info, len(cols) + 2)
    speed = [
        (k.removeprefix("speedup_vs_"), v) for k, v in provs.get("fastzero", {}).items() if k.startswith("speedup_vs_")
    ]
    if speed:
        lines += ["", "Speedup of fastzero (peer time / fastzero time, median of per-round ratios): "]
        lines[-1] += ", ".join(f"{peer} {v:.2f}x" for peer, v in speed)
    return lines + ["", LEGEND]


LEGEND = (
    "ms/step: median of rank 0's timed steps (forward + backward + optimizer step; the providers step in turn, one "
    "step each per round); spread: IQR / median; tokens/s: micro-batch x sequence / step time. Model states: bytes "
    "held per rank between steps (fastzero: the sum of its memory_breakdown(); peers: the distinct storages of "
    "params, grads and optimizer state, a DTensor by its local shard), beside the unsharded model's 16 B per param "
    "(fp32 param, grad, exp_avg, exp_avg_sq; DeepSpeed sets its grads to None after its step, so it holds 12 B); "
    "the embeddings, norms and tied LM head stay whole on every rank in every plan. Split layers: this rank's "
    "params (weights and biases) of attn.c_attn, attn.c_proj, mlp.c_fc and mlp.c_proj; x tp / unsharded is 1.0 "
    "for an exact 1/tp split (the row layers' biases are whole: slightly "
    f"above 1); target: within {TARGET:.0%}. Comm: the bytes of the tensors handed to collectives in one step "
    "(each all-reduce's tensor), recorded by a dispatch mode on rank 0 and 1 (the larger shown); a collective over "
    "a group of one rank moves nothing and is left out (DeepSpeed's all-reduce of its flat grads over its "
    "data-parallel group of 1). Megatron formula: 4 all-reduces of b x s x h fp32 elements per layer per "
    "micro-batch (2 forward, 2 backward); fastzero adds one all-reduce of 2 fp64 scalars (the global gradient "
    "norm's tensor-parallel part, 16 bytes). gradient_clipping is 0 for both engines (DeepSpeed 0.19's default, "
    "1.0, would change the update and add a norm all-reduce)."
)

FAMILY = Family(
    "tp",
    "tensor-parallel GPT-2 training at TP=2 (2 ranks, Gloo) vs PyTorch parallelize_module and DeepSpeed AutoTP; "
    "not in --all: a 2-process job that fills both cores (30 s quick, minutes in full)",
    cases,
    tuple(p for p in PROVIDERS if p != "fastzero"),
    None,
    in_all=False,
    measure=measure,
    table=table,
)
