"""One rank of the checkpoint tag-validation test (started by tests/dist.py).
Arguments: a directory and the output prefix. For each
checkpoint.tag_validation (ignore, warn, fail), in its own save directory
``<dir>/<mode>``: each rank saves under its own tag ("t<rank>"), then every
rank under the same tag; records the error or warnings of each save and what
the save directory holds, by mode, to `out` + f".rank{rank}.pt"."""

import sys
import warnings
from pathlib import Path

import torch

import fastzero
from tests.workers.train_zero import MICRO, config, global_batch, make_model


def save(engine, root, tag) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            path, error = engine.save_checkpoint(root, tag=tag), None
        except Exception as exc:
            path, error = None, f"{type(exc).__name__}: {exc}"
    return dict(path=path, error=error, warnings=[str(w.message) for w in caught if "tags differ" in str(w.message)])


def run(mode: str, root: Path) -> dict:
    engine, *_ = fastzero.initialize(
        model=make_model(), config={**config(dict(stage=1, gas=1)), "checkpoint": {"tag_validation": mode}}
    )
    rank, world = engine.global_rank, engine.world_size
    x, y = global_batch(0, MICRO * world)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    engine.backward(torch.nn.functional.mse_loss(engine(x[rows]), y[rows]))
    engine.step()
    differ = save(engine, root, f"t{rank}")
    same = save(engine, root, "same")
    engine.comm.barrier()
    return dict(differ=differ, same=same, left=sorted(p.name for p in root.iterdir()))


def main(root: str, out: str) -> None:
    results = {mode: run(mode, Path(root) / mode) for mode in ("ignore", "warn", "fail")}
    torch.save(results, f"{out}.rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:3])
