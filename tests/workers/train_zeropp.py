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
import warnings

import torch

import fastzero
import fastzero.zero
from bench.tiny_gpt import lm_loss, make_model, sequences
from fastzero.comm import cross_node_bytes, node_ranks

MICRO = 4


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
    cfg.update(run.get("top", {}))  # top-level keys (prescale_gradients, gradient_predivide_factor)
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
    for name, p in model.named_parameters():  # "freeze": names containing any of these train no more (LoRA-like)
        p.requires_grad_(not any(part in name for part in run.get("freeze", ())))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
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
    with fastzero.zero.GatheredParameters(list(engine.module.parameters())):
        seen = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
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
            state_dict={k: v.float() for k, v in engine.state_dict().items()},
            seen_in_gathered_parameters=seen,
            init_warnings=[str(w.message) for w in caught],
        ),
        f"{run['out']}.rank{rank}.pt",
    )


if __name__ == "__main__":
    for run in json.loads(open(sys.argv[1]).read()):
        train(run)
