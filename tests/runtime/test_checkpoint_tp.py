"""The tensor-parallel split of a param, both ways: every rank's piece of
the logical param (Megatron's contiguous chunks and strides) and the
logical param from the pieces, through every tensor size."""

import pytest
import torch

from fastzero.runtime.checkpoint_tp import Split


@pytest.mark.parametrize("dim,stride", [(0, 1), (1, 1), (0, 3), (1, 3)])
def test_take_and_assemble_round_trip(dim, stride):
    full = torch.randn(36, 72)
    for size in (1, 2, 3, 4):
        split = Split(dim, stride, size)
        pieces = [split.take(full, r) for r in range(size)]
        assert all(list(p.shape) == split.local_shape(list(full.shape)) for p in pieces)
        assert split.full_shape(list(pieces[0].shape)) == list(full.shape)
        assert torch.equal(split.assemble(pieces), full)
        # every element lands on exactly one rank
        assert sum(p.numel() for p in pieces) == full.numel()


def test_stride_3_gives_each_rank_its_heads_of_q_k_and_v():
    hidden, size = 8, 2
    q, k, v = (torch.full((hidden, 4), float(i)) + torch.arange(hidden)[:, None] for i in (0, 100, 200))
    fused = torch.cat([q, k, v], 0)  # the [3 hidden, in] weight of a fused q/k/v projection
    local = Split(0, 3, size).take(fused, 1)
    half = hidden // size
    assert torch.equal(local, torch.cat([q[half:], k[half:], v[half:]], 0))


def test_moving_between_tensor_sizes():
    full = torch.randn(36, 6)
    two, three = Split(0, 3, 2), Split(0, 3, 3)
    saved = [two.take(full, r) for r in range(2)]
    assert torch.equal(three.take(two.assemble(saved), 2), three.take(full, 2))


def test_sizes_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match=r"shape \(10, 4\) does not split along dim 0 into 2 ranks x stride 3"):
        Split(0, 3, 2).take(torch.zeros(10, 4), 0)


def test_assemble_needs_every_piece():
    with pytest.raises(ValueError, match="1 pieces for a param split over 2 ranks"):
        Split(0, 1, 2).assemble([torch.zeros(2)])
