"""bf16 params without an fp32 master, written with stochastic rounding
(bf16_stochastic_round=True): the CPU kernel equals the reference to the bit
with every state format, ISA path and thread count; the rounding is unbiased,
so updates below half a bf16 ulp still move a param on average (round to
nearest leaves it where it is); the optimizers' arguments and refusals."""

import pytest
import torch

from fastzero.ops import CPUAdam, FusedAdam, cpu_adam_step
from fastzero.ops.adam import int8_codes, reference
from tests.helpers import make_model, train

F32, BF16, U8 = torch.float32, torch.bfloat16, torch.uint8
SIZES = [1, 7, 17, 255, 257, 4099, 100003]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)


def states(fmt: str, n: int) -> dict:
    if fmt == "int8":
        blocks = int8_codes.blocks_of(n, 256)
        return dict(
            m=torch.zeros(n, dtype=U8),
            v=torch.zeros(n, dtype=U8),
            kw=dict(
                state_format="int8",
                exp_avg_absmax=[torch.zeros(blocks)],
                exp_avg_sq_absmax=[torch.zeros(blocks)],
            ),
        )
    dtype = {"fp32": F32, "bf16": BF16, "param_dtype": BF16}[fmt]
    kw = {"state_format": fmt} if fmt != "param_dtype" else {}
    return dict(m=(0.1 * torch.randn(n)).to(dtype), v=(0.01 * torch.rand(n)).to(dtype), kw=kw)


def run(step_fn, p, g, st, step, seed):
    step_fn([p], [g], [st["m"]], [st["v"]], step=step, bf16_stochastic_round=True, seed=seed, **st["kw"], **HYPER)


def same_bits(a, b):
    if a.dtype == U8:
        return torch.equal(a, b)
    view = torch.int16 if a.dtype == BF16 else torch.int32
    return torch.equal(a.view(view), b.view(view))


def clone_state(st):
    kw = {k: ([t.clone() for t in v] if isinstance(v, list) else v) for k, v in st["kw"].items()}
    return dict(m=st["m"].clone(), v=st["v"].clone(), kw=kw)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "param_dtype", "int8"])
def test_cpu_kernel_equals_reference_to_the_bit(isa, seeded, fmt):
    for n in SIZES:
        p = torch.randn(n).to(BF16)
        st = states(fmt, n)
        p_ref, st_ref = p.clone(), clone_state(st)
        for step in range(1, 5):
            g = torch.randn(n)
            run(cpu_adam_step, p, g, st, step, seed=11)
            run(reference.adam_step, p_ref, g, st_ref, step, seed=11)
        assert same_bits(p, p_ref), (fmt, n)
        assert same_bits(st["m"], st_ref["m"]) and same_bits(st["v"], st_ref["v"]), (fmt, n)
        for key in ("exp_avg_absmax", "exp_avg_sq_absmax"):
            if key in st["kw"]:
                assert same_bits(st["kw"][key][0], st_ref["kw"][key][0])


def test_threads_and_chunks_give_the_same_bits(isa, seeded):
    n = (1 << 18) * 2 + 77
    base, g = torch.randn(n).to(BF16), torch.randn(n)
    out = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            p, st = base.clone(), states("fp32", n)
            torch.manual_seed(0)
            st = dict(m=torch.zeros(n), v=torch.zeros(n), kw={"state_format": "fp32"})
            run(cpu_adam_step, p, g, st, 1, seed=3)
            out.append(p)
    finally:
        torch.set_num_threads(old)
    assert same_bits(out[0], out[1])


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_tiny_updates_move_params_on_average_where_nearest_leaves_them(isa, backend):
    """p = 1 (bf16 ulp 2^-7) and a step of 1e-4, 1.3% of an ulp: round to
    nearest leaves every param at 1, stochastic rounding moves each by an ulp
    with probability 0.013, so the mean over many elements is the fp32 step
    within a few standard deviations."""
    n = 200_000
    g = torch.ones(n)
    fp32_step = None
    for sr in (False, True):
        p = torch.ones(n, dtype=BF16)
        m, v = torch.zeros(n), torch.zeros(n)
        kw = dict(step=1, lr=1e-4, beta1=0.0, beta2=0.0, eps=0.0, state_format="fp32", backend=backend)
        cpu_adam_step([p], [g], [m], [v], bf16_stochastic_round=sr, seed=5 if sr else None, **kw)
        moved = (1.0 - p.double()).mean().item()
        if not sr:
            assert moved == 0.0  # nearest: every update is lost
        else:
            fp32_step = 1e-4
            ulp = 2.0**-8  # the next bf16 below 1 is 1 - 2^-8
            f = fp32_step / ulp
            sigma = ulp * (f * (1 - f) / n) ** 0.5
            assert abs(moved - fp32_step) <= 5 * sigma, (moved, fp32_step, sigma)
            assert set(p.float().unique().tolist()) == {1.0 - ulp, 1.0}


def test_fp32_params_in_the_same_call_are_written_as_without_it(isa, seeded):
    p32, p16, g32, g16 = torch.randn(1000), torch.randn(1000).to(BF16), torch.randn(1000), torch.randn(1000)
    ms = [torch.zeros(1000), torch.zeros(1000)]
    vs = [torch.zeros(1000), torch.zeros(1000)]
    want = p32.clone()
    cpu_adam_step([want], [g32], [torch.zeros(1000)], [torch.zeros(1000)], step=1, **HYPER)
    cpu_adam_step([p32, p16], [g32, g16], ms, vs, step=1, bf16_stochastic_round=True, **HYPER)
    assert same_bits(p32, want)


@pytest.mark.parametrize("cls", [CPUAdam, FusedAdam])
def test_optimizer_writes_bf16_params_stochastically(isa, seeded, cls):
    model = make_model(BF16)
    params = [p.detach().clone() for p in model.parameters()]
    opt = cls(model.parameters(), lr=1e-2, bf16_stochastic_round=True, seed=9, state_format="bf16")
    assert opt.bf16_stochastic_round and opt.seed == 9
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    for step in range(1, 4):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        opt.step()
        reference.adam_step(
            params, grads, ms, vs, step=step, lr=1e-2, state_format="bf16", seed=9, bf16_stochastic_round=True
        )
    for p, q in zip(model.parameters(), params):
        assert same_bits(p.detach(), q)
    assert opt.state_dict()["state_format"]["seed"] == 9
    again = cls(model.parameters(), lr=1e-2, bf16_stochastic_round=True)
    again.load_state_dict(opt.state_dict())
    assert again.seed == 9  # the run goes on with the same random bits


def test_refusals():
    model = make_model(BF16)
    with pytest.raises(ValueError, match="master_weights=True keeps one"):
        FusedAdam(model.parameters(), bf16_stochastic_round=True, master_weights=True)
    with pytest.raises(ValueError, match="only state_format='bf16', 'int8'\\s+and\\s+bf16_stochastic_round"):
        CPUAdam(model.parameters(), seed=3)
    with pytest.raises(TypeError, match="True or False"):
        CPUAdam(model.parameters(), bf16_stochastic_round="yes")
    CPUAdam(model.parameters(), bf16_stochastic_round=True, seed=3)


def test_bf16_params_train_with_stochastic_rounding(isa, seeded):
    model = make_model(BF16)
    opt = CPUAdam(model.parameters(), lr=1e-3, bf16_stochastic_round=True)
    before = [p.detach().clone() for p in model.parameters()]
    train(model, opt, 5)
    assert all(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
