"""The CUDA backend of block-wise quantization (csrc/cuda/quant.cu,
fastzero.ops.quant.cuda).

Without a GPU: quant.cu compiles for sm_80 and sm_90 with warnings as errors
(tests/test_cuda_backend.py compiles every source of build.CUDA_SOURCES); here
its entry points, linked with common.cu and loaded without a driver, refuse
bad arguments with codes and messages, and the Python side refuses CPU
tensors. On a GPU (``pytest -m gpu``): codes, scales and dequantized values
against the reference to the bit, on the shared cases (every dtype, partial
blocks, zero / huge / tiny / tie / NaN / inf blocks, both roundings)."""

import ctypes

import pytest
import torch

from fastzero.native import abi, build
from fastzero.ops import quant
from fastzero.ops.quant import cuda as fz_cuda
from fastzero.ops.quant import reference as ref
from tests.ops.quant.cases import DTYPES, assert_same, check_backend, dtype_id
from tests.ops.test_cuda_backend import _nvcc_or_skip

FAKE = 1 << 20  # a device address never dereferenced: the calls below fail their checks first


@pytest.fixture(scope="module")
def quant_lib(tmp_path_factory):
    """common.cu and quant.cu for sm_90, linked and loaded (cudart is static:
    this works without a driver), with the signatures of fastzero.native.abi."""
    nvcc = _nvcc_or_skip()
    out = tmp_path_factory.mktemp("quant-lib")
    src = build.cuda_source_dir()
    objects = [build.compile_source(src / n, out / f"{n}.o", ("90",), nvcc=nvcc) for n in ("common.cu", "quant.cu")]
    lib = ctypes.CDLL(str(build.link(objects, out / build.CUDA_LIBRARY, nvcc)))
    for name in ("fz_cuda_last_error", "fz_cuda_quant_quantize", "fz_cuda_quant_dequantize_sum"):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = abi.CUDA_SIGNATURES[name]
    return lib


def _quantize(lib, n, block, bits=8, *, dtype=0, x=FAKE, codes=FAKE, scales=FAKE):
    return lib.fz_cuda_quant_quantize(x, dtype, codes, scales, n, block, bits, 0, 0, None)


def _dequantize_sum(lib, n, block, bits=8, *, ranks=1, stride=0, dtype=0, scales=FAKE, out=FAKE):
    return lib.fz_cuda_quant_dequantize_sum(FAKE, bits, stride, scales, ranks, out, dtype, n, block, None)


def test_quantize_refuses_bad_arguments(quant_lib):
    lib = quant_lib
    assert _quantize(lib, 64, 16, dtype=3) == 1
    assert b"unsupported dtype" in lib.fz_cuda_last_error()
    assert _quantize(lib, 64, 16, bits=5) == 1
    assert b"bits must be 8 or 4" in lib.fz_cuda_last_error()
    assert _quantize(lib, 64, 15, bits=4) == 1
    assert b"even block" in lib.fz_cuda_last_error()
    assert _quantize(lib, 64, 0) == 1
    assert _quantize(lib, -1, 16) == 1
    assert _quantize(lib, 64, 16, x=None) == 1
    assert b"null" in lib.fz_cuda_last_error()
    assert _quantize(lib, 64, 16, dtype=1, x=FAKE + 1) == 1  # fp16 x at an odd address
    assert b"not aligned" in lib.fz_cuda_last_error()
    assert _quantize(lib, 64, 16, scales=FAKE + 2) == 1
    assert _quantize(lib, 0, 16, x=None, codes=None, scales=None) == 0  # nothing to do


def test_dequantize_sum_refuses_bad_arguments(quant_lib):
    lib = quant_lib
    assert _dequantize_sum(lib, 64, 16, ranks=0) == 1
    assert b"ranks >= 1" in lib.fz_cuda_last_error()
    assert _dequantize_sum(lib, 64, 16, stride=-1) == 1
    assert _dequantize_sum(lib, 64, 16, dtype=7) == 1
    assert b"unsupported dtype" in lib.fz_cuda_last_error()
    assert _dequantize_sum(lib, 64, 7, bits=4) == 1
    assert _dequantize_sum(lib, 64, 16, out=None) == 1
    assert b"null" in lib.fz_cuda_last_error()
    assert _dequantize_sum(lib, 64, 16, dtype=2, out=FAKE + 1) == 1
    assert b"not aligned" in lib.fz_cuda_last_error()
    assert _dequantize_sum(lib, 0, 16, out=None, scales=None) == 0


def test_cpu_tensors_are_refused_with_a_pointer_to_the_cpu_path():
    x = torch.randn(64)
    with pytest.raises(ValueError, match="takes cuda tensors; for CPU tensors use fastzero.ops.quant"):
        fz_cuda.quant_quantize(x, torch.empty(64, dtype=torch.int8), torch.empty(1), 8, 64, False, 0)
    with pytest.raises(ValueError, match="takes cuda tensors"):
        fz_cuda.quant_dequantize(torch.zeros(64, dtype=torch.int8), torch.ones(1), torch.empty(64), 64)


# ---------------------------------------------------------------------------
# On a GPU: the kernels against the reference

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SIZES = [1, 7, 257, 4099, (1 << 20) + 3]
BLOCKS = [2, 64, 256, 1000, 4096]


@gpu
@needs_cuda
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", BLOCKS)
def test_cuda_matches_reference(block, bits, dtype, stochastic):
    for n in SIZES:
        check_backend("cuda", n, block, bits, dtype, stochastic, device="cuda")


@gpu
@needs_cuda
def test_cuda_is_the_default_and_matches_the_cpu_kernels():
    assert quant.FAMILY.choose("cuda").backend == "cuda"
    x = torch.randn(100_003)
    for stochastic in (False, True):
        want = quant.quantize_blockwise(x, 4, 512, stochastic=stochastic, seed=77, backend="cpu")
        got = quant.quantize_blockwise(x.cuda(), 4, 512, stochastic=stochastic, seed=77)
        assert_same(got[0].cpu(), want[0], "codes")
        assert_same(got[1].cpu(), want[1], "scales")
    c, s = ref.quantize(x, 8, 512)
    assert_same(
        quant.dequantize_blockwise(c.cuda(), s.cuda(), block=512).cpu(), ref.dequantize(c, s, x.numel(), 512), "values"
    )
