"""One rank of a checkpoint across tensor-parallel layouts (started by
tests/dist.py). A small Hugging Face GPT-2 (tests/workers/autotp_model.py's)
trains at tensor `tp` x data (world / tp) under ZeRO `stage` on fixed global
batches (each data rank its share), from step `start` (loading `load`) to
`steps` (saving to `save` at the end when given). Saves the global losses
and, after a save, the logits of a fixed batch. Argument: a JSON run spec."""

import json
import sys

import torch

import fastzero
from tests.workers.autotp_model import VOCAB, build

GLOBAL, SEQ = 4, 10


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=torch.Generator().manual_seed(500 + step))


def main(run: dict) -> None:
    fastzero.init_distributed()
    world = torch.distributed.get_world_size()
    tp = run["tp"]
    dp = world // tp
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL // dp,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": run["stage"], "reduce_bucket_size": 2000},
        "tensor_parallel": {"autotp_size": tp},
        "steps_per_print": 10**6,
    }
    engine, *_ = fastzero.initialize(model=build("gpt2"), config=config)
    if run.get("load"):
        engine.load_checkpoint(run["load"])
    rank = engine.comm.rank  # the data rank
    losses = []
    for step in range(run.get("start", 0), run["steps"]):
        ids = batch(step)[rank * (GLOBAL // dp) : (rank + 1) * (GLOBAL // dp)]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    out = {"losses": losses}
    if run.get("save"):
        engine.save_checkpoint(run["save"])
        with torch.no_grad(), engine.gathered():
            out["logits"] = engine(input_ids=batch(-1)).logits.detach()
    torch.save(out, f"{run['out']}.rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
