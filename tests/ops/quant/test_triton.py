"""The Triton quantization kernels against the plain-PyTorch reference through
the public functions: codes, scales and dequantized values to the bit. Without
a GPU they run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1,
set by tests/conftest.py before triton is imported), so sizes stay small."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from fastzero.ops import quant  # noqa: E402
from fastzero.ops.quant import reference as ref  # noqa: E402
from tests.ops.quant.cases import DTYPES, assert_same, check_backend, dtype_id  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (n, block): one element; a partial last block; blocks below and above the
# kernel's tile of 1024 and of odd sizes; 8 blocks so every special block is in
CASES = [(1, 2), (9, 4), (301, 64), (520, 130), (2500, 2048), (8 * 40 + 3, 40)]


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("bits", [8, 4])
def test_triton_matches_reference(bits, dtype, stochastic):
    for n, block in CASES:
        check_backend("triton", n, block, bits, dtype, stochastic, device=DEVICE)


def test_triton_nan_block_and_empty_input():
    x = torch.randn(300, device=DEVICE)
    x[100] = float("nan")
    codes, scales = quant.quantize_blockwise(x, 8, 64, backend="triton")
    assert scales.isfinite().tolist() == [True, False, True, True, True]
    assert (codes[64:128] == 0).all()
    c0, s0 = quant.quantize_blockwise(torch.empty(0, device=DEVICE), 4, 64, backend="triton")
    assert c0.numel() == 0 and s0.numel() == 0
    out = torch.empty(0, device=DEVICE)
    assert quant.dequantize_sum([c0, c0], [s0, s0], out, block=64, backend="triton") is out


def test_triton_stochastic_is_bit_identical_to_the_cpu_path():
    x = torch.randn(777)
    want = ref.quantize(x, 4, 32, True, 4242)
    got = quant.quantize_blockwise(x.to(DEVICE), 4, 32, stochastic=True, seed=4242, backend="triton")
    assert_same(got[0].cpu(), want[0], "codes")
    assert_same(got[1].cpu(), want[1], "scales")
