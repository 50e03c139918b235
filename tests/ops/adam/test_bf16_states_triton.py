"""The Triton Adam kernel with bf16 states written by stochastic rounding
(state_format="bf16") against the reference, to the bit. Without a GPU it runs
on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py), the same multi-tensor code path a GPU runs."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from fastzero.ops import FusedAdam  # noqa: E402
from fastzero.ops.adam import AdamHyperparams, reference  # noqa: E402
from fastzero.triton_kernels import adam  # noqa: E402
from tests.helpers import make_model, train  # noqa: E402
from tests.ops.adam.test_bf16_states import assert_same_bits, bits  # noqa: E402

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [0, 1, 7, 17, 1023, 2048, 4099]  # the interpreter's 2048-element items and 1024-element blocks, tails
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
# (param, grad, copy) of one call: one launch per combination
MIXED = [(F32, BF16, None), (BF16, BF16, None), (F16, F32, None), (BF16, F32, None)]
WITH_COPY = [(F32, BF16, BF16), (F32, F32, F16), (F32, F16, BF16)]


def make(sizes, combos):
    out = [[], [], [], [], []]
    for i, n in enumerate(sizes):
        p, g, c = combos[i % len(combos)]
        out[0].append(torch.randn(n).to(DEVICE, p))
        out[1].append(torch.randn(n).to(DEVICE, g))
        out[2].append((0.1 * torch.randn(n)).to(DEVICE, BF16))
        out[3].append((0.01 * torch.rand(n)).to(DEVICE, BF16))
        out[4].append(None if c is None else torch.zeros(n, device=DEVICE, dtype=c))
    out[4] = None if out[4][0] is None else out[4]
    return out


def run(combos, sizes=SIZES, steps=7, grad_scale=None, seed=3, **hyper):
    kernel = make(sizes, combos)
    ref = [None if t is None else [x.cpu().clone() for x in t] for t in kernel]
    hp = AdamHyperparams(**{k: v for k, v in hyper.items()})
    for step in range(1, steps + 1):
        if step > 1:
            for a, b in zip(kernel[1], ref[1]):
                a.copy_(torch.randn(a.shape).to(a.dtype))
                b.copy_(a.cpu())
        scale = None if grad_scale is None else torch.tensor(grad_scale, device=DEVICE)
        adam.adam_step(
            *kernel[:4],
            step=torch.tensor(float(step), device=DEVICE),
            hp=hp,
            grad_scale=scale,
            found_inf=torch.tensor(0.0, device=DEVICE),
            param_copies=kernel[4],
            state_format="bf16",
            seed=seed,
        )
        reference.adam_step(
            *ref[:4], step=step, hp=hp, grad_scale=grad_scale, param_copies=ref[4], state_format="bf16", seed=seed
        )
    for name, ks, rs in zip(("param", "grad", "exp_avg", "exp_avg_sq", "copy"), kernel, ref):
        for i, (k, r) in enumerate(zip(ks or [], rs or [])):
            assert_same_bits(k.cpu(), r, f"{name} {i} (numel {k.numel()}, {k.dtype})")


def test_mixed_dtypes_ragged_sizes_to_the_bit():
    run(MIXED, **HYPER)


def test_fp32_masters_with_copies_to_the_bit():
    run(WITH_COPY, **HYPER)


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("grad_scale", [None, 3.7])
def test_modes_and_grad_scale_to_the_bit(adamw_mode, bias_correction, grad_scale):
    run(
        MIXED[:2],
        sizes=[5, 2049],
        steps=4,
        grad_scale=grad_scale,
        adamw_mode=adamw_mode,
        bias_correction=bias_correction,
        **{k: v for k, v in HYPER.items()},
    )


def test_found_inf_changes_nothing():
    t = make([17, 2049], MIXED)
    before = [[x.clone() for x in lst] for lst in t[:4]]
    adam.adam_step(
        *t[:4],
        step=torch.tensor(1.0, device=DEVICE),
        hp=AdamHyperparams(**HYPER),
        found_inf=torch.tensor(1.0, device=DEVICE),
        state_format="bf16",
    )
    for a, b in zip(sum(t[:4], []), sum(before, [])):
        assert torch.equal(bits(a), bits(b))


def test_fused_adam_through_triton_equals_its_cpu_path_to_the_bit():
    """The optimizer drives the Triton kernel (a device step counter) and the
    CPU kernel (an int) to the same bits: one rule, one key."""
    a, b = make_model(), make_model()
    opt_triton = FusedAdam(a.parameters(), lr=1e-2, state_format="bf16", seed=17, backend="triton")
    opt_cpu = FusedAdam(b.parameters(), lr=1e-2, state_format="bf16", seed=17, backend="cpu")
    train(a, opt_triton, 4)
    train(b, opt_cpu, 4)
    assert opt_triton.last_backend == "triton" and opt_cpu.last_backend == "cpu"
    for p, q in zip(a.parameters(), b.parameters()):
        assert_same_bits(p.detach(), q.detach(), "param")
        for key in ("exp_avg", "exp_avg_sq"):
            assert_same_bits(opt_triton.state[p][key], opt_cpu.state[q][key], key)


def test_bad_format_arguments_are_refused():
    t = make([8], [(F32, F32, None)])
    kw = dict(step=torch.tensor(1.0, device=DEVICE), hp=AdamHyperparams())
    with pytest.raises(TypeError, match="must be bfloat16"):
        adam.adam_step(t[0], t[1], [t[2][0].float()], [t[3][0].float()], state_format="bf16", **kw)
    with pytest.raises(ValueError, match="only state_format='bf16'"):
        adam.adam_step(*t[:4], seed=1, **kw)
