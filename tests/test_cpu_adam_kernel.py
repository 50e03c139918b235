"""The functional CPU Adam kernel against the plain-PyTorch reference, on
every ISA path, dtype combination and awkward size."""

import pytest
import torch

from fastzero.ops import cpu_adam_step, reference
from fastzero.ops.reference.tolerances import assert_close

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


def clone_all(tensors):
    return [None if t is None else [x.clone() for x in t] for t in tensors]


def run_both(sizes, combo, steps=7, **hyper):
    """The kernel, the reference in the same dtypes, and the reference in
    fp32 storage (the ideal that low-precision storage approximates)."""
    kernel = make_tensors(sizes, *combo)
    ref = clone_all(kernel)
    ideal = [None if t is None else [x.to(torch.float32, copy=True) for x in t] for t in kernel]
    for step in range(1, steps + 1):
        if step > 1:  # fresh random grads every step
            for a, b, c in zip(kernel[1], ref[1], ideal[1]):
                a.copy_(torch.randn(a.shape).to(a.dtype))
                b.copy_(a)
                c.copy_(a)
        backend = cpu_adam_step(*kernel[:4], step=step, param_copies=kernel[4], **hyper)
        reference.adam_step(*ref[:4], step=step, param_copies=ref[4], **hyper)
        reference.adam_step(*ideal[:4], step=step, param_copies=ideal[4], **hyper)
    return backend, kernel, ref, ideal


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


HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(str(d).split(".")[-1] if d else "none" for d in c))
def test_every_dtype_combo_every_size(isa, seeded, combo):
    backend, kernel, ref, ideal = run_both(SIZES, combo, **HYPER)
    assert backend == f"cpu:{isa}"
    check_all(kernel, ref, ideal)


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("grad_scale", [None, 1024.0, 3.7])
def test_modes_and_grad_scale(isa, seeded, adamw_mode, bias_correction, grad_scale):
    hyper = dict(HYPER, adamw_mode=adamw_mode, bias_correction=bias_correction, grad_scale=grad_scale)
    _, kernel, ref, ideal = run_both([17, 1023, 4099], (F32, F32, F32, None), **hyper)
    check_all(kernel, ref, ideal)


def test_ragged_tensor_list_with_empty_tensor(isa, seeded):
    sizes = [0, 1, 5, 64, 333, 70001, 0, 129, 200003]  # crosses thread split points
    _, kernel, ref, ideal = run_both(sizes, (F32, BF16, F32, BF16), **HYPER)
    check_all(kernel, ref, ideal)


@pytest.mark.parametrize("c_dtype", [BF16, F16])
def test_low_precision_copy_rounds_exactly_like_torch(isa, seeded, c_dtype):
    """lr=0 leaves the fp32 master unchanged, so the copy must equal
    master.to(dtype) bit for bit: round to nearest even, subnormals, overflow."""
    special = torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, -70000.0, 6e-8, 3e-8, 1e-5, 3e38, float("inf")])
    master = torch.cat([torch.randn(100003) * torch.logspace(-9, 5, 100003), special])
    copy = torch.empty_like(master, dtype=c_dtype)
    m, v = torch.randn_like(master), torch.rand_like(master)
    cpu_adam_step([master], [torch.randn_like(master)], [m], [v], step=3, lr=0.0, beta1=0.9, beta2=0.999,
                  eps=1e-8, param_copies=[copy])  # fmt: skip
    assert torch.equal(copy.view(torch.int16), master.to(c_dtype).view(torch.int16))


@pytest.mark.parametrize("p_dtype", [BF16, F16])
def test_low_precision_params_round_trip_exactly(isa, seeded, p_dtype):
    """With lr=0 every bf16/fp16 param value, subnormals included, survives
    the kernel's load, fp32 math and rounding store unchanged."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    p = bits.view(p_dtype).clone()
    p = p[torch.isfinite(p.float())]
    before = p.clone()
    g = torch.randn(p.shape)
    cpu_adam_step([p], [g], [torch.zeros(p.shape)], [torch.zeros(p.shape)], step=1, lr=0.0, beta1=0.9,
                  beta2=0.999, eps=1e-8)  # fmt: skip
    assert torch.equal(p, before)  # value-exact (the sign of a zero may flip: -0 - 0*x, as in torch)


def test_isa_paths_agree(seeded, monkeypatch):
    """Every ISA path computes the same numbers (to fp32 rounding: only the
    scalar path may round a multiply-add in two steps)."""
    from fastzero.ops import native

    isas = native.supported_isas()
    if len(isas) < 2:
        pytest.skip(f"only {isas} on this CPU")
    base = make_tensors([100003], F32, BF16, F32, BF16)
    results = {}
    for name in isas:
        monkeypatch.setenv("FASTZERO_CPU_ISA", name)
        t = clone_all(base)
        for step in (1, 2, 3):
            cpu_adam_step(*t[:4], step=step, param_copies=t[4], **HYPER)
        results[name] = t
    best = results[isas[-1]]
    for name in isas[:-1]:
        for a, b in zip(sum(results[name], []), sum(best, [])):
            assert_close(a, b, msg=f"{name} against {isas[-1]}")


def test_thread_count_does_not_change_results(isa, seeded):
    base = make_tensors([3, 100003, 77777], F32, F32, F32, None)
    out = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            t = clone_all(base)
            cpu_adam_step(*t[:4], step=1, **HYPER)
            out.append(t)
    finally:
        torch.set_num_threads(old)
    for t in out[1:]:
        for a, b in zip(t[0] + t[2] + t[3], out[0][0] + out[0][2] + out[0][3]):
            assert torch.equal(a, b)
