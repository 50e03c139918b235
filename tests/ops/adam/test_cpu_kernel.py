"""The functional CPU Adam kernel against the plain-PyTorch reference, on
every ISA path, dtype combination and awkward size."""

import pytest
import torch

from fastzero.ops import cpu_adam_step, reference
from fastzero.ops.tolerances import assert_close
from tests.kernel_checks import BF16, COMBOS, F16, F32, SIZES, check_all, clone_all, make_tensors, run_both

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(str(d).split(".")[-1] if d else "none" for d in c))
def test_every_dtype_combo_every_size(isa, seeded, combo):
    backend, kernel, ref, ideal = run_both(cpu_adam_step, reference.adam_step, SIZES, combo, **HYPER)
    assert backend == f"cpu:{isa}"
    check_all(kernel, ref, ideal)


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("grad_scale", [None, 1024.0, 3.7])
def test_modes_and_grad_scale(isa, seeded, adamw_mode, bias_correction, grad_scale):
    hyper = dict(HYPER, adamw_mode=adamw_mode, bias_correction=bias_correction, grad_scale=grad_scale)
    _, kernel, ref, ideal = run_both(
        cpu_adam_step, reference.adam_step, [17, 1023, 4099], (F32, F32, F32, None), **hyper
    )
    check_all(kernel, ref, ideal)


def test_ragged_tensor_list_with_empty_tensor(isa, seeded):
    sizes = [0, 1, 5, 64, 333, 70001, 0, 129, 200003]  # crosses thread split points
    _, kernel, ref, ideal = run_both(cpu_adam_step, reference.adam_step, sizes, (F32, BF16, F32, BF16), **HYPER)
    check_all(kernel, ref, ideal)


@pytest.mark.parametrize("c_dtype", [BF16, F16])
def test_low_precision_copy_rounds_exactly_like_torch(isa, seeded, c_dtype):
    """lr=0 leaves the fp32 master unchanged, so the copy must equal
    master.to(dtype) bit for bit: round to nearest even, subnormals, overflow."""
    special = torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, -70000.0, 6e-8, 3e-8, 1e-5, 3e38, float("inf")])
    master = torch.cat([torch.randn(100003) * torch.logspace(-9, 5, 100003), special])
    copy = torch.empty_like(master, dtype=c_dtype)
    m, v = torch.randn_like(master), torch.rand_like(master)
    cpu_adam_step(
        [master],
        [torch.randn_like(master)],
        [m],
        [v],
        step=3,
        lr=0.0,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        param_copies=[copy],
    )
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
    cpu_adam_step(
        [p], [g], [torch.zeros(p.shape)], [torch.zeros(p.shape)], step=1, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8
    )
    assert torch.equal(p, before)  # value-exact (the sign of a zero may flip: -0 - 0*x, as in torch)


def test_isa_paths_agree(seeded, monkeypatch):
    """Every ISA path computes the same numbers (to fp32 rounding: only the
    scalar path may round a multiply-add in two steps)."""
    from fastzero import native

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
