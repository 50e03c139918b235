"""Adam's optimizer-state formats on a small language model: does storing the
moments in fewer bits cost loss, and what does each step cost?

The model, data and loss are bench/tiny_gpt.py's (a small pre-norm GPT trained
on a fixed random Markov language whose best possible loss is the chain's
entropy, printed as the floor). Every optimizer trains its own copy of the
same initial model on the same batches, in lockstep (step t of every run back
to back, so the machine's noise hits their times alike), and is scored on the
same held-out sequences. Runs (``--only`` picks some):

- ``fastzero-fp32``, ``fastzero-bf16-sr``, ``fastzero-int8``: CPUAdam with
  ``state_format="fp32"``, ``"bf16"`` (stochastic rounding) and ``"int8"``
  (block-wise, blocks of 256), fp32 params.
- ``bf16-rtn``: the same fp32 params with bf16 states written by round to
  nearest: fastzero's reference ``adam_step`` with bf16 exp_avg/exp_avg_sq and
  ``state_format=None`` (the fp32 math, each state stored with ``.copy_``).
  What stochastic rounding is for: beta2 = 0.999 moves exp_avg_sq by 0.1% a
  step, under half of bf16's relative spacing (2^-8 to 2^-7), so rounded to
  nearest it stops following the gradients once it is large enough.
- ``torch-fp32``: torch.optim.AdamW(fused=True), the anchor.
- Peers with low-bit states, where they import (skipped with the reason):
  ``torchao-adamw8bit`` (torchao.optim.AdamW8bit, blocks of 256, fp32 params),
  ``bnb-adamw8bit`` (bitsandbytes.optim.AdamW8bit), and
  ``torchao-bf16-sr``: torchao's AdamW with ``bf16_stochastic_round=True``,
  which rounds the *params* stochastically: the model in bf16 (no fp32 master),
  its states bf16 rounded to nearest, so its forward and backward run in bf16
  too (a different job: compare it with the next two).
- ``fastzero-bf16-params-sr``: the same job in fastzero: the model in bf16, no
  fp32 master, ``CPUAdam(bf16_stochastic_round=True)`` (fp32 states);
  ``fastzero-bf16-params-rtn``: the same with the params rounded to nearest.

Reported per run: the held-out loss at the end (and along the way), the median
time of ``opt.step()`` and of a whole training step after the first
``WARMUP`` steps (torchao compiles its step on first use).

    python -m bench.state_formats_convergence --steps 400 --json out.json --report out.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fastzero.ops import CPUAdam, reference

from .machine import machine_info
from .tiny_gpt import SEQ, chain, lm_loss, make_model, sequences

HYPER = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
WARMUP = 5  # steps left out of the times (first-use compiles, allocations)
HELD_OUT_SEED = 12345


class RoundToNearestBF16Adam(torch.optim.Optimizer):
    """AdamW keeping exp_avg/exp_avg_sq in bf16, rounded to nearest: fastzero's reference step with
    state_format=None (fp32 math, states stored by ``.copy_``)."""

    def __init__(self, params, lr, betas, eps, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if not self.state[p]:
                    self.state[p] = {k: torch.zeros_like(p, dtype=torch.bfloat16) for k in ("exp_avg", "exp_avg_sq")}
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            reference.adam_step(
                params,
                [p.grad for p in params],
                [self.state[p]["exp_avg"] for p in params],
                [self.state[p]["exp_avg_sq"] for p in params],
                step=group["step"],
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
            )


class Skip(Exception):
    """An optimizer that cannot run here; its message says why."""


def _import(module: str):
    try:
        return __import__(module, fromlist=["_"])
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        raise Skip(f"{module} not importable ({type(exc).__name__}: {exc})") from None


def _torchao(name: str, **kw) -> Callable:
    return lambda ps, hp: getattr(_import("torchao.optim"), name)(ps, **hp, **kw)


# name -> (make the optimizer from the params and the hyperparameters, the params' dtype)
OPTIMIZERS: dict[str, tuple[Callable, torch.dtype]] = {
    "fastzero-fp32": (lambda ps, hp: CPUAdam(ps, **hp, state_format="fp32"), torch.float32),
    "fastzero-bf16-sr": (lambda ps, hp: CPUAdam(ps, **hp, state_format="bf16"), torch.float32),
    "bf16-rtn": (lambda ps, hp: RoundToNearestBF16Adam(ps, **hp), torch.float32),
    "fastzero-int8": (lambda ps, hp: CPUAdam(ps, **hp, state_format="int8"), torch.float32),
    "torch-fp32": (lambda ps, hp: torch.optim.AdamW(ps, **hp, fused=True), torch.float32),
    "torchao-adamw8bit": (_torchao("AdamW8bit", block_size=256), torch.float32),
    "bnb-adamw8bit": (lambda ps, hp: _import("bitsandbytes.optim").AdamW8bit(ps, **hp), torch.float32),
    "torchao-bf16-sr": (_torchao("_AdamW", bf16_stochastic_round=True), torch.bfloat16),
    "fastzero-bf16-params-sr": (lambda ps, hp: CPUAdam(ps, **hp, bf16_stochastic_round=True), torch.bfloat16),
    "fastzero-bf16-params-rtn": (lambda ps, hp: CPUAdam(ps, **hp), torch.bfloat16),
}


def chain_entropy(ids: torch.Tensor) -> float:
    """The best loss any model can reach on `ids`: the mean of -log p(next | current) under the chain."""
    logp = chain().log()
    return float(-logp[ids[:, :-1], ids[:, 1:]].mean())


@torch.no_grad()
def held_out_loss(model, ids: torch.Tensor) -> float:
    return float(lm_loss(model(ids[:, :-1]), ids))


class Run:
    """One optimizer training its own copy of the model."""

    def __init__(self, name: str, args) -> None:
        make, dtype = OPTIMIZERS[name]
        self.name = name
        self.model = make_model(args.hidden, args.layers).to(dtype)
        try:
            self.opt = make(list(self.model.parameters()), dict(HYPER, lr=args.lr))
        except Skip:
            raise
        except Exception as exc:  # noqa: BLE001 - a peer without a CPU path
            raise Skip(f"{type(exc).__name__}: {exc}") from None
        self.opt_times: list[float] = []
        self.step_times: list[float] = []
        self.curve: list[tuple[int, float]] = []
        self.error: str | None = None

    def step(self, ids: torch.Tensor) -> None:
        t0 = time.perf_counter()
        loss = lm_loss(self.model(ids[:, :-1]), ids)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        t1 = time.perf_counter()
        self.opt.step()
        t2 = time.perf_counter()
        self.opt_times.append(t2 - t1)
        self.step_times.append(t2 - t0)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"training loss {loss.item()}")

    def result(self) -> dict:
        times = lambda ts: statistics.median(ts[WARMUP:] or ts) * 1e3  # noqa: E731
        out = dict(name=self.name, curve=self.curve, error=self.error)
        if self.opt_times:
            out |= dict(
                final_loss=self.curve[-1][1] if self.curve else None,
                opt_ms=times(self.opt_times),
                step_ms=times(self.step_times),
                first_opt_ms=self.opt_times[0] * 1e3,
            )
        return out


def train(names: list[str], args, seed: int, say=print) -> tuple[list[dict], dict[str, str]]:
    """Every optimizer in `names` on the batches of data seed `seed`, in lockstep."""
    train_ids = sequences(args.steps * args.batch, seed=seed)
    held_out = sequences(args.held_out, seed=HELD_OUT_SEED)
    runs, skipped = [], {}
    for name in names:
        try:
            runs.append(Run(name, args))
        except Skip as exc:
            skipped[name] = str(exc)
    every = max(1, args.steps // args.points)
    for t in range(args.steps):
        ids = train_ids[t * args.batch : (t + 1) * args.batch]
        for run in runs:
            if run.error is None:
                try:
                    run.step(ids)
                except Exception as exc:  # noqa: BLE001 - a peer failing mid-run is a result, not a crash
                    run.error = f"step {t + 1}: {type(exc).__name__}: {exc}"
        if (t + 1) % every == 0 or t + 1 == args.steps:
            for run in runs:
                if run.error is None:
                    run.curve.append((t + 1, held_out_loss(run.model, held_out)))
            say(f"seed {seed} step {t + 1}: " + ", ".join(f"{r.name} {r.curve[-1][1]:.4f}" for r in runs if r.curve))
    return [r.result() | {"seed": seed} for r in runs], skipped


def markdown(res: dict) -> str:
    cfg = res["config"]
    seeds = cfg["seeds"]
    by = {}
    for r in res["runs"]:
        by.setdefault(r["name"], []).append(r)
    base = {r["seed"]: r.get("final_loss") for r in by.get("fastzero-fp32", [])}
    lines = [
        "# Adam state formats: convergence on bench/tiny_gpt.py",
        "",
        f"hidden {cfg['hidden']}, {cfg['layers']} layers, {res['params']:,} params; {cfg['steps']} steps of "
        f"{cfg['batch']} sequences of {SEQ} tokens; AdamW lr {cfg['lr']}, betas {HYPER['betas']}, "
        f"weight decay {HYPER['weight_decay']}; data seeds {', '.join(map(str, seeds))}; held-out loss over "
        f"{cfg['held_out']} sequences (the chain's entropy, the floor: {res['floor']:.4f}). "
        f"Commit `{res['machine']['git_sha']}`, torch {res['machine']['torch']}, "
        f"{res['machine']['torch_threads']} threads, load average {res['load']}.",
        "",
        "| optimizer | final held-out loss, per seed | mean | vs fastzero-fp32 (mean of per-seed differences) "
        "| opt.step ms | whole step ms |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, runs in by.items():
        losses = [r.get("final_loss") for r in runs]
        if any(x is None for x in losses):
            lines.append(f"| {name} | failed: {runs[0]['error']} | | | | |")
            continue
        diffs = [r["final_loss"] - base[r["seed"]] for r in runs if base.get(r["seed"]) is not None]
        diff = f"{statistics.mean(diffs):+.4f}" if diffs and name != "fastzero-fp32" else ""
        lines.append(
            f"| {name} | {' / '.join(f'{x:.4f}' for x in losses)} | {statistics.mean(losses):.4f} | {diff} | "
            f"{_median(runs, 'opt_ms'):.2f} | {_median(runs, 'step_ms'):.2f} |"
        )
    for name, why in res["skipped"].items():
        lines.append(f"| {name} | skipped: {why} | | | | |")
    lines += ["", "Held-out loss along the way (first seed):", ""]
    first = [r for r in res["runs"] if r["seed"] == seeds[0] and r["curve"]]
    if first:
        steps = [s for s, _ in first[0]["curve"]]
        lines += ["| step | " + " | ".join(r["name"] for r in first) + " |", "|---:|" + "---:|" * len(first)]
        for i, s in enumerate(steps):
            cells = [f"{r['curve'][i][1]:.4f}" if i < len(r["curve"]) else "" for r in first]
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog=f"python -m {__package__}.state_formats_convergence", description=__doc__)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=32, help="sequences per step")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=HYPER["lr"])
    ap.add_argument("--seeds", type=_ints, default=[1], help="data seeds, e.g. 1,2,3")
    ap.add_argument("--held-out", type=int, default=1024, help="held-out sequences")
    ap.add_argument("--points", type=int, default=10, help="held-out evaluations along the way")
    ap.add_argument("--only", type=lambda s: s.split(","), default=list(OPTIMIZERS), help="optimizers (comma list)")
    # one thread: the model is small (its matmuls gain little from a second thread) and, on shared cores, a
    # second OpenMP thread that waits for a busy core made a training step ~5x slower here
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path)
    args = ap.parse_args(argv)
    unknown = set(args.only) - set(OPTIMIZERS)
    if unknown:
        ap.error(f"unknown optimizers {sorted(unknown)}; known: {', '.join(OPTIMIZERS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    res = dict(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=machine_info(),
        config=dict(vars(args), json=None, report=None, hyper=dict(HYPER, lr=args.lr)),
        params=sum(p.numel() for p in make_model(args.hidden, args.layers).parameters()),
        floor=chain_entropy(sequences(args.held_out, seed=HELD_OUT_SEED)),
        runs=[],
        skipped={},
    )
    for seed in args.seeds:
        runs, skipped = train(args.only, args, seed)
        res["runs"] += runs
        res["skipped"] |= skipped
    res["load"] = f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    text = markdown(res)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1, default=str) + "\n")
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
