"""One rank of the reference-drift run (tests/runtime/test_reference_drift.py,
started by tests/dist.py): a small GPT-2 trained with fastzero, fp32 AdamW
and gradient clipping, at each ZeRO stage in turn. Rank 0 trains the
reference in lockstep: the same model in one process on the union of the
ranks' micro-batches, torch.optim.AdamW after clip_grad_norm_. Arguments: a
JSON file with the run (stages, steps, hyperparameters, out); each rank saves
its per-step losses and grad norms (rank 0 the reference's too: its loss and
its gradient's norm in fp64, before clipping; and those of a plain-torch
emulation of the ranks, :func:`dp_step`) to out + f".rank{rank}.pt"."""

import json
import sys

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

import fastzero

MICRO, SEQ = 4, 32


def make_model(run: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=run.get("layers", 2),
        n_embd=run.get("embd", 64),
        n_head=4,
        vocab_size=run.get("vocab", 128),
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def global_batch(step: int, rows: int, vocab: int) -> torch.Tensor:
    """Learnable token sequences: each row counts up from a random start by a random stride."""
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (rows, 1), generator=gen)
    stride = torch.randint(1, 8, (rows, 1), generator=gen)
    return (start + stride * torch.arange(SEQ)) % vocab


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, averaged in fp64: the loss differences the
    test fits are far below an fp32 loss's rounding step."""
    logits = model(tokens).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), tokens[:, 1:].reshape(-1))


def train_stage(run: dict, stage: int) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": run["lr"], "weight_decay": run["weight_decay"]}},
        "gradient_clipping": run["clip"],
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    engine, *_ = fastzero.initialize(model=make_model(run), config=cfg)
    rank, world = engine.comm.rank, engine.comm.world_size
    ref = ref_opt = dp = dp_opt = None
    if rank == 0:
        ref, dp = make_model(run), make_model(run)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=run["lr"], weight_decay=run["weight_decay"])
        dp_opt = torch.optim.AdamW(dp.parameters(), lr=run["lr"], weight_decay=run["weight_decay"])
    out = dict(losses=[], norms=[], ref_losses=[], ref_norms=[], dp_losses=[], dp_norms=[])
    for step in range(run["steps"]):
        tokens = global_batch(step, MICRO * world, run.get("vocab", 128))
        loss = lm_loss(engine, tokens[rank * MICRO : (rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
        out["norms"].append(engine.get_global_grad_norm())
        if ref is not None:
            ref_opt.zero_grad()
            ref_loss = lm_loss(ref, tokens)
            ref_loss.backward()
            params = [p for p in ref.parameters() if p.grad is not None]
            out["ref_norms"].append(float(torch.cat([p.grad.double().flatten() for p in params]).norm()))
            if run["clip"] > 0:
                torch.nn.utils.clip_grad_norm_(params, run["clip"])
            ref_opt.step()
            out["ref_losses"].append(ref_loss.item())
            dp_step(run, dp, dp_opt, tokens, world, out)
    return out


def dp_step(run: dict, model, opt, tokens: torch.Tensor, world: int, out: dict) -> None:
    """Data parallelism in plain torch, in one process: each rank's micro-batch through its own forward and
    backward (the gradients summed as the all-reduce sums them), the sum halved, clipped, torch's AdamW. Its
    forward and backward round as the ranks' do, so the engine is held to it closely on any CPU; the
    whole-batch reference rounds differently, by how much depending on the CPU's matmul kernels."""
    opt.zero_grad()
    losses = []
    for r in range(world):
        loss = lm_loss(model, tokens[r * MICRO : (r + 1) * MICRO])
        loss.backward()
        losses.append(loss.item())
    params = [p for p in model.parameters() if p.grad is not None]
    for p in params:
        p.grad.div_(world)
    out["dp_norms"].append(float(torch.cat([p.grad.double().flatten() for p in params]).norm()))
    if run["clip"] > 0:
        torch.nn.utils.clip_grad_norm_(params, run["clip"])
    opt.step()
    out["dp_losses"].append(sum(losses) / world)


if __name__ == "__main__":
    logging.set_verbosity_error()
    torch.set_num_threads(1)
    run = json.load(open(sys.argv[1]))
    results = {stage: train_stage(run, stage) for stage in run["stages"]}
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    torch.save(results, f"{run['out']}.rank{rank}.pt")
