"""The CPU backend of block-wise quantization: the SIMD kernels of csrc/cpu
(quant.cpp), on buffers the caller checked."""

from __future__ import annotations

import torch
from torch import Tensor

from fastzero.native import DTYPE_CODES, ISA_NAMES, cpu_isa, cpu_ops


def _bits(codes: Tensor) -> int:
    return 8 if codes.dtype == torch.int8 else 4


def quant_quantize(
    x: Tensor, codes: Tensor, scales: Tensor, bits: int, block: int, stochastic: bool, seed: int
) -> None:
    cpu_ops().quant_quantize(
        ISA_NAMES.index(cpu_isa()),
        x.data_ptr(),
        DTYPE_CODES[x.dtype],
        codes.data_ptr(),
        scales.data_ptr(),
        x.numel(),
        block,
        bits,
        stochastic,
        seed,
        torch.get_num_threads(),
    )


def quant_dequantize_sum(codes: Tensor, scales: Tensor, out: Tensor, block: int) -> None:
    """codes [R, C] and scales [R, blocks], contiguous: out = the sum over rows."""
    cpu_ops().quant_dequantize_sum(
        ISA_NAMES.index(cpu_isa()),
        codes.data_ptr(),
        _bits(codes),
        codes.shape[-1] if codes.dim() == 2 else codes.numel(),
        scales.data_ptr(),
        codes.shape[0] if codes.dim() == 2 else 1,
        out.data_ptr(),
        DTYPE_CODES[out.dtype],
        out.numel(),
        block,
        torch.get_num_threads(),
    )


def quant_dequantize(codes: Tensor, scales: Tensor, out: Tensor, block: int) -> None:
    quant_dequantize_sum(codes.view(1, -1), scales.view(1, -1), out, block)
