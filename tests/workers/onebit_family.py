"""One rank of a standalone ZeroOneAdam / OneBitLamb run (started by
tests/dist.py), for the tests' multi-rank references. Arguments: a JSON file
{"optimizer": "ZeroOneAdam" | "OneBitLamb", "kwargs": {...}, "steps": n,
"out": path}. Each rank steps on its own data
(tests/runtime/onebit_family_reference.py) and saves its params, flattened,
after every step to `out` + f".rank{rank}.pt"."""

import json
import sys

import torch

from fastzero.comm import Comm, init_distributed
from fastzero.runtime.onebit_lamb import OneBitLamb
from fastzero.runtime.zero_one_adam import ZeroOneAdam
from tests.runtime.onebit_family_reference import flat, model, param_groups, set_grads


def main(spec: dict) -> None:
    init_distributed()
    comm = Comm()
    m = model()
    cls = {"ZeroOneAdam": ZeroOneAdam, "OneBitLamb": OneBitLamb}[spec["optimizer"]]
    opt = cls(param_groups(m), comm=comm, **spec["kwargs"])
    history, coeffs = [], []
    for step in range(spec["steps"]):
        set_grads(m, comm.rank, step)
        opt.step()
        history.append(flat(m.parameters()))
        coeffs.append(opt.get_lamb_coeffs() if isinstance(opt, OneBitLamb) else [])
    torch.save({"params": history, "coeffs": coeffs}, f"{spec['out']}.rank{comm.rank}.pt")


if __name__ == "__main__":
    main(json.load(open(sys.argv[1])))
