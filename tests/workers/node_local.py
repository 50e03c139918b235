"""One rank of the node-local checkpoint tests (started by tests/dist.py
with simulated nodes and FASTZERO_NODE_LOCAL_ROOT_<i>). Argument: a JSON
file with a list of runs, each one of:

- a training run of tests/workers/train_zero.py (no "mode");
- "refused": a fresh engine tries to load `load`; records the error and
  whether the engine changed;
- "crash": trains 2 steps, saves tag "t", trains 2 more, then saves `tag`
  while rank `victim` dies (os._exit) just before its `nth` call of the
  checkpoint_files operation `op`; the other ranks record the states of
  both saves first, then fail in the save's next collective;
- "recover": for each crashed directory, a fresh engine loads `latest` and
  tag "t" (recording steps, params and warnings), saves tag "t" again and
  loads that.

Each writes what the tests compare to `out` + f".rank{rank}.pt"."""

import json
import os
import sys
import warnings

import torch

import fastzero
from fastzero.runtime import checkpoint_files as files
from tests.workers.train_zero import MICRO, config, global_batch, make_model, train

NODE_LOCAL = {"checkpoint": {"use_node_local_storage": True}}


def engine_for(run: dict):
    engine, *_ = fastzero.initialize(model=make_model(), config=config({**run, "top": NODE_LOCAL}))
    return engine


def params(engine) -> dict:
    with engine.gathered() as module:
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def steps(engine, first: int, last: int) -> None:
    rank, world, gas = engine.comm.rank, engine.comm.world_size, engine.gradient_accumulation_steps()
    for step in range(first, last):
        x, y = global_batch(step, MICRO * gas * world)
        for m in range(gas):
            rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
            engine.backward(torch.nn.functional.mse_loss(engine(x[rows]), y[rows]))
            engine.step()


def refused(run: dict, rank: int) -> None:
    engine = engine_for(run)
    before = params(engine)
    try:
        engine.load_checkpoint(run["load"])
        error = None
    except Exception as exc:  # noqa: BLE001 - the test reads which error it was
        error = f"{type(exc).__name__}: {exc}"
    after = params(engine)
    unchanged = engine.global_steps == 0 and all(torch.equal(before[k], after[k]) for k in before)
    torch.save(dict(error=error, unchanged=unchanged), f"{run['out']}.rank{rank}.pt")


def crash(run: dict, rank: int) -> None:
    engine = engine_for(run)
    steps(engine, 0, 2)
    engine.save_checkpoint(run["dir"], tag="t")
    old = params(engine)
    steps(engine, 2, 4)
    torch.save(dict(old=old, new=params(engine)), f"{run['out']}.rank{rank}.pt")
    if rank == run["victim"]:
        real, count = getattr(files, run["op"]), [0]

        def dying(*args):
            count[0] += 1
            if count[0] == run["nth"]:
                os._exit(17)  # the crash: nothing after this instant runs
            return real(*args)

        setattr(files, run["op"], dying)
    engine.save_checkpoint(run["dir"], tag=run["tag"])
    raise AssertionError("the save did not fail: the crash point was not reached")


def recover(run: dict, rank: int) -> None:
    out = []
    for directory in run["dirs"]:
        got = {}
        for tag in (None, "t"):
            engine = engine_for(run)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.load_checkpoint(directory, tag=tag)
            said = [str(w.message) for w in caught]
            got[tag] = dict(steps=engine.global_steps, params=params(engine), warnings=said)
        with warnings.catch_warnings(record=True) as caught:  # a crashed writer's lock is stale: taken over
            warnings.simplefilter("always")
            engine.save_checkpoint(directory, tag="t")
        fresh = engine_for(run)
        fresh.load_checkpoint(directory)
        got["again"] = dict(steps=fresh.global_steps, params=params(fresh), warnings=[str(w.message) for w in caught])
        out.append(got)
    torch.save(out, f"{run['out']}.rank{rank}.pt")


if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    for run in json.load(open(sys.argv[1])):
        {"refused": refused, "crash": crash, "recover": recover}.get(run.get("mode"), lambda r, _: train(r))(run, rank)
