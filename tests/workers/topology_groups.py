"""One rank of the topology group checks (started by tests/dist.py, 4
ranks): each axis's group holds the ranks the hand-computed layout says,
the mpu answers agree with it, and bad sizes raise on every rank. Saves
what it saw to argv[1] + f".rank{rank}.pt"."""

import sys

import torch
import torch.distributed as dist

import fastzero
from fastzero.comm import gloo_twin
from fastzero.parallel import (
    PipeModelDataParallelTopology,
    ProcessTopology,
    Topology,
    current,
    data_group,
    tensor_group,
)


def seen(topo: Topology) -> dict:
    out = {}
    for axis in ("tensor", "data", "pipe"):
        group = topo.get_group(axis)
        ranks = dist.get_process_group_ranks(group)
        total = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(total, group=group)  # the group really connects those ranks
        out[axis] = (ranks, topo.get_group_ranks(axis), total.item())
    out["mpu"] = dict(
        model=(topo.get_model_parallel_rank(), topo.get_model_parallel_world_size()),
        tensor=(topo.get_tensor_model_parallel_rank(), topo.get_tensor_model_parallel_world_size()),
        slice=(topo.get_slice_parallel_rank(), topo.get_slice_parallel_world_size()),
        data=(topo.get_data_parallel_rank(), topo.get_data_parallel_world_size()),
        pipe=(topo.get_pipe_parallel_rank(), topo.get_pipe_parallel_world_size()),
        pipeline=(topo.get_pipeline_model_parallel_rank(), topo.get_pipeline_model_parallel_world_size()),
        groups=(
            topo.get_model_parallel_group() is topo.get_group("tensor"),
            topo.get_tensor_model_parallel_group() is topo.get_group("model"),
            topo.get_data_parallel_group() is topo.get_group("data"),
            topo.get_pipe_parallel_group() is topo.get_group("pipe"),
        ),
    )
    return out


if __name__ == "__main__":
    fastzero.init_distributed()
    out = {}
    tp_dp = Topology(tensor=2)  # data derived: 2
    pipe_tp = Topology(tensor=2, pipe=2)
    of_deepspeed = Topology.of(PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=2))
    out["tp_dp"], out["pipe_tp"], out["of_deepspeed"] = seen(tp_dp), seen(pipe_tp), seen(of_deepspeed)
    tp_dp.make_current()
    out["current"] = (
        current() is tp_dp,
        tensor_group() is tp_dp.get_group("tensor"),
        data_group() is tp_dp.get_group("data"),
    )
    twin = gloo_twin(tp_dp.get_group("data"))  # as the engine's stage-3 check on GPUs builds it
    out["twin"] = (dist.get_process_group_ranks(twin), dist.get_backend(twin))
    errors = []
    for kwargs in (dict(tensor=3), dict(tensor=2, data=1), dict(tensor=2, data=2, pipe=2), dict(data=0)):
        try:
            Topology(**kwargs)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    try:  # model varies slowest here: not the layout Topology builds
        Topology.of(ProcessTopology(["model", "data"], [2, 2]))
        errors.append(None)
    except ValueError as exc:
        errors.append(str(exc))
    out["errors"] = errors
    torch.save(out, f"{sys.argv[1]}.rank{dist.get_rank()}.pt")
