"""The CUDA Adam kernel with bf16 states written by stochastic rounding
(state_format="bf16") against the reference (run on CPU copies), to the bit.
Needs a GPU (``pytest -m gpu``); without one, tests/ops/test_cuda_backend.py
compiles the source for sm_80 and sm_90 and checks the C entry's arguments.

The per-step constants come from fp64 on the device (libdevice's pow) and on
the host (glibc's) for the reference: they agree after rounding to fp32
except with a probability of about 1e-9 per constant, which these fixed
hyperparameters and steps do not meet."""

import pytest
import torch

from fastzero.ops import FusedAdam
from fastzero.ops.adam import cuda as adam_cuda
from fastzero.ops.adam import reference
from tests.helpers import make_model, train
from tests.ops.adam.test_bf16_states import assert_same_bits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SIZES = [0, 1, 7, 17, 1023, 4099, 65536, (1 << 20) + 3]  # vector tails, one chunk, many chunks plus a ragged one
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
COMBOS = [(F32, F32, None), (F32, BF16, BF16), (F32, F16, F16), (BF16, BF16, None), (F16, F32, None)]


def run(sizes, combo, steps=7, grad_scale=None, unaligned=False, seed=9, **hyper):
    p_dt, g_dt, c_dt = combo

    def new(x, dtype):
        x = x.to("cuda", dtype)
        return torch.cat([torch.zeros(1, dtype=dtype, device="cuda"), x])[1:] if unaligned else x

    kernel = [
        [new(torch.randn(n), p_dt) for n in sizes],
        [new(torch.randn(n), g_dt) for n in sizes],
        [new(0.1 * torch.randn(n), BF16) for n in sizes],
        [new(0.01 * torch.rand(n), BF16) for n in sizes],
        None if c_dt is None else [new(torch.zeros(n), c_dt) for n in sizes],
    ]
    ref = [None if t is None else [x.cpu().clone() for x in t] for t in kernel]
    for step in range(1, steps + 1):
        if step > 1:
            for a, b in zip(kernel[1], ref[1]):
                a.copy_(torch.randn(a.shape, device="cuda").to(a.dtype))
                b.copy_(a.cpu())
        scale = None if grad_scale is None else torch.tensor(grad_scale, device="cuda")
        t = torch.tensor(float(step), device="cuda")
        adam_cuda.adam_step(
            *kernel[:4], step=t, grad_scale=scale, param_copies=kernel[4], state_format="bf16", seed=seed, **hyper
        )
        reference.adam_step(
            *ref[:4], step=step, grad_scale=grad_scale, param_copies=ref[4], state_format="bf16", seed=seed, **hyper
        )
    torch.cuda.synchronize()
    for name, ks, rs in zip(("param", "grad", "exp_avg", "exp_avg_sq", "copy"), kernel, ref):
        for i, (k, r) in enumerate(zip(ks or [], rs or [])):
            assert_same_bits(k.cpu(), r, f"{name} {i} (numel {k.numel()}, {k.dtype})")


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(str(d).split(".")[-1] if d else "none" for d in c))
def test_every_combo_every_size_to_the_bit(combo):
    torch.manual_seed(1)
    run(SIZES, combo, **HYPER)


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("grad_scale", [None, 3.7])
def test_modes_grad_scale_and_unaligned_views(adamw_mode, grad_scale):
    torch.manual_seed(2)
    run([17, 70001], (F32, BF16, BF16), grad_scale=grad_scale, unaligned=True, adamw_mode=adamw_mode, **HYPER)


def test_found_inf_changes_nothing():
    p = torch.randn(4099, device="cuda")
    m, v = torch.zeros_like(p, dtype=BF16), torch.zeros_like(p, dtype=BF16)
    before = [p.clone(), m.clone(), v.clone()]
    adam_cuda.adam_step(
        [p],
        [torch.randn_like(p)],
        [m],
        [v],
        step=torch.tensor(1.0, device="cuda"),
        found_inf=torch.tensor(1.0, device="cuda"),
        state_format="bf16",
        **HYPER,
    )
    for a, b in zip((p, m, v), before):
        assert torch.equal(a, b)


def test_fused_adam_on_a_gpu_equals_its_cpu_path_to_the_bit():
    a, b = make_model().cuda(), make_model()
    opt_gpu = FusedAdam(a.parameters(), lr=1e-2, state_format="bf16", seed=4)
    opt_cpu = FusedAdam(b.parameters(), lr=1e-2, state_format="bf16", seed=4)
    train(a, opt_gpu, 4)
    train(b, opt_cpu, 4)
    assert opt_gpu.last_backend == "cuda"
    for p, q in zip(a.parameters(), b.parameters()):
        assert_same_bits(p.detach().cpu(), q.detach(), "param")
        for key in ("exp_avg", "exp_avg_sq"):
            assert_same_bits(opt_gpu.state[p][key].cpu(), opt_cpu.state[q][key], key)
