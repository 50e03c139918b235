"""One rank of the tests of DeepSpeed's param-state helpers
(``deepspeed.utils.safe_get_full_fp32_param`` and the rest, reached through
``import fastzero as deepspeed``; started by tests/dist.py). Argument: a
JSON file with a list of runs; each saves what the tests compare to `out` +
f".rank{rank}.pt". The single-process reference in
tests/utils/test_tensor_fragment.py runs :func:`session` too, with a plain
stage-0 engine and the state read and written by hand."""

import json
import sys

import torch

import fastzero
import fastzero as deepspeed
from tests.workers.train_zero import MICRO, config, global_batch, make_model

ZERO3 = dict(stage3_param_persistence_threshold=100, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
BEFORE = 2  # training steps before the reads
SET_PARAM = ("0.weight", "3.weight")  # partitioned and (stage 3) persistent
SET_STATE = (("2.weight", "exp_avg"), ("0.bias", "exp_avg_sq"))


def engine_config(run: dict, gas: int) -> dict:
    """No clipping: the rank-summed norm's last bits would differ from one process's."""
    zero = ZERO3 if run["stage"] == 3 else {}
    return config(dict(run, gas=gas, clip=0, zero=zero))


def edits(seed: int = 11) -> dict[str, dict[str, torch.Tensor]]:
    """What is written: a gradient for every param, two params, two states (exp_avg_sq kept positive)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {n: p.shape for n, p in make_model().named_parameters()}
    grads = {n: torch.randn(s, generator=gen) * 0.1 for n, s in shapes.items()}
    params = {n: torch.randn(shapes[n], generator=gen) * 0.5 + 1.0 for n in SET_PARAM}
    states = {f"{n}.{k}": torch.randn(shapes[n], generator=gen).abs() * 1e-3 for n, k in SET_STATE}
    return {"grads": grads, "params": params, "states": states}


def backward_all(engine, step: int, rank: int, world: int) -> None:
    """Every micro-batch of `step`'s global batch: the backwards, and the step() calls between them (which
    only count); the step's own step() is left to the caller."""
    gas = engine.gradient_accumulation_steps()
    x, y = global_batch(step, MICRO * gas * world)
    for m in range(gas):
        rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
        engine.backward(torch.nn.functional.mse_loss(engine(x[rows]).float(), y[rows]))
        if m < gas - 1:
            engine.step()


def whole(engine, model) -> dict[str, torch.Tensor]:
    with engine.gathered():
        return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def session(engine, model, rank: int, world: int, access) -> dict:
    """Train, read every param's fp32 value, states and gradient, write the edits, step, train one more step.
    `access`: (get_grad, get_param, get_state, set_grad, set_param, set_state), each taking the param's name."""
    get_grad, get_param, get_state, set_grad, set_param, set_state = access
    names = [n for n, _ in model.named_parameters()]
    for step in range(BEFORE):
        backward_all(engine, step, rank, world)
        engine.step()
    backward_all(engine, BEFORE, rank, world)
    out = {
        "grad": {n: get_grad(n) for n in names},
        "fp32": {n: get_param(n) for n in names},
        "exp_avg": {n: get_state(n, "exp_avg") for n in names},
        "exp_avg_sq": {n: get_state(n, "exp_avg_sq") for n in names},
    }
    e = edits()
    for n in names:
        set_grad(n, e["grads"][n])
    for n in SET_PARAM:
        set_param(n, e["params"][n])
    for n, key in SET_STATE:
        set_state(n, key, e["states"][f"{n}.{key}"])
    out["read_back"] = {
        "grad": {n: get_grad(n) for n in names},
        "fp32": {n: get_param(n) for n in SET_PARAM},
        "state": {f"{n}.{k}": get_state(n, k) for n, k in SET_STATE},
    }
    out["model_after_set"] = whole(engine, model)
    engine.step()
    out["after_step"] = whole(engine, model)
    backward_all(engine, BEFORE + 1, rank, world)
    engine.step()
    out["after_more"] = whole(engine, model)
    return out


def helpers(model):
    """The session's access through deepspeed.utils' names (the full ones; the vectorized update for grads)."""
    u = deepspeed.utils
    params = dict(model.named_parameters())
    cpu = lambda t: t.detach().float().cpu().clone()
    pending = {}

    def set_grad(n, value):  # collected, then written in one safe_update_full_grad_vectorized, except 0.bias
        if n == "0.bias":
            u.safe_set_full_grad(params[n], value)
        else:
            pending[n] = value
            if len(pending) == len(params) - 1:
                by_id = {id(params[k]): v for k, v in pending.items()}
                u.safe_update_full_grad_vectorized([params[k] for k in pending], lambda g, p: by_id[id(p)] + 0 * g)

    return (
        lambda n: cpu(u.safe_get_full_grad(params[n])),
        lambda n: cpu(u.safe_get_full_fp32_param(params[n])),
        lambda n, k: cpu(u.safe_get_full_optimizer_state(params[n], k)),
        set_grad,
        lambda n, v: u.safe_set_full_fp32_param(params[n], v),
        lambda n, k, v: u.safe_set_full_optimizer_state(params[n], v, k),
    )


def run_session(run: dict, rank: int, world: int) -> dict:
    model = make_model()
    engine, *_ = fastzero.initialize(model=model, config=engine_config(run, gas=2))
    out = session(engine, model, rank, world, helpers(model))
    if run["stage"] == 3:  # the local pieces of one more boundary backward, beside the full values
        backward_all(engine, BEFORE + 2, rank, world)
        u, params = deepspeed.utils, dict(model.named_parameters())
        out["local"] = {
            n: {
                "fp32": u.safe_get_local_fp32_param(p).cpu(),
                "exp_avg": u.safe_get_local_optimizer_state(p, "exp_avg").cpu(),
                "grad": u.safe_get_local_grad(p).cpu(),
                "full_fp32": u.safe_get_full_fp32_param(p).cpu(),
                "full_exp_avg": u.safe_get_full_optimizer_state(p, "exp_avg").cpu(),
                "full_grad": u.safe_get_full_grad(p).cpu(),
            }
            for n, p in params.items()
        }
        # this rank's elements set: the full value read back holds every rank's
        for n, p in params.items():
            piece = out["local"][n]["fp32"]
            u.safe_set_local_fp32_param(p, piece * 0 + float(rank + 1))
            u.safe_set_local_optimizer_state(p, piece * 0 - float(rank + 1), "exp_avg")
            u.safe_set_local_grad(p, piece * 0 + 10.0 * (rank + 1))
        out["local_set"] = {
            n: {
                "fp32": u.safe_get_full_fp32_param(p).cpu(),
                "exp_avg": u.safe_get_full_optimizer_state(p, "exp_avg").cpu(),
                "grad": u.safe_get_full_grad(p).cpu(),
            }
            for n, p in params.items()
        }
        out["local_set_model"] = whole(engine, model)
    return out


def run_int8(run: dict, rank: int, world: int) -> dict:
    """int8 states: the decoded state read, a state written (encoded again) and read back; the fp32 param
    written (the states stay packed) and read back."""
    model = make_model()
    engine, *_ = fastzero.initialize(model=model, config=engine_config(run, gas=2))
    for step in range(BEFORE):
        backward_all(engine, step, rank, world)
        engine.step()
    u, p = deepspeed.utils, dict(model.named_parameters())["0.weight"]
    before = u.safe_get_full_optimizer_state(p, "exp_avg").cpu()
    value = torch.rand(p.shape, generator=torch.Generator().manual_seed(5)) * 2e-3 - 1e-3  # the same on every rank
    u.safe_set_full_optimizer_state(p, value, "exp_avg")
    weights = value * 100
    u.safe_set_full_fp32_param(p, weights)
    return {
        "before": before,
        "value": value,
        "after": u.safe_get_full_optimizer_state(p, "exp_avg").cpu(),
        "weights": weights,
        "weights_after": u.safe_get_full_fp32_param(p).cpu(),
        "model_weights": whole(engine, model)["0.weight"],
    }


def run_tiny(run: dict, rank: int, world: int) -> dict:
    """Stage 3, params some rank owns none of (a 1-element bias): the setters on every rank, inside
    engine.gathered() too (where the held params are gathered again: every rank must take part)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = fastzero.initialize(model=model, config=cfg)
    engine.backward(engine(torch.ones(2, 3)).sum())
    engine.step()
    u, params = deepspeed.utils, dict(model.named_parameters())
    owned = {n: u.safe_get_local_fp32_param(p).numel() for n, p in params.items()}
    with engine.gathered():
        for n, p in params.items():
            u.safe_set_local_fp32_param(p, torch.full((owned[n],), float(rank + 1)))
            u.safe_set_local_optimizer_state(p, torch.full((owned[n],), -float(rank + 1)), "exp_avg")
    return {
        "owned": owned,
        "fp32": {n: u.safe_get_full_fp32_param(p).cpu() for n, p in params.items()},
        "exp_avg": {n: u.safe_get_full_optimizer_state(p, "exp_avg").cpu() for n, p in params.items()},
        "model": whole(engine, model),
    }


def run_refusals(run: dict, rank: int, world: int) -> dict:
    """Bad calls: each raises on every rank (none left waiting in a collective), naming the fix."""
    model = make_model()
    model[3].bias.requires_grad_(False)
    engine, *_ = fastzero.initialize(model=model, config=engine_config(run, gas=1))
    u, params = deepspeed.utils, dict(model.named_parameters())
    said = {}

    def expect(name, exc, fn):
        try:
            fn()
        except exc as e:
            said[name] = str(e)
        else:
            raise AssertionError(f"{name}: no {exc.__name__}")

    w = params["0.weight"]
    expect("grad before backward", RuntimeError, lambda: u.safe_get_full_grad(w))
    expect("unknown key", ValueError, lambda: u.safe_get_full_optimizer_state(w, "momentum_buffer"))
    expect("set unknown key", ValueError, lambda: u.safe_set_full_optimizer_state(w, torch.zeros(w.shape), "nope"))
    for n, p in params.items():  # every rank raises, also where it owns none of the param
        if p.requires_grad:
            expect(f"set unknown key {n}", ValueError, lambda p=p: u.safe_set_full_optimizer_state(p, p * 0, "x"))
    expect("wrong shape", ValueError, lambda: u.safe_set_full_fp32_param(w, torch.zeros(3)))
    expect("transposed", ValueError, lambda: u.safe_set_full_fp32_param(w, torch.zeros(w.shape[::-1])))
    u.safe_set_full_fp32_param(w, w.detach().reshape(-1) * 0 + 0.25)  # flat is taken
    said["flat set"] = float(u.safe_get_full_fp32_param(w).sum()) / w.numel()
    expect("frozen", ValueError, lambda: u.safe_set_full_fp32_param(params["3.bias"], torch.zeros(17)))
    expect("local at stage 1", ValueError, lambda: u.safe_get_local_fp32_param(w))
    said["frozen get"] = u.safe_get_full_fp32_param(params["3.bias"])  # None, as DeepSpeed's
    x, y = global_batch(0, MICRO * world)
    engine.backward(torch.nn.functional.mse_loss(engine(x[rank * MICRO : (rank + 1) * MICRO]), y[:MICRO]))
    said["grad norm"] = float(u.safe_get_full_grad(w).norm())
    engine.step()
    expect("grad after step", RuntimeError, lambda: u.safe_get_full_grad(w))
    return said


RUNS = {"session": run_session, "int8": run_int8, "tiny": run_tiny, "refusals": run_refusals}

if __name__ == "__main__":
    fastzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for run in json.loads(open(sys.argv[1]).read()):
        torch.save(RUNS[run["kind"]](run, rank, world), f"{run['out']}.rank{rank}.pt")
    torch.distributed.destroy_process_group()
