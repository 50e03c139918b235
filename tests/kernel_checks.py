"""Inputs and checks shared by the tests of the CPU optimizer kernels."""

import torch

from fastzero.ops.tolerances import assert_close

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SIZES = [1, 7, 15, 16, 17, 1023, 100003]  # every SIMD tail of 8 and 16 lanes
# (param, grad, state, copy) combinations the kernel supports.
COMBOS = [
    (F32, F32, F32, None),
    (F32, BF16, F32, None),
    (F32, F16, F32, None),
    (F32, BF16, F32, BF16),
    (F32, F16, F32, F16),
    (F32, F32, F32, BF16),
    (BF16, BF16, F32, None),
    (BF16, F32, F32, None),
    (BF16, BF16, BF16, None),
    (F16, F16, F32, None),
    (F16, F32, F16, None),
    (F16, BF16, F32, None),
]


def make_tensors(sizes, p_dtype, g_dtype, s_dtype, c_dtype):
    params = [torch.randn(n).to(p_dtype) for n in sizes]
    grads = [torch.randn(n).to(g_dtype) for n in sizes]
    exp_avgs = [(0.1 * torch.randn(n)).to(s_dtype) for n in sizes]
    exp_avg_sqs = [(0.01 * torch.rand(n)).to(s_dtype) for n in sizes]
    copies = None if c_dtype is None else [torch.empty(n, dtype=c_dtype) for n in sizes]
    return params, grads, exp_avgs, exp_avg_sqs, copies


def clone_all(tensors, dtype=None):
    """Fresh copies (in `dtype`, if given) of lists of tensors; never aliases."""
    return [None if t is None else [x.to(dtype or x.dtype, copy=True) for x in t] for t in tensors]


def run_both(kernel_step, reference_step, sizes, combo, steps=20, **hyper):
    """Steps of the kernel, of the reference in the same dtypes, and of the
    reference in fp32 storage (the ideal that low-precision storage
    approximates), from the same inputs and fresh grads every step."""
    kernel = make_tensors(sizes, *combo)
    ref = clone_all(kernel)
    ideal = clone_all(kernel, torch.float32)
    for step in range(1, steps + 1):
        if step > 1:  # fresh random grads every step
            for a, b, c in zip(kernel[1], ref[1], ideal[1]):
                a.copy_(torch.randn(a.shape).to(a.dtype))
                b.copy_(a)
                c.copy_(a)
        out = kernel_step(*kernel[:4], step=step, param_copies=kernel[4], **hyper)
        reference_step(*ref[:4], step=step, param_copies=ref[4], **hyper)
        reference_step(*ideal[:4], step=step, param_copies=ideal[4], **hyper)
    return out, kernel, ref, ideal


def check_all(kernel, ref, ideal):
    """fp32 results match the reference to fp32 rounding. Low-precision state
    that is rounded every step may flip roundings differently and compound,
    so there the kernel's error against the fp32 ideal must be at most twice
    the same-dtype reference's, in max and in RMS (flash-attention's method)."""
    names = ("param", "grad", "exp_avg", "exp_avg_sq", "copy")
    for name, ks, rs, ids in zip(names, kernel, ref, ideal):
        for i, (k, r, ide) in enumerate(zip(ks or [], rs or [], ids or [])):
            what = f"{name} {i} (numel {k.numel()}, {k.dtype})"
            assert k.dtype == r.dtype, what
            if k.dtype == torch.float32 or name in ("grad", "copy") or k.numel() == 0:
                assert_close(k, r, msg=what)
                continue
            err_k, err_r = (k.float() - ide).abs(), (r.float() - ide).abs()
            assert err_k.max() <= 2 * err_r.max() + 1e-6, f"{what}: max error {err_k.max()} vs torch {err_r.max()}"
            rms_k, rms_r = err_k.pow(2).mean().sqrt(), err_r.pow(2).mean().sqrt()
            assert rms_k <= 2 * rms_r + 1e-7, f"{what}: RMS error {rms_k} vs torch {rms_r}"
