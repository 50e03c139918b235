"""The Python side of the native code's contract, defined once: dtype codes,
instruction-set codes and the CUDA library's C ABI (its version and every
entry point's ctypes signature).

The C side is csrc/cpu/common.h (``enum DType``, ``enum Isa``),
csrc/cuda/common.cuh (``enum DType``) and csrc/cuda/fastzero_cuda.h
(``FZ_CUDA_ABI_VERSION`` and the ``fz_cuda_*`` prototypes);
tests/test_native_abi.py parses those headers and checks they agree with
this file. The optimizers' hyperparameter structs (csrc/common/hyperparams.h)
are laid out by each family's dataclass (fastzero.ops.hyperparams), not
here, and cross as one pointer (``c_void_p``: pass ``ctypes.byref`` of the
struct); tests/test_hyperparams_abi.py checks that layout.
"""

from __future__ import annotations

import ctypes

import torch

# enum DType: the storage dtype of a tensor a kernel reads or writes.
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
NO_DTYPE = -1  # kNone: an absent tensor (no low-precision param copy)

# enum Isa: the CPU kernels' instruction sets; the index is the code, best last.
ISA_NAMES = ("scalar", "avx2", "avx512")

# FZ_CPU_ABI_VERSION (csrc/cpu/common.h): a prebuilt extension of another
# version (a stale build) is passed over for a just-in-time build.
CPU_ABI_VERSION = 7

# FZ_CUDA_ABI_VERSION: a library speaking another version is refused.
CUDA_ABI_VERSION = 8

_VP, _I, _I64, _D, _U32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_double, ctypes.c_uint32
_PTRS, _I64S = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64)

# Every exported function of libfastzero_cuda.so: (restype, argtypes).
CUDA_SIGNATURES: dict[str, tuple[type, list[type]]] = {
    "fz_cuda_abi_version": (_I, []),
    "fz_cuda_last_error": (ctypes.c_char_p, []),
    "fz_cuda_chunk_elems": (_I64, []),
    "fz_cuda_check_device": (_I, []),
    # p, g, m, v, copy, numel, n, p/g/s/c dtype, hyper (fz_adam_hyper*), step, grad_scale, found_inf, seed,
    # sr_states, sr_params, stream
    "fz_cuda_adam": (_I, [_PTRS] * 5 + [_I64S] + [_I] * 5 + [_VP] * 4 + [_I64, _I, _I, _VP]),
    # p, g, m, v, copy, m_scales, v_scales, numel, n, p/g/c dtype, block_size, hyper (fz_adam_hyper*), step,
    # grad_scale, found_inf, seed, sr_params, stream
    "fz_cuda_adam_int8": (_I, [_PTRS] * 7 + [_I64S] + [_I] * 4 + [_I64] + [_VP] * 4 + [_I64, _I, _VP]),
    # x, numel, n, dtype, scale, found_inf, partials, partials_len, stream
    "fz_cuda_l2norm_partials": (_I, [_PTRS, _I64S, _I, _I, _VP, _VP, _VP, _I64, _VP]),
    # partials, partials_len, hyper (fz_lamb_hyper*), found_inf, clip_out, stream
    "fz_cuda_lamb_clip_factor": (_I, [_VP, _I64, _VP, _VP, _VP, _VP]),
    # p, g, m, v, copy, numel, out_index, n, p/g/s/c dtype, hyper (fz_lamb_hyper*), step, grad_scale, clip,
    # found_inf, partials, partials_len, ratio_scratch, coeffs_out, stream
    "fz_cuda_lamb": (_I, [_PTRS] * 5 + [_I64S] * 2 + [_I] * 5 + [_VP] * 6 + [_I64] + [_VP] * 3),
    # x, x_dtype, error, bits, scales, numel, chunks, partials, partials_len, stream
    "fz_cuda_onebit_pack": (_I, [_VP, _I, _VP, _VP, _VP, _I64, _I64, _VP, _I64, _VP]),
    # bits, scales, out, rows, row_bytes, average, stream
    "fz_cuda_onebit_unpack": (_I, [_VP, _VP, _VP, _I64, _I64, _I, _VP]),
    # x, x_dtype, codes, scales, n, block, bits, stochastic, seed, stream
    "fz_cuda_quant_quantize": (_I, [_VP, _I, _VP, _VP, _I64, _I64, _I, _I, _U32, _VP]),
    # codes, bits, code_stride, scales, ranks, out, out_dtype, n, block, stream
    "fz_cuda_quant_dequantize_sum": (_I, [_VP, _I, _I64, _VP, _I64, _VP, _I, _I64, _I64, _VP]),
}
