"""One rank of a tensor x data parallel ZeRO run (started by tests/dist.py;
4 ranks: tensor 2 x data 2). Argument: a JSON file with a list of runs;
each trains the hand-split model and saves what the tests compare to
`out` + f".rank{rank}.pt". The unsplit model and the single-process AdamW
reference are here too, for the tests to import."""

import json
import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fastzero
import fastzero.zero
from fastzero.parallel import Topology, mark_tensor_parallel, tensor_group

IN, HIDDEN, OUT = 9, 14, 5
CUTS = {"even": (0, 7, 14), "uneven": (0, 8, 14)}  # where HIDDEN is cut between the 2 tensor ranks
MICRO, GAS, DP, TP = 3, 2, 2, 2
LR, WD, CLIP = 1e-2, 0.1, 0.05  # CLIP below the gradient norm: every step is clipped


class Full(torch.nn.Module):
    """The unsplit model: Linear -> GELU -> Linear -> LayerNorm."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(IN, HIDDEN), torch.nn.Linear(HIDDEN, OUT)
        self.norm = torch.nn.LayerNorm(OUT)
        with torch.no_grad():  # LayerNorm's params start at 1 and 0: give them gradients worth checking
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return self.norm(self.fc2(F.gelu(self.fc1(x))))


class _CopyToTensor(torch.autograd.Function):
    """Identity forward; the input's gradient summed over the tensor group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensor(torch.autograd.Function):
    """Sum over the tensor group forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def rows_of(rank: int, cut: str = "even") -> slice:
    """Tensor rank `rank`'s rows of fc1 (its columns of fc2)."""
    return slice(CUTS[cut][rank], CUTS[cut][rank + 1])


class Split(torch.nn.Module):
    """Full split by hand over the tensor group: fc1 by output rows
    (column-parallel), fc2 by input columns (row-parallel, its bias
    replicated and added once after the sum), the LayerNorm replicated.
    `shell`: the same params, left as built (to be loaded)."""

    def __init__(self, tp_rank: int, shell: bool = False, cut: str = "even"):
        super().__init__()
        part = rows_of(tp_rank, cut)
        self.fc1 = torch.nn.Linear(IN, part.stop - part.start)
        self.fc2 = torch.nn.Linear(part.stop - part.start, OUT, bias=False)
        self.fc2_bias = torch.nn.Parameter(torch.zeros(OUT))
        self.norm = torch.nn.LayerNorm(OUT)
        if not shell:
            full = Full()
            with torch.no_grad():
                self.fc1.weight.copy_(full.fc1.weight[part])
                self.fc1.bias.copy_(full.fc1.bias[part])
                self.fc2.weight.copy_(full.fc2.weight[:, part])
                self.fc2_bias.copy_(full.fc2.bias)
                self.norm.load_state_dict(full.norm.state_dict())
        mark_tensor_parallel(self.fc1.weight, 0)
        mark_tensor_parallel(self.fc1.bias, 0)
        mark_tensor_parallel(self.fc2.weight, 1)

    def forward(self, x):
        group = tensor_group()  # the current topology's (initialize made it current)
        h = F.gelu(self.fc1(_CopyToTensor.apply(x, group)))
        return self.norm(_ReduceFromTensor.apply(self.fc2(h), group) + self.fc2_bias)


def full_view(split_params: dict, tp_rank: int, cut: str = "even") -> dict:
    """The split model's params under the full model's names, with the slice of the full param each one is."""
    part = rows_of(tp_rank, cut)
    return {
        "fc1.weight": (split_params["fc1.weight"], (part,)),
        "fc1.bias": (split_params["fc1.bias"], (part,)),
        "fc2.weight": (split_params["fc2.weight"], (slice(None), part)),
        "fc2.bias": (split_params["fc2_bias"], ()),
        "norm.weight": (split_params["norm.weight"], ()),
        "norm.bias": (split_params["norm.bias"], ()),
    }


def global_batch(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    rows = MICRO * GAS * DP
    return torch.randn(rows, IN, generator=gen), torch.randn(rows, OUT, generator=gen)


def micro_rows(m: int, dp_rank: int) -> slice:
    start = (m * DP + dp_rank) * MICRO
    return slice(start, start + MICRO)


def reference(steps: int):
    """Single-process AdamW on the unsplit model, same global batches:
    (per-micro-batch losses [step][m][dp_rank], grad norms, final params)."""
    model = Full()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, norms = [], []
    for step in range(steps):
        x, y = global_batch(step)
        step_losses = []
        for m in range(GAS):
            per_rank = []
            for d in range(DP):
                loss = F.mse_loss(model(x[micro_rows(m, d)]), y[micro_rows(m, d)])
                (loss / (GAS * DP)).backward()
                per_rank.append(loss.item())
            step_losses.append(per_rank)
        losses.append(step_losses)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "allgather_bucket_size": 40},
        "steps_per_print": 1000,
    }


class HandMpu:
    """A Megatron-style mpu written by hand: tensor groups [0, 1], [2, 3],
    data groups [0, 2], [1, 3] (every rank creates every group)."""

    def __init__(self):
        rank = dist.get_rank()
        for ranks in ([0, 1], [2, 3]):
            group = dist.new_group(ranks)
            if rank in ranks:
                self.tp, self.tp_ranks = group, ranks
        for ranks in ([0, 2], [1, 3]):
            group = dist.new_group(ranks)
            if rank in ranks:
                self.dp, self.dp_ranks = group, ranks

    def get_model_parallel_group(self):
        return self.tp

    def get_model_parallel_rank(self):
        return self.tp_ranks.index(dist.get_rank())

    def get_model_parallel_world_size(self):
        return len(self.tp_ranks)

    def get_data_parallel_group(self):
        return self.dp

    def get_data_parallel_rank(self):
        return self.dp_ranks.index(dist.get_rank())

    def get_data_parallel_world_size(self):
        return len(self.dp_ranks)


def train(run: dict, topo: Topology, mpu: HandMpu) -> None:
    rank = dist.get_rank()
    tp_rank, dp_rank = topo.get_tensor_model_parallel_rank(), topo.get_data_parallel_rank()
    if run.get("init"):  # partitioned over the current topology's data group as it is built, then loaded
        topo.make_current()
        with fastzero.zero.Init():
            model = Split(tp_rank, shell=True)
        assert all(p.numel() == 0 for p in model.parameters())
    else:
        model = Split(tp_rank, cut=run.get("cut", "even"))
    cfg = config(run["stage"])
    if run.get("skip_at") is not None:
        cfg["non_finite_grads"] = "skip"
    if run.get("fp16"):
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12, "hysteresis": 1}
    parallel = dict(mpu=mpu) if run.get("mpu") else dict(topology=topo)
    engine, *_ = fastzero.initialize(model=model, config=cfg, **parallel)
    if run.get("init"):
        engine.load_state_dict(Split(tp_rank).state_dict())
    losses, norms, skipped, scales = [], [], [], []
    for step in range(run["steps"]):
        if run.get("skip_at") == step and tp_rank == 1:  # a NaN in a replicated param's grad on one tensor rank
            hook = model.fc2_bias.register_hook(lambda g: g * math.nan)
        x, y = global_batch(step)
        for m in range(GAS):
            rows = micro_rows(m, dp_rank)
            loss = F.mse_loss(engine(x[rows]).float(), y[rows])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if run.get("skip_at") == step and tp_rank == 1:
            hook.remove()
        norms.append(engine.get_global_grad_norm())
        skipped.append(not engine.was_step_applied())
        scales.append(engine.loss_scale)
    with engine.gathered() as module:
        params = {n: p.detach().float().clone() for n, p in module.named_parameters()}
    torch.save(
        dict(
            tp_rank=tp_rank,
            dp_rank=dp_rank,
            losses=losses,
            norms=norms,
            skipped=skipped,
            scales=scales,
            params=params,
            dp_world_size=engine.dp_world_size,
            mp_world_size=engine.mp_world_size,
            world_size=engine.world_size,
            train_batch_size=engine.train_batch_size(),
            grad_ops=sorted({(e.op, e.world_size) for e in engine.comm.events(tag="grad")}),
        ),
        f"{run['out']}.rank{rank}.pt",
    )


def sampler_indices(topo: Topology) -> list[int]:
    """The indices this rank's loader yields from a 24-sample data set."""
    data = torch.utils.data.TensorDataset(torch.arange(24))
    engine, _, loader, _ = fastzero.initialize(model=Split(topo.get_model_parallel_rank()), config=config(0),
                                               topology=topo, training_data=data)  # fmt: skip
    return [int(i) for (batch,) in loader for i in batch]


class WorldDataMpu(HandMpu):
    """Wrong on purpose: the whole world as the data group beside tensor groups of 2."""

    def get_data_parallel_group(self):
        return dist.group.WORLD


def refused_init(topo: Topology) -> str:
    """Built under zero.Init over the whole world, trained over the data group: refused by name."""
    with fastzero.zero.Init(data_parallel_group=dist.group.WORLD):
        model = Split(topo.get_model_parallel_rank(), shell=True)
    try:
        fastzero.initialize(model=model, config=config(3), topology=topo)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def refused(mpu) -> str:
    try:
        fastzero.initialize(model=Split(0), config=config(1), mpu=mpu)
    except ValueError as exc:
        return str(exc)
    return "accepted"


if __name__ == "__main__":
    fastzero.init_distributed()
    topo = Topology(tensor=TP, data=DP)
    mpu = HandMpu()
    runs = json.load(open(sys.argv[1]))
    for run in runs:
        if run.get("init_elsewhere"):
            torch.save(refused_init(topo), f"{run['out']}.rank{dist.get_rank()}.pt")
        elif run.get("bad_mpu"):
            torch.save(refused(WorldDataMpu()), f"{run['out']}.rank{dist.get_rank()}.pt")
        elif run.get("sampler"):
            torch.save(sampler_indices(topo), f"{run['out']}.rank{dist.get_rank()}.pt")
        else:
            train(run, topo, mpu)
