"""1-bit compression (the reference) and the compressed all-reduce as 2 and
4 Gloo processes: the same result everywhere, error feedback that keeps the
running sums together, exactness, and the bytes on the wire."""

import pytest
import torch

from fastzero.comm.compressed import compressed_allreduce, error_buffers, padded_numel
from fastzero.ops.reference import onebit
from tests.dist import run_ranks
from tests.runtime.test_zero_engine import WORKER

COMPRESSED = WORKER.parent / "compressed.py"


def test_pack_and_unpack_signs_bit_exact():
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(3, 64, generator=gen)
    packed = onebit.pack_signs(y)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 8)
    assert torch.equal(onebit.unpack_signs(packed), torch.where(y >= 0, 1.0, -1.0))
    # element i in bit i % 8 of byte i // 8
    first_and_tenth = -torch.ones(16)
    first_and_tenth[[0, 9]] = 1
    assert onebit.pack_signs(first_and_tenth).tolist() == [1, 2]


def test_compress_keeps_the_error_it_makes():
    gen = torch.Generator().manual_seed(1)
    x, err = torch.randn(256, generator=gen), torch.randn(256, generator=gen) * 0.1
    bits, scales, new_err = onebit.compress(x, err, chunks=4)
    y = (x + err).reshape(4, -1)
    torch.testing.assert_close(scales, y.norm(dim=1) / 8)  # ||y|| / sqrt(64)
    torch.testing.assert_close(onebit.decompress(bits, scales) + new_err, x + err)  # nothing lost


def test_one_process_and_bad_buffers():
    x = torch.randn(37)
    we, se = error_buffers(37, 1)
    assert we.numel() == padded_numel(37, 1) == 40
    y = compressed_allreduce(x, we, se)
    torch.testing.assert_close(y + we[:37] + se[:37], x)  # one rank: the errors hold what compression dropped
    with pytest.raises(ValueError, match=r"make them with error_buffers\(37, 1\)"):
        compressed_allreduce(x, torch.zeros(8), se)


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_allreduce_on_ranks(tmp_path, world):
    run_ranks(COMPRESSED, world, [tmp_path / "out"], timeout=300)
    for rank in range(world):
        res = torch.load(tmp_path / f"out.rank{rank}.pt")
        fb, no_fb = res["feedback=True"], res["feedback=False"]
        assert fb["same"] and no_fb["same"]  # every rank gets the same tensor
        # with error feedback the gap between the running sums stays bounded; without it, it grows with the steps
        assert max(fb["drift"][30:]) < 2 * max(fb["drift"][:10]) + 0.5
        assert no_fb["drift"][-1] > 4 * fb["drift"][-1]
        assert res["exact"]
        b = res["bytes"]
        assert b["signs"] <= b["fp16"] / 16 + 1e-9, b
        assert b["scales"] <= 8 * world * world, b
