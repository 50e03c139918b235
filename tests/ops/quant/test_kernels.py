"""Block-wise quantization (fastzero.ops.quant): the reference against an
element-by-element numpy statement of the rules, the CPU kernels against the
reference on every ISA path (codes, scales and dequantized values equal to
the bit), the error bounds, stochastic rounding's bias, and the checks."""

import numpy as np
import pytest
import torch

from fastzero.ops import quant
from fastzero.ops.quant import reference as ref
from tests.ops.quant.cases import DTYPES, assert_same, check_backend, dtype_id, special_input

# 0 and 1 element, a partial last block, primes, more than one work item of
# the threaded kernels (2^18 elements) with a ragged end
SIZES = [0, 1, 7, 255, 257, 1001, 4099]
LONG = (1 << 18) + 1031  # block 256 only: the long case costs the reference most of the time
BLOCKS = [2, 64, 256, 1000, 4096, 6000]  # not a multiple of the vector groups; at and above the 4096-value tile


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", BLOCKS)
def test_cpu_matches_reference(isa, block, bits, dtype, stochastic):
    for n in SIZES + ([LONG] if block == 256 else []):
        check_backend("cpu", n, block, bits, dtype, stochastic)


@pytest.mark.parametrize("bits,block", [(8, 999), (8, 1000), (4, 1000)])
def test_cpu_stochastic_groups_across_2_16(isa, bits, block):
    """Stochastic rounding takes a shortcut for vector groups whose indices
    share their top 16 bits: groups that start off a multiple of the group
    (odd blocks) cross 65536 and take the full hash."""
    check_backend("cpu", 70_001, block, bits, torch.float32, True)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("bits,block", [(8, 256), (4, 256), (8, 1000)])
def test_cpu_streams_large_codes(isa, bits, block, stochastic):
    """Codes of 1 MiB and more are written with cache-bypassing stores (in
    aligned groups; block 1000 mixes aligned and unaligned ones)."""
    n = (1 << 21) + 777
    x = torch.randn(n, generator=torch.Generator().manual_seed(bits + block))
    codes, scales = quant.quantize_blockwise(x, bits, block, stochastic=stochastic, seed=5)
    want_codes, want_scales = ref.quantize(x, bits, block, stochastic, 5)
    assert_same(codes, want_codes, "codes")
    assert_same(scales, want_scales, "scales")


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_uniform_is_the_documented_hash():
    idx = [0, 1, 2, 12345, (1 << 32) - 1, 1 << 32, (1 << 32) + 7, (5 << 32) + 99, (1 << 40) + 3]
    for seed in (0, 1, 0xDEADBEEF, (1 << 32) - 1):
        got = ref.uniform(seed, torch.tensor(idx, dtype=torch.int64))
        for i, u in zip(idx, got.tolist()):
            key = _fmix32((seed + 0x9E3779B9 * (i >> 32)) & 0xFFFFFFFF)
            assert u == (_fmix32((i & 0xFFFFFFFF) ^ key) >> 8) / 2**24
        assert (got >= 0).all() and (got < 1).all()


def _numpy_quantize(x: np.ndarray, bits: int, block: int, u: np.ndarray | None):
    """The rules element by element in numpy fp32 (IEEE ops, rint = half to even)."""
    qm = np.float32(ref.qmax(bits))
    codes, scales = [], []
    for lo in range(0, len(x), block):
        blk = x[lo : lo + block].astype(np.float32)
        s = np.max(np.abs(blk)) / qm if np.isfinite(blk).all() else np.float32(np.nan)
        scales.append(np.float32(s))
        for j, v in enumerate(blk):
            if not np.isfinite(s) or s == 0:
                codes.append(0)
                continue
            r = np.float32(v / np.float32(s))
            if u is not None:
                r = np.float32(r + u[lo + j])
            r = min(max(r, -qm), qm)
            codes.append(int(np.floor(r)) if u is not None else int(np.rint(r)))
    return np.array(codes, dtype=np.int64), np.array(scales, dtype=np.float32)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("bits", [8, 4])
def test_reference_states_the_rules(bits, stochastic):
    for n, block in [(1, 2), (37, 8), (300, 64), (1000, 256)]:
        x = special_input(n, block, bits, torch.float32, seed=n)
        u = ref.uniform(99, torch.arange(n)).numpy() if stochastic else None
        want_codes, want_scales = _numpy_quantize(x.numpy(), bits, block, u)
        codes, scales = ref.quantize(x, bits, block, stochastic, 99)
        assert_same(scales, torch.from_numpy(want_scales), "scales")
        q = ref.unpack_int4(codes, n) if bits == 4 else codes
        assert q.tolist() == want_codes.tolist()


def test_int4_packing_layout():
    x = torch.tensor([1.0, -1.0, 7.0, -7.0, 0.0, 3.0, -2.0], dtype=torch.float32)  # absmax 7: scale 1
    for backend in ("reference", "cpu"):
        codes, scales = quant.quantize_blockwise(x, 4, 8, backend=backend)
        assert scales.tolist() == [1.0]
        # element 2k in the low nibble of byte k, two's complement; the odd tail leaves the high nibble 0
        assert codes.tolist() == [0x1 | 0xF << 4, 0x7 | 0x9 << 4, 0x0 | 0x3 << 4, 0xE]
        assert codes.dtype == torch.uint8


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_round_trip_error_bound(isa, bits, dtype):
    """|x - deq(q(x))| <= s / 2 for nearest, < s for stochastic, wherever the
    scale is a normal float (a subnormal scale is itself rounded: docs/quant.md)."""
    gen = torch.Generator().manual_seed(bits)
    n, block = 50_000, 256
    x = (torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 1.5)).to(dtype)  # no fp16 inf
    for stochastic, bound in ((False, 0.5), (True, 1.0)):
        codes, scales = quant.quantize_blockwise(x, bits, block, stochastic=stochastic, seed=3)
        y = quant.dequantize_blockwise(codes, scales, numel=n, block=block)
        s = scales.repeat_interleave(block)[:n].double()
        err = (x.double() - y.double()).abs()
        assert scales.isfinite().all() and (scales.abs() >= torch.finfo(torch.float32).tiny).all()
        # fp32 rounding of x / s and of q * s adds a few ulps of |x| at most
        assert (err <= bound * s + 4e-7 * x.double().abs()).all(), (err / s).max()
        assert ((err < bound * s) | (err == 0)).float().mean() > 0.99


def test_stochastic_rounding_is_unbiased(isa):
    """The mean of many roundings (fresh seeds) tends to x / s: per element
    within 5 standard errors (the variance of one rounding is <= 1/4)."""
    gen = torch.Generator().manual_seed(7)
    n, block, trials = 2048, 128, 400
    x = torch.randn(n, generator=gen)
    total = torch.zeros(n, dtype=torch.float64)
    scales = None
    for seed in range(trials):
        codes, scales = quant.quantize_blockwise(x, 8, block, stochastic=True, seed=seed)
        total += codes.double()
    ratio = x.double() / scales.repeat_interleave(block).double()
    mean = total / trials
    assert ((mean - ratio).abs() <= 5 * 0.5 / trials**0.5).all()
    assert abs((mean - ratio).mean()) <= 5 * 0.5 / (trials * n) ** 0.5  # no bias overall
    nearest = quant.quantize_blockwise(x, 8, block)[0].double()
    assert ((mean - ratio).abs().mean()) < 0.5 * (nearest - ratio).abs().mean()  # closer than nearest


def test_stochastic_codes_depend_on_the_seed_only(isa):
    x = torch.randn(10_000)
    a = quant.quantize_blockwise(x, 4, 256, stochastic=True, seed=1)[0]
    assert torch.equal(a, quant.quantize_blockwise(x, 4, 256, stochastic=True, seed=1)[0])
    assert not torch.equal(a, quant.quantize_blockwise(x, 4, 256, stochastic=True, seed=2)[0])
    torch.manual_seed(0)
    b = quant.quantize_blockwise(x, 4, 256, stochastic=True)[0]  # seed from torch's generator
    torch.manual_seed(0)
    assert torch.equal(b, quant.quantize_blockwise(x, 4, 256, stochastic=True)[0])


def test_non_finite_blocks_are_reported(isa):
    x = torch.randn(1000)
    x[300] = float("nan")
    x[700] = float("inf")
    codes, scales = quant.quantize_blockwise(x, 8, 256)
    assert scales.isfinite().tolist() == [True, False, False, True]
    assert (codes[256:768] == 0).all()
    y = quant.dequantize_blockwise(codes, scales, block=256)
    assert y[256:768].isnan().all() and y[:256].isfinite().all() and y[768:].isfinite().all()
    with pytest.raises(ValueError, match=r"2 of 4 blocks hold NaN or inf \(first: block 1"):
        quant.quantize_blockwise(x, 8, 256, check=True)
    quant.quantize_blockwise(torch.randn(1000), 8, 256, check=True)  # finite: no error


def test_zero_block_has_zero_scale_and_codes(isa):
    x = torch.zeros(300)
    x[0] = -0.0
    for bits in (8, 4):
        codes, scales = quant.quantize_blockwise(x, bits, 100)
        assert (scales == 0).all() and (codes == 0).all()
        assert (quant.dequantize_blockwise(codes, scales, numel=300, block=100) == 0).all()


def test_out_buffers_views_and_shapes(isa):
    x = torch.randn(64, 33).t()  # not contiguous: flattened in its logical order
    codes, scales = quant.quantize_blockwise(x, 8, 100)
    want = ref.quantize(x.contiguous(), 8, 100)
    assert torch.equal(codes, want[0]) and torch.equal(scales, want[1])
    out = (torch.empty(2112, dtype=torch.int8), torch.empty(22))
    got = quant.quantize_blockwise(x, 8, 100, out=out)
    assert got[0] is out[0] and torch.equal(out[0], codes) and torch.equal(out[1], scales)
    y = torch.empty(2112, dtype=torch.bfloat16)
    assert quant.dequantize_blockwise(codes, scales, y, block=100) is y
    assert torch.equal(y, ref.dequantize(codes, scales, 2112, 100).bfloat16())
    # whole blocks: the block is worked out from the counts
    c4, s4 = quant.quantize_blockwise(x, 4, 64)
    assert torch.equal(quant.dequantize_blockwise(c4, s4), ref.dequantize(c4, s4, 2112, 64))
    # stacked 2-D chunks and scales are the same as lists
    out2 = torch.empty(2112)
    quant.dequantize_sum(torch.stack([c4, c4]), torch.stack([s4, s4]), out2)
    assert torch.equal(out2, ref.dequantize_sum([c4, c4], [s4, s4], 2112, 64))


def test_default_backend_on_cpu_is_the_native_one(isa):
    assert quant.FAMILY.choose("cpu").backend == "cpu"


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda x: quant.quantize_blockwise(x, 3), ValueError, "bits=3 is not supported"),
        (lambda x: quant.quantize_blockwise(x, 8, 0), ValueError, "block=0 must be >= 1"),
        (lambda x: quant.quantize_blockwise(x, 4, 255), ValueError, "int4 needs an even block"),
        (lambda x: quant.quantize_blockwise(x, True), TypeError, "bits must be an int"),
        (lambda x: quant.quantize_blockwise(x.int(), 8), TypeError, "x is torch.int32"),
        (lambda x: quant.quantize_blockwise(x, 8, stochastic=True, seed=-1), ValueError, "seed must be an int"),
        (lambda x: quant.quantize_blockwise(x, 8, stochastic=True, seed=1 << 32), ValueError, "seed must be an int"),
        (
            lambda x: quant.quantize_blockwise(x, 8, 256, out=(torch.empty(1000, dtype=torch.int8), torch.empty(3))),
            ValueError,
            "out scales must be a contiguous torch.float32 tensor of 4",
        ),
        (
            lambda x: quant.quantize_blockwise(x, 4, 256, out=(torch.empty(1000, dtype=torch.uint8), torch.empty(4))),
            ValueError,
            "out codes must be a contiguous torch.uint8 tensor of 500",
        ),
        (lambda x: quant.dequantize_blockwise(x, torch.ones(4)), TypeError, "codes are torch.float32"),
        (
            lambda x: quant.dequantize_blockwise(torch.zeros(1000, dtype=torch.int8), torch.ones(4).double()),
            TypeError,
            "scales are torch.float64",
        ),
        (
            lambda x: quant.dequantize_blockwise(torch.zeros(1000, dtype=torch.int8), torch.ones(3)),
            ValueError,
            "pass block=",
        ),
        (
            lambda x: quant.dequantize_blockwise(torch.zeros(1000, dtype=torch.int8), torch.ones(3), block=256),
            ValueError,
            "need 4 scales, got 3",
        ),
        (
            lambda x: quant.dequantize_blockwise(
                torch.zeros(500, dtype=torch.uint8), torch.ones(4), numel=1002, block=256
            ),
            ValueError,
            "500 codes do not hold 1002 int4 values",
        ),
        (
            lambda x: quant.dequantize_blockwise(
                torch.zeros(1000, dtype=torch.int8), torch.ones(4), torch.empty(2000)[::2], block=256
            ),
            ValueError,
            "non-contiguous",
        ),
        (
            lambda x: quant.dequantize_blockwise(
                torch.zeros(1000, dtype=torch.int8), torch.ones(4), torch.empty(1000, dtype=torch.int32), block=256
            ),
            TypeError,
            "out must be",
        ),
        (
            lambda x: quant.dequantize_blockwise(
                torch.zeros(10, dtype=torch.int8), torch.ones(1), torch.empty(10), dtype=torch.float16
            ),
            ValueError,
            "drop dtype=",
        ),
        (
            lambda x: quant.dequantize_sum(
                [torch.zeros(10, dtype=torch.int8)] * 2, [torch.ones(1)] * 3, torch.empty(10)
            ),
            ValueError,
            "2 ranks of chunks but 3 of scales",
        ),
        (
            lambda x: quant.dequantize_sum(
                [torch.zeros(10, dtype=torch.int8), torch.zeros(9, dtype=torch.int8)],
                [torch.ones(1)] * 2,
                torch.empty(10),
            ),
            ValueError,
            "one size",
        ),
        (lambda x: quant.dequantize_sum([], [], torch.empty(10)), TypeError, "non-empty list"),
        (
            lambda x: quant.dequantize_sum([torch.zeros(10, dtype=torch.int8)], [torch.ones(1)], torch.empty(11)),
            ValueError,
            "10 codes do not hold 11 int8 values",
        ),
    ],
)
def test_bad_input_is_refused_with_the_fix(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.randn(1000))


def test_native_binding_refuses_a_bad_format():
    from fastzero.native import cpu_ops

    with pytest.raises(ValueError, match="even block"):
        cpu_ops().quant_quantize(0, 0, 0, 0, 0, 10, 3, 4, False, 0, 1)
    with pytest.raises(ValueError, match="ranks >= 1"):
        cpu_ops().quant_dequantize_sum(0, 0, 8, 10, 0, 0, 0, 0, 10, 5, 1)
