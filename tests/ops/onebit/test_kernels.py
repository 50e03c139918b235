"""The 1-bit pack and unpack ops against the plain-PyTorch reference: sign
bits bit-exact, scales and errors to float rounding, on every CPU ISA path."""

import pytest
import torch

from fastzero.ops import onebit
from fastzero.ops.reference import onebit as ref

SIZES = [(8, 1), (56, 1), (56, 7), (1000, 5), (4096, 2), (4 * 104, 4), (2 * ((1 << 18) + 40), 2)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(numel, dtype, gen):
    x = (torch.randn(numel, generator=gen) * 3).to(dtype)
    error = torch.randn(numel, generator=gen) * 0.5
    k = min(16, numel // 2)
    x[:k] = torch.tensor([0.0, -0.0] * (k // 2), dtype=dtype)  # y = e for these: its sign decides
    error[:4] = torch.tensor([0.0, -0.0, 0.0, -0.0])  # y exactly +0 and -0: both count as >= 0
    return x, error


def check_pack(backend, numel, chunks, dtype):
    gen = torch.Generator().manual_seed(numel * 31 + chunks)
    x, error = _inputs(numel, dtype, gen)
    want_bits, want_scales, want_error = ref.compress(x, error.clone(), chunks)
    bits, scales = onebit.pack(x, error, chunks, backend=backend)
    assert torch.equal(bits, want_bits)
    # the reference sums squares in fp32, the kernels in double: scales differ by rounding only
    torch.testing.assert_close(scales, want_scales, rtol=1e-5, atol=0)
    torch.testing.assert_close(error, want_error, rtol=0, atol=2e-5 * want_scales.max().item())


def check_unpack(backend, rows, row_bytes):
    gen = torch.Generator().manual_seed(rows * 1000 + row_bytes)
    bits = torch.randint(0, 256, (rows * row_bytes,), dtype=torch.uint8, generator=gen)
    scales = torch.rand(rows, generator=gen) + 0.1
    values = ref.decompress(bits, scales)
    assert torch.equal(onebit.unpack(bits, scales, backend=backend), values)
    torch.testing.assert_close(
        onebit.unpack(bits, scales, average=True, backend=backend),
        values.reshape(rows, -1).mean(0),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel,chunks", SIZES)
def test_cpu_pack_matches_reference(isa, numel, chunks, dtype):
    check_pack("cpu", numel, chunks, dtype)


# (2, 1 << 20): outputs of 32 and 64 MiB take the cache-bypassing stores
@pytest.mark.parametrize("rows,row_bytes", [(1, 1), (1, 33), (2, 7), (4, 1000), (3, (1 << 15) + 5), (2, 1 << 20)])
def test_cpu_unpack_matches_reference(isa, rows, row_bytes):
    check_unpack("cpu", rows, row_bytes)


def test_non_finite_values_match_the_reference(isa):
    """NaN has no sign bit set (NaN >= 0 is false) and makes its chunk's scale NaN; inf likewise."""
    gen = torch.Generator().manual_seed(3)
    x, error = torch.randn(4 * 64, generator=gen), torch.randn(4 * 64, generator=gen)
    x[5], x[70], x[200] = float("nan"), float("inf"), float("-inf")
    want_bits, want_scales, want_error = ref.compress(x, error.clone(), 4)
    bits, scales = onebit.pack(x, error, 4)
    assert torch.equal(bits, want_bits)
    torch.testing.assert_close(scales, want_scales, rtol=1e-5, atol=0, equal_nan=True)
    torch.testing.assert_close(error, want_error, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_reference_backend_is_the_reference():
    check_pack("reference", 1000, 5, torch.float32)
    check_unpack("reference", 3, 11)


def test_pack_then_unpack_round_trip(isa):
    """Unpacked values plus the new error give back x + old error."""
    gen = torch.Generator().manual_seed(7)
    x, error = torch.randn(4096, generator=gen), torch.randn(4096, generator=gen)
    y = x + error
    bits, scales = onebit.pack(x, error, 4)
    torch.testing.assert_close(onebit.unpack(bits, scales) + error, y, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: onebit.pack(torch.randn(16, dtype=torch.float64), torch.zeros(16)), "float64"),
        (lambda: onebit.pack(torch.randn(16), torch.zeros(16, dtype=torch.float16)), "must be float32"),
        (lambda: onebit.pack(torch.randn(16), torch.zeros(8)), "8 elements"),
        (lambda: onebit.pack(torch.randn(20), torch.zeros(20)), "multiple of 8"),
        (lambda: onebit.pack(torch.randn(16), torch.zeros(16), 3), "multiple of 24"),
        (lambda: onebit.pack(torch.randn(32)[::2], torch.zeros(16)), "contiguous"),
        (lambda: onebit.unpack(torch.zeros(4, dtype=torch.int8), torch.ones(1)), "uint8"),
        (lambda: onebit.unpack(torch.zeros(5, dtype=torch.uint8), torch.ones(2)), "rows"),
        (lambda: onebit.unpack(torch.zeros(4, dtype=torch.uint8), torch.ones(1), out=torch.empty(8)), "32"),
    ],
)
def test_bad_input_names_the_problem(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()
