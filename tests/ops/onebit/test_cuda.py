"""The CUDA backend of 1-bit compression (csrc/cuda/onebit.cu,
fastzero.ops.onebit.cuda.onebit_pack and onebit_unpack).

Without a GPU: onebit.cu compiles for sm_80 and sm_90 with warnings as errors
(tests/test_cuda_backend.py compiles every source of build.CUDA_SOURCES and
checks that the library exports exactly ``_SIGNATURES``); here its entry
points refuse bad arguments with codes and messages, and the Python side
refuses CPU tensors and bad shapes before any pointer crosses.
On a GPU (``pytest -m gpu``): pack and unpack against
:mod:`fastzero.ops.reference.onebit` on fresh random inputs: bits bit for bit,
scales within an ulp or two of the fp64 value (and at fp32 tolerance of the
reference's), the new error bit for bit ``y - (+-scale)``, for every x dtype,
chunks 1/2/4/7 and chunk lengths that end mid-warp, mid-block and past one
reduction tile; unpack bit for bit in both modes.
"""

import ctypes
import math

import pytest
import torch

from fastzero.native import abi, build
from fastzero.ops import onebit
from fastzero.ops.onebit import cuda as fz_cuda
from fastzero.ops.reference import onebit as ref
from fastzero.ops.tolerances import assert_close
from tests.ops.test_cuda_backend import _driver_present, _nvcc_or_skip

F32, BF16, F16, U8 = torch.float32, torch.bfloat16, torch.float16, torch.uint8

# ---------------------------------------------------------------------------
# The C entry points, without a GPU

_ONEBIT_FUNCTIONS = ("fz_cuda_last_error", "fz_cuda_chunk_elems", "fz_cuda_onebit_pack", "fz_cuda_onebit_unpack")
FAKE = 1 << 20  # a device address never dereferenced: the calls below fail their checks first


@pytest.fixture(scope="module")
def onebit_lib(tmp_path_factory):
    """common.cu and onebit.cu for sm_90, linked and loaded (cudart is
    static: this works without a driver), with the 1-bit signatures bound."""
    nvcc = _nvcc_or_skip()
    out = tmp_path_factory.mktemp("onebit-lib")
    src = build.cuda_source_dir()
    objects = [build.compile_source(src / n, out / f"{n}.o", ("90",), nvcc=nvcc) for n in ("common.cu", "onebit.cu")]
    lib = ctypes.CDLL(str(build.link(objects, out / build.CUDA_LIBRARY, nvcc)))
    for name in _ONEBIT_FUNCTIONS:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = abi.CUDA_SIGNATURES[name]
    return lib


def _pack(lib, numel, chunks, *, x=FAKE, dtype=0, error=FAKE, partials=FAKE, partials_len=1 << 20):
    return lib.fz_cuda_onebit_pack(x, dtype, error, FAKE, FAKE, numel, chunks, partials, partials_len, None)


def test_pack_refuses_bad_arguments(onebit_lib):
    lib = onebit_lib
    assert _pack(lib, 64, 1, dtype=3) == 1
    assert b"unsupported dtype" in lib.fz_cuda_last_error()
    assert _pack(lib, 100, 2) == 1  # 50 elements a chunk: not whole bytes
    assert b"do not split into 2 chunks" in lib.fz_cuda_last_error()
    assert _pack(lib, 64, 0) == 1
    assert _pack(lib, -8, 1) == 1
    # chunks of 65544 elements take two reduction tiles each: 4 partials
    assert _pack(lib, 2 * 65544, 2, partials_len=3) == 1
    assert b"4 needed" in lib.fz_cuda_last_error()
    assert _pack(lib, 64, 1, partials=None) == 1
    assert _pack(lib, 64, 1, x=None) == 1
    assert b"null" in lib.fz_cuda_last_error()
    assert _pack(lib, 64, 1, error=FAKE + 2) == 1
    assert b"not aligned" in lib.fz_cuda_last_error()
    assert _pack(lib, 64, 1, dtype=1, x=FAKE + 1) == 1  # fp16 x at an odd address


def test_unpack_refuses_bad_arguments(onebit_lib):
    lib = onebit_lib
    assert lib.fz_cuda_onebit_unpack(FAKE, FAKE, FAKE, 0, 4, 0, None) == 1
    assert b"0 rows" in lib.fz_cuda_last_error()
    assert lib.fz_cuda_onebit_unpack(FAKE, FAKE, None, 2, 4, 1, None) == 1
    assert b"null" in lib.fz_cuda_last_error()
    assert lib.fz_cuda_onebit_unpack(FAKE, FAKE, FAKE + 2, 2, 4, 0, None) == 1
    assert b"not aligned" in lib.fz_cuda_last_error()
    assert lib.fz_cuda_onebit_unpack(FAKE, FAKE, FAKE, 1 << 40, 1 << 40, 0, None) == 1
    # nothing to write is fine, and touches no CUDA API
    assert lib.fz_cuda_onebit_unpack(None, None, None, 3, 0, 1, None) == 0


def test_launch_without_a_driver_is_an_error_not_a_crash(onebit_lib):
    if _driver_present():
        pytest.skip("a CUDA driver is installed: launching at fake pointers would run")
    lib = onebit_lib
    assert _pack(lib, 64, 1) == 2
    assert b"onebit_sumsq_kernel" in lib.fz_cuda_last_error()
    assert lib.fz_cuda_onebit_unpack(FAKE, FAKE, FAKE, 2, 4, 1, None) == 2
    assert b"onebit_unpack_average_kernel" in lib.fz_cuda_last_error()


# ---------------------------------------------------------------------------
# The Python side, on any machine


def _cpu_pack_args(n=64, chunks=2):
    return torch.randn(n), torch.zeros(n), torch.empty(n // 8, dtype=U8), torch.empty(chunks), chunks


def test_cpu_tensors_are_refused_with_a_pointer_to_the_cpu_path():
    with pytest.raises(ValueError, match=r"onebit_pack: x is on cpu; this op takes cuda tensors.*onebit\.pack"):
        fz_cuda.onebit_pack(*_cpu_pack_args())
    with pytest.raises(ValueError, match=r"onebit_unpack: bits is on cpu.*onebit\.pack and unpack"):
        fz_cuda.onebit_unpack(torch.zeros(8, dtype=U8), torch.ones(2), torch.empty(64), False)


def test_non_tensors_are_refused():
    _, error, bits, scales, chunks = _cpu_pack_args()
    with pytest.raises(TypeError, match="onebit_pack: x must be a torch.Tensor, got list"):
        fz_cuda.onebit_pack([0.0] * 64, error, bits, scales, chunks)


# ---------------------------------------------------------------------------
# On a GPU: the kernels against the reference

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Elements per chunk: one byte, a warp's partial tail (8/16/24 past a multiple
# of 32), around a signs block (4096), past one reduction tile (65536), a million.
LENGTHS = [8, 24, 40, 4096 - 8, 4096 + 16, 65536 + 24, (1 << 20) + 8]
DTYPES = [F32, F16, BF16]


def _new_pack_outputs(numel, chunks):
    bits = torch.full((numel // 8,), 0xAA, dtype=U8, device="cuda")
    return bits, torch.full((chunks,), -1.0, device="cuda")


def check_pack(x, error_before, chunks, bits, scales, error_after):
    """The kernel's outputs for x and the error it started from."""
    rbits, rscales, rerror = ref.compress(x, error_before.clone(), chunks)
    assert torch.equal(bits, rbits), "sign bits"
    y = (x.float() + error_before).reshape(chunks, -1)
    exact = ((y.double() ** 2).sum(1) / y.shape[1]).sqrt().float()
    torch.testing.assert_close(scales, exact, rtol=2.5e-7, atol=0, equal_nan=True)  # within 2 ulps of fp64's
    torch.testing.assert_close(scales, rscales, rtol=1e-5, atol=1e-6, equal_nan=True)
    # The new error is y - (+-scale) with the kernel's scale, to the bit.
    expected = (y - scales[:, None] * ref.unpack_signs(bits.reshape(chunks, -1))).reshape(-1)
    torch.testing.assert_close(error_after, expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(error_after, rerror, rtol=1e-5, atol=1e-6, equal_nan=True)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunks", [1, 2, 4, 7])
@pytest.mark.parametrize("length", LENGTHS)
def test_pack_matches_the_reference(dtype, chunks, length):
    """Three calls with fresh x: the error carries over."""
    torch.manual_seed(1234)
    numel = length * chunks
    error = 0.1 * torch.randn(numel, device="cuda")
    for _ in range(3):
        x = torch.randn(numel, device="cuda").to(dtype)
        before = error.clone()
        bits, scales = _new_pack_outputs(numel, chunks)
        fz_cuda.onebit_pack(x, error, bits, scales, chunks)
        check_pack(x, before, chunks, bits, scales, error)


@gpu
@needs_cuda
def test_pack_signed_zeros_zero_chunks_and_nan():
    """y = -0.0 packs as 1 (torch's y >= 0), NaN as 0; an all-zero chunk has
    scale 0 and error 0; a NaN makes its chunk's scale NaN only."""
    length, chunks = 40, 4
    x = torch.randn(length * chunks, device="cuda")
    error = torch.zeros_like(x)
    x[:length] = 0.0  # chunk 0: all zero
    x[length : length + 8] = -0.0  # chunk 1 starts with -0.0 + -0.0 = -0.0
    error[length : length + 8] = -0.0
    x[2 * length + 5] = float("nan")  # chunk 2 holds a NaN
    x[3 * length + 3] = float("inf")  # chunk 3 an inf: scale inf, error NaN there
    before = error.clone()
    bits, scales = _new_pack_outputs(x.numel(), chunks)
    fz_cuda.onebit_pack(x, error, bits, scales, chunks)
    check_pack(x, before, chunks, bits, scales, error)
    assert int(bits[length // 8]) == 0xFF  # the -0.0 byte
    assert int(bits[(2 * length + 5) // 8]) >> 5 & 1 == 0  # NaN -> 0
    assert scales[0].item() == 0.0 and not error[:length].any()
    assert math.isnan(scales[2].item()) and math.isinf(scales[3].item())
    assert math.isfinite(scales[1].item())


@gpu
@needs_cuda
def test_pack_of_nothing():
    """No elements: the reference's 0 / sqrt(0) scales are NaN."""
    x, error = torch.empty(0, device="cuda"), torch.empty(0, device="cuda")
    bits, scales = _new_pack_outputs(0, 3)
    fz_cuda.onebit_pack(x, error, bits, scales, 3)
    assert torch.isnan(scales).all()


def _unaligned(t):
    """A copy of t one element into a new buffer: not 16-byte aligned."""
    out = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
    out.copy_(t)
    return out


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pack_unaligned_views_take_the_scalar_path(dtype):
    torch.manual_seed(1234)
    chunks, numel = 2, 2 * (65536 + 24)
    x = _unaligned(torch.randn(numel, device="cuda").to(dtype))
    error = _unaligned(0.1 * torch.randn(numel, device="cuda"))
    assert x.data_ptr() % 16 and error.data_ptr() % 16
    before = error.clone()
    bits, scales = _new_pack_outputs(numel, chunks)
    fz_cuda.onebit_pack(x, error, bits, scales, chunks)
    check_pack(x, before, chunks, bits, scales, error)


@gpu
@needs_cuda
def test_pack_is_deterministic_and_follows_the_current_stream():
    """Fixed reduction orders: the same bits twice; on a side stream too."""
    torch.manual_seed(1234)
    chunks, numel = 3, 3 * ((1 << 20) + 8)
    x = torch.randn(numel, device="cuda", dtype=BF16)
    error0 = 0.1 * torch.randn(numel, device="cuda")
    results = []
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            error = error0.clone()
            bits, scales = _new_pack_outputs(numel, chunks)
            fz_cuda.onebit_pack(x, error, bits, scales, chunks)
        torch.cuda.current_stream().wait_stream(stream)
        results.append((bits, scales, error))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    check_pack(x, error0, chunks, *results[0][:2], results[0][2])


@gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 2, 4, 7])
@pytest.mark.parametrize("row_bytes", [1, 3, 4, 513, 4097, 1 << 17])
@pytest.mark.parametrize("average", [False, True])
def test_unpack_matches_the_reference(rows, row_bytes, average):
    torch.manual_seed(1234)
    bits = torch.randint(0, 256, (rows * row_bytes,), dtype=U8, device="cuda")
    scales = torch.randn(rows, device="cuda")
    check_unpack(bits, scales, average)


def check_unpack(bits, scales, average, out=None):
    rows = scales.numel()
    numel = bits.numel() * 8 // (rows if average else 1)
    if out is None:
        out = torch.full((numel,), float("nan"), device="cuda")
    fz_cuda.onebit_unpack(bits, scales, out, average)
    values = ref.decompress(bits, scales)
    if not average:
        assert torch.equal(out, values)
        return
    # The fp32 sum in row order, divided by the row count (a tensor: torch
    # divides by a Python number as a multiplication by its reciprocal).
    acc = torch.zeros(numel, device="cuda")
    for row in values.reshape(rows, -1):
        acc = acc + row
    assert torch.equal(out, acc / torch.full_like(acc, rows))
    assert_close(out, values.reshape(rows, -1).mean(0))


@gpu
@needs_cuda
@pytest.mark.parametrize("average", [False, True])
def test_unpack_into_an_unaligned_out(average):
    torch.manual_seed(1234)
    rows, row_bytes = 3, 1001
    bits = torch.randint(0, 256, (rows * row_bytes,), dtype=U8, device="cuda")
    out = _unaligned(torch.full((8 * row_bytes * (1 if average else rows),), float("nan"), device="cuda"))
    assert out.data_ptr() % 16
    check_unpack(bits, torch.rand(rows, device="cuda"), average, out)


@gpu
@needs_cuda
def test_the_dispatcher_runs_the_cuda_kernels():
    """fastzero.ops.onebit with backend='cuda' against backend='reference'."""
    torch.manual_seed(1234)
    chunks, numel = 4, 4 * 4104
    x = torch.randn(numel, device="cuda", dtype=F16)
    e_cuda = 0.1 * torch.randn(numel, device="cuda")
    e_ref = e_cuda.clone()
    bits, scales = onebit.pack(x, e_cuda, chunks, backend="cuda")
    rbits, rscales = onebit.pack(x, e_ref, chunks, backend="reference")
    assert torch.equal(bits, rbits)
    assert_close(scales, rscales)
    torch.testing.assert_close(e_cuda, e_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(onebit.unpack(bits, scales, backend="cuda"), onebit.unpack(bits, scales, backend="reference"))
    avg = onebit.unpack(bits, scales, average=True, backend="cuda")
    assert_close(avg, onebit.unpack(bits, scales, average=True, backend="reference"))


@gpu
@needs_cuda
def test_device_checks_on_a_gpu():
    n, chunks = 64, 2
    x, error = torch.randn(n, device="cuda"), torch.zeros(n, device="cuda")
    bits, scales = _new_pack_outputs(n, chunks)
    with pytest.raises(ValueError, match="onebit_pack: bits is on cpu"):
        fz_cuda.onebit_pack(x, error, bits.cpu(), scales, chunks)
    with pytest.raises(TypeError, match="onebit_pack: error has dtype torch.float16; supported: float32"):
        fz_cuda.onebit_pack(x, error.half(), bits, scales, chunks)
    with pytest.raises(TypeError, match="onebit_pack: x has dtype torch.float64"):
        fz_cuda.onebit_pack(x.double(), error, bits, scales, chunks)
    with pytest.raises(ValueError, match="onebit_pack: scales has 3 elements, 2 needed"):
        fz_cuda.onebit_pack(x, error, bits, torch.empty(3, device="cuda"), chunks)
    with pytest.raises(ValueError, match="do not split into 3 chunks"):
        fz_cuda.onebit_pack(x, error, bits, torch.empty(3, device="cuda"), 3)
    with pytest.raises(ValueError, match="onebit_pack: x is not contiguous"):
        fz_cuda.onebit_pack(torch.randn(2 * n, device="cuda")[::2], error, bits, scales, chunks)
    with pytest.raises(ValueError, match="onebit_unpack: out has 64 elements, 16 needed"):
        fz_cuda.onebit_unpack(bits[:4], scales, torch.empty(64, device="cuda"), True)
    with pytest.raises(ValueError, match="do not split into 3 rows"):
        fz_cuda.onebit_unpack(bits, torch.ones(3, device="cuda"), torch.empty(64, device="cuda"), False)
