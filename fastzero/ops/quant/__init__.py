"""Block-wise symmetric quantization (ZeRO++'s qwZ weights, qgZ gradients),
on every backend: ``quantize_blockwise``, ``dequantize_blockwise`` and
``dequantize_sum``. The math and the formats (rounding, int4 packing,
NaN/inf blocks, the stochastic-rounding hash) are
:mod:`fastzero.ops.quant.reference`; the backends are registered in
``backends.py`` (``backend=`` > ``FASTZERO_BACKEND`` > the fastest here).
docs/quant.md is the guide.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastzero.ops.quant import reference
from fastzero.ops.quant.backends import FAMILY

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_CODE_DTYPES = {torch.int8: 8, torch.uint8: 4}


def _check_int(name: str, value: object, op: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be an int, got {value!r}")
    return value


def _check_format(bits: int, block: int, op: str) -> None:
    _check_int("bits", bits, op)
    _check_int("block", block, op)
    if bits not in (4, 8):
        raise ValueError(f"{op}: bits={bits} is not supported; use 8 (int8) or 4 (int4, two codes a byte)")
    if block <= 0:
        raise ValueError(f"{op}: block={block} must be >= 1 (elements per scale)")
    if bits == 4 and block % 2:
        raise ValueError(f"{op}: int4 needs an even block (two codes a byte, blocks on byte edges); got {block}")


def code_numel(numel: int, bits: int) -> int:
    """Elements of the codes tensor for `numel` values: numel (int8) or ceil(numel / 2) (int4)."""
    return numel if bits == 8 else (numel + 1) // 2


def quantize_blockwise(
    x: Tensor,
    bits: int = 8,
    block: int = 256,
    *,
    stochastic: bool = False,
    seed: int | None = None,
    out: tuple[Tensor, Tensor] | None = None,
    check: bool = False,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """(codes, scales) of x (fp32/bf16/fp16, flattened) in blocks of `block`:
    ``s = absmax / qmax`` per block (fp32), ``q = rne(clamp(x / s, -qmax, qmax))``
    (qmax 127 for bits=8, 7 for bits=4). codes: int8 [n] or, for bits=4,
    uint8 [ceil(n / 2)] (even element in the low nibble). ``stochastic=True``:
    ``q = floor(clamp(x / s + u, -qmax, qmax))`` with u from the documented
    counter hash of (seed, element index): bit-identical on every backend;
    seed None draws one from torch's default generator. A block holding NaN or
    inf gets scale NaN and codes 0 (``scales.isfinite()`` tells; ``check=True``
    raises ValueError naming the blocks, at the cost of a device sync).
    `out`: (codes, scales) buffers to write into."""
    op = "quantize_blockwise"
    _check_format(bits, block, op)
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: x must be a tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{op}: x is {x.dtype}; quantize float32, float16 or bfloat16 values (cast it first)")
    if seed is None:
        seed = int(torch.randint(0, 1 << 32, (1,), dtype=torch.int64).item()) if stochastic else 0
    elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 32:
        raise ValueError(f"{op}: seed must be an int in [0, 2**32), got {seed!r}")
    flat = x.reshape(-1)  # a copy where x is not contiguous: the kernels read it flat
    n = flat.numel()
    blocks = -(-n // block)
    want_codes = (code_numel(n, bits), torch.int8 if bits == 8 else torch.uint8)
    if out is None:
        codes = torch.empty(want_codes[0], dtype=want_codes[1], device=x.device)
        scales = torch.empty(blocks, dtype=torch.float32, device=x.device)
    else:
        codes, scales = out
        for name, t, numel, dtype in (("codes", codes, *want_codes), ("scales", scales, blocks, torch.float32)):
            if t.dtype != dtype or t.numel() != numel or not t.is_contiguous() or t.device != x.device:
                raise ValueError(
                    f"{op}: out {name} must be a contiguous {dtype} tensor of {numel} elements on {x.device} "
                    f"(got {t.dtype} [{t.numel()}]{'' if t.is_contiguous() else ' non-contiguous'} on {t.device})"
                )
    if n:
        impl = FAMILY.impl(FAMILY.choose(x.device.type, backend).backend)
        impl.quant_quantize(flat, codes.view(-1), scales.view(-1), bits, block, bool(stochastic), seed)
    if check:
        bad = (~scales.isfinite()).nonzero().flatten()
        if bad.numel():
            raise ValueError(
                f"{op}: {bad.numel()} of {blocks} blocks hold NaN or inf (first: block {bad[0].item()}, "
                f"elements {bad[0].item() * block}..); their scales are NaN. Find where they come from "
                "(an overflow upstream), or skip this step"
            )
    return codes, scales


def _layout(op: str, codes: Tensor, scales: Tensor, n: int | None, block: int | None) -> tuple[int, int, int]:
    """(bits, numel, block) of codes and scales."""
    bits = _CODE_DTYPES.get(codes.dtype)
    if bits is None:
        raise TypeError(f"{op}: codes are {codes.dtype}; they must be int8 (bits=8) or uint8 (int4, packed)")
    if scales.dtype != torch.float32:
        raise TypeError(f"{op}: scales are {scales.dtype}; they must be float32 (as quantize_blockwise returns them)")
    if n is None:
        n = codes.numel() if bits == 8 else 2 * codes.numel()
    if code_numel(n, bits) != codes.numel():
        raise ValueError(f"{op}: {codes.numel()} codes do not hold {n} int{bits} values")
    blocks = scales.numel()
    if block is None:
        if blocks == 0 or n % blocks:
            raise ValueError(
                f"{op}: {n} values do not split into {blocks} equal blocks; the last block is partial, "
                "so pass block= (the block quantize_blockwise used)"
            )
        block = n // blocks
    _check_format(bits, block, op)
    if -(-n // block) != blocks:
        raise ValueError(f"{op}: {n} values in blocks of {block} need {-(-n // block)} scales, got {blocks}")
    return bits, n, block


def _check_out(op: str, out: Tensor, n: int, device: torch.device) -> None:
    if not isinstance(out, Tensor) or out.dtype not in _FLOATS:
        raise TypeError(f"{op}: out must be a float32, float16 or bfloat16 tensor")
    if out.numel() != n or not out.is_contiguous() or out.device != device:
        raise ValueError(
            f"{op}: out must be contiguous with {n} elements on {device} "
            f"(got [{out.numel()}]{'' if out.is_contiguous() else ' non-contiguous'} on {out.device})"
        )


def dequantize_blockwise(
    codes: Tensor,
    scales: Tensor,
    out: Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    numel: int | None = None,
    block: int | None = None,
    backend: str | None = None,
) -> Tensor:
    """Values ``q * s`` (fp32 math, then rounded to out's dtype) of codes
    from :func:`quantize_blockwise`. The width comes from codes' dtype (int8:
    8 bits, uint8: packed int4). The count is out's numel, else `numel`, else
    codes.numel() (int8) or 2 * codes.numel() (int4: pass numel= or out for
    an odd count). The block is `block`, else count / scales.numel() (whole
    blocks: data with a partial last block must pass block=)."""
    op = "dequantize_blockwise"
    if codes.device != scales.device:
        raise ValueError(f"{op}: codes are on {codes.device} but scales on {scales.device}; put both on one")
    if out is not None:
        if isinstance(out, Tensor) and dtype not in (torch.float32, out.dtype):
            raise ValueError(f"{op}: dtype={dtype} but out is {out.dtype}; out's dtype is used: drop dtype=")
        if numel is not None and numel != out.numel():
            raise ValueError(f"{op}: numel={numel} but out has {out.numel()} elements")
        numel = out.numel()
    bits, n, block = _layout(op, codes, scales, numel, block)
    if out is None:
        if dtype not in _FLOATS:
            raise TypeError(f"{op}: dtype={dtype} must be float32, float16 or bfloat16")
        out = torch.empty(n, dtype=dtype, device=codes.device)
    _check_out(op, out, n, codes.device)
    if n:
        impl = FAMILY.impl(FAMILY.choose(codes.device.type, backend).backend)
        impl.quant_dequantize(codes.contiguous().view(-1), scales.contiguous().view(-1), out.view(-1), block)
    return out


def _stack(op: str, name: str, parts: list[Tensor] | Tensor) -> Tensor:
    if isinstance(parts, Tensor):
        if parts.dim() != 2:
            raise ValueError(f"{op}: {name} as one tensor must be 2-D [ranks, ...], got {tuple(parts.shape)}")
        return parts.contiguous()
    parts = list(parts)
    if not parts or not all(isinstance(p, Tensor) for p in parts):
        raise TypeError(f"{op}: {name} must be a non-empty list of tensors (one per rank) or a 2-D tensor")
    sizes = {p.numel() for p in parts}
    if len(sizes) != 1 or len({(p.dtype, p.device) for p in parts}) != 1:
        raise ValueError(f"{op}: every rank's {name} must have one size, dtype and device; got sizes {sorted(sizes)}")
    return torch.stack([p.reshape(-1) for p in parts])


def dequantize_sum(
    chunks: list[Tensor] | Tensor,
    scales: list[Tensor] | Tensor,
    out: Tensor,
    *,
    block: int | None = None,
    backend: str | None = None,
) -> Tensor:
    """out = sum over ranks r of ``q_r * s_r`` (chunks[r], scales[r]: one
    rank's codes and scales for the same values), added in fp32 in rank order
    and written once to out (fp32/bf16/fp16). The block is worked out as in
    :func:`dequantize_blockwise`; the count is out.numel()."""
    op = "dequantize_sum"
    codes = _stack(op, "chunks", chunks)
    scale_rows = _stack(op, "scales", scales)
    if codes.shape[0] != scale_rows.shape[0]:
        raise ValueError(f"{op}: {codes.shape[0]} ranks of chunks but {scale_rows.shape[0]} of scales")
    if codes.device != scale_rows.device:
        raise ValueError(f"{op}: chunks are on {codes.device} but scales on {scale_rows.device}; put both on one")
    if not isinstance(out, Tensor):
        raise TypeError(f"{op}: out must be a float tensor (the summed values are written to it)")
    bits, n, block = _layout(op, codes[0], scale_rows[0], out.numel(), block)
    _check_out(op, out, n, codes.device)
    if n:
        impl = FAMILY.impl(FAMILY.choose(codes.device.type, backend).backend)
        impl.quant_dequantize_sum(codes, scale_rows, out.view(-1), block)
    return out


__all__ = ["FAMILY", "code_numel", "dequantize_blockwise", "dequantize_sum", "quantize_blockwise", "reference"]
