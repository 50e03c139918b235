"""The 1-bit compression ops of 1-bit Adam: pack and unpack, on every backend.

``pack`` adds the error carried over from the last call, takes one scale per
chunk (``||y||_2 / sqrt(n)``), writes the sign bits eight to a byte (element i
of a chunk in bit ``i % 8`` of byte ``i // 8``) and leaves the new error in
place, in one kernel. ``unpack`` turns bits and scales back into values:
either each row with its own scale (the gathered result) or the average of
the rows (the server's average of what every worker sent). The math is
:mod:`fastzero.ops.onebit.reference`; the backends are registered in
``backends.py`` (``backend=`` > ``FASTZERO_BACKEND`` > the fastest here).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastzero.ops.backend import forced_backend
from fastzero.ops.onebit import reference
from fastzero.ops.onebit.backends import FAMILY

_PACK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_pack(x: Tensor, error: Tensor, chunks: int) -> None:
    if x.dtype not in _PACK_DTYPES:
        raise TypeError(f"onebit pack: x is {x.dtype}; use float32, float16 or bfloat16")
    if error.dtype != torch.float32:
        raise TypeError(f"onebit pack: the error buffer is {error.dtype}; it must be float32")
    if x.device != error.device:
        raise ValueError(f"onebit pack: x is on {x.device} but the error buffer on {error.device}; put both on one")
    if not (x.is_contiguous() and error.is_contiguous()):
        raise ValueError("onebit pack: x and the error buffer must be contiguous (call .contiguous())")
    if error.numel() != x.numel():
        raise ValueError(f"onebit pack: the error buffer has {error.numel()} elements, x has {x.numel()}")
    if chunks < 1 or x.numel() % (8 * chunks):
        raise ValueError(
            f"onebit pack: {x.numel()} elements do not split into {chunks} chunks of whole bytes; "
            f"pad to a multiple of {8 * max(chunks, 1)} (fastzero.comm.compressed.padded_numel)"
        )


def pack(x: Tensor, error: Tensor, chunks: int = 1, *, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """(sign bits uint8 [numel/8], scales fp32 [chunks]) of ``x + error``;
    `error` (fp32, x's shape) becomes the new error in place."""
    _check_pack(x, error, chunks)
    bits = torch.empty(x.numel() // 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(chunks, dtype=torch.float32, device=x.device)
    FAMILY.impl(FAMILY.choose(x.device.type, backend).backend).onebit_pack(
        x.reshape(-1), error.reshape(-1), bits, scales, chunks
    )
    return bits, scales


def unpack(
    bits: Tensor, scales: Tensor, *, average: bool = False, out: Tensor | None = None, backend: str | None = None
) -> Tensor:
    """fp32 values of `bits` (one row per scale): rows concatenated, each
    sign times its row's scale, or with ``average=True`` the mean of the
    rows (one row's length)."""
    if bits.dtype != torch.uint8 or scales.dtype != torch.float32:
        raise TypeError(f"onebit unpack: bits must be uint8 and scales float32, got {bits.dtype} and {scales.dtype}")
    if bits.device != scales.device:
        raise ValueError(f"onebit unpack: bits on {bits.device} but scales on {scales.device}")
    rows = scales.numel()
    if rows == 0 or bits.numel() % rows:
        raise ValueError(f"onebit unpack: {bits.numel()} bytes do not split into {rows} rows")
    bits, scales = bits.contiguous().reshape(-1), scales.contiguous()
    numel = bits.numel() * 8 // (rows if average else 1)
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=bits.device)
    elif out.dtype != torch.float32 or out.numel() != numel or not out.is_contiguous() or out.device != bits.device:
        raise ValueError(f"onebit unpack: out must be a contiguous float32 tensor of {numel} on {bits.device}")
    FAMILY.impl(FAMILY.choose(bits.device.type, backend).backend).onebit_unpack(bits, scales, out, average)
    return out


def pack_mask(mask: Tensor, *, backend: str | None = None) -> Tensor:
    """A 0/1 mask (a dropout's) as bits: uint8 [ceil(numel / 8)], element i of
    the mask (in its logical order) in bit ``i % 8`` of byte ``i // 8``; any
    nonzero value reads as 1. The CPU backend packs contiguous fp32, fp16 and
    bf16 masks in one SIMD pass; everything else (other dtypes, layouts, the
    CUDA backends) takes the reference's few PyTorch ops, which run anywhere."""
    bits = torch.empty((mask.numel() + 7) // 8, dtype=torch.uint8, device=mask.device)
    _mask_impl(mask, backend).mask_pack(mask, bits)
    return bits


def unpack_mask(bits: Tensor, out: Tensor, *, backend: str | None = None) -> Tensor:
    """Writes the 0/1 values :func:`pack_mask` packed into `out` (its shape,
    dtype and device; ``out.numel()`` values) and returns it."""
    if bits.dtype != torch.uint8 or bits.dim() != 1:
        raise TypeError(
            f"unpack_mask: bits must be a 1-D uint8 tensor (from pack_mask), got {bits.dtype} {bits.dim()}-D"
        )
    if bits.device != out.device:
        raise ValueError(f"unpack_mask: bits on {bits.device} but out on {out.device}; put both on one")
    if bits.numel() != (out.numel() + 7) // 8:
        raise ValueError(
            f"unpack_mask: {bits.numel()} bytes of bits hold {8 * bits.numel()} values; out has {out.numel()} "
            "(pass the mask's own shape)"
        )
    _mask_impl(out, backend).mask_unpack(bits.contiguous(), out)
    return out


_MASK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_cpu_default: list = []  # the module CPU tensors get by default, once chosen (called per mask: kept cheap)


def _mask_impl(t: Tensor, backend: str | None):
    """The CPU backend's kernels where that backend is chosen and takes `t`; else the reference. A named
    backend is checked against `t`'s device as every op of the family checks it."""
    if backend is None and forced_backend() is None:
        if not _cpu_default:
            _cpu_default.append(FAMILY.impl("cpu") if FAMILY.choose("cpu").backend == "cpu" else reference)
        cpu = _cpu_default[0]
    else:
        cpu = FAMILY.impl("cpu") if FAMILY.choose(t.device.type, backend).backend == "cpu" else reference
    takes = t.device.type == "cpu" and t.dtype in _MASK_DTYPES and t.is_contiguous()
    return cpu if takes else reference


__all__ = ["FAMILY", "pack", "pack_mask", "reference", "unpack", "unpack_mask"]
