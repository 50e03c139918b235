"""The CUDA backend of 1-bit compression (csrc/cuda/onebit.cu)."""

from __future__ import annotations

import torch
from torch import Tensor

from fastzero.native import DTYPE_CODES, check_rc, cuda_lib
from fastzero.ops.marshal import check_flat, num_chunks, stream

_CPU_HINT = "; for CPU tensors use fastzero.ops.onebit.pack and unpack, which take their CPU path for them"


def onebit_pack(x: Tensor, error: Tensor, bits: Tensor, scales: Tensor, chunks: int) -> None:
    r"""1-bit compression with error feedback of CUDA tensors, in place:
    :func:`fastzero.ops.onebit.reference.compress`'s math. Over ``chunks``
    chunks of ``len = x.numel() / chunks`` elements (a multiple of 8):

    .. math::
        y = x + e;\quad s_c = \sqrt{\textstyle\sum y^2 / len};\quad
        b_i = [y_i \ge 0];\quad e \leftarrow y - s_c (2b - 1)

    ``x`` fp32/fp16/bf16; ``error`` fp32 with x's elements, updated in
    place; ``bits`` uint8 (x.numel() / 8: element i of a chunk in bit i % 8
    of byte i // 8 of the chunk's bytes) and ``scales`` fp32 (``chunks``) are
    written. Sums of squares in fp64, in a fixed order (deterministic). The
    work is enqueued on the current CUDA stream; nothing waits for it.
    """
    op = "onebit_pack"
    tensors = {"x": x, "error": error, "bits": bits, "scales": scales}
    dtypes = {"x": tuple(DTYPE_CODES), "error": (torch.float32,), "bits": (torch.uint8,), "scales": (torch.float32,)}
    device = check_flat(op, tensors, dtypes, _CPU_HINT)
    numel = x.numel()
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"{op}: chunks must be an int >= 1, got {chunks!r}")
    if numel % (8 * chunks):
        raise ValueError(f"{op}: {numel} elements do not split into {chunks} chunks of whole bytes (8 elements)")
    for name, t, want in (("error", error, numel), ("bits", bits, numel // 8), ("scales", scales, chunks)):
        if t.numel() != want:
            raise ValueError(f"{op}: {name} has {t.numel()} elements, {want} needed (x has {numel} in {chunks} chunks)")
    lib = cuda_lib(op)
    tiles = num_chunks(numel // chunks, lib.fz_cuda_chunk_elems())
    with torch.cuda.device(device):
        # Scratch on the current stream: reused only by work queued after the kernels.
        partials = torch.empty(max(chunks * tiles, 1), dtype=torch.float64, device=device)
        rc = lib.fz_cuda_onebit_pack(
            x.data_ptr(),
            DTYPE_CODES[x.dtype],
            error.data_ptr(),
            bits.data_ptr(),
            scales.data_ptr(),
            numel,
            chunks,
            partials.data_ptr(),
            chunks * tiles,
            stream(device),
        )
        check_rc(lib, rc, op)


def onebit_unpack(bits: Tensor, scales: Tensor, out: Tensor, average: bool) -> None:
    """Sign bits back to fp32 values on CUDA tensors:
    :func:`fastzero.ops.onebit.reference.decompress`'s math. ``bits`` uint8
    holds one row of K bytes per element of ``scales`` (fp32, R rows). With
    ``average=False`` ``out`` (fp32, R * 8K) gets each row's signs times its
    scale; with ``average=True`` ``out`` (fp32, 8K) gets their mean over the
    rows (an fp32 sum in row order, divided by R). Enqueued on the current
    CUDA stream; nothing waits for it.
    """
    op = "onebit_unpack"
    tensors = {"bits": bits, "scales": scales, "out": out}
    dtypes = {"bits": (torch.uint8,), "scales": (torch.float32,), "out": (torch.float32,)}
    device = check_flat(op, tensors, dtypes, _CPU_HINT)
    rows = scales.numel()
    if rows == 0 or bits.numel() % rows:
        raise ValueError(f"{op}: {bits.numel()} bytes of bits do not split into {rows} rows (one per scale)")
    row_bytes = bits.numel() // rows
    want = 8 * row_bytes * (1 if average else rows)
    if out.numel() != want:
        raise ValueError(
            f"{op}: out has {out.numel()} elements, {want} needed ({rows} rows of {row_bytes} bytes"
            f"{', averaged' if average else ''})"
        )
    lib = cuda_lib(op)
    with torch.cuda.device(device):
        rc = lib.fz_cuda_onebit_unpack(
            bits.data_ptr(), scales.data_ptr(), out.data_ptr(), rows, row_bytes, int(bool(average)), stream(device)
        )
        check_rc(lib, rc, op)
