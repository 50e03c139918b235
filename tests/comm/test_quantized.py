"""ZeRO++'s quantized collectives (fastzero.comm.quantized) as 4 Gloo
processes on 2 simulated nodes: the int8 all-gather and the int4/int8
reduce-scatter, flat and hierarchical, equal to the reference kernels'
results element by element; what crosses nodes; the packing."""

import json

import pytest
import torch

from fastzero.comm import QuantFormat, cross_node_bytes
from fastzero.comm.collectives import CommEvent
from fastzero.comm.quantized import mix_seed
from fastzero.ops import quant
from tests.dist import run_ranks
from tests.paths import WORKERS


def test_collectives_equal_the_reference_on_two_nodes(tmp_path):
    run_ranks(WORKERS / "quantized_comm.py", 4, [tmp_path / "r"], local_world=2, timeout=300)
    reports = [json.loads((tmp_path / f"r.{k}.json").read_text()) for k in range(4)]
    for rep in reports:
        assert rep["nodes"] == [[0, 1], [2, 3]] and rep["hierarchical"]
        # per size and dtype: 4 gathered chunks, 4 flat and 4 hierarchical reductions, each element checked
        # against the reference kernels and against the format's error bound around the exact sum
        assert rep["checks"] == 3 * 2 * (4 + 4 + 4)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n", [1, 15, 16, 256, 1000])
def test_pack_round_trip(bits, n):
    fmt = QuantFormat(bits, 16)
    x = torch.randn(n)
    buf = torch.empty(fmt.packed_bytes(n), dtype=torch.uint8)
    assert buf.numel() % 4 == 0 and fmt.scale_offset(n) % 4 == 0
    fmt.pack(x, buf)
    codes, scales = fmt.unpack(buf, n)
    want_codes, want_scales = quant.quantize_blockwise(x, bits, 16)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    out = torch.empty(n)
    fmt.dequantize(buf, out)
    assert ((out - x).abs() <= scales.repeat_interleave(16)[:n] * 0.5 * (1 + 1e-6)).all()


def test_formats_refuse_what_cannot_pack():
    with pytest.raises(ValueError, match="even block"):
        QuantFormat(4, 15)
    with pytest.raises(ValueError, match="bits=3"):
        QuantFormat(3, 16)


def test_seeds_differ_by_every_key_and_repeat():
    seeds = {mix_seed(a, b, c) for a in range(4) for b in range(4) for c in range(4)}
    assert len(seeds) == 64 and all(0 <= s < 1 << 32 for s in seeds)
    assert mix_seed(1, 2, 3) == mix_seed(1, 2, 3) != mix_seed(3, 2, 1)


def test_cross_node_bytes_count_what_leaves_the_node():
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}
    event = lambda op, n: CommEvent(op, "t", n, 0.0, world_size=4, ranks=(0, 1, 2, 3))
    assert cross_node_bytes(event("all_gather", 100), node_of) == 200  # a chunk from each of 2 other-node ranks
    assert cross_node_bytes(event("reduce_scatter", 400), node_of) == 200  # a quarter of the input from each
    assert cross_node_bytes(event("all_to_all", 400), node_of) == 200
    assert cross_node_bytes(event("all_reduce", 400), node_of) == 400
    inside = CommEvent("all_gather", "t", 100, 0.0, world_size=2, ranks=(0, 1))
    assert cross_node_bytes(inside, node_of) == 0
