"""The CUDA backend of block-wise quantization (csrc/cuda/quant.cu), on
buffers that fastzero.ops.quant checked (1-D, contiguous, one device)."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from fastzero.native import DTYPE_CODES, check_rc, cuda_lib
from fastzero.ops.marshal import check_flat, stream

_CPU_HINT = "; for CPU tensors use fastzero.ops.quant's functions, which take their CPU path for them"
_VP, _I, _I64, _U32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint32
# The C ABI of quant.cu (csrc/cuda/fastzero_cuda.h), declared here on first use.
_SIGNATURES = {
    # x, x_dtype, codes, scales, n, block, bits, stochastic, seed, stream
    "fz_cuda_quant_quantize": [_VP, _I, _VP, _VP, _I64, _I64, _I, _I, _U32, _VP],
    # codes, bits, code_stride, scales, ranks, out, out_dtype, n, block, stream
    "fz_cuda_quant_dequantize_sum": [_VP, _I, _I64, _VP, _I64, _VP, _I, _I64, _I64, _VP],
}


def _lib(op: str) -> ctypes.CDLL:
    lib = cuda_lib(op)
    for name, argtypes in _SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError as exc:
            raise RuntimeError(
                f"{op}: the loaded CUDA library has no {name}; it predates the quantization kernels: "
                "rebuild it (python setup.py build_ext --inplace, or clear the fastzero build cache)"
            ) from exc
        fn.restype, fn.argtypes = _I, argtypes
    return lib


def quant_quantize(
    x: Tensor, codes: Tensor, scales: Tensor, bits: int, block: int, stochastic: bool, seed: int
) -> None:
    """:func:`fastzero.ops.quant.reference.quantize` of CUDA tensors, into codes and scales;
    enqueued on the current stream."""
    op = "quant_quantize"
    dtypes = {"x": tuple(DTYPE_CODES), "codes": (torch.int8, torch.uint8), "scales": (torch.float32,)}
    device = check_flat(op, {"x": x, "codes": codes, "scales": scales}, dtypes, _CPU_HINT)
    lib = _lib(op)
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
    lib = _lib(op)
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
