"""initialize(topology=, mpu=) in one process: what it accepts, what it
refuses, and the start-up agreement's description of split params."""

import pytest
import torch

import fastzero
from fastzero.parallel import PipeDataParallelTopology, Topology, current, mark_tensor_parallel, set_current
from fastzero.runtime.agreement import describe_model

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.fixture(autouse=True)
def no_current():
    set_current(None)
    yield
    set_current(None)


def test_topology_and_mpu_together_are_refused():
    topo = Topology()
    with pytest.raises(ValueError, match="topology= or mpu=, not both"):
        fastzero.initialize(model=torch.nn.Linear(3, 2), config=CONFIG, topology=topo, mpu=topo)
    with pytest.raises(TypeError, match="takes a fastzero.parallel.Topology"):
        fastzero.initialize(model=torch.nn.Linear(3, 2), config=CONFIG, topology="tensor=2")
    assert current() is None


def test_a_topology_becomes_current_and_sizes_the_engine():
    topo = Topology()
    engine, *_ = fastzero.initialize(model=torch.nn.Linear(3, 2), config=CONFIG, topology=topo)
    assert current() is topo
    assert (engine.dp_world_size, engine.mp_world_size, engine.world_size, engine.global_rank) == (1, 1, 1, 0)
    assert engine.train_batch_size() == 2
    # a DeepSpeed-style topology is made into a Topology
    fastzero.initialize(model=torch.nn.Linear(3, 2), config=CONFIG, topology=PipeDataParallelTopology(1, 1))
    assert isinstance(current(), Topology)


def test_split_params_are_described_by_their_split_not_their_shape():
    a, b = torch.nn.Linear(4, 6), torch.nn.Linear(4, 7)  # an uneven split: tensor ranks hold 6 and 7 rows
    for m in (a, b):
        mark_tensor_parallel(m.weight, 0)
    da, db = describe_model(a), describe_model(b)
    assert da["weight"] == db["weight"] == "param split on dim 0 float32"
    assert da["bias"] != db["bias"]  # unmarked params still compare their shapes
