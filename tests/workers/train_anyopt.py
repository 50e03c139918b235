"""One rank of a ZeRO run with a client optimizer fastzero has no fused
kernel for (started by tests/dist.py). Argument: a JSON file with a list of
runs; each trains the test model with ``run["opt"]`` and saves the params,
the optimizer state (this rank's pieces) and the memory breakdown to
`out` + f".rank{rank}.pt"."""

import json
import sys
import warnings

import torch

import fastzero
from tests.workers.train_zero import MICRO, global_batch, make_model


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, arXiv:2302.06675), a custom optimizer the tests
    define: ``update = sign(beta1 m + (1 - beta1) g)``,
    ``p -= lr (update + wd p)``, ``m = beta2 m + (1 - beta2) g``."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * beta1 + p.grad * (1 - beta1)), alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


# each optimizer with hyperparameters that exercise its options (two param groups: per-group values kept)
OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=0.005, momentum=0.5, centered=True, weight_decay=0.01),
    "lion": lambda groups: Lion(groups, lr=0.002, weight_decay=0.1),
}


def param_groups(model: torch.nn.Module) -> list[dict]:
    """Two groups: the first layer at half the lr of the rest."""
    first = list(model[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    return [{"params": first, "lr_scale": 0.5}, {"params": rest}]


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = OPTIMIZERS[name](param_groups(model))
    opt.param_groups[0]["lr"] *= opt.param_groups[0].pop("lr_scale")
    return opt


def config(run: dict) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": run.get("gas", 2),
        "gradient_clipping": run.get("clip", 0.5),
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": run["stage"],
            "reduce_bucket_size": run.get("bucket", 640),
            "allgather_bucket_size": 100000,
            "stage3_param_persistence_threshold": 100,
        },
        "steps_per_print": 1000,
    }
    cfg["zero_optimization"].update(run.get("zero", {}))
    if run.get("offload"):
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False
    if run.get("dtype") == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def state_pieces(engine) -> list[dict]:
    """This rank's pieces of the optimizer state (master, per-element state, scalars), detached copies."""
    out = []
    for g, og in zip(engine.groups, engine.optimizer.param_groups):
        for piece in g.pieces_out(engine.optimizer, og["params"]):
            tensors = {k: v.detach().clone() for k, v in piece.tensors.items()}
            out.append(dict(name=piece.name, lo=piece.lo, hi=piece.hi, tensors=tensors, scalars=piece.scalars))
    return out


def train(run: dict) -> None:
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the untested-optimizer warning
        engine, *_ = fastzero.initialize(model=model, optimizer=make_optimizer(run["opt"], model), config=config(run))
    rank, world, gas = engine.comm.rank, engine.comm.world_size, engine.gradient_accumulation_steps()
    start = run.get("start", 0)
    loaded = None
    if run.get("load"):
        engine.load_checkpoint(run["load"])
        loaded = state_pieces(engine)
    for step in range(start, run.get("steps", 6)):
        x, y = global_batch(step, MICRO * gas * world)
        for m in range(gas):
            rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
            loss = torch.nn.functional.mse_loss(engine(x[rows]).float(), y[rows])
            engine.backward(loss)
            engine.step()
        if run.get("save_at") == step + 1:
            engine.save_checkpoint(run["save"])
            saved = state_pieces(engine)
    with engine.gathered() as module:
        params = {n: p.detach().float().clone() for n, p in module.named_parameters()}
    torch.save(
        dict(
            params=params,
            state=state_pieces(engine),
            saved=saved if run.get("save_at") else None,
            loaded=loaded,
            memory=engine.memory_breakdown(),
            inner=type(engine.optimizer.inner).__name__,
        ),
        f"{run['out']}.rank{rank}.pt",
    )


if __name__ == "__main__":
    for run in json.load(open(sys.argv[1])):
        train(run)
