"""tests/workers/pipe_train.py's runs with zero_optimization.overlap_comm on
(a rank of tests/runtime/test_post_step_gather.py's pipeline test): each
result also holds, per step(), whether it returned with param all-gathers in
flight, and the sites that waited for them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fastzero.runtime.engine import Engine  # noqa: E402
from tests.workers import pipe_train  # noqa: E402

FLIGHTS: list[tuple[bool, list]] = []
_config, _train, _step = pipe_train.config, pipe_train.train, Engine.step


def config(run: dict) -> dict:
    cfg = _config(run)
    cfg["zero_optimization"]["overlap_comm"] = True
    cfg["zero_optimization"]["overlap_param_gather"] = True
    return cfg


def step(self) -> None:
    boundary, before = self.is_gradient_accumulation_boundary(), {id(e) for e in self.comm.record}
    _step(self)
    if boundary:
        launched = [e for e in self.comm.events(op="all_gather", tag="param") if id(e) not in before]
        FLIGHTS.append((self._params_in_flight and all(e.wait_site == "" for e in launched), launched))


def train(run: dict) -> dict:
    FLIGHTS.clear()
    out = _train(run)
    out["in_flight"] = [flag for flag, _ in FLIGHTS]
    out["wait_sites"] = sorted({e.wait_site for _, events in FLIGHTS for e in events})
    return out


pipe_train.config, pipe_train.train, Engine.step = config, train, step

if __name__ == "__main__":
    pipe_train.main()
