"""One rank of the PipelineModule checks (started by tests/dist.py with 2 or
4 ranks): builds the layouts of argv[2], runs each one's chunks in part
order by hand (send/recv of activations forward, of input grads backward),
sums the tied grads, and saves what it saw to argv[1] + f".rank{rank}.pt"
for tests/pipe/test_module.py to compare with the unpipelined model."""

import sys

import torch
import torch.distributed as dist
from torch import nn

D = 6
BUILT: list[tuple[int, str]] = []  # (tag, device type) of every Counted built in this process


class Counted(nn.Linear):
    """A Linear that records its construction (tag = the layer index it stands for)."""

    def __init__(self, tag: int, fan_in: int, fan_out: int, bias: bool = True) -> None:
        super().__init__(fan_in, fan_out, bias=bias)
        BUILT.append((tag, self.weight.device.type))


def head(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The tied module reused transposed, as an embedding reused as the output head."""
    return x @ module.weight


def make_layers() -> list:
    from fastzero.pipe import module as pm

    return [
        pm.TiedLayerSpec("emb", Counted, 0, D, D, bias=False),  # all of it tied
        pm.LayerSpec(Counted, 1, D, 8),
        nn.GELU(),  # built by the caller, on every rank
        pm.LayerSpec(Counted, 3, 8, D),
        torch.tanh,  # a function
        pm.LayerSpec(Counted, 5, D, D),
        pm.LayerSpec(Counted, 6, D, D),
        pm.TiedLayerSpec("emb", Counted, 7, D, D, bias=False, forward_fn=head),
    ]


def inputs(data_coord: int) -> torch.Tensor:
    """Each data replica's batch (different per replica: tied groups must stay inside one)."""
    g = torch.Generator().manual_seed(1000 + data_coord)
    return torch.randn(3, D, generator=g)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return (out * torch.linspace(-1.0, 2.0, out.numel()).view_as(out)).sum()


def run_by_hand(model, x: torch.Tensor):
    """Forward through parts 0..p*v-1 and backward in reverse, each on its
    owning rank of this data/tensor coordinate; returns the last part's
    output (None elsewhere)."""
    p, v, topo = model.num_stages, model.virtual_stages, model.topology
    coord = topo.get_coord(dist.get_rank())

    def rank_of(stage: int) -> int:
        return topo.get_rank(pipe=stage, data=coord.data, model=coord.model)

    def send(t: torch.Tensor, stage: int) -> None:
        dist.send(torch.tensor(t.shape), dst=rank_of(stage))
        dist.send(t.detach().contiguous(), dst=rank_of(stage))

    def recv(stage: int) -> torch.Tensor:
        shape = torch.zeros(2, dtype=torch.long)
        dist.recv(shape, src=rank_of(stage))
        t = torch.empty(*shape.tolist())
        dist.recv(t, src=rank_of(stage))
        return t

    kept, last = {}, p * v - 1
    for part in range(p * v):
        if part % p != model.stage_id:
            continue
        inp = x if part == 0 else recv((part - 1) % p).requires_grad_()
        out = model.chunks[part // p](inp)
        if part < last:
            send(out, (part + 1) % p)
        kept[part] = (inp, out)
    result = None
    for part in range(last, -1, -1):
        if part % p != model.stage_id:
            continue
        inp, out = kept[part]
        if part == last:
            result = out.detach()
            loss_of(out).backward()
        else:
            out.backward(recv((part + 1) % p))
        if part > 0:
            send(inp.grad, (part - 1) % p)
    model.allreduce_tied_grads()
    return result


def run_layout(name: str, **kwargs) -> dict:
    from fastzero.pipe import PipelineModule

    BUILT.clear()
    model = PipelineModule(make_layers(), seed_layers=True, **kwargs)
    built = list(BUILT)
    coord = model.topology.get_coord(dist.get_rank())
    out = run_by_hand(model, inputs(coord.data))
    return dict(
        parts=model.partitions(),
        stage=model.stage_id,
        data=coord.data,
        first_last=(model.is_first_stage(), model.is_last_stage()),
        owners=[model.part_owner(i) for i in range(8)],
        stage_owners=[model.stage_owner(i) for i in range(8)],
        chunk_ranges=[(c.part, c.start, c.stop) for c in model.chunks],
        chunk_params=[sorted(n for n, _ in c.named_parameters()) for c in model.chunks],
        built=built,
        state={k: v.clone() for k, v in model.state_dict().items()},
        grads={n: p.grad.clone() for n, p in model.named_parameters()},
        out=out,
        tied={k: (names, ranks) for k, (names, ranks, _) in model.tied_groups().items()},
        replicated={n: p.ds_pipe_replicated for n, p in model.named_parameters()},
    )


def errors(world: int) -> list:
    from fastzero.parallel import PipeDataParallelTopology, ProcessTopology
    from fastzero.pipe import PipelineModule

    cases = [
        dict(num_stages=world, virtual_stages=5),  # more parts than the 8 layers
        dict(num_stages=2, virtual_stages=2, partition_method=[0, 2, 2, 5, 8]),  # part 1 empty
        dict(num_stages=2, partition_method=[0, 4, 6, 8]),  # 3 parts given for 2
        dict(num_stages=2, partition_method="bogus"),
        dict(num_stages=2, virtual_stages=2, partition_method="type:Gelu"),  # one GELU for 4 parts
        dict(topology=ProcessTopology(["data"], [world])),  # no pipe axis
        dict(topology=PipeDataParallelTopology(num_pp=2, num_dp=world)),  # 2 x world ranks
        dict(num_stages=3),  # does not divide the world
        dict(num_stages=1, topology=PipeDataParallelTopology(num_pp=2, num_dp=world // 2)),  # disagree
    ]
    out = []
    for kwargs in cases:
        try:
            PipelineModule(make_layers(), **kwargs)
            out.append((repr(kwargs), None, None))
        except (ValueError, TypeError) as exc:
            out.append((repr(kwargs), type(exc).__name__, str(exc)))
    return out


def tied_sync() -> dict:
    """Unseeded layers built from a different generator state on each rank:
    the tied weights must still agree after construction."""
    from fastzero.pipe import PipelineModule

    torch.manual_seed(100 + dist.get_rank())
    model = PipelineModule(make_layers(), num_stages=2, partition_method="uniform")
    return {n: p.detach().clone() for n, p in model.tied_modules.named_parameters()}


if __name__ == "__main__":
    import fastzero
    from fastzero.parallel import PipeDataParallelTopology, Topology

    fastzero.init_distributed()
    world = dist.get_world_size()
    out = {}
    if world == 2:
        out["p2"] = run_layout("p2", num_stages=2)
        out["p2v2"] = run_layout("p2v2", num_stages=2, virtual_stages=2, partition_method="uniform")
        out["p2_ckpt"] = run_layout("p2_ckpt", num_stages=2, activation_checkpoint_interval=2)
        out["tied_sync"] = tied_sync()
    else:
        out["p2d2"] = run_layout(
            "p2d2", topology=PipeDataParallelTopology(num_pp=2, num_dp=2), partition_method="type:counted"
        )
        out["p4v2"] = run_layout("p4v2", num_stages=4, virtual_stages=2)
        out["p2t2"] = run_layout("p2t2", topology=Topology(tensor=2, pipe=2), partition_method="uniform")
    out["errors"] = errors(world)
    torch.save(out, f"{sys.argv[1]}.rank{dist.get_rank()}.pt")
