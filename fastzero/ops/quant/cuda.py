"""The CUDA backend of block-wise quantization (csrc/cuda/quant.cu), on
buffers that fastzero.ops.quant checked (1-D, contiguous, one device)."""

from __future__ import annotations

import torch
from torch import Tensor

from fastzero.native import DTYPE_CODES, check_rc, cuda_lib
from fastzero.ops.marshal import check_flat, stream

_CPU_HINT = "; for CPU tensors use fastzero.ops.quant's functions, which take their CPU path for them"


def quant_quantize(
    x: Tensor, codes: Tensor, scales: Tensor, bits: int, block: int, stochastic: bool, seed: int
) -> None:
    """:func:`fastzero.ops.quant.reference.quantize` of CUDA tensors, into codes and scales;
    enqueued on the current stream."""
    op = "quant_quantize"
    dtypes = {"x": tuple(DTYPE_CODES), "codes": (torch.int8, torch.uint8), "scales": (torch.float32,)}
    device = check_flat(op, {"x": x, "codes": codes, "scales": scales}, dtypes, _CPU_HINT)
    lib = cuda_lib(op)
    with torch.cuda.device(device):
        rc = lib.fz_cuda_quant_quantize(
            x.data_ptr(),
            DTYPE_CODES[x.dtype],
            codes.data_ptr(),
            scales.data_ptr(),
            x.numel(),
            block,
            bits,
            int(bool(stochastic)),
            seed,
            stream(device),
        )
        check_rc(lib, rc, op)


def quant_dequantize_sum(codes: Tensor, scales: Tensor, out: Tensor, block: int) -> None:
    """out = the fp32 sum over the rows of codes [R, C] with scales [R, blocks]
    (contiguous), in row order; enqueued on the current stream."""
    op = "quant_dequantize_sum"
    codes2, scales2 = codes.reshape(codes.shape[0] if codes.dim() == 2 else 1, -1), scales.reshape(-1)
    dtypes = {"codes": (torch.int8, torch.uint8), "scales": (torch.float32,), "out": tuple(DTYPE_CODES)}
    device = check_flat(op, {"codes": codes2.view(-1), "scales": scales2, "out": out}, dtypes, _CPU_HINT)
    lib = cuda_lib(op)
    with torch.cuda.device(device):
        rc = lib.fz_cuda_quant_dequantize_sum(
            codes2.data_ptr(),
            8 if codes.dtype == torch.int8 else 4,
            codes2.shape[1],
            scales2.data_ptr(),
            codes2.shape[0],
            out.data_ptr(),
            DTYPE_CODES[out.dtype],
            out.numel(),
            block,
            stream(device),
        )
        check_rc(lib, rc, op)


def quant_dequantize(codes: Tensor, scales: Tensor, out: Tensor, block: int) -> None:
    quant_dequantize_sum(codes.view(1, -1), scales.view(1, -1), out, block)
