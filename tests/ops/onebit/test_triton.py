"""The Triton 1-bit compression kernels (pack, unpack) against the plain-PyTorch
reference, directly and through the public dispatcher. Without a GPU they run on
CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before triton is imported)."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from fastzero.ops import onebit  # noqa: E402
from fastzero.ops.reference import onebit as ref  # noqa: E402
from fastzero.triton_kernels import onebit as tk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (numel, chunks): one byte; chunks of 8*7; a chunk of exactly one block (1024); chunks of one
# block and a tail; several blocks and a tail.
SHAPES = [(8, 1), (56, 1), (112, 2), (224, 4), (4096, 4), (2064, 2), (8000, 1), (9216, 4)]


def dtype_id(dt):
    return str(dt).split(".")[-1]


def triton_pack(x, error, chunks):
    bits = torch.empty(x.numel() // 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(chunks, dtype=torch.float32, device=x.device)
    tk.onebit_pack(x, error, bits, scales, chunks)
    return bits, scales


def check_pack(x, error, chunks):
    """Packs with the kernel and the reference from the same state; compares, and
    returns the kernel's new error (the reference's is compared with it)."""
    want_bits, want_scales, want_error = ref.compress(x, error, chunks)
    bits, scales = triton_pack(x, error, chunks)  # error: updated in place
    assert torch.equal(bits, want_bits), "sign bits differ"
    torch.testing.assert_close(scales, want_scales, rtol=1e-5, atol=1e-6, equal_nan=True)
    # The new error is y -+ scale: it differs from the reference's only by the scale's rounding.
    atol = 1e-6 * max(float(want_scales.nan_to_num().abs().max()), 1.0)
    torch.testing.assert_close(error, want_error, rtol=1e-5, atol=atol, equal_nan=True)
    return bits, scales


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("numel,chunks", SHAPES)
def test_pack_matches_reference(numel, chunks, dtype):
    torch.manual_seed(numel + chunks)
    error = torch.zeros(numel, device=DEVICE)
    for _ in range(3):  # fresh x each step, the error carried over as 1-bit Adam carries it
        x = torch.randn(numel, device=DEVICE).to(dtype)
        check_pack(x, error, chunks)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_pack_signed_zeros(dtype):
    """y = +0.0 and y = -0.0 both give bit 1 (torch's `y >= 0`), in every byte position."""
    torch.manual_seed(7)
    n = 64
    x = torch.randn(n, device=DEVICE).to(dtype)
    error = 0.1 * torch.randn(n, device=DEVICE)
    x[0:8:2], error[0:8:2] = 0.0, 0.0  # +0.0 + +0.0 = +0.0
    x[1:8:2], error[1:8:2] = -0.0, -0.0  # -0.0 + -0.0 = -0.0
    x[9:16:3], error[9:16:3] = 1.5, -1.5  # +0.0 by cancellation
    x[17:24:2], error[17:24:2] = -0.0, 0.0  # +0.0
    y = x.float() + error
    assert torch.signbit(y[1:8:2]).all() and int((y[:24] == 0).sum()) == 15
    bits, _ = check_pack(x, error, 2)
    assert int(bits[0]) == 0xFF  # the first byte is all zeros of either sign


def test_pack_nan_stays_in_its_chunk():
    """NaN gives bit 0 and a NaN scale for its own chunk only (as the reference)."""
    torch.manual_seed(3)
    x = torch.randn(112, device=DEVICE)
    x[5] = float("nan")
    error = torch.randn(112, device=DEVICE)
    _, scales = check_pack(x, error, 2)
    assert scales[0].isnan() and scales[1].isfinite()


def test_pack_empty():
    x = torch.empty(0, device=DEVICE)
    error = torch.empty(0, device=DEVICE)
    check_pack(x, error, 1)


def random_bits(rows, row_bytes):
    bits = torch.randint(0, 256, (rows * row_bytes,), dtype=torch.uint8, device=DEVICE)
    scales = torch.rand(rows, device=DEVICE) + 0.1
    return bits, scales


# (rows, bytes a row): one byte; under, at and over one program's 128 bytes; several programs
UNPACK_SHAPES = [(1, 1), (3, 7), (2, 128), (4, 129), (3, 300)]


@pytest.mark.parametrize("rows,row_bytes", UNPACK_SHAPES)
def test_unpack_matches_reference(rows, row_bytes):
    torch.manual_seed(rows * 1000 + row_bytes)
    bits, scales = random_bits(rows, row_bytes)
    want = ref.decompress(bits, scales)
    out = torch.empty(rows * row_bytes * 8, device=DEVICE)
    tk.onebit_unpack(bits, scales, out, False)
    assert torch.equal(out, want)  # +-scale: exact


@pytest.mark.parametrize("rows,row_bytes", UNPACK_SHAPES)
def test_unpack_average_matches_reference(rows, row_bytes):
    torch.manual_seed(rows * 1000 + row_bytes + 1)
    bits, scales = random_bits(rows, row_bytes)
    want = ref.decompress(bits, scales).reshape(rows, -1).mean(0)
    out = torch.empty(row_bytes * 8, device=DEVICE)
    tk.onebit_unpack(bits, scales, out, True)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_dispatcher_triton_backend(dtype):
    """pack then unpack through fastzero.ops.onebit with backend='triton', against the
    same calls with backend='reference'."""
    torch.manual_seed(11)
    n, chunks = 2064, 2
    error = 0.1 * torch.randn(n, device=DEVICE)
    want_error = error.clone()
    for _ in range(2):
        x = torch.randn(n, device=DEVICE).to(dtype)
        y = x.float() + error
        bits, scales = onebit.pack(x, error, chunks, backend="triton")
        want_bits, want_scales = onebit.pack(x, want_error, chunks, backend="reference")
        assert torch.equal(bits, want_bits)
        torch.testing.assert_close(scales, want_scales, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(error, want_error, rtol=1e-5, atol=1e-6 * float(want_scales.max()))
        want_error.copy_(error)  # next step from the same state

    values = onebit.unpack(bits, scales, backend="triton")
    assert torch.equal(values, onebit.unpack(bits, scales, backend="reference"))
    # values + new error = y, up to rounding: what is not sent is carried over
    torch.testing.assert_close(values + error, y, rtol=1e-6, atol=1e-6)

    out = torch.full((n // chunks,), float("nan"), device=DEVICE)
    got = onebit.unpack(bits, scales, average=True, out=out, backend="triton")
    assert got is out
    want = onebit.unpack(bits, scales, average=True, backend="reference")
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
