"""The CUDA backend of the optimizer ops and of 1-bit compression: Python side of csrc/cuda.

Python owns the tensors: every check (device, dtype, contiguity, sizes)
happens here, before a pointer reaches the kernels' C ABI
(csrc/cuda/fastzero_cuda.h), which :mod:`fastzero.native.loader` loads
with ctypes (an install-time build, ``$FASTZERO_CUDA_LIB``, or a
just-in-time build with nvcc into a cache on first use). Importing this
module never fails: without a GPU, nvcc or a working build,
:func:`fastzero.native.cuda_available` says why and the ops raise that
reason when called.

Per-step scalars stay on the device, so a step never waits for the GPU:
``step`` (t >= 1), ``grad_scale`` and ``found_inf`` are 0-d float32 tensors
read by the kernels, which compute the bias corrections themselves and change
nothing when ``found_inf`` is nonzero. Lists may mix dtypes: each dtype
combination is one multi-tensor launch (or a few, for very long lists).
"""

from __future__ import annotations

import ctypes
from collections import defaultdict

import torch
from torch import Tensor

from fastzero.checks import check_adam_hyperparams, check_device_step, check_lamb_hyperparams
from fastzero.native import DTYPE_CODES, NO_DTYPE, check_rc, cuda_lib

_ADAM_CPU_HINT = (
    "; for CPU tensors use fastzero.ops.CPUAdam (or cpu_adam_step), or FusedAdam, which takes its CPU path for them"
)
_LAMB_CPU_HINT = "; for CPU tensors use fastzero.ops.FusedLamb, which takes its CPU path for them"
_ONEBIT_CPU_HINT = "; for CPU tensors use fastzero.ops.onebit.pack and unpack, which take their CPU path for them"

# ---------------------------------------------------------------------------
# Checks: everything the kernels assume, before any pointer crosses.


def _check_flat(op: str, tensors: dict[str, Tensor], dtypes: dict[str, tuple], hint: str) -> torch.device:
    """The 1-D buffers of a onebit op: tensors, on one CUDA device (the
    first's), contiguous, of the dtypes allowed. Returns the device."""
    device = None
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cuda":
            raise ValueError(f"{op}: {name} is on {t.device}; this op takes cuda tensors{hint}")
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first} is on {device}; one call, one device")
        if t.dtype not in dtypes[name]:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes[name])
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported: {allowed}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} is not contiguous; pass t.contiguous() (the kernel uses its memory as is)")
    return device


# ---------------------------------------------------------------------------
# Marshalling


def _groups(params, grads, exp_avgs, param_copies) -> dict[tuple, list[int]]:
    """Tensor indices by dtype combination (param, grad, state, copy or None),
    in first-seen order: one multi-tensor launch each."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, (p, g, m) in enumerate(zip(params, grads, exp_avgs)):
        c = None if param_copies is None else param_copies[i].dtype
        groups[(p.dtype, g.dtype, m.dtype, c)].append(i)
    return groups


def _ptrs(tensors, idx):
    return (ctypes.c_void_p * len(idx))(*[tensors[i].data_ptr() for i in idx])


def _numels(tensors, idx):
    return (ctypes.c_int64 * len(idx))(*[tensors[i].numel() for i in idx])


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _num_chunks(numel: int, chunk: int) -> int:
    return -(-numel // chunk)


def _codes(key: tuple) -> tuple[int, int, int, int]:
    p, g, s, c = key
    return DTYPE_CODES[p], DTYPE_CODES[g], DTYPE_CODES[s], NO_DTYPE if c is None else DTYPE_CODES[c]


# ---------------------------------------------------------------------------
# The ops


def adam_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    adamw_mode: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    param_copies: list[Tensor] | None = None,
) -> None:
    r"""One Adam/AdamW step over lists of CUDA tensors, in one pass over memory
    per dtype combination: :func:`fastzero.ops.reference.adam_step`'s math in
    fp32 whatever the storage dtypes.

    .. math::
        g &\leftarrow g / s \qquad (s = \text{grad\_scale}) \\
        p &\leftarrow p\,(1 - \text{lr}\cdot\text{wd}) \text{ (AdamW) } \quad\text{or}\quad
            g \leftarrow g + \text{wd}\cdot p \text{ (Adam)} \\
        m &\leftarrow \beta_1 m + (1-\beta_1) g \qquad
        v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        p &\leftarrow p - \text{lr}\,\frac{m / bc_1}{\sqrt{v / bc_2} + \epsilon}
            \qquad bc_i = 1 - \beta_i^{t}

    Params fp32/bf16/fp16; grads any of these; states fp32 or the param's
    dtype; ``param_copies`` (fp32 params only) bf16/fp16 tensors written in
    the same pass. ``step`` is a 0-d float32 tensor on the params' device
    holding t >= 1; ``grad_scale`` (grads are divided by it) and
    ``found_inf`` (nonzero: nothing changes) likewise, or None. The work is
    enqueued on the current CUDA stream; nothing waits for it.
    """
    op = "adam_step"
    scalars = {"step": step, "grad_scale": grad_scale, "found_inf": found_inf}
    device = check_device_step(op, params, grads, exp_avgs, exp_avg_sqs, param_copies, scalars, hint=_ADAM_CPU_HINT)
    check_adam_hyperparams(lr, (beta1, beta2), eps, weight_decay)
    if device is None:
        return  # no tensors
    lib = cuda_lib(op)
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        for key, idx in _groups(params, grads, exp_avgs, param_copies).items():
            rc = lib.fz_cuda_adam(
                _ptrs(params, idx), _ptrs(grads, idx), _ptrs(exp_avgs, idx), _ptrs(exp_avg_sqs, idx),
                None if param_copies is None else _ptrs(param_copies, idx),
                _numels(params, idx), len(idx), *_codes(key),
                step.data_ptr(), lr, beta1, beta2, eps, weight_decay, int(bias_correction), int(adamw_mode),
                _ptr(grad_scale), _ptr(found_inf), stream,
            )  # fmt: skip
            check_rc(lib, rc, op)


def lamb_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    eps_inside_sqrt: bool,
    weight_decay: float,
    bias_correction: bool,
    max_grad_norm: float,
    max_coeff: float,
    min_coeff: float,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    param_copies: list[Tensor] | None = None,
    coeffs_out: Tensor,
) -> None:
    r"""One LAMB step over lists of CUDA tensors:
    :func:`fastzero.ops.reference.lamb_step`'s math (DeepSpeed's FusedLamb)
    in fp32 whatever the storage dtypes, with the trust ratio of tensor i
    written to ``coeffs_out[i]`` (a float32 tensor of len(params) elements on
    the params' device).

    On the device, without a host sync: the global grad norm (when
    ``max_grad_norm > 0``) over the whole list; phase 1 updates m and v and
    sums ||p||^2 and ||u||^2 per tensor; phase 2 recomputes u and applies
    p -= lr sqrt(bc2) / bc1 * r * u. Dtype rules, ``step``, ``grad_scale``,
    ``found_inf`` and ``param_copies`` as :func:`adam_step`'s; when
    ``found_inf`` is nonzero, ``coeffs_out`` is left unchanged too.
    """
    op = "lamb_step"
    scalars = {"step": step, "grad_scale": grad_scale, "found_inf": found_inf}
    device = check_device_step(op, params, grads, exp_avgs, exp_avg_sqs, param_copies, scalars, hint=_LAMB_CPU_HINT)
    check_adam_hyperparams(lr, (beta1, beta2), eps, weight_decay)
    check_lamb_hyperparams(max_grad_norm, max_coeff, min_coeff)
    if not isinstance(coeffs_out, Tensor):
        raise TypeError(f"coeffs_out must be a float32 tensor, got {type(coeffs_out).__name__}")
    if device is None:
        return  # no tensors
    if coeffs_out.dtype != torch.float32 or coeffs_out.numel() != len(params):
        raise ValueError(
            f"coeffs_out must be float32 with one element per param ({len(params)}), got {coeffs_out.dtype} "
            f"with {coeffs_out.numel()}"
        )
    if coeffs_out.device != device or not coeffs_out.is_contiguous():
        raise ValueError(f"coeffs_out must be contiguous and on the params' device ({device}), got {coeffs_out.device}")
    lib = cuda_lib(op)
    chunk = lib.fz_cuda_chunk_elems()
    inf_ptr = _ptr(found_inf)
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        # Scratch lives on the current stream: the caching allocator reuses it
        # only for work queued after these kernels.
        clip = None
        if max_grad_norm > 0.0:
            by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
            for i, g in enumerate(grads):
                by_dtype[g.dtype].append(i)
            counts = {dt: sum(_num_chunks(grads[i].numel(), chunk) for i in idx) for dt, idx in by_dtype.items()}
            total = sum(counts.values())
            partials = torch.empty(max(total, 1), dtype=torch.float64, device=device)
            offset = 0
            for dt, idx in by_dtype.items():
                rc = lib.fz_cuda_l2norm_partials(
                    _ptrs(grads, idx), _numels(grads, idx), len(idx), DTYPE_CODES[dt], _ptr(grad_scale), inf_ptr,
                    partials.data_ptr() + 8 * offset, counts[dt], stream,
                )  # fmt: skip
                check_rc(lib, rc, op)
                offset += counts[dt]
            clip = torch.empty((), dtype=torch.float32, device=device)
            rc = lib.fz_cuda_clip_factor(partials.data_ptr(), total, max_grad_norm, inf_ptr, clip.data_ptr(), stream)
            check_rc(lib, rc, op)
        for key, idx in _groups(params, grads, exp_avgs, param_copies).items():
            chunks = sum(_num_chunks(params[i].numel(), chunk) for i in idx)
            partials = torch.empty(max(2 * chunks, 1), dtype=torch.float64, device=device)
            ratio = torch.empty(len(idx), dtype=torch.float64, device=device)
            rc = lib.fz_cuda_lamb(
                _ptrs(params, idx), _ptrs(grads, idx), _ptrs(exp_avgs, idx), _ptrs(exp_avg_sqs, idx),
                None if param_copies is None else _ptrs(param_copies, idx),
                _numels(params, idx), (ctypes.c_int64 * len(idx))(*idx), len(idx), *_codes(key),
                step.data_ptr(), lr, beta1, beta2, eps, int(eps_inside_sqrt), weight_decay, int(bias_correction),
                max_coeff, min_coeff, _ptr(grad_scale), _ptr(clip), inf_ptr,
                partials.data_ptr(), 2 * chunks, ratio.data_ptr(), coeffs_out.data_ptr(), stream,
            )  # fmt: skip
            check_rc(lib, rc, op)


def onebit_pack(x: Tensor, error: Tensor, bits: Tensor, scales: Tensor, chunks: int) -> None:
    r"""1-bit compression with error feedback of CUDA tensors, in place:
    :func:`fastzero.ops.reference.onebit.compress`'s math. Over ``chunks``
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
    device = _check_flat(op, tensors, dtypes, _ONEBIT_CPU_HINT)
    numel = x.numel()
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"{op}: chunks must be an int >= 1, got {chunks!r}")
    if numel % (8 * chunks):
        raise ValueError(f"{op}: {numel} elements do not split into {chunks} chunks of whole bytes (8 elements)")
    for name, t, want in (("error", error, numel), ("bits", bits, numel // 8), ("scales", scales, chunks)):
        if t.numel() != want:
            raise ValueError(f"{op}: {name} has {t.numel()} elements, {want} needed (x has {numel} in {chunks} chunks)")
    lib = cuda_lib(op)
    tiles = _num_chunks(numel // chunks, lib.fz_cuda_chunk_elems())
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        # Scratch on the current stream: reused only by work queued after the kernels.
        partials = torch.empty(max(chunks * tiles, 1), dtype=torch.float64, device=device)
        rc = lib.fz_cuda_onebit_pack(
            x.data_ptr(), DTYPE_CODES[x.dtype], error.data_ptr(), bits.data_ptr(), scales.data_ptr(), numel, chunks,
            partials.data_ptr(), chunks * tiles, stream,
        )  # fmt: skip
        check_rc(lib, rc, op)


def onebit_unpack(bits: Tensor, scales: Tensor, out: Tensor, average: bool) -> None:
    """Sign bits back to fp32 values on CUDA tensors:
    :func:`fastzero.ops.reference.onebit.decompress`'s math. ``bits`` uint8
    holds one row of K bytes per element of ``scales`` (fp32, R rows). With
    ``average=False`` ``out`` (fp32, R * 8K) gets each row's signs times its
    scale; with ``average=True`` ``out`` (fp32, 8K) gets their mean over the
    rows (an fp32 sum in row order, divided by R). Enqueued on the current
    CUDA stream; nothing waits for it.
    """
    op = "onebit_unpack"
    tensors = {"bits": bits, "scales": scales, "out": out}
    dtypes = {"bits": (torch.uint8,), "scales": (torch.float32,), "out": (torch.float32,)}
    device = _check_flat(op, tensors, dtypes, _ONEBIT_CPU_HINT)
    rows = scales.numel()
    if rows == 0 or bits.numel() % rows:
        raise ValueError(f"{op}: {bits.numel()} bytes of bits do not split into {rows} rows (one per scale)")
    row_bytes = bits.numel() // rows
    want = 8 * row_bytes * (1 if average else rows)
    if out.numel() != want:
        raise ValueError(f"{op}: out has {out.numel()} elements, {want} needed ({rows} rows of {row_bytes} bytes"
                         f"{', averaged' if average else ''})")  # fmt: skip
    lib = cuda_lib(op)
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        rc = lib.fz_cuda_onebit_unpack(
            bits.data_ptr(), scales.data_ptr(), out.data_ptr(), rows, row_bytes, int(bool(average)), stream
        )
        check_rc(lib, rc, op)
