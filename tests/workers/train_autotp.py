"""One rank of AutoTP training (started by tests/dist.py): a small Hugging
Face model (tests/workers/autotp_model.py's) sharded by the config's
``tensor_parallel.autotp_size`` alone, trained at tensor 2 x data
(world / 2) under a ZeRO stage for a few steps; every rank also trains the
unsharded twin with torch.optim.AdamW on the same global batches, one
process, and saves both runs' losses and its own pieces of the final
weights next to the twin's. Arguments: arch, stage, steps, out, and
optionally a JSON object of more zero_optimization keys (ZeRO++)."""

import json
import sys

import torch

import fastzero
from fastzero.parallel import is_tensor_parallel
from tests.workers.autotp_model import VOCAB, build

MICRO, SEQ, LR, WD = 2, 10, 3e-3, 0.01


def batch(step: int, rows: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(100 + step))


def main(arch: str, stage: int, steps: int, out: str, zero: dict) -> None:
    fastzero.init_distributed()
    world = torch.distributed.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, **zero},
        "tensor_parallel": {"autotp_size": 2},
        "steps_per_print": 10**6,
    }
    engine, *_ = fastzero.initialize(model=build(arch), config=config)
    dp, dp_rank, tp_rank = engine.dp_world_size, engine.comm.rank, engine.tensor_comm.rank
    assert dp == world // 2
    losses = []
    for step in range(steps):
        ids = batch(step, MICRO * dp)[dp_rank * MICRO : (dp_rank + 1) * MICRO]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)  # the global batch's mean loss (each data rank's, summed over tensor too)
        losses.append(total.item() / world)
    with engine.gathered() as module:
        mine = {
            n: (
                p.detach().clone(),
                is_tensor_parallel(p),
                getattr(p, "partition_dim", 0),
                getattr(p, "partition_stride", 1),
            )
            for n, p in module.named_parameters()
        }
    twin = build(arch)
    opt = torch.optim.AdamW(twin.parameters(), lr=LR, weight_decay=WD)
    twin_losses = []
    for step in range(steps):
        ids = batch(step, MICRO * dp)
        # the engine averages the data ranks' mean losses: the mean over micro-batches here
        loss = (
            sum(
                twin(input_ids=ids[i * MICRO : (i + 1) * MICRO], labels=ids[i * MICRO : (i + 1) * MICRO]).loss
                for i in range(dp)
            )
            / dp
        )
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
        opt.step()
        twin_losses.append(loss.item())
    expected = {}
    for name, p in twin.named_parameters():
        if name in mine and mine[name][1]:
            _, _, dim, stride = mine[name]
            pieces = p.detach().chunk(2 * stride, dim)
            expected[name] = torch.cat(pieces[tp_rank::2], dim)
        elif name in mine:
            expected[name] = p.detach().clone()
    result = dict(losses=losses, twin_losses=twin_losses, params={n: v[0] for n, v in mine.items()}, expected=expected)
    torch.save(result, f"{out}.rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]) if sys.argv[5:] else {})
