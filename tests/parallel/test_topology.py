"""The process topology: rank <-> coordinates and each axis's rank lists
against DeepSpeed's documented examples and a 2 x 2 x 2 grid computed by
hand; Topology's groups on 4 Gloo ranks; bad sizes."""

import itertools

import pytest
import torch

from fastzero.parallel import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    Topology,
)
from tests.dist import run_ranks
from tests.paths import WORKERS


def test_deepspeed_docstring_examples():
    x = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert x.get_rank(x=0, y=1) == 1
    assert x.get_dim("y") == 3 and x.get_dim("z") == 0
    assert (x.get_coord(rank=1).x, x.get_coord(rank=1).y) == (0, 1)
    assert x.get_axis_list(axis="x", idx=0) == [0, 1, 2]
    assert x.get_axis_list(axis="y", idx=0) == [0, 3]
    assert x.get_axis_comm_lists("z") == []
    assert x.world_size() == 6
    a = ProcessTopology(axes=["a", "b"], dims=[2, 2])
    assert a.get_rank_repr(rank=3) == "a_01-b_01"
    assert a.get_rank_repr(rank=3, omit_axes=["a"]) == "b_01"


def test_pipe_data_model_grid_2x2x2():
    # axes pipe, data, model (model fastest): rank = 4 * pipe + 2 * data + model
    t = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert t.get_axis_names() == ["pipe", "data", "model"]
    assert [tuple(t.get_coord(r)) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1),
    ]  # fmt: skip
    assert t.get_rank(pipe=1, data=0, model=1) == 5
    assert t.get_rank(pipe=0, data=1, model=0) == 2
    assert t.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.get_axis_comm_lists("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.get_axis_comm_lists("tensor") == t.get_axis_comm_lists("model")
    assert t.filter_match(pipe=0, data=1) == [2, 3]
    assert t.filter_match(tensor=1) == [1, 3, 5, 7]
    assert t.get_axis_list("data", 1) == [2, 3, 6, 7]
    assert t.get_axis_list("pipe", 1) == [4, 5, 6, 7]
    assert t.get_rank_repr(3) == "model_01"
    assert t.get_rank_repr(6, omit_axes=[]) == "pipe_01-data_01-model_00"
    assert t.get_dim("tensor") == t.get_dim("model") == 2
    p = PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert p.get_axis_names() == ["pipe", "data"]
    assert p.get_axis_comm_lists("data") == [[0, 1, 2], [3, 4, 5]]
    assert p.get_axis_comm_lists("pipe") == [[0, 3], [1, 4], [2, 5]]


@pytest.mark.parametrize("dims", [[1], [3, 1, 2], [2, 5, 3], [1, 1, 1, 7]])
def test_row_major_both_ways(dims):
    axes = [f"a{i}" for i in range(len(dims))]
    t = ProcessTopology(axes, dims)
    strides = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        strides[i] = strides[i + 1] * dims[i + 1]
    for coord in itertools.product(*(range(d) for d in dims)):
        rank = sum(c * s for c, s in zip(coord, strides))
        assert t.get_rank(**dict(zip(axes, coord))) == rank
        assert tuple(t.get_coord(rank)) == coord
    for axis in axes:  # each axis's lists partition the ranks, and members differ only on that axis
        lists = t.get_axis_comm_lists(axis)
        assert sorted(r for ranks in lists for r in ranks) == list(range(t.world_size()))
        for ranks in lists:
            assert [getattr(t.get_coord(r), axis) for r in ranks] == list(range(t.get_dim(axis)))
            others = {tuple(v for a, v in t.get_coord(r)._asdict().items() if a != axis) for r in ranks}
            assert len(others) == 1


def test_bad_input():
    with pytest.raises(ValueError, match="integers >= 1"):
        ProcessTopology(["x", "y"], [2, 0])
    with pytest.raises(ValueError, match="give one each"):
        ProcessTopology(["x", "y"], [2])
    with pytest.raises(ValueError, match="repeat"):
        ProcessTopology(["x", "x"], [2, 2])
    t = PipeModelDataParallelTopology(1, 2, 2)
    with pytest.raises(ValueError, match="filter_match"):
        t.get_rank(data=0)
    with pytest.raises(ValueError, match="not an axis"):
        t.get_rank(pipe=0, data=0, depth=0)
    with pytest.raises(ValueError, match="outside the topology"):
        t.get_rank(pipe=0, data=2, model=0)
    with pytest.raises(ValueError, match="not found"):
        t.get_coord(4)


def test_single_process_topology():
    t = Topology()
    assert (t.get_dim("tensor"), t.get_dim("data"), t.get_dim("pipe")) == (1, 1, 1)
    assert t.get_model_parallel_rank() == t.get_data_parallel_rank() == 0
    assert t.get_model_parallel_world_size() == t.get_data_parallel_world_size() == 1
    with pytest.raises(ValueError, match=r"tensor x data x pipe = 2 but the world size is 1"):
        Topology(tensor=1, data=2)
    with pytest.raises(ValueError, match=r"does not divide the world size 1"):
        Topology(tensor=2)
    with pytest.raises(ValueError, match="integers >= 1"):
        Topology(tensor=0)
    with pytest.raises(ValueError, match="integers >= 1"):
        Topology(pipe=-1)


def test_groups_on_four_ranks(tmp_path):
    out = tmp_path / "groups"
    run_ranks(WORKERS / "topology_groups.py", 4, [out])
    # tensor 2 x data 2 (pipe 1): rank = 2 * data + tensor
    tp_dp = {"tensor": [[0, 1], [2, 3]], "data": [[0, 2], [1, 3]], "pipe": [[0], [1], [2], [3]]}
    # pipe 2 x tensor 2 (data 1): rank = 2 * pipe + tensor
    pipe_tp = {"tensor": [[0, 1], [2, 3]], "data": [[0], [1], [2], [3]], "pipe": [[0, 2], [1, 3]]}
    for rank in range(4):
        res = torch.load(f"{out}.rank{rank}.pt")
        for name, want in (("tp_dp", tp_dp), ("pipe_tp", pipe_tp), ("of_deepspeed", tp_dp)):
            for axis, lists in want.items():
                ranks = next(r for r in lists if rank in r)
                assert res[name][axis] == (ranks, ranks, float(sum(ranks))), (name, axis, rank)
        mpu = res["tp_dp"]["mpu"]
        tensor, data = rank % 2, rank // 2
        for key in ("model", "tensor", "slice"):
            assert mpu[key] == (tensor, 2), key
        assert mpu["data"] == (data, 2)
        assert mpu["pipe"] == mpu["pipeline"] == (0, 1)
        assert mpu["groups"] == (True, True, True, True)
        mpu = res["pipe_tp"]["mpu"]
        assert (mpu["tensor"], mpu["pipe"], mpu["data"]) == ((rank % 2, 2), (rank // 2, 2), (0, 1))
        assert res["current"] == (True, True, True)
        assert res["twin"] == (tp_dp["data"][tensor], "gloo")
        e = res["errors"]
        assert "tensor x pipe = 3 does not divide the world size 4" in e[0]
        assert "tensor x data x pipe = 2 but the world size is 4" in e[1]
        assert "tensor x data x pipe = 8 but the world size is 4" in e[2]
        assert "integers >= 1" in e[3]
        assert "in another order than pipe, data, model" in e[4]
