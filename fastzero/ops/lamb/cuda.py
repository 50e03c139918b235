"""The CUDA backend of LAMB (csrc/cuda/multi_tensor_lamb.cu and
multi_tensor_l2norm.cu): norms, trust ratios and updates on the device, with
no host sync."""

from __future__ import annotations

import ctypes
from collections import defaultdict

import torch
from torch import Tensor

from fastzero.checks import check_device_step
from fastzero.native import DTYPE_CODES, check_rc, cuda_lib
from fastzero.ops.lamb.hyperparams import LambHyperparams
from fastzero.ops.marshal import dtype_codes, dtype_groups, num_chunks, numels, pointers, ptr, stream

_CPU_HINT = "; for CPU tensors use fastzero.ops.FusedLamb, which takes its CPU path for them"


def lamb_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: Tensor,
    coeffs_out: Tensor,
    hp: LambHyperparams | None = None,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    param_copies: list[Tensor] | None = None,
    **hyper,
) -> None:
    r"""One LAMB step over lists of CUDA tensors:
    :func:`fastzero.ops.lamb.reference.lamb_step`'s math (DeepSpeed's FusedLamb)
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
    hp = hp if hp is not None else LambHyperparams.from_kwargs(**hyper)
    scalars = {"step": step, "grad_scale": grad_scale, "found_inf": found_inf}
    device = check_device_step("lamb_step", params, grads, exp_avgs, exp_avg_sqs, param_copies, scalars, hint=_CPU_HINT)
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
    launch(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        step=step,
        hp=hp,
        grad_scale=grad_scale,
        found_inf=found_inf,
        param_copies=param_copies,
        coeffs_out=coeffs_out,
    )


def launch(
    params, grads, exp_avgs, exp_avg_sqs, *, step, hp, coeffs_out, grad_scale=None, found_inf=None, param_copies=None
):
    """:func:`lamb_step` on lists that were checked. The hyperparameters
    cross whole, as one fz_lamb_hyper; the kernels derive the clip factor,
    trust ratios and step size from it."""
    if not params:
        return
    op, device = "lamb_step", params[0].device
    lib = cuda_lib(op)
    chunk = lib.fz_cuda_chunk_elems()
    inf_ptr = ptr(found_inf)
    hyper = ctypes.byref(hp.c_struct())  # host memory, copied into the kernels' parameters during each call
    with torch.cuda.device(device):
        # Scratch lives on the current stream: the caching allocator reuses it
        # only for work queued after these kernels.
        clip = None
        if hp.clips_grad_norm:
            by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
            for i, g in enumerate(grads):
                by_dtype[g.dtype].append(i)
            counts = {dt: sum(num_chunks(grads[i].numel(), chunk) for i in idx) for dt, idx in by_dtype.items()}
            total = sum(counts.values())
            partials = torch.empty(max(total, 1), dtype=torch.float64, device=device)
            offset = 0
            for dt, idx in by_dtype.items():
                rc = lib.fz_cuda_l2norm_partials(
                    pointers(grads, idx),
                    numels(grads, idx),
                    len(idx),
                    DTYPE_CODES[dt],
                    ptr(grad_scale),
                    inf_ptr,
                    partials.data_ptr() + 8 * offset,
                    counts[dt],
                    stream(device),
                )
                check_rc(lib, rc, op)
                offset += counts[dt]
            clip = torch.empty((), dtype=torch.float32, device=device)
            rc = lib.fz_cuda_lamb_clip_factor(
                partials.data_ptr(), total, hyper, inf_ptr, clip.data_ptr(), stream(device)
            )
            check_rc(lib, rc, op)
        for key, idx in dtype_groups(params, grads, exp_avgs, param_copies).items():
            chunks = sum(num_chunks(params[i].numel(), chunk) for i in idx)
            partials = torch.empty(max(2 * chunks, 1), dtype=torch.float64, device=device)
            ratio = torch.empty(len(idx), dtype=torch.float64, device=device)
            rc = lib.fz_cuda_lamb(
                pointers(params, idx),
                pointers(grads, idx),
                pointers(exp_avgs, idx),
                pointers(exp_avg_sqs, idx),
                None if param_copies is None else pointers(param_copies, idx),
                numels(params, idx),
                (ctypes.c_int64 * len(idx))(*idx),
                len(idx),
                *dtype_codes(key),
                hyper,
                step.data_ptr(),
                ptr(grad_scale),
                ptr(clip),
                inf_ptr,
                partials.data_ptr(),
                2 * chunks,
                ratio.data_ptr(),
                coeffs_out.data_ptr(),
                stream(device),
            )
            check_rc(lib, rc, op)
