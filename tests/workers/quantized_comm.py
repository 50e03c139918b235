"""One rank of the quantized collectives' test (tests/comm/test_quantized.py),
started with simulated nodes (LOCAL_WORLD_SIZE). Each rank's inputs come from
seeds every rank knows, so each rank computes what every collective must
give it with the plain-PyTorch reference kernels (the reference backend),
element by element, and checks it. Writes a JSON report to argv[1] + rank."""

import json
import sys

import torch
import torch.distributed as dist

from fastzero.comm import (
    Comm,
    QuantFormat,
    QuantizedGather,
    QuantizedReduceScatter,
    cross_node_bytes,
    hierarchy,
    init_distributed,
    node_ranks,
)
from fastzero.comm.quantized import mix_seed
from fastzero.ops import quant


def values(rank: int, n: int, dtype, tag: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * tag + 17 * rank + n)
    return (torch.randn(n, generator=gen) * (1 + rank)).to(dtype)


def roundtrip(fmt: QuantFormat, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quant.quantize_blockwise(x, fmt.bits, fmt.block, stochastic=fmt.stochastic, seed=seed, backend="reference")


def error_bound(fmt: QuantFormat, pieces) -> torch.Tensor:
    """Per element, what quantizing each of [(x, seed), ...] may move it: half
    a step (round to nearest) or a step (stochastic) of its block's scale."""
    per = 1.0 if fmt.stochastic else 0.5
    return sum(per * roundtrip(fmt, x, s)[1].repeat_interleave(fmt.block)[: x.numel()] for x, s in pieces)


def check_bound(got, exact, bound, dtype) -> None:
    slack = exact.abs() * (2**-7 if dtype == torch.bfloat16 else 1e-6) + 1e-6  # the output's own rounding
    excess = (got.float() - exact).abs() - bound * (1 + 1e-5) - slack
    assert excess.max() <= 0, excess.max()


def reference_sum(fmt, pieces, out_dtype) -> torch.Tensor:
    """dequantize_sum of [(x, seed), ...] with the reference backend."""
    codes, scales = zip(*(roundtrip(fmt, x, s) for x, s in pieces))
    out = torch.empty(pieces[0][0].numel(), dtype=out_dtype)
    return quant.dequantize_sum(list(codes), list(scales), out, block=fmt.block, backend="reference")


def main() -> None:
    init_distributed()
    comm = Comm()
    rank, world = comm.rank, comm.world_size
    nodes = node_ranks(comm)
    h = hierarchy(comm, nodes)
    report = dict(nodes=nodes, hierarchical=h is not None, checks=0)
    node_of = {r: k for k, ranks in enumerate(nodes) for r in ranks}
    for n, block in ((48, 16), (37 * 16, 64), (1024, 256)):
        for dtype in (torch.float32, torch.bfloat16):
            # qwZ: every rank's chunk, quantized by its owner, lands dequantized on every rank
            fmt = QuantFormat(8, block)
            out = torch.full((world * n,), float("nan"), dtype=dtype)
            g = QuantizedGather(comm, out, values(rank, n, dtype, 1), fmt, "param")
            g.wait()
            for r in range(world):
                codes, scales = roundtrip(fmt, values(r, n, dtype, 1), 0)
                want = quant.dequantize_blockwise(codes, scales, dtype=dtype, block=block, backend="reference")
                assert torch.equal(out[r * n : (r + 1) * n], want), (n, block, dtype, r)
                report["checks"] += 1
            assert g.event.nbytes == fmt.packed_bytes(n) and g.event.op == "all_gather"
            # qgZ, flat and hierarchical, int4 and int8, nearest and stochastic
            for bits in (4, 8):
                for stochastic in (False, True):
                    fmt = QuantFormat(bits, block, stochastic)
                    inputs = {s: values(s, world * n, dtype, 2 + bits + stochastic) for s in range(world)}
                    chunk = lambda s, r, inputs=inputs, n=n: inputs[s][r * n : (r + 1) * n]
                    flat = torch.empty(n, dtype=dtype)
                    rs = QuantizedReduceScatter(comm, flat, inputs[rank], fmt, "grad", seed=5)
                    rs.wait()
                    want = reference_sum(fmt, [(chunk(s, rank), mix_seed(5, s, rank)) for s in range(world)], dtype)
                    assert torch.equal(flat, want), ("flat", n, block, dtype, bits, stochastic)
                    assert rs.event.op == "all_to_all" and rs.event.nbytes == world * fmt.packed_bytes(n)
                    exact = sum(chunk(s, rank).float() for s in range(world))
                    check_bound(flat, exact, error_bound(fmt, [(chunk(s, rank), 0) for s in range(world)]), dtype)
                    report["checks"] += 1
                    if h is None:
                        continue
                    comm.record.clear()
                    h.intra.record.clear()
                    h.inter.record.clear()
                    two = torch.empty(n, dtype=dtype)
                    QuantizedReduceScatter(comm, two, inputs[rank], fmt, "grad", seed=9, hierarchy=h).wait()
                    want, bound = hierarchical_reference(fmt, nodes, rank, chunk, dtype, n, seed=9)
                    assert torch.equal(two, want), ("hierarchical", n, block, dtype, bits, stochastic)
                    check_bound(two, exact, bound, dtype)
                    (intra,), (inter,) = h.intra.events(), h.inter.events()
                    mine = next(ns for ns in nodes if rank in ns)
                    assert list(intra.ranks) == mine and len({node_of[r] for r in inter.ranks}) == len(nodes)
                    assert cross_node_bytes(intra, node_of) == 0
                    # across nodes: one chunk from each other node, not every other-node rank's
                    assert cross_node_bytes(inter, node_of) == (len(nodes) - 1) * fmt.packed_bytes(n)
                    assert not comm.events()  # nothing went over the whole group
                    report["checks"] += 1
    json.dump(report, open(f"{sys.argv[1]}.{rank}.json", "w"))
    dist.barrier()


def hierarchical_reference(fmt, nodes, rank, chunk, dtype, n, seed):
    """Each node's ranks sum (quantized) their chunks for the owners with one
    local index; each node's sum for this rank's chunk is quantized again
    and the owner sums the nodes'."""
    L = len(nodes[0])
    me_node = next(k for k, ns in enumerate(nodes) if rank in ns)
    local = nodes[me_node].index(rank)
    per_node, bound = [], 0.0
    for members in nodes:
        pieces = [(chunk(s, rank), mix_seed(seed, s, me_node * L + local)) for s in members]
        partial = reference_sum(fmt, pieces, torch.float32)
        relay = members[local]  # the rank of node k with this rank's local index sends node k's sum on
        per_node.append((partial, mix_seed(seed, relay, me_node, 1 << 40)))
        bound = bound + error_bound(fmt, pieces)
    return reference_sum(fmt, per_node, dtype), bound + error_bound(fmt, per_node)


if __name__ == "__main__":
    main()
