"""Inputs and checks shared by the quantization tests of every backend."""

from __future__ import annotations

import torch

from fastzero.ops import quant
from fastzero.ops.quant import reference as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BIG = {torch.float32: 3.0e38, torch.float16: 6.0e4, torch.bfloat16: 3.0e38}
TINY = {torch.float32: 1.0e-42, torch.float16: 6.0e-8, torch.bfloat16: 1.0e-40}  # subnormals


def dtype_id(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def special_input(n: int, block: int, bits: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    """Random values of several magnitudes, with a zero block, a block of huge
    and one of tiny (subnormal) values, ties (k + 0.5 times a scale), -0.0,
    and a NaN, an inf and a -inf block where n allows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 2)
    blocks = -(-n // block)
    spans = [(b * block, min(n, (b + 1) * block)) for b in range(blocks)]
    if blocks >= 2:
        lo, hi = spans[1]
        x[lo:hi] = 0.0
        x[lo] = -0.0
    if blocks >= 3:
        lo, hi = spans[2]
        x[lo:hi] = torch.rand(hi - lo, generator=gen) * BIG[dtype] * torch.sign(torch.randn(hi - lo, generator=gen))
    if blocks >= 4:
        lo, hi = spans[3]
        x[lo:hi] = torch.rand(hi - lo, generator=gen) * TINY[dtype]
    if blocks >= 5:  # ties: absmax qmax, so the scale is 1 and x / s = k + 0.5 exactly
        lo, hi = spans[4]
        x[lo:hi] = torch.randint(-6, 6, (hi - lo,), generator=gen) + 0.5
        x[lo] = float(ref.qmax(bits))
    for k, bad in zip((5, 6, 7), (float("nan"), float("inf"), float("-inf"))):
        if blocks > k:
            lo, hi = spans[k]
            x[lo + (hi - lo) // 2] = bad
    return x.to(dtype).to(device)


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Every element equal (NaN where NaN), dtypes and sizes too."""
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    )
    same = (got == want) | (got.isnan() & want.isnan()) if got.is_floating_point() else got == want
    bad = (~same).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{what}: {bad.numel()} elements differ, first at {bad[:5].tolist()}: {got[bad[:5]]} vs {want[bad[:5]]}"
    )


def check_backend(
    backend: str, n: int, block: int, bits: int, dtype: torch.dtype, stochastic: bool, device: str = "cpu"
):
    """quantize, dequantize (every out dtype) and a 3-rank dequantize_sum of
    `backend` against the reference, element by element."""
    x = special_input(n, block, bits, dtype, seed=n * 7 + block + bits, device=device)
    seed = 12345 + n
    codes, scales = quant.quantize_blockwise(x, bits, block, stochastic=stochastic, seed=seed, backend=backend)
    want_codes, want_scales = ref.quantize(x.cpu(), bits, block, stochastic, seed)
    assert_same(codes.cpu(), want_codes, "codes")
    assert_same(scales.cpu(), want_scales, "scales")
    for out_dtype in DTYPES:
        got = quant.dequantize_blockwise(codes, scales, dtype=out_dtype, numel=n, block=block, backend=backend)
        want = ref.dequantize(want_codes, want_scales, n, block).to(out_dtype)
        assert_same(got.cpu(), want, f"dequantize to {dtype_id(out_dtype)}")
    ranks = [(codes, scales)]
    for r in (1, 2):
        xr = special_input(n, block, bits, dtype, seed=n + 1000 * r, device=device)
        ranks.append(quant.quantize_blockwise(xr, bits, block, stochastic=stochastic, seed=seed + r, backend=backend))
    want_sum = ref.dequantize_sum([c.cpu() for c, _ in ranks], [s.cpu() for _, s in ranks], n, block)
    for out_dtype in DTYPES:
        out = torch.full((n,), 7.0, dtype=out_dtype, device=device)
        quant.dequantize_sum([c for c, _ in ranks], [s for _, s in ranks], out, block=block, backend=backend)
        assert_same(out.cpu(), want_sum.to(out_dtype), f"dequantize_sum to {dtype_id(out_dtype)}")
