"""One rank of a fault-injection run (started by tests/dist.py). Argument: a
JSON file with a list of runs. Each run trains the test model of
train_zero.py with faults injected and saves what happened on this rank
(the error it raised, the warnings, params, skipped steps) to
`out` + f".rank{rank}.pt". A run that raises is recorded, not fatal, so the
test sees every rank's error."""

import json
import math
import sys
import warnings

import torch

import fastzero
from tests.workers.train_zero import MICRO, config, global_batch, make_model


class Wide(torch.nn.Module):
    """Another model: the same names, one shape differs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(33, 66), torch.nn.GELU(), torch.nn.Linear(66, 17), torch.nn.LayerNorm(17)
        )

    def forward(self, x):
        return self.net(x)


def train(run: dict, rank: int, world: int) -> dict:
    model = Wide().net if run.get("wide_on") == rank else make_model(run.get("model", "mlp"))
    cfg = config(run)
    for key, value in run.get("config", {}).items():
        cfg[key] = value
    for key, value in run.get("config_on", {}).get(str(rank), {}).items():
        cfg[key] = value
    engine, *_ = fastzero.initialize(model=model, config=cfg)
    gas, losses = engine.gradient_accumulation_steps(), []
    for step in range(run.get("steps", 4)):
        x, y = global_batch(step, MICRO * gas * world)
        for m in range(gas):
            rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
            # branchy: the branch follows the step, or (diverge) the rank too
            branch = step + rank if run.get("diverge") else step
            args = (x[rows], branch) if run.get("model") == "branchy" else (x[rows],)
            loss = torch.nn.functional.mse_loss(engine(*args).float(), y[rows])
            if run.get("nan_at") == [step, rank]:
                loss = loss * math.nan
            engine.backward(loss)
            if run.get("twice"):  # a second backward before the step: its gradients accumulate
                x2, y2 = global_batch(100 + step, MICRO * gas * world)
                engine.backward(torch.nn.functional.mse_loss(engine(x2[rows]).float(), y2[rows]))
            engine.step()
            losses.append(loss.item())
    with engine.gathered() as module:
        params = {n: p.detach().float().clone() for n, p in module.named_parameters()}
    return dict(params=params, skipped=engine.skipped_steps, losses=losses, history=engine.monitor.history)


def main() -> None:
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for run in json.load(open(sys.argv[1])):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = dict(error=None, **train(run, rank, world))
            except Exception as exc:  # recorded for the test: every rank must raise, and say why
                result = dict(error=(type(exc).__name__, str(exc)))
        result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        torch.save(result, f"{run['out']}.rank{rank}.pt")


if __name__ == "__main__":
    main()
