"""fastzero.ops.norms.sum_of_squares, the engine's grad-norm accumulation."""

import math

import pytest
import torch

from fastzero.ops.norms import BLOCK, sum_of_squares


@pytest.mark.parametrize("n", [0, 1, BLOCK - 1, BLOCK, 3 * BLOCK + 5, 2_000_003])
def test_exact_to_rounding_at_any_length(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3
    got = sum_of_squares(x)
    assert got.dtype == torch.float64 and got.dim() == 0
    want = float(x.double().square().sum())
    assert float(got) == pytest.approx(want, rel=2e-7, abs=0.0)


def test_one_fp32_norm_of_a_long_buffer_is_what_it_replaces():
    """The drift of issue 13: torch's fp32 norm of 2M elements is off by far more than rounding."""
    x = torch.randn(2_000_003, generator=torch.Generator().manual_seed(0)) * 1e-3
    want = math.sqrt(float(x.double().square().sum()))
    assert abs(math.sqrt(float(sum_of_squares(x))) / want - 1) < 1e-7
    assert abs(float(torch.linalg.vector_norm(x)) / want - 1) > 1e-6  # what the engine used to take


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_is_read_as_fp32(dtype):
    x = (torch.randn(5 * BLOCK + 3, generator=torch.Generator().manual_seed(1)) * 100).to(dtype)
    assert float(sum_of_squares(x)) == pytest.approx(float(x.double().square().sum()), rel=2e-7)


@pytest.mark.parametrize("bad, want", [(math.inf, math.inf), (math.nan, math.nan)])
def test_inf_and_nan_carry_through(bad, want):
    x = torch.ones(2 * BLOCK + 7)
    for i in (3, 2 * BLOCK + 2):  # in a full row, in the tail
        y = x.clone()
        y[i] = bad
        got = float(sum_of_squares(y))
        assert got == want or (math.isnan(want) and math.isnan(got))
