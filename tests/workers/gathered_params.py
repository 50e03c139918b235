"""One rank of the fastzero.zero.GatheredParameters tests (started by
tests/dist.py). Argument: a JSON file with a list of runs; each run saves
what the tests compare to `out` + f".rank{rank}.pt". The training helpers
are shared with the single-process references in
tests/runtime/test_gathered_parameters.py."""

import json
import sys
import warnings

import torch

import fastzero
import fastzero.zero as zero
from fastzero.checkpoint import consolidate
from tests.workers.train_zero import MICRO, config, global_batch, make_model

# stage 3: the two weights partitioned, the biases and the LayerNorm (under 100 elements) persistent
ZERO3 = dict(stage3_param_persistence_threshold=100, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
EDITED = ("0.weight", "3.weight", "2.bias")  # a partitioned weight, a persistent one, and a frozen one in "after"


def engine_config(stage: int, dtype: str, gas: int) -> dict:
    """No clipping: the rank-summed norm's last bits would differ from one process's."""
    return config(dict(stage=stage, dtype=dtype, gas=gas, clip=0, zero=ZERO3 if stage == 3 else {}))


def param_groups(model) -> list[dict]:
    """Two param groups (lrs differ), trainable params only."""
    first = [p for p in model[0].parameters() if p.requires_grad]
    rest = [p for m in (model[2], model[3]) for p in m.parameters() if p.requires_grad]
    return [{"params": first}, {"params": rest, "lr": 3e-3}]


def edit_values(seed: int = 7) -> dict[str, torch.Tensor]:
    """What the modifier rank writes: far from the params' own values (a seeded init at another scale)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {n: p.shape for n, p in make_model().named_parameters()}
    return {n: torch.randn(shapes[n], generator=gen) * 0.5 + 1.0 for n in EDITED}


def train_steps(engine, steps: range, rank: int, world: int) -> None:
    """The global batch of train_zero: micro-batch m of rank r is rows (m * world + r) * MICRO onwards."""
    gas = engine.gradient_accumulation_steps()
    for step in steps:
        x, y = global_batch(step, MICRO * gas * world)
        for m in range(gas):
            rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
            engine.backward(torch.nn.functional.mse_loss(engine(x[rows]).float(), y[rows]))
            engine.step()


def whole(model, engine=None) -> dict[str, torch.Tensor]:
    """Every param whole, as fp32 copies (through the engine's own gathered() when there is one)."""
    with zero.GatheredParameters(list(model.parameters())) if engine is None else engine.gathered():
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def write(params: dict, names, values: dict, rank: int, modifier: int) -> None:
    """The modifier writes `values`; every other rank writes junk, which must not survive."""
    with torch.no_grad():
        for n in names:
            params[n].copy_(values[n] if rank == modifier else torch.full_like(params[n], 7.0 + rank))


def run_init(run: dict, rank: int, world: int) -> dict:
    """(a) Params partitioned by zero.Init, edited on rank 0 before initialize, then trained."""
    with zero.Init():
        model = make_model()
    names = EDITED[:2]
    params = dict(model.named_parameters())
    values = edit_values()
    with zero.GatheredParameters([params[n] for n in names], modifier_rank=0):
        assert all(params[n].shape == values[n].shape for n in names)
        write(params, names, values, rank, 0)
    assert all(p.numel() == 0 for p in model.parameters())  # partitioned again
    after_edit = whole(model)
    assert all(p.numel() == 0 for p in model.parameters())
    engine, *_ = fastzero.initialize(model=model, config=engine_config(3, run["dtype"], 1))
    train_steps(engine, range(run["steps"]), rank, world)
    return dict(after_edit=after_edit, params=whole(model, engine))


def run_after(run: dict, rank: int, world: int) -> dict:
    """(b), (d) Edited after initialize and a few steps, then trained on: the masters must hold the edit."""
    model = make_model()
    model[2].bias.requires_grad_(False)  # frozen: broadcast, no master
    engine, *_ = fastzero.initialize(
        model=model, model_parameters=param_groups(model), config=engine_config(run["stage"], run["dtype"], 1)
    )
    train_steps(engine, range(run["before"]), rank, world)
    params = dict(model.named_parameters())
    values = edit_values()
    modifier = run["modifier"]
    with zero.GatheredParameters([params[n] for n in EDITED], modifier_rank=modifier):
        write(params, EDITED, values, rank, modifier)
    engine.save_checkpoint(run["out"] + ".ckpt", tag="edited")
    masters = {n: t for n, t in consolidate(run["out"] + ".ckpt", "edited").items() if n in EDITED}
    after_edit = whole(model)
    train_steps(engine, range(run["before"], run["before"] + run["after"]), rank, world)
    return dict(after_edit=after_edit, masters=masters, params=whole(model, engine))


def run_discard(run: dict, rank: int, world: int) -> dict:
    """(c) modifier_rank=None drops edits of partitioned params (and warns), before and after initialize;
    nested blocks commit at an exit with modifier_rank."""
    with zero.Init():
        model = make_model()
    params = dict(model.named_parameters())
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = whole(model)
        with zero.GatheredParameters(model.parameters()):
            write(params, EDITED, edit_values(), rank, -1)
        out["init"] = (before, whole(model))
        engine, *_ = fastzero.initialize(model=model, config=engine_config(3, run["dtype"], 1))
        train_steps(engine, range(1), rank, world)
        before = whole(model)
        with zero.GatheredParameters(model.parameters()):
            write(params, EDITED, edit_values(), rank, -1)
        out["engine"] = (before, whole(model))
    out["warnings"] = [str(w.message) for w in caught if "modifier_rank=None" in str(w.message)]
    # nested: an inner exit with modifier_rank commits; the outer exit without it drops what came after
    w = params["0.weight"]
    first, second = edit_values(1)["0.weight"], edit_values(2)["0.weight"]
    with zero.GatheredParameters([w, params["3.weight"]]):
        with zero.GatheredParameters(w, modifier_rank=1):
            write(params, ["0.weight"], {"0.weight": first}, rank, 1)
        assert w.numel() == first.numel()  # the outer block still holds it
        write(params, ["0.weight"], {"0.weight": second}, rank, 1)  # dropped at the outer exit
    out["nested_drop"] = whole(model)["0.weight"]
    with zero.GatheredParameters(w, modifier_rank=0):
        with zero.GatheredParameters([w, params["2.weight"]], modifier_rank=0):
            write(params, ["0.weight"], {"0.weight": first}, rank, 0)
        write(params, ["0.weight"], {"0.weight": second}, rank, 0)  # committed at the outer exit
    out["nested_commit"] = whole(model)["0.weight"]
    assert w.numel() == 0
    train_steps(engine, range(1, 2), rank, world)  # the engine still trains after it all
    out["params"] = whole(model, engine)
    return out


def run_refusals(run: dict, rank: int, world: int) -> dict:
    """Ranks that disagree, or fail inside the block, get an error on every rank and lose nothing."""
    engine, *_ = fastzero.initialize(model=make_model(), config=engine_config(3, "bf16", 1))
    model = engine.module
    params = dict(model.named_parameters())
    errors = {}
    before = whole(model)
    mine = [params["0.weight"]] if rank == 0 else [params["0.weight"], params["2.weight"]]
    try:
        with zero.GatheredParameters(mine, modifier_rank=0):
            pass
    except RuntimeError as exc:
        errors["mismatch"] = str(exc)
    try:
        with zero.GatheredParameters([params[n] for n in EDITED[:2]], modifier_rank=0):
            write(params, EDITED[:2], edit_values(), rank, 0)
            if rank == 1:
                raise KeyError("the user's own error on rank 1")
    except (RuntimeError, KeyError) as exc:
        errors["failed"] = f"{type(exc).__name__}: {exc}"
    errors["unchanged"] = all(torch.equal(before[n], t) for n, t in whole(model).items())
    return errors


if __name__ == "__main__":
    fastzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    kinds = dict(init=run_init, after=run_after, discard=run_discard, refusals=run_refusals)
    for run in json.load(open(sys.argv[1])):
        torch.save(kinds[run["kind"]](run, rank, world), f"{run['out']}.rank{rank}.pt")
