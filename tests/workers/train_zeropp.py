"""One rank of a ZeRO++ training run (tests/runtime/test_zeropp.py, the zeropp
benchmark): a small GPT-like model on a deterministic synthetic language
(a fixed random Markov chain over the vocabulary), trained with
``fastzero.initialize``. Argument: a JSON file with a list of runs; each
writes what the tests compare to ``out + f".rank{rank}.pt"``: the losses, the
held-out loss, the params (exact, through ``engine.gathered()``), the memory
breakdown, and one whole step's collectives (the last step's) from every
group the engine communicates over."""

import json
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import fastzero
from fastzero.comm import cross_node_bytes, node_ranks

VOCAB, SEQ, MICRO = 64, 16, 4


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, hidden: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, hidden), nn.Embedding(SEQ, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB)

    def forward(self, ids):
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model(hidden: int = 64, layers: int = 2) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(hidden, layers)


def chain() -> torch.Tensor:
    """The language: each token has 4 likely successors (a fixed random table)."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(VOCAB, VOCAB, generator=gen) * 0.5
    top = torch.randint(0, VOCAB, (VOCAB, 4), generator=gen)
    logits.scatter_add_(1, top, torch.full((VOCAB, 4), 4.0))
    return logits.softmax(-1)


def sequences(rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    probs = chain()
    ids = torch.empty(rows, SEQ + 1, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (rows,), generator=gen)
    for t in range(SEQ):
        ids[:, t + 1] = torch.multinomial(probs[ids[:, t]], 1, generator=gen).squeeze(1)
    return ids


def lm_loss(logits, ids):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def config(run: dict) -> dict:
    zero = {
        "stage": run["stage"],
        "overlap_comm": True,
        "reduce_bucket_size": run.get("bucket", 50_000),
        "allgather_bucket_size": run.get("bucket", 50_000),
        "stage3_param_persistence_threshold": run.get("persist", 1000),
        "stage3_prefetch_bucket_size": 10**6,
        "stage3_max_reuse_distance": run.get("reuse", 0),  # 0: released after each use, gathered again
        **run.get("zero", {}),
    }
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": run.get("gas", 1),
        "optimizer": {"type": "AdamW", "params": {"lr": run.get("lr", 3e-3), "weight_decay": 0.01}},
        "gradient_clipping": run.get("clip", 1.0),
        "zero_optimization": zero,
        "steps_per_print": 10**6,
    }
    if run.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
        if run["stage"] == 3:
            zero["offload_param"] = {"device": "cpu"}
    if run.get("dtype") == "bf16":
        cfg["bf16"] = {"enabled": True}
    if run.get("dtype") == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12, "hysteresis": 1}
    return cfg


def step_record(engine, node_of, backward_start: float) -> list[dict]:
    """One step's collectives over every group the engine has."""
    out = []
    for comm in engine.comms():
        for e in comm.record:
            out.append(
                dict(
                    op=e.op,
                    tag=e.tag,
                    nbytes=e.nbytes,
                    wire=e.wire_bytes,
                    cross=cross_node_bytes(e, node_of),
                    ranks=list(e.ranks),
                    backward=e.launched >= backward_start,
                )
            )
    return out


def train(run: dict) -> None:
    model = make_model(run.get("hidden", 64), run.get("layers", 2))
    engine, *_ = fastzero.initialize(model=model, config=config(run))
    rank, world, gas = engine.comm.rank, engine.comm.world_size, engine.gradient_accumulation_steps()
    node_of = {r: k for k, ranks in enumerate(node_ranks(engine.comm)) for r in ranks}
    steps, start, losses = run.get("steps", 10), run.get("start", 0), []
    if run.get("load"):
        engine.load_checkpoint(run["load"])
    record, backward_start = [], float("inf")
    for step in range(start, steps):
        ids = sequences(MICRO * gas * world, 1000 + step)
        if step == steps - 1:
            for comm in engine.comms():
                comm.record.clear()
        for m in range(gas):
            rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
            loss = lm_loss(engine(ids[rows, :-1]), ids[rows])
            if run.get("inf_at") == [step, rank]:
                loss = loss * float("inf")
            if step == steps - 1 and m == 0:
                backward_start = time.perf_counter()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if step == steps - 1:
            record = step_record(engine, node_of, backward_start)
        if run.get("save_at") == step + 1:
            engine.save_checkpoint(run["save"])
    held_out = sequences(64, 99)
    with torch.no_grad(), engine.gathered() as module:
        eval_loss = lm_loss(module(held_out[:, :-1]), held_out).item()
        params = {n: p.detach().float().clone() for n, p in module.named_parameters()}
    torch.save(
        dict(
            losses=losses,
            eval_loss=eval_loss,
            params=params,
            memory=engine.memory_breakdown(),
            record=record,
            skipped=engine.skipped_steps,
            nodes=node_of,
        ),
        f"{run['out']}.rank{rank}.pt",
    )


if __name__ == "__main__":
    for run in json.loads(open(sys.argv[1]).read()):
        train(run)
