"""fastzero.comm's functional surface (DeepSpeed's ``deepspeed.comm``): no-ops
on one process without a process group; torch.distributed's results on 2
Gloo ranks."""

import datetime
import json
from pathlib import Path

import pytest
import torch

import fastzero.comm as dist
from fastzero.comm import env as comm_env
from tests.dist import run_ranks

WORKER = Path(__file__).resolve().parent.parent / "workers" / "functional.py"

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


@pytest.fixture
def alone(monkeypatch):
    """A plain process: no launcher variables, no process group."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()


def test_single_process_identity(alone):
    assert dist.is_available()
    assert (dist.get_rank(), dist.get_world_size(), dist.get_local_rank(), dist.get_global_rank()) == (0, 1, 0, 0)
    t = torch.arange(5.0)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG):
        assert dist.all_reduce(t, op=op) is None
    dist.reduce(t, dst=0)
    dist.broadcast(t, src=0)
    assert torch.equal(t, torch.arange(5.0))
    assert dist.barrier() is None
    work = dist.all_reduce(t, async_op=True)
    assert work.wait() and work.is_completed()
    assert dist.new_group([0]) is None and dist.get_world_group() is None
    dist.destroy_process_group()  # nothing to destroy: no error


def test_single_process_copies(alone):
    x = torch.arange(6.0).reshape(2, 3)
    parts = [torch.empty(2, 3)]
    dist.all_gather(parts, x)
    assert torch.equal(parts[0], x)
    flat = torch.empty(6)
    dist.all_gather_into_tensor(flat, x)
    assert torch.equal(flat, x.flatten())
    shard = torch.empty(2, 3)
    dist.reduce_scatter_tensor(shard, x.flatten())
    assert torch.equal(shard, x)
    a2a = torch.empty(6)
    dist.all_to_all_single(a2a, x.flatten())
    assert torch.equal(a2a, x.flatten())
    got = [torch.empty(2, 3)]
    dist.gather(x, got, dst=0)
    assert torch.equal(got[0], x)
    sc = torch.empty(2, 3)
    dist.scatter(sc, [x], src=0)
    assert torch.equal(sc, x)
    objs = [None]
    dist.all_gather_object(objs, {"a": 1})
    assert objs == [{"a": 1}]


def test_single_process_deepspeeds_other_collectives(alone):
    x = torch.arange(4.0)
    got = [torch.empty(4)]
    dist.all_to_all(got, [x])
    assert torch.equal(got[0], x)
    piece = torch.empty(4)
    dist.reduce_scatter(piece, [x])
    assert torch.equal(piece, x)
    a, b = x.clone(), torch.ones(2)
    assert dist.all_reduce_coalesced([a, b]) is None and torch.equal(a, x) and torch.equal(b, torch.ones(2))
    assert dist.all_reduce_coalesced([a], async_op=True).wait()
    assert dist.inference_all_reduce(a) is a
    flat = torch.empty(4)
    dist.allgather_fn(flat, x)
    dist.reduce_scatter_fn(piece, x)
    assert torch.equal(flat, x) and torch.equal(piece, x)
    assert dist.monitored_barrier() is None and dist.get_all_ranks_from_group() == [0]
    assert dist.has_all_gather_into_tensor() and dist.has_reduce_scatter_tensor() and dist.has_all_reduce_coalesced()
    assert isinstance(dist.has_coalescing_manager(), bool)
    with pytest.raises(ValueError, match="2 dtypes/devices"):
        dist.all_reduce_coalesced([x, torch.ones(2, dtype=torch.float64)])
    with pytest.raises(ValueError, match="exactly 1"):
        dist.all_to_all([x, x], [x, x])


def test_single_process_refusals(alone):
    t = torch.zeros(2)
    with pytest.raises(ValueError, match="only rank of a single process is 0"):
        dist.broadcast(t, src=1)
    with pytest.raises(ValueError, match="exactly 1"):
        dist.all_gather([t, t], t)
    with pytest.raises(ValueError, match="4 elements and input 2"):
        dist.all_gather_into_tensor(torch.empty(4), t)
    with pytest.raises(ValueError, match="only rank 0"):
        dist.new_group([0, 1])
    for call in (lambda: dist.send(t, 1), lambda: dist.recv(t), lambda: dist.isend(t, 1), lambda: dist.irecv(t, 0)):
        with pytest.raises(RuntimeError, match="no peer"):
            call()


def test_several_ranks_without_a_group_refuse(monkeypatch):
    """The launcher says 2 ranks but nobody made the group: refuse, do not return one rank's values."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (dist.get_rank(), dist.get_world_size(), dist.get_local_rank()) == (1, 2, 1)
    with pytest.raises(RuntimeError, match="init_distributed"):
        dist.all_reduce(torch.ones(2))
    with pytest.raises(RuntimeError, match="init_distributed"):
        dist.barrier()


def test_init_distributed_takes_deepspeeds_keywords(alone, monkeypatch):
    """DeepSpeed's signature: timeout as a timedelta, dist_init_required=False without a group."""
    with pytest.raises(RuntimeError, match="dist_init_required=False"):
        dist.init_distributed(dist_init_required=False)
    with pytest.raises(ValueError, match="give one"):
        dist.init_distributed(timeout=datetime.timedelta(seconds=5), timeout_s=5)
    with pytest.raises(ValueError, match="timeout_s="):
        dist.init_distributed(timeout=datetime.timedelta(seconds=-1))
    with pytest.raises(ValueError, match="rank must be in"):
        dist.init_distributed(rank=2, world_size=2)
    # the port where MASTER_PORT is unset reaches the rendezvous
    seen = {}

    class Stop(Exception):
        pass

    def read_env(environ=None):
        seen["env"] = environ
        raise Stop  # before any rendezvous

    monkeypatch.setattr(comm_env, "dist_env", read_env)
    with pytest.raises(Stop):
        dist.init_distributed(distributed_port=12345, environ={})
    assert seen["env"]["MASTER_PORT"] == "12345"


def test_two_ranks_match_torch_distributed():
    outs = [json.loads(o.strip().splitlines()[-1]) for o in run_ranks(WORKER, 2, timeout=120)]
    for r, out in enumerate(outs):
        assert (out["rank"], out["world"], out["local_rank"], out["initialized"]) == (r, 2, r, True)
        assert out["all_reduce"] == [10.0, 12.0, 14.0, 16.0]
        assert out["all_reduce_max"] == [2.0, 2.0]
        assert out["broadcast"] == [1.0, 1.0, 1.0]
        assert out["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert out["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        # input r = arange(4) * (r + 1); the sum is arange(4) * 3, rank r keeps chunk r
        assert out["reduce_scatter_tensor"] == [[0.0, 3.0], [6.0, 9.0]][r]
        assert out["global_rank_of_1"] == 1
        assert out["after_destroy"] is False
        # DeepSpeed's other collectives: rank r's j-th input (10 r + j) lands in rank j's r-th output
        assert out["all_to_all"] == [[10.0 * j + r] * 2 for j in range(2)]
        assert out["reduce_scatter"] == [3.0 * (r + 1)] * 2  # sum over ranks q of (q + 1) * (r + 1)
        assert out["coalesced"] == [[1.0] * 4, [3.0] * 3] and out["coalesced_async"] == [[2.0, 2.0], [1.0]]
        assert out["inference_all_reduce"] == [3.0, 3.0]
        assert out["fns"] == [[[1.0], [3.0]][r], [0.0, 1.0]]  # arange(2) + rank summed: [1, 3]; rank r keeps r
        assert out["all_ranks"] == [0, 1] and out["has"] == [True, True, True]
