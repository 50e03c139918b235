"""One rank of the cross-rank checkpoint agreement test (started by
tests/dist.py). Arguments: the save directory and the output prefix. Trains
the test model 2 steps at stage 2, saves, rank 0 flips a byte of rank 1's
file, then a fresh engine on every rank tries to load it; then a save whose
file write fails on rank 1 only (a full disk). Each rank records the errors
it raised, whether its engine changed and what the failed save left, to
`out` + f".rank{rank}.pt"."""

import errno
import sys
import zipfile
from pathlib import Path

import torch

import fastzero
from fastzero.runtime import checkpoint_files as files
from fastzero.runtime import checkpoint_io as ckpt
from tests.workers.train_zero import MICRO, config, global_batch, make_model

RUN = dict(stage=2, gas=1)


def flip_byte(path: Path) -> int:
    """Flips one byte in the middle of the largest tensor record of the
    torch.save file `path` (so torch.load still succeeds, with one wrong
    value), or in the middle of the file when it has no tensor data.
    Returns the byte's offset."""
    with zipfile.ZipFile(path) as z:
        records = [i for i in z.infolist() if "/data/" in i.filename and i.file_size > 0]
    raw = bytearray(path.read_bytes())
    if records:
        rec = max(records, key=lambda i: i.file_size)
        # the local header: 30 bytes, then the name and the extra field, whose lengths it holds
        name_len = int.from_bytes(raw[rec.header_offset + 26 : rec.header_offset + 28], "little")
        extra_len = int.from_bytes(raw[rec.header_offset + 28 : rec.header_offset + 30], "little")
        offset = rec.header_offset + 30 + name_len + extra_len + rec.file_size // 2
    else:
        offset = len(raw) // 2
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))
    return offset


def state(engine) -> dict:
    with engine.gathered() as module:
        params = {n: p.detach().clone() for n, p in module.named_parameters()}
    masters = [p.detach().clone() for g in engine.optimizer.param_groups for p in g["params"]]
    return dict(params=params, masters=masters, steps=engine.global_steps, rng=torch.get_rng_state())


def same(a: dict, b: dict) -> bool:
    return (
        a["steps"] == b["steps"]
        and all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
        and all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"], strict=True))
        and torch.equal(a["rng"], b["rng"])
    )


def main(save_dir: str, out: str) -> None:
    engine, *_ = fastzero.initialize(model=make_model(), config=config(RUN))
    rank, world = engine.comm.rank, engine.comm.world_size
    for step in range(2):
        x, y = global_batch(step, MICRO * world)
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(torch.nn.functional.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
    engine.save_checkpoint(save_dir)
    if rank == 0:
        flip_byte(ckpt.resolve(save_dir) / "rank00001.pt")
    engine.comm.barrier()
    fresh, *_ = fastzero.initialize(model=make_model(), config=config(RUN))
    before = state(fresh)
    try:
        fresh.load_checkpoint(save_dir)
        error = None
    except ckpt.CheckpointError as exc:
        error = f"{type(exc).__name__}: {exc}"
    unchanged = same(before, state(fresh))
    real_write = files._write

    def full_on_rank_1(path, obj):
        if rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, obj)

    files._write = full_on_rank_1
    try:
        engine.save_checkpoint(save_dir, tag="second")
        save_error = None
    except ckpt.CheckpointError as exc:
        save_error = f"{type(exc).__name__}: {exc}"
    files._write = real_write
    engine.comm.barrier()
    left = sorted(p.name for p in Path(save_dir).iterdir())
    latest = (Path(save_dir) / "latest").read_text()
    torch.save(
        dict(error=error, unchanged=unchanged, save_error=save_error, left=left, latest=latest),
        f"{out}.rank{rank}.pt",
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
