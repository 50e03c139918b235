"""The CPU backend of 1-bit compression: the SIMD kernels of csrc/cpu
(onebit.cpp), on buffers the caller checked."""

from __future__ import annotations

import torch
from torch import Tensor

from fastzero.native import DTYPE_CODES, ISA_NAMES, cpu_isa, cpu_ops


# Masks on one thread: a block's mask (256K values) packs in tens of microseconds, less than waking a pool.
def mask_pack(mask: Tensor, bits: Tensor) -> None:
    cpu_ops().mask_pack(
        ISA_NAMES.index(cpu_isa()), mask.data_ptr(), DTYPE_CODES[mask.dtype], bits.data_ptr(), mask.numel(), 1
    )


def mask_unpack(bits: Tensor, out: Tensor) -> None:
    cpu_ops().mask_unpack(
        ISA_NAMES.index(cpu_isa()), bits.data_ptr(), out.data_ptr(), DTYPE_CODES[out.dtype], out.numel(), 1
    )


def onebit_pack(x: Tensor, error: Tensor, bits: Tensor, scales: Tensor, chunks: int) -> None:
    cpu_ops().onebit_pack(
        ISA_NAMES.index(cpu_isa()),
        x.data_ptr(),
        DTYPE_CODES[x.dtype],
        error.data_ptr(),
        bits.data_ptr(),
        scales.data_ptr(),
        x.numel(),
        chunks,
        torch.get_num_threads(),
    )


def onebit_unpack(bits: Tensor, scales: Tensor, out: Tensor, average: bool) -> None:
    rows = scales.numel()
    cpu_ops().onebit_unpack(
        ISA_NAMES.index(cpu_isa()),
        bits.data_ptr(),
        scales.data_ptr(),
        out.data_ptr(),
        rows,
        bits.numel() // rows,
        average,
        torch.get_num_threads(),
    )
