"""bf16 optimizer states written with stochastic rounding (state_format="bf16"):
the rule (fastzero/ops/adam/reference.py) against an element-by-element
statement of it, the CPU kernel against the reference to the bit on every ISA
path, thread count and awkward size, the rounding's bias, special values,
found_inf, state dicts across formats, and bad input."""

import logging
import math
import struct

import pytest
import torch

from fastzero import native
from fastzero.ops import CPUAdam, FusedAdam, FusedLamb, cpu_adam_step
from fastzero.ops.adam import AdamHyperparams, reference
from fastzero.ops.optimizer_base import resolve_state_format
from tests.helpers import make_model, train

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SIZES = [1, 7, 15, 16, 17, 31, 1023, 100003]  # every SIMD tail of 8 and 16 lanes, primes
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
STEPS = 7  # as PyTorch's optimizer tests


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == F32 else t.view(torch.int16)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit for bit, except that NaNs compare equal whatever their payloads
    (fp32 params: the order of operations picks which NaN propagates)."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    same = bits(a) == bits(b)
    if a.dtype == F32:
        same |= torch.isnan(a) & torch.isnan(b)
    bad = (~same).nonzero().flatten()
    if bad.numel():
        i = bad[0].item()
        raise AssertionError(f"{what}: {bad.numel()} of {a.numel()} differ; first at {i}: {a[i]} vs {b[i]}")


def make(sizes, p_dtype, g_dtype, copies=None, scale=1.0):
    params = [torch.randn(n).to(p_dtype) for n in sizes]
    grads = [(scale * torch.randn(n)).to(g_dtype) for n in sizes]
    exp_avgs = [(0.1 * torch.randn(n)).bfloat16() for n in sizes]
    exp_avg_sqs = [(0.01 * torch.rand(n)).bfloat16() for n in sizes]
    cps = None if copies is None else [torch.zeros(n, dtype=copies) for n in sizes]
    return [params, grads, exp_avgs, exp_avg_sqs, cps]


def clone(ts):
    return [None if t is None else [x.clone() for x in t] for t in ts]


def run_steps(kernel_step, tensors, steps=STEPS, *, seed=7, grad_scale=None, fresh_grads=True, **hyper):
    """Steps of kernel_step and of the reference from the same tensors (fresh
    grads every step); returns both sets."""
    ref = clone(tensors)
    for step in range(1, steps + 1):
        if step > 1 and fresh_grads:
            for a, b in zip(tensors[1], ref[1]):
                a.copy_(torch.randn(a.shape).to(a.dtype))
                b.copy_(a)
        kw = dict(step=step, grad_scale=grad_scale, state_format="bf16", seed=seed, **hyper)
        kernel_step(*tensors[:4], param_copies=tensors[4], **kw)
        reference.adam_step(*ref[:4], param_copies=ref[4], **kw)
    return tensors, ref


def check_same(kernel, ref):
    for name, ks, rs in zip(("param", "grad", "exp_avg", "exp_avg_sq", "copy"), kernel, ref):
        for i, (k, r) in enumerate(zip(ks or [], rs or [])):
            assert_same_bits(k, r, f"{name} {i} (numel {k.numel()}, {k.dtype})")


# -- the rule ---------------------------------------------------------------------------------------


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def _sr_one(x: float, seed: int, step: int, i: int, which: int) -> int:
    """The rule for one element, in Python integers: the bf16 bit pattern."""
    stream = _fmix32(_fmix32(seed) ^ (step & 0xFFFFFFFF))
    key = _fmix32((stream + 0x9E3779B9 * (i >> 32)) & 0xFFFFFFFF)
    h = _fmix32((i & 0xFFFFFFFF) ^ key)
    r = h & 0xFFFF if which == 0 else h >> 16
    if math.isnan(x):
        return 0x7FC0
    (b,) = struct.unpack("<I", struct.pack("<f", x))
    return (b + r) >> 16


def test_reference_rule_matches_its_statement_element_by_element():
    torch.manual_seed(0)
    index = torch.tensor([0, 1, 2, 1000, (1 << 32) - 1, 1 << 32, (1 << 32) + 5, (3 << 33) + 17], dtype=torch.int64)
    x = torch.randn(index.numel()) * torch.logspace(-40, 38, index.numel())
    x[2] = float("nan")
    for seed, step in [(0, 1), (12345, 7), (2**32 - 1, 2**32 + 3)]:
        r_m, r_v = reference.sr_bits(seed, step, index)
        for which, r in enumerate((r_m, r_v)):
            got = reference.round_bf16_stochastic(x, r).view(torch.int16).int() & 0xFFFF
            want = [_sr_one(float(x[k]), seed, step, int(index[k]), which) for k in range(index.numel())]
            assert got.tolist() == want


# -- the CPU kernel against the reference, to the bit --------------------------------------------------


@pytest.mark.parametrize(
    "p_dtype,g_dtype,copies",
    [
        (F32, F32, None),
        (F32, BF16, BF16),
        (F32, F16, F16),
        (F32, F32, BF16),
        (BF16, BF16, None),
        (BF16, F32, None),
        (F16, F16, None),
        (F16, BF16, None),
    ],
    ids=lambda d: str(d).removeprefix("torch.") if d is not None else "none",
)
def test_cpu_kernel_equals_reference_to_the_bit(isa, seeded, p_dtype, g_dtype, copies):
    kernel, ref = run_steps(cpu_adam_step, make(SIZES, p_dtype, g_dtype, copies), **HYPER)
    check_same(kernel, ref)
    assert cpu_adam_step(*kernel[:4], param_copies=kernel[4], step=8, state_format="bf16") == f"cpu:{isa}"


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("grad_scale", [None, 1024.0, 3.7])
def test_modes_and_grad_scale_to_the_bit(isa, seeded, adamw_mode, bias_correction, grad_scale):
    hyper = dict(HYPER, adamw_mode=adamw_mode, bias_correction=bias_correction)
    tensors = make([17, 1023, 4099], F32, BF16, BF16, scale=grad_scale or 1.0)
    check_same(*run_steps(cpu_adam_step, tensors, grad_scale=grad_scale, **hyper))


def test_ragged_list_across_chunks_and_threads(isa, seeded):
    """Sizes 0 and ones that cross the kernels' 2^18-element chunks: every
    thread count gives the reference's bits (the bits key on each element's
    index in its tensor, never on the chunk or thread that wrote it)."""
    sizes = [0, 1, 5, 64, 333, 70001, 0, 129, (1 << 18) + 5, 200003]
    base = make(sizes, F32, BF16, BF16)
    results = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            torch.manual_seed(5)  # the same fresh grads for every thread count
            kernel, ref = run_steps(cpu_adam_step, clone(base), steps=3, **HYPER)
            check_same(kernel, ref)
            results.append(kernel)
    finally:
        torch.set_num_threads(old)
    for other in results[1:]:
        check_same(other, results[0])


def test_every_isa_path_gives_the_same_bits(seeded, monkeypatch):
    isas = native.supported_isas()
    if not isas:
        pytest.skip(f"native CPU kernels unavailable: {native.cpu_ops_error()}")
    base = make([100003, 31], F32, BF16, BF16)
    out = {}
    for name in isas:
        monkeypatch.setenv("FASTZERO_CPU_ISA", name)
        torch.manual_seed(9)
        out[name], _ = run_steps(cpu_adam_step, clone(base), steps=3, **HYPER)
    for name in isas[1:]:
        check_same(out[name], out[isas[0]])


def test_seed_and_step_change_the_bits_the_same_seed_repeats_them(isa, seeded):
    base = make([4099], F32, F32)
    runs = {}
    for seed in (0, 0, 1):
        t = clone(base)
        cpu_adam_step(*t[:4], step=3, state_format="bf16", seed=seed, **HYPER)
        runs.setdefault(seed, []).append(t)
    assert torch.equal(bits(runs[0][0][2][0]), bits(runs[0][1][2][0]))
    differ = (bits(runs[0][0][2][0]) != bits(runs[1][0][2][0])).float().mean()
    assert 0.2 < differ < 0.8  # about half the roundings go the other way


# -- the rounding's bias --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_stochastic_rounding_is_unbiased(isa, backend):
    """With beta1 = beta2 = 0 and lr = 0 the kernel writes exp_avg = SR(g) and
    exp_avg_sq = SR(g*g). Over 1500 seeds the mean of each rounding is the
    fp32 value within 6 standard deviations of the mean of two-point draws
    (ulp * sqrt(f (1 - f) / n), f the value's fraction of a bf16 ulp)."""
    torch.manual_seed(3)
    n, seeds = 512, 1500
    g = torch.randn(n) * torch.logspace(-3, 3, n)
    g[:4] = torch.tensor(
        [1.0 + 2**-9, 1.0 + 2**-8 - 2**-20, -3.0 - 2**-12, 1e-40]
    )  # fractions near 1/2, 1, 0; a subnormal
    sums = [torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)]
    for seed in range(seeds):
        p, m, v = torch.zeros(n), torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16)
        cpu_adam_step(
            [p], [g], [m], [v], step=1, lr=0.0, beta1=0.0, beta2=0.0, state_format="bf16", seed=seed, backend=backend
        )
        sums[0] += m.double()
        sums[1] += v.double()
    for x, total in zip((g, g * g), sums):
        xb = x.contiguous().view(torch.int32)
        lo = (xb & ~0xFFFF).view(F32).double()  # truncated: the neighbour toward zero
        hi = ((xb | 0xFFFF) + 1).view(F32).double()  # the next bf16 pattern away from zero
        f = (x.double() - lo) / (hi - lo)  # the probability of rounding away from zero
        sigma = (hi - lo).abs() * torch.sqrt(f * (1 - f) / seeds)
        err = (total / seeds - x.double()).abs()
        assert bool((err <= 6 * sigma).all()), float((err / sigma.clamp_min(1e-300)).max())
        assert bool((err[f == 0] == 0).all())  # a bf16 value is never moved


# -- special values ------------------------------------------------------------------------------------------


def test_special_values_round_as_the_rule_says(isa):
    """exp_avg = SR(g) and exp_avg_sq = SR(g*g) (beta1 = beta2 = 0, lr = 0):
    zeros keep their sign, bf16 values stay, NaN is 0x7FC0, inf stays inf,
    subnormals round to a neighbour, values above bf16's largest finite
    round to it or to inf, and every bit is the reference's."""
    bf16_max = torch.finfo(BF16).max
    f32_max = torch.finfo(F32).max
    specials = [
        0.0,
        -0.0,
        1.0,
        -2.5,
        float("nan"),
        -float("nan"),
        1e-45,
        -1e-45,
        1e-40,
        -3e-39,
        1.1754944e-38,
        bf16_max,
        -bf16_max,
        3.3961e38,
        -3.3961e38,
        f32_max,
        3.0e-20,
        1.5e19,
        2e19,
        float("inf"),
    ]
    x = torch.tensor(specials * 64)  # the same values at many indices: many random draws
    n = x.numel()
    p, m, v = torch.zeros(n), torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16)
    ref = [p.clone(), m.clone(), v.clone()]
    kw = dict(step=1, lr=0.0, beta1=0.0, beta2=0.0, state_format="bf16", seed=11)
    cpu_adam_step([p], [x], [m], [v], **kw)
    reference.adam_step([ref[0]], [x], [ref[1]], [ref[2]], **kw)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), ref):
        assert_same_bits(a, b, name)
    mb, vb = m.view(torch.int16).int() & 0xFFFF, v.view(torch.int16).int() & 0xFFFF
    finite, nan = torch.isfinite(x), torch.isnan(x)
    xb = x.view(torch.int32)
    assert bool((mb[nan] == 0x7FC0).all()) and bool((vb[nan] == 0x7FC0).all())  # no carry into the sign
    # exp_avg = g exactly before rounding for finite g (for inf g it is inf + 0 * inf = NaN, as torch's lerp)
    assert bool((mb[x == 0] == ((xb[x == 0] >> 16) & 0xFFFF)).all())  # zeros keep their sign
    exact = finite & (x.bfloat16().float() == x)
    assert torch.equal(m[exact].float(), x[exact])  # bf16 values stay
    moved = mb[finite] - ((xb[finite] >> 16) & 0xFFFF)
    assert bool(((moved == 0) | (moved == 1)).all())  # truncated, or the next pattern away from zero
    for value in (1e-40, -3e-39, 3.3961e38, -3.3961e38):  # both neighbours are drawn somewhere
        assert set(moved[x[finite] == value].tolist()) == {0, 1}, value
    big = finite & (x.abs() > bf16_max)
    assert set(m[big].float().abs().unique().tolist()) == {bf16_max, float("inf")}  # no saturation
    assert bool((v[x.abs() >= 1.9e19] == float("inf")).all())  # g*g overflowed in fp32 (or inf): inf stays inf
    assert torch.equal(p[finite], torch.zeros(int(finite.sum())))  # lr = 0 moves no finite param


def test_found_inf_skips_and_changes_nothing(isa, seeded):
    model = make_model()
    opt = CPUAdam(model.parameters(), lr=1e-2, state_format="bf16")
    train(model, opt, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    states = [(s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for s in opt.state.values()]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step(found_inf=torch.tensor(1.0))
    assert opt.param_groups[0]["step"] == 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    for (m, v), s in zip(states, opt.state.values()):
        assert torch.equal(bits(m), bits(s["exp_avg"])) and torch.equal(bits(v), bits(s["exp_avg_sq"]))


# -- the optimizers ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [CPUAdam, FusedAdam])
@pytest.mark.parametrize("p_dtype", [F32, BF16])
def test_optimizer_runs_the_functional_step_with_its_seed_and_step(isa, seeded, cls, p_dtype):
    model = make_model(p_dtype)
    params = [p.detach().clone() for p in model.parameters()]
    opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1, state_format="bf16", seed=42)
    assert opt.state_format == "bf16" and opt.seed == 42 and not opt.fp32_optimizer_states
    ms = [torch.zeros_like(p, dtype=BF16) for p in params]
    vs = [torch.zeros_like(p, dtype=BF16) for p in params]
    for step in range(1, 4):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        opt.step()
        reference.adam_step(params, grads, ms, vs, step=step, lr=1e-2, weight_decay=0.1, state_format="bf16", seed=42)
    for p, q, m, v in zip(model.parameters(), params, ms, vs):
        assert_same_bits(p.detach(), q, "param")
        assert opt.state[p]["exp_avg"].dtype == BF16
        assert_same_bits(opt.state[p]["exp_avg"], m, "exp_avg")
        assert_same_bits(opt.state[p]["exp_avg_sq"], v, "exp_avg_sq")
    assert (opt.backend if cls is CPUAdam else opt.last_backend).startswith("cpu")


def test_master_weights_with_bf16_states(isa, seeded):
    """FusedAdam's fp32 masters of bf16 params, with bf16 states: the kernel
    updates the master, rounds the states stochastically, writes the param."""
    model = make_model(BF16)
    opt = FusedAdam(model.parameters(), lr=1e-2, master_weights=True, state_format="bf16")
    train(model, opt, 3)
    for p in model.parameters():
        s = opt.state[p]
        assert s["master_param"].dtype == F32 and s["exp_avg"].dtype == BF16
        assert torch.equal(p.detach(), s["master_param"].bfloat16())


def _trained(fmt, steps=3, **kw):
    torch.manual_seed(21)
    model = make_model()
    opt = CPUAdam(model.parameters(), lr=1e-2, state_format=fmt, **kw)
    train(model, opt, steps)
    return model, opt


def test_state_dict_carries_the_format_and_seed(isa):
    _, opt = _trained("bf16", seed=99)
    sd = opt.state_dict()
    assert sd["state_format"] == {"format": "bf16", "seed": 99}
    assert all(s["exp_avg"].dtype == BF16 for s in sd["state"].values())
    _, opt32 = _trained("fp32")
    assert opt32.state_dict()["state_format"] == {"format": "fp32", "seed": None}


def test_fp32_states_load_into_bf16_rounded_with_a_note_and_training_goes_on(isa, caplog):
    model, opt = _trained("fp32")
    sd = opt.state_dict()
    into = CPUAdam(model.parameters(), lr=1e-2, state_format="bf16")
    with caplog.at_level(logging.INFO, logger="fastzero"):
        into.load_state_dict(sd)
    note = [r for r in caplog.records if "converted" in r.getMessage()]
    assert note and note[0].levelno == logging.WARNING
    assert "state_format='fp32'" in note[0].getMessage() and "float32 -> bfloat16" in note[0].getMessage()
    for p, pid in zip(model.parameters(), sd["param_groups"][0]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(into.state[p][key], sd["state"][pid][key].bfloat16())  # rounded to nearest
    assert into.param_groups[0]["step"] == 3
    train(model, into, 2)
    assert into.param_groups[0]["step"] == 5
    assert all(into.state[p]["exp_avg"].dtype == BF16 for p in model.parameters())


def test_bf16_states_load_into_fp32_exactly_with_a_note(isa, caplog):
    model, opt = _trained("bf16")
    sd = opt.state_dict()
    into = CPUAdam(model.parameters(), lr=1e-2)
    with caplog.at_level(logging.INFO, logger="fastzero"):
        into.load_state_dict(sd)
    note = [r for r in caplog.records if "converted" in r.getMessage()]
    assert note and note[0].levelno == logging.INFO and "bfloat16 -> float32 (exact)" in note[0].getMessage()
    for p, pid in zip(model.parameters(), sd["param_groups"][0]["params"]):
        assert torch.equal(into.state[p]["exp_avg"], sd["state"][pid]["exp_avg"].float())
    train(model, into, 2)


def test_a_resumed_bf16_run_is_the_uninterrupted_one_to_the_bit(isa):
    """The state dict's seed and step key the rounding of the steps after the
    load: the resumed run takes the checkpoint's seed over its own."""
    model = make_model()
    gen = torch.Generator().manual_seed(2)
    grads = [[torch.randn(p.shape, generator=gen) for p in model.parameters()] for _ in range(5)]

    def steps(model, opt, which):
        for k in which:
            for p, g in zip(model.parameters(), grads[k]):
                p.grad = g.clone()
            opt.step()

    whole = make_model()
    steps(whole, CPUAdam(whole.parameters(), lr=1e-2, state_format="bf16", seed=123), range(5))
    first = CPUAdam(model.parameters(), lr=1e-2, state_format="bf16", seed=123)
    steps(model, first, range(3))
    again = CPUAdam(model.parameters(), lr=1e-2, state_format="bf16", seed=5)
    again.load_state_dict(first.state_dict())
    assert again.seed == 123
    steps(model, again, range(3, 5))
    for p, q in zip(model.parameters(), whole.parameters()):
        assert_same_bits(p.detach(), q.detach(), "param")


def test_torch_adamw_loads_a_bf16_state_dict(isa):
    model, opt = _trained("bf16")
    theirs = torch.optim.AdamW(model.parameters(), lr=1e-2)
    theirs.load_state_dict(opt.state_dict())
    train(model, theirs, 1)


# -- bad input ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(state_format="bf16", fp32_optimizer_states=True), ValueError, "contradicts"),
        (dict(state_format="fp32", fp32_optimizer_states=False), ValueError, "contradicts"),
        (dict(state_format="fp8"), ValueError, "known: 'fp32', 'bf16', 'param_dtype'"),
        (dict(seed=3), ValueError, "only state_format='bf16'"),
        (dict(state_format="bf16", seed=-1), ValueError, "seed must be an int in"),
        (dict(state_format="bf16", seed=2**32), ValueError, "seed must be an int in"),
        (dict(state_format="bf16", seed=1.5), ValueError, "seed must be an int in"),
        (dict(state_format="bf16", seed=True), ValueError, "seed must be an int in"),
        (dict(fp32_optimizer_states="yes"), TypeError, "True or False"),
    ],
)
@pytest.mark.parametrize("cls", [CPUAdam, FusedAdam])
def test_bad_format_arguments_are_refused(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        cls(make_model().parameters(), **kwargs)


def test_the_formats_that_agree_with_fp32_optimizer_states():
    params = list(make_model().parameters())
    assert CPUAdam(params).state_format == "fp32"
    assert CPUAdam(params, fp32_optimizer_states=False).state_format == "param_dtype"
    assert CPUAdam(params, fp32_optimizer_states=False, state_format="bf16").state_format == "bf16"
    assert CPUAdam(params, fp32_optimizer_states=True, state_format="fp32").state_format == "fp32"
    assert FusedAdam(params, state_format="param_dtype").fp32_optimizer_states is False
    assert FusedLamb(params).state_format == "fp32"
    with pytest.raises(ValueError, match="not implemented here"):  # LAMB's kernels write fp32 or the param's dtype
        resolve_state_format("FusedLamb", FusedLamb.state_formats, "bf16", None, None)


def test_functional_step_checks_states_against_the_format(isa):
    p, g = torch.randn(8), torch.randn(8)
    m32, v32 = torch.zeros(8), torch.zeros(8)
    m16, v16 = torch.zeros(8, dtype=BF16), torch.zeros(8, dtype=BF16)
    with pytest.raises(TypeError, match="state_format='bf16'"):
        cpu_adam_step([p], [g], [m16], [v16], step=1)  # bf16 states of fp32 params: name the format
    with pytest.raises(TypeError, match="must be bfloat16"):
        cpu_adam_step([p], [g], [m32], [v32], step=1, state_format="bf16")
    with pytest.raises(TypeError, match="must be torch.float32"):
        cpu_adam_step([p], [g], [m16], [v16], step=1, state_format="fp32")
    with pytest.raises(ValueError, match="only state_format='bf16'"):
        cpu_adam_step([p], [g], [m32], [v32], step=1, seed=1)
    with pytest.raises(ValueError, match="known"):
        cpu_adam_step([p], [g], [m32], [v32], step=1, state_format="int4")
    with pytest.raises(TypeError, match="uint8 codes"):
        cpu_adam_step([p], [g], [m32], [v32], step=1, state_format="int8")
    cpu_adam_step([p], [g], [m16], [v16], step=1, state_format="bf16", seed=2**32 - 1)


def test_load_refuses_a_malformed_format_record():
    model = make_model()
    opt = CPUAdam(model.parameters())
    sd = opt.state_dict()
    sd["state_format"] = {"format": "fp4"}
    with pytest.raises(ValueError, match="'state_format'"):
        CPUAdam(model.parameters()).load_state_dict(sd)


def test_native_entry_refuses_a_seed_without_bf16_states():
    ops = native.cpu_ops()
    if ops is None:
        pytest.skip("no native kernels")
    hyper = bytes(AdamHyperparams().c_struct())
    with pytest.raises(ValueError, match="needs bf16 states"):
        ops.adam(0, [0], [0], [0], [0], [], [1], 0, 0, 0, -1, hyper, 1, 1.0, 5, True, False, 1)
    with pytest.raises(ValueError, match="seed must be"):
        ops.adam(0, [0], [0], [0], [0], [], [1], 0, 0, 2, -1, hyper, 1, 1.0, 2**32, True, False, 1)
    with pytest.raises(ValueError, match="needs bf16 params"):
        ops.adam(0, [0], [0], [0], [0], [], [1], 0, 0, 0, -1, hyper, 1, 1.0, 5, False, True, 1)
