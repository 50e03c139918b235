"""The gradient reduction's options (DeepSpeed's communication_data_type,
prescale_gradients / gradient_predivide_factor): 4 Gloo ranks reduce bf16
grads whose exact sums are known, in every GradReducer mode."""

import pytest
import torch

from fastzero.comm import FlatLayout, GradReducer
from tests.dist import run_ranks
from tests.paths import WORKERS
from tests.workers.reduction import grads

WORLD = 4


def exact_flat(numels, bucket, world_layout, seed_base, world=WORLD, pre=1.0):
    """The exact sum over ranks (fp64) of the worker's grads, laid out flat."""
    lay = FlatLayout(numels, world_layout, bucket)
    total = torch.zeros(lay.total, dtype=torch.float64)
    for r in range(world):
        for i, g in enumerate(grads(seed_base + r)):
            total[lay.offsets[i] : lay.offsets[i] + g.numel()] += g.double()
    return lay, total * pre


def owned(lay, flat, rank):
    out = torch.zeros(lay.shard_size, dtype=flat.dtype)
    for b in lay.buckets:
        lo, hi = b.owned(rank)
        out[b.shard_start : b.shard_start + b.chunk] = flat[lo:hi]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("reduction") / "out"
    run_ranks(WORKERS / "reduction.py", WORLD, [path], timeout=300)
    return [torch.load(f"{path}.rank{r}.pt") for r in range(WORLD)]


def expected(results, key, rank):
    """What a reduction in fp32 gives: each micro-batch's sum rounded to bf16
    once (the second micro-batch added to the bf16 shard, as the shard
    accumulates)."""
    mode, copy, micro, _, pre = key
    numels, bucket = results[0]["layout"]
    world_layout = WORLD if mode == "reduce_scatter" else 1
    got = None
    for m in range(micro):
        lay, total = exact_flat(numels, bucket, world_layout, 100 * m, pre=pre)
        part = total if mode == "all_reduce" else owned(lay, total, rank)
        got = part.bfloat16() if got is None else (got.double() + part).bfloat16()
    return got


@pytest.mark.parametrize("pre", [1.0, 0.25])
@pytest.mark.parametrize(
    "mode,copy,micro", [("all_reduce", False, 1), ("reduce_scatter", False, 1), ("reduce_scatter", True, 2)]
)
def test_fp32_communication_rounds_once(results, mode, copy, micro, pre):
    key = (mode, copy, micro, torch.float32, pre)
    for rank, res in enumerate(results):
        got = res["out"][key]
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, expected(results, key, rank), rtol=0, atol=0)


@pytest.mark.parametrize(
    "mode,copy,micro", [("all_reduce", False, 1), ("reduce_scatter", False, 1), ("reduce_scatter", True, 2)]
)
def test_bf16_communication_rounds_along_the_way(results, mode, copy, micro):
    """The default (the grads' dtype) is close to the exact sum but not equal
    to the fp32 reduction everywhere: what the option is for, and proof that
    the fp32 test above can tell them apart."""
    differs = 0
    for rank, res in enumerate(results):
        bf16 = res["out"][(mode, copy, micro, None, 1.0)]
        want = expected(results, (mode, copy, micro, torch.float32, 1.0), rank)
        torch.testing.assert_close(bf16.float(), want.float(), rtol=2**-6, atol=2**-5)
        differs += int((bf16 != want).sum())
    assert differs > 0


def test_pre_scale_is_applied_before_the_sum(results):
    for res in results:
        for key, got in res["out"].items():
            if key[4] == 0.25 and key[3] is torch.float32:
                base = res["out"][(*key[:4], 1.0)]
                torch.testing.assert_close(got, (base.double() / 4).bfloat16(), rtol=0, atol=0)


def test_a_pool_of_another_dtype_is_refused():
    from fastzero.comm import BufferPool, Comm

    lay = FlatLayout([10], 1, 10)
    with pytest.raises(ValueError, match="buffer pool holds torch.bfloat16; the reduction is in torch.float32"):
        GradReducer(
            Comm(),
            lay,
            "reduce_scatter",
            shard=torch.zeros(lay.shard_size, dtype=torch.bfloat16),
            pool=BufferPool(torch.bfloat16, torch.device("cpu")),
            comm_dtype=torch.float32,
        )
