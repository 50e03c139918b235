"""0/1 masks as bits (the selective checkpoint keeps dropout masks so): the
CPU kernels against the plain-PyTorch reference, bit for bit, on every ISA
path, and the round trip back to values in the mask's dtype."""

import pytest
import torch

from fastzero.ops import onebit

# whole SIMD steps, tails of single bytes, a last byte part filled, several 2^18-element segments
SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 33, 1000, 4096 + 3, 3 * (1 << 18) + 13]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _mask(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=gen) < 0.7).to(dtype)


def _bits_by_loop(values: torch.Tensor) -> list[int]:
    """The layout spelled out: bit i % 8 of byte i // 8 is element i != 0."""
    flat = (values.reshape(-1) != 0).tolist()
    return [sum(1 << k for k in range(8) if i + k < len(flat) and flat[i + k]) for i in range(0, len(flat), 8)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_cpu_pack_and_unpack_match_the_reference(isa, n, dtype):
    mask = _mask(n, dtype, n)
    bits = onebit.pack_mask(mask)
    assert bits.dtype == torch.uint8 and bits.shape == ((n + 7) // 8,)
    assert torch.equal(bits, onebit.pack_mask(mask, backend="reference"))
    out = torch.full((n,), 5.0, dtype=dtype)  # every value is overwritten
    assert onebit.unpack_mask(bits, out) is out
    assert torch.equal(out, mask)


def test_the_layout_is_bit_i_mod_8_of_byte_i_div_8(isa):
    mask = _mask(77, torch.float32, 5)
    assert onebit.pack_mask(mask).tolist() == _bits_by_loop(mask)
    assert onebit.pack_mask(mask, backend="reference").tolist() == _bits_by_loop(mask)


def test_any_nonzero_value_reads_as_one(isa):
    """-0 is zero; NaN, inf, negatives and subnormals are not (the same on every path)."""
    values = torch.tensor([0.0, -0.0, 1.0, float("nan"), float("-inf"), -2.5, 1e-45, 0.0] * 5)
    for dtype in DTYPES:
        x = values.to(dtype)
        want = _bits_by_loop(x)
        assert onebit.pack_mask(x).tolist() == want
        assert onebit.pack_mask(x, backend="reference").tolist() == want


@pytest.mark.parametrize(
    "make",
    [
        lambda m: m.to(torch.bool),
        lambda m: m.to(torch.uint8),
        lambda m: m.to(torch.float64),
        lambda m: torch.stack([m, 1 - m], 1)[:, 0],  # not contiguous
        lambda m: m.reshape(13, 7).t(),  # transposed: the logical order, not the memory order
    ],
    ids=["bool", "uint8", "float64", "strided", "transposed"],
)
def test_other_dtypes_and_layouts_take_the_reference_in_logical_order(make):
    mask = make(_mask(91, torch.float32, 9))
    bits = onebit.pack_mask(mask)
    assert bits.tolist() == _bits_by_loop(mask)
    out = torch.full_like(mask, 3) if mask.dtype != torch.bool else torch.zeros_like(mask)
    assert torch.equal(onebit.unpack_mask(bits, out), mask)


def test_a_strided_output_gets_its_values_and_nothing_beside_them():
    mask = _mask(48, torch.float32, 3)
    buffer = torch.full((48, 2), 9.0)
    assert torch.equal(onebit.unpack_mask(onebit.pack_mask(mask), buffer[:, 1]), mask)
    assert (buffer[:, 0] == 9).all()


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: onebit.unpack_mask(torch.zeros(2, dtype=torch.int8), torch.empty(16)), "uint8"),
        (lambda: onebit.unpack_mask(torch.zeros(2, 1, dtype=torch.uint8), torch.empty(16)), "1-D"),
        (lambda: onebit.unpack_mask(torch.zeros(2, dtype=torch.uint8), torch.empty(17)), "hold 16 values"),
        (lambda: onebit.unpack_mask(torch.zeros(3, dtype=torch.uint8), torch.empty(16)), "the mask's own shape"),
        (lambda: onebit.pack_mask(torch.ones(8), backend="nonesuch"), "nonesuch"),
        (lambda: onebit.pack_mask(torch.ones(8), backend="cuda"), "does not run"),
    ],
)
def test_bad_input_names_the_problem(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()
