"""The functional CPU LAMB kernel against the plain-PyTorch reference, on
every ISA path, dtype combination and awkward size."""

import pytest
import torch

from fastzero.ops import cpu_lamb_step, reference
from tests.kernel_checks import COMBOS, F32, SIZES, check_all, run_both

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(str(d).split(".")[-1] if d else "none" for d in c))
def test_every_dtype_combo_every_size(isa, seeded, combo):
    ratios, kernel, ref, ideal = run_both(cpu_lamb_step, reference.lamb_step, SIZES, combo, **HYPER)
    check_all(kernel, ref, ideal)


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0, 1e9])
@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("grad_scale", [None, 512.0])
def test_modes(isa, seeded, max_grad_norm, eps_inside_sqrt, bias_correction, grad_scale):
    hyper = dict(
        HYPER,
        max_grad_norm=max_grad_norm,
        eps_inside_sqrt=eps_inside_sqrt,
        bias_correction=bias_correction,
        grad_scale=grad_scale,
    )
    sizes, combo = [17, 1023, 70001], (F32, F32, F32, None)
    ratios, kernel, ref, ideal = run_both(cpu_lamb_step, reference.lamb_step, sizes, combo, **hyper)
    check_all(kernel, ref, ideal)
    # the trust ratios of the last step, against the reference's from the same state
    p, g, m, v, _ = [None if t is None else [x.clone() for x in t] for t in ref]
    expected = reference.lamb_step(p, g, m, v, step=8, **hyper)
    got = cpu_lamb_step(*[[x.clone() for x in t] for t in ref[:4]], step=8, **hyper)
    assert got == pytest.approx(expected, rel=1e-5)


def test_trust_ratio_bounds_and_zero_norms(isa):
    params = [torch.zeros(100), torch.randn(1000), torch.randn(1000) * 100]
    grads = [torch.randn(100), torch.randn(1000), torch.randn(1000) * 1e-3]
    states = [[torch.zeros(t.shape) for t in params] for _ in range(2)]
    ratios = cpu_lamb_step(
        params, grads, *states, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, max_coeff=2.0, min_coeff=0.5
    )
    assert ratios[0] == 1.0  # ||p|| = 0
    assert all(0.5 <= r <= 2.0 for r in ratios)


def test_clipping_uses_the_global_norm_over_all_tensors(isa):
    """The clip factor comes from the norm of all grads together: scaling one
    tensor's grad changes every tensor's update."""
    torch.manual_seed(0)
    base = [torch.randn(500) for _ in range(2)]
    grads_small = [torch.randn(500) for _ in range(2)]
    grads_big = [grads_small[0], grads_small[1] * 100]
    out = []
    for grads in (grads_small, grads_big):
        params = [b.clone() for b in base]
        m, v = [torch.zeros(500) for _ in range(2)], [torch.zeros(500) for _ in range(2)]
        cpu_lamb_step(params, grads, m, v, step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, max_grad_norm=1.0)
        out.append(m[0])
    assert not torch.allclose(out[0], out[1])  # tensor 0's momentum saw tensor 1's norm
