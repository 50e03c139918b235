"""int8 block-wise optimizer states (state_format="int8"): the codes against
an independent statement of the rule (nearest value of the code's table, ties
to the even code), the block scales and their special cases, re-encoding's
idempotence, the CPU kernel against the reference to the bit on every ISA
path, thread count, block size and awkward size, the optimizers, state dicts
across formats, and bad input."""

import logging

import pytest
import torch

from fastzero import native
from fastzero.ops import CPUAdam, FusedAdam, cpu_adam_step
from fastzero.ops.adam import int8_codes, reference
from fastzero.ops.adam.int8_codes import EXP_AVG, EXP_AVG_SQ
from tests.helpers import make_model, train

F32, BF16, F16, U8 = torch.float32, torch.bfloat16, torch.float16, torch.uint8
SIZES = [1, 7, 15, 16, 17, 63, 255, 256, 257, 1023, 4099, 100003]  # SIMD tails, partial blocks, primes
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
STEPS = 7


def bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == F32:
        return t.view(torch.int32)
    return t.view(torch.int16) if t.dtype in (BF16, F16) else t


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit for bit; NaNs compare equal whatever their payloads."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    same = bits(a) == bits(b)
    if a.is_floating_point():
        same |= torch.isnan(a) & torch.isnan(b)
    bad = (~same).nonzero().flatten()
    if bad.numel():
        i = bad[0].item()
        raise AssertionError(f"{what}: {bad.numel()} of {a.numel()} differ; first at {i}: {a[i]} vs {b[i]}")


def spread(n: int, scale: float = 1.0) -> torch.Tensor:
    """Values over many magnitudes (so codes from the subnormal ones to 1 occur)."""
    return scale * torch.randn(n) * torch.exp2(torch.randint(-40, 4, (n,)).float())


def make(sizes, p_dtype=F32, g_dtype=F32, copies=None, block=256):
    """params, grads, exp_avg codes, exp_avg_sq codes, their scales, copies:
    states encoded from random values (not zeros), so step 1 decodes them."""
    params = [torch.randn(n).to(p_dtype) for n in sizes]
    grads = [spread(n).to(g_dtype) for n in sizes]
    ms, mss, vs, vss = [], [], [], []
    for n in sizes:
        codes, scales = int8_codes.quantize(EXP_AVG, 0.1 * spread(n), block)
        ms.append(codes), mss.append(scales)
        codes, scales = int8_codes.quantize(EXP_AVG_SQ, 0.01 * spread(n).square(), block)
        vs.append(codes), vss.append(scales)
    cps = None if copies is None else [torch.zeros(n, dtype=copies) for n in sizes]
    return [params, grads, ms, vs, mss, vss, cps]


def clone(ts):
    return [None if t is None else [x.clone() for x in t] for t in ts]


def step_both(kernel_step, tensors, steps=STEPS, *, block=256, grad_scale=None, **hyper):
    """Steps of kernel_step and of the reference from the same tensors, fresh
    grads every step; returns both."""
    ref = clone(tensors)
    for step in range(1, steps + 1):
        if step > 1:
            for a, b in zip(tensors[1], ref[1]):
                a.copy_(spread(a.numel()).to(a.dtype))
                b.copy_(a)
        for t, run in ((tensors, kernel_step), (ref, reference.adam_step)):
            run(
                *t[:4],
                exp_avg_absmax=t[4],
                exp_avg_sq_absmax=t[5],
                param_copies=t[6],
                step=step,
                grad_scale=grad_scale,
                state_format="int8",
                block_size=block,
                **hyper,
            )
    return tensors, ref


def check_same(kernel, ref):
    names = ("param", "grad", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax", "copy")
    for name, ks, rs in zip(names, kernel, ref):
        for i, (k, r) in enumerate(zip(ks or [], rs or [])):
            assert_same_bits(k, r, f"{name} {i} (numel {k.numel()}, {k.dtype})")


# -- the rule --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", int8_codes.CODES, ids=lambda c: c.name)
def test_codes_are_the_nearest_value_ties_to_even(code):
    """Independent of the bit tricks: each y in [0, 1] gets the code whose
    value is nearest, the even code on a tie (exp_avg_sq: never 0 for y > 0)."""
    table = int8_codes.value(code, torch.arange(code.top + 1)).double()
    assert table[0] == 0 and table[-1] == 1 and bool((table[1:] > table[:-1]).all())
    mids = ((table[1:] + table[:-1]) / 2).float()
    y = torch.cat([torch.rand(20000) * torch.exp2(-torch.randint(0, 40, (20000,)).float()), table.float(), mids])
    y = torch.cat([y, torch.nextafter(mids, torch.zeros(())), torch.nextafter(mids, torch.ones(()))]).clamp(0, 1)
    got = int8_codes.encode(code, y)
    dist = (table[None, :] - y.double()[:, None]).abs()
    best = dist.min(1, keepdim=True).values
    ties = dist == best
    want = torch.where(ties.sum(1) > 1, (ties * (torch.arange(code.top + 1) % 2 == 0)).int().argmax(1), dist.argmin(1))
    if not code.signed:
        want = torch.where((y > 0) & (want == 0), 1, want)
    assert torch.equal(got, want)


@pytest.mark.parametrize("code", int8_codes.CODES, ids=lambda c: c.name)
@pytest.mark.parametrize("block", [64, 256, 4096])
def test_quantize_error_is_within_half_a_step_and_reencoding_is_idempotent(code, block):
    torch.manual_seed(3)
    x = spread(3 * block + 17)
    if not code.signed:
        x = x.abs()
    codes, scales = int8_codes.quantize(code, x, block)
    assert codes.dtype == U8 and scales.dtype == F32 and scales.numel() == 4
    s = scales.repeat_interleave(block)[: x.numel()]
    assert torch.equal(
        s.unique(), torch.cat([x[i : i + block].abs().max().reshape(1) for i in range(0, 4 * block, block)]).unique()
    )
    back = int8_codes.dequantize(code, codes, scales, block)
    y = x.abs() / s
    sub = 2.0 ** (code.emin - 3)  # the subnormal step
    step = torch.where(y < 2.0**code.emin, sub, torch.exp2(torch.floor(torch.log2(y.clamp_min(1e-45)))) / 8)
    bound = step * s / 2
    if not code.signed:  # a value below the smallest code is raised to it
        bound = torch.where((y > 0) & (y < sub / 2), sub * s, bound)
    assert bool(((back - x).abs() <= bound * (1 + 1e-6)).all())
    assert bool((torch.sign(back) * torch.sign(x) >= 0).all())
    again, scales_again = int8_codes.quantize(code, back, block)
    assert torch.equal(again, codes) and torch.equal(scales_again, scales)


@pytest.mark.parametrize("code", int8_codes.CODES, ids=lambda c: c.name)
def test_stochastic_codes_are_unbiased_and_stay_between_the_neighbours(code):
    """With 16 random bits per element, y's code is one of its two neighbours
    on the code grid, the upper one with probability y's fraction of the step
    (to 2^-16): over 4096 draws the mean decoded value is y within 6 standard
    deviations of two-point draws. Values on the grid never move."""
    torch.manual_seed(7)
    table = int8_codes.value(code, torch.arange(code.top + 1)).double()
    y = torch.cat([torch.rand(300) * torch.exp2(-torch.randint(0, 36, (300,)).float()), table[1:60].float()])
    draws = 4096
    total = torch.zeros(y.numel(), dtype=torch.float64)
    lo_code = torch.searchsorted(table, y.double(), right=True) - 1  # the neighbour at or below
    for _ in range(draws):
        c = int8_codes.encode(code, y, torch.randint(0, 1 << 16, y.shape))
        assert bool(((c == lo_code) | (c == lo_code + 1) | ((c == 1) & (lo_code == 0))).all())
        total += table[c]
    lo = table[lo_code]
    hi = table[(lo_code + 1).clamp_max(code.top)]
    f = torch.where(hi > lo, (y.double() - lo) / (hi - lo), torch.zeros(()))
    sigma = (hi - lo) * torch.sqrt(f * (1 - f) / draws) + (hi - lo) * 2.0**-16
    raised = (~torch.tensor(code.signed)) & (lo_code == 0) & (y > 0)  # exp_avg_sq: never 0 above 0
    err = (total / draws - y.double()).abs()
    assert bool((err[~raised] <= 6 * sigma[~raised] + 1e-300).all())
    on_grid = f == 0
    assert bool((err[on_grid & ~raised] == 0).all())


def test_reencoding_decoded_values_is_idempotent_with_any_random_bits():
    torch.manual_seed(8)
    for code in int8_codes.CODES:
        x = spread(5 * 256 + 3)
        x = x if code.signed else x.abs()
        codes, scales = int8_codes.quantize(code, x, 256, torch.randint(0, 1 << 16, x.shape))
        back = int8_codes.dequantize(code, codes, scales, 256)
        for _ in range(3):
            again, scales_again = int8_codes.quantize(code, back, 256, torch.randint(0, 1 << 16, x.shape))
            assert torch.equal(again, codes) and torch.equal(scales_again, scales)


def test_the_seed_keys_the_codes_and_repeats_them(isa, seeded):
    base = make([4099])
    runs = {}
    for seed in (0, 0, 1):
        t = clone(base)
        kw = dict(exp_avg_absmax=t[4], exp_avg_sq_absmax=t[5], state_format="int8", seed=seed)
        cpu_adam_step(*t[:4], step=3, **kw, **HYPER)
        runs.setdefault(seed, []).append(t)
    assert torch.equal(runs[0][0][2][0], runs[0][1][2][0])
    differ = (runs[0][0][3][0] != runs[1][0][3][0]).float().mean()
    assert 0.05 < differ < 0.95  # many exp_avg_sq codes round the other way


def test_block_scales_of_special_blocks():
    """A zero block: scale 0, codes 0. A block holding inf or NaN: scale NaN,
    codes 0 (it decodes to NaN). Subnormal values only: scale 0. A tiny
    positive exp_avg_sq beside a huge one: code 1, not 0."""
    block = 64
    x = torch.randn(5 * block)
    x[:block] = 0
    x[block + 5] = float("inf")
    x[2 * block + 9] = float("nan")
    x[3 * block : 4 * block] = 1e-40
    for code in int8_codes.CODES:
        xs = x if code.signed else x.abs()
        codes, scales = int8_codes.quantize(code, xs, block)
        assert scales[0] == 0 and bool((codes[:block] == 0).all())
        assert torch.isnan(scales[1]) and torch.isnan(scales[2]) and bool((codes[block : 3 * block] == 0).all())
        assert scales[3] == 0 and bool((codes[3 * block : 4 * block] == 0).all())
        assert scales[4] == xs[4 * block :].abs().max()
        back = int8_codes.dequantize(code, codes, scales, block)
        assert bool(torch.isnan(back[block : 3 * block]).all()) and bool((back[:block] == 0).all())
    v = torch.tensor([1.0] + [1e-30] * 63)
    codes, _ = int8_codes.quantize(EXP_AVG_SQ, v, 64)
    assert codes[0] == EXP_AVG_SQ.top and bool((codes[1:] == 1).all())


# -- the CPU kernel against the reference, to the bit ------------------------------------------------------


@pytest.mark.parametrize(
    "p_dtype,g_dtype,copies",
    [(F32, F32, None), (F32, BF16, BF16), (F32, F16, F16), (BF16, BF16, None), (BF16, F32, None), (F16, F16, None)],
    ids=lambda d: str(d).removeprefix("torch.") if d is not None else "none",
)
def test_cpu_kernel_equals_reference_to_the_bit(isa, seeded, p_dtype, g_dtype, copies):
    kernel, ref = step_both(cpu_adam_step, make(SIZES, p_dtype, g_dtype, copies), **HYPER)
    check_same(kernel, ref)


@pytest.mark.parametrize("block", [64, 512, 4096])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_block_sizes_and_modes_to_the_bit(isa, seeded, block, adamw_mode):
    hyper = dict(HYPER, adamw_mode=adamw_mode)
    tensors = make([block - 1, block, 3 * block + 5], F32, BF16, BF16, block=block)
    check_same(*step_both(cpu_adam_step, tensors, block=block, **hyper))


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("grad_scale", [None, 1024.0, 3.7])
def test_bias_correction_and_grad_scale_to_the_bit(isa, seeded, bias_correction, grad_scale):
    hyper = dict(HYPER, bias_correction=bias_correction)
    check_same(*step_both(cpu_adam_step, make([17, 1023, 4099]), grad_scale=grad_scale, **hyper))


def test_ragged_list_across_chunks_and_threads(isa, seeded):
    """Sizes 0 and ones that cross the kernels' 2^18-element chunks (block
    edges): every thread count gives the reference's bits."""
    sizes = [0, 1, 5, 64, 333, 70001, 0, 129, (1 << 18) + 5, 200003]
    base = make(sizes)
    results = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            torch.manual_seed(5)
            kernel, ref = step_both(cpu_adam_step, clone(base), steps=2, **HYPER)
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
    base = make([100003, 31])
    out = {}
    for name in isas:
        monkeypatch.setenv("FASTZERO_CPU_ISA", name)
        torch.manual_seed(9)
        out[name], _ = step_both(cpu_adam_step, clone(base), steps=3, **HYPER)
    for name in isas[1:]:
        check_same(out[name], out[isas[0]])


def test_special_values_to_the_bit(isa):
    """Zero blocks, blocks that turn non-finite (a NaN or inf grad: scale NaN),
    subnormal-only blocks, and exp_avg_sq far below its block's max: the
    kernel's codes and scales are the reference's."""
    n, block = 6 * 64, 64
    g = torch.randn(n)
    g[:64] = 0
    g[70] = float("nan")
    g[140] = float("inf")
    g[200:256] = 1e-41
    g[256:320] *= torch.exp2(-torch.arange(64).float())  # down to 2^-63 of the block's first
    p = torch.randn(n)
    zeros = lambda dtype, k: torch.zeros(k, dtype=dtype)  # noqa: E731
    a = [[p.clone()], [g], [zeros(U8, n)], [zeros(U8, n)], [zeros(F32, 6)], [zeros(F32, 6)]]
    b = clone(a)
    for step in (1, 2):
        for t, run in ((a, cpu_adam_step), (b, reference.adam_step)):
            kw = dict(exp_avg_absmax=t[4], exp_avg_sq_absmax=t[5], block_size=block, state_format="int8")
            run(*t[:4], step=step, lr=1e-3, **kw)
    check_same(a, b)
    assert torch.isnan(a[4][0][1]) and torch.isnan(a[5][0][2]) and a[4][0][0] == 0


def _carrying_code_subnormals(code, r_of, fits):
    """Elements i (> 0) and values y in the code's subnormal range whose
    truncated encoding t (20 bits below the code's last) reads 2^20 - 1 after
    adding r_of[i] * 16, with half a unit of t dropped: rounding t to nearest
    instead of truncating it would carry into the next code. `fits(y)` gives a
    grad that makes y (or None)."""
    found = []
    for i in range(1, r_of.numel()):
        low = ((1 << 20) - 1 - 16 * int(r_of[i])) % (1 << 20)
        for top in range(4, 8):  # t in [2^22, 2^23): y in [2^(emin - 1), 2^emin)
            t = (top << 20) + low
            g = fits((t + 0.5) * 2.0 ** (code.emin - 23))
            if g is not None:
                found.append((i, t, g))
                break
    return found


def test_encode_truncates_below_the_codes_subnormal_step(isa):
    """The codes' rule truncates y * 2^(23 - emin) before adding the random
    bits. Values made so that rounding it to nearest would carry into the next
    code (beta1 = beta2 = 0: the new exp_avg is the grad, exp_avg_sq its
    square; the block's max is 1): the kernel's codes are the reference's."""
    n, seed, step = 256, 7, 1
    rm, rv = reference.sr_bits(seed, step, torch.arange(n))
    f32 = lambda y: torch.tensor(y, dtype=F32)  # noqa: E731

    def square_root_of(y):  # an fp32 g with fl(g * g) == y, if one exists
        g0 = torch.tensor(y**0.5, dtype=F32)
        for d in range(-2, 3):
            g = (g0.view(torch.int32) + d).view(F32)
            if torch.equal(g * g, f32(y)):
                return float(g)
        return None

    m_cases = _carrying_code_subnormals(EXP_AVG, rm, lambda y: y)[:24]
    v_cases = [c for c in _carrying_code_subnormals(EXP_AVG_SQ, rv, square_root_of) if c[0] > 128][:24]
    assert len(m_cases) >= 8 and len(v_cases) >= 8
    g = 0.5 * torch.rand(n) * torch.exp2(-torch.randint(0, 30, (n,)).float())
    g[0] = 1.0
    m_at = [i for i, _, _ in m_cases if i <= 128]
    for i, _, y in m_cases:
        if i <= 128:
            g[i] = y
    for i, _, root in v_cases:
        g[i] = root
    hyper = dict(lr=1e-3, beta1=0.0, beta2=0.0, weight_decay=0.0)
    a = [[torch.randn(n)], [g], [torch.zeros(n, dtype=U8)], [torch.zeros(n, dtype=U8)]]
    a += [[torch.zeros(1)], [torch.zeros(1)]]
    b = clone(a)
    for t, run in ((a, cpu_adam_step), (b, reference.adam_step)):
        kw = dict(exp_avg_absmax=t[4], exp_avg_sq_absmax=t[5], state_format="int8", seed=seed)
        run(*t[:4], step=step, **kw, **hyper)
    check_same(a, b)
    assert a[4][0][0] == 1 and a[5][0][0] == 1
    m_codes, v_codes = b[2][0].long(), b[3][0].long()
    for i, t, _ in m_cases:  # the premise: the reference truncated, with these random bits
        if i in m_at:
            assert m_codes[i] == (t + 16 * int(rm[i])) >> 20
    for i, t, _ in v_cases:
        assert v_codes[i] == (t + 16 * int(rv[i])) >> 20


def test_found_inf_skips_and_changes_nothing(isa, seeded):
    model = make_model()
    opt = CPUAdam(model.parameters(), lr=1e-2, state_format="int8")
    train(model, opt, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    states = [{k: v.clone() for k, v in s.items() if k != "step"} for s in opt.state.values()]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step(found_inf=torch.tensor(1.0))
    assert opt.param_groups[0]["step"] == 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    for saved, s in zip(states, opt.state.values()):
        for k, v in saved.items():
            assert torch.equal(bits(v), bits(s[k])), k


# -- the optimizers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [CPUAdam, FusedAdam])
@pytest.mark.parametrize("p_dtype", [F32, BF16])
def test_optimizer_runs_the_functional_step(isa, seeded, cls, p_dtype):
    model = make_model(p_dtype)
    params = [p.detach().clone() for p in model.parameters()]
    opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1, state_format="int8", block_size=64)
    assert opt.state_format == "int8" and opt.block_size == 64 and opt.seed == 0 and not opt.fp32_optimizer_states
    ms = [torch.zeros_like(p, dtype=U8) for p in params]
    vs = [torch.zeros_like(p, dtype=U8) for p in params]
    mss = [torch.zeros(int8_codes.blocks_of(p.numel(), 64)) for p in params]
    vss = [torch.zeros_like(s) for s in mss]
    for step in range(1, 4):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        opt.step()
        reference.adam_step(
            params,
            grads,
            ms,
            vs,
            step=step,
            lr=1e-2,
            weight_decay=0.1,
            state_format="int8",
            exp_avg_absmax=mss,
            exp_avg_sq_absmax=vss,
            block_size=64,
        )
    for p, q, m, v, sm, sv in zip(model.parameters(), params, ms, vs, mss, vss):
        state = opt.state[p]
        assert_same_bits(p.detach(), q, "param")
        for key, want in (("exp_avg", m), ("exp_avg_sq", v), ("exp_avg_absmax", sm), ("exp_avg_sq_absmax", sv)):
            assert_same_bits(state[key], want, key)
    assert (opt.backend if cls is CPUAdam else opt.last_backend).startswith("cpu")


def test_master_weights_with_int8_states(isa, seeded):
    model = make_model(BF16)
    opt = FusedAdam(model.parameters(), lr=1e-2, master_weights=True, state_format="int8")
    train(model, opt, 3)
    for p in model.parameters():
        state = opt.state[p]
        assert state["master_param"].dtype == F32 and state["exp_avg"].dtype == U8
        assert torch.equal(p.detach(), state["master_param"].to(BF16))


def test_int8_tracks_fp32_states(isa, seeded):
    """Twenty steps of seeded random grads: the params stay within a small
    fraction of how far fp32 states moved them (stochastic rounding moves each
    state by up to a code step, 6-12%, at random from step to step: about 5%
    of each update, not summing up when the steps' grads are independent)."""
    runs = {}
    for fmt in ("fp32", "int8"):
        model = make_model()
        start = [p.detach().clone() for p in model.parameters()]
        train(model, CPUAdam(model.parameters(), lr=1e-3, state_format=fmt), 20)
        runs[fmt] = [(p.detach() - s) for p, s in zip(model.parameters(), start)]
    for a, b in zip(runs["fp32"], runs["int8"]):
        assert (a - b).norm() <= 0.1 * a.norm()


def _trained(fmt, **kw):
    model = make_model()
    opt = CPUAdam(model.parameters(), lr=1e-2, state_format=fmt, **kw)
    train(model, opt, 3)
    return model, opt


def test_state_dict_carries_codes_scales_and_block_size(isa):
    _, opt = _trained("int8", block_size=128)
    sd = opt.state_dict()
    assert sd["state_format"] == {"format": "int8", "seed": 0, "block_size": 128}
    for state in sd["state"].values():
        assert state["exp_avg"].dtype == U8 and state["exp_avg_sq"].dtype == U8
        assert state["exp_avg_absmax"].numel() == int8_codes.blocks_of(state["exp_avg"].numel(), 128)


def test_an_int8_run_resumed_from_its_state_dict_is_the_uninterrupted_one_to_the_bit(isa):
    gen = torch.Generator().manual_seed(2)
    whole, model = make_model(), make_model()
    grads = [[torch.randn(p.shape, generator=gen) for p in model.parameters()] for _ in range(5)]

    def steps(model, opt, which):
        for k in which:
            for p, g in zip(model.parameters(), grads[k]):
                p.grad = g.clone()
            opt.step()

    steps(whole, CPUAdam(whole.parameters(), lr=1e-2, state_format="int8"), range(5))
    first = CPUAdam(model.parameters(), lr=1e-2, state_format="int8")
    steps(model, first, range(3))
    again = CPUAdam(model.parameters(), lr=1e-2, state_format="int8")
    again.load_state_dict(first.state_dict())
    steps(model, again, range(3, 5))
    for p, q in zip(model.parameters(), whole.parameters()):
        assert_same_bits(p.detach(), q.detach(), "param")


@pytest.mark.parametrize("into", ["fp32", "bf16", "param_dtype"])
def test_int8_states_load_into_other_formats_decoded_with_a_note(isa, caplog, into):
    model, opt = _trained("int8")
    sd = opt.state_dict()
    other = CPUAdam(model.parameters(), lr=1e-2, state_format=into)
    with caplog.at_level(logging.INFO, logger="fastzero"):
        other.load_state_dict(sd)
    note = [r for r in caplog.records if "converted" in r.getMessage()]
    assert note and "int8 (blocks of 256) -> " in note[0].getMessage()
    assert note[0].levelno == (logging.INFO if into == "fp32" else logging.WARNING)
    for p, pid in zip(model.parameters(), sd["param_groups"][0]["params"]):
        saved = sd["state"][pid]
        state = other.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        for key, code, scale in (
            ("exp_avg", EXP_AVG, "exp_avg_absmax"),
            ("exp_avg_sq", EXP_AVG_SQ, "exp_avg_sq_absmax"),
        ):
            decoded = int8_codes.dequantize(code, saved[key], saved[scale], 256)
            assert torch.equal(state[key], decoded.to(state[key].dtype))
    train(model, other, 2)
    assert other.param_groups[0]["step"] == 5


@pytest.mark.parametrize("saved", ["fp32", "bf16", "int8-64"])
def test_other_formats_load_into_int8_encoded_with_a_note(isa, caplog, saved):
    fmt, _, block = saved.partition("-")
    model, opt = _trained(fmt, **({"block_size": int(block)} if block else {}))
    sd = opt.state_dict()
    into = CPUAdam(model.parameters(), lr=1e-2, state_format="int8")
    with caplog.at_level(logging.INFO, logger="fastzero"):
        into.load_state_dict(sd)
    note = [r for r in caplog.records if "converted" in r.getMessage()]
    assert note and note[0].levelno == logging.WARNING and "-> int8 (blocks of 256)" in note[0].getMessage()
    for p, pid in zip(model.parameters(), sd["param_groups"][0]["params"]):
        src = dict(sd["state"][pid])
        m32, v32 = (
            (src["exp_avg"].float(), src["exp_avg_sq"].float())
            if fmt != "int8"
            else (
                int8_codes.dequantize(EXP_AVG, src["exp_avg"], src["exp_avg_absmax"], 64),
                int8_codes.dequantize(EXP_AVG_SQ, src["exp_avg_sq"], src["exp_avg_sq_absmax"], 64),
            )
        )
        codes, scales = int8_codes.quantize(EXP_AVG, m32, 256)
        assert torch.equal(into.state[p]["exp_avg"], codes) and torch.equal(into.state[p]["exp_avg_absmax"], scales)
        codes, scales = int8_codes.quantize(EXP_AVG_SQ, v32, 256)
        assert torch.equal(into.state[p]["exp_avg_sq"], codes)
    train(model, into, 2)


# -- bad input ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(state_format="int8", block_size=100), ValueError, "power of two from 64 to 4096"),
        (dict(state_format="int8", block_size=8192), ValueError, "power of two from 64 to 4096"),
        (dict(state_format="int8", block_size=True), ValueError, "power of two"),
        (dict(block_size=256), ValueError, "only\\s+state_format='int8'"),
        (dict(state_format="bf16", block_size=256), ValueError, "only\\s+state_format='int8'"),
        (dict(state_format="int8", fp32_optimizer_states=True), ValueError, "contradicts"),
    ],
)
@pytest.mark.parametrize("cls", [CPUAdam, FusedAdam])
def test_bad_format_arguments_are_refused(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        cls(make_model().parameters(), **kwargs)


def test_functional_step_checks_codes_and_scales(isa):
    p, g = torch.randn(300), torch.randn(300)
    m, v = torch.zeros(300, dtype=U8), torch.zeros(300, dtype=U8)
    ms, vs = torch.zeros(2), torch.zeros(2)
    kw = dict(step=1, state_format="int8")
    with pytest.raises(TypeError, match="uint8 codes"):
        cpu_adam_step([p], [g], [m.float()], [v], exp_avg_absmax=[ms], exp_avg_sq_absmax=[vs], **kw)
    with pytest.raises(ValueError, match="needs exp_avg_absmax"):
        cpu_adam_step([p], [g], [m], [v], exp_avg_sq_absmax=[vs], **kw)
    with pytest.raises(ValueError, match="has 3 elements.*2 blocks of\\s+256"):
        cpu_adam_step([p], [g], [m], [v], exp_avg_absmax=[torch.zeros(3)], exp_avg_sq_absmax=[vs], **kw)
    with pytest.raises(TypeError, match="float32"):
        cpu_adam_step([p], [g], [m], [v], exp_avg_absmax=[ms.double()], exp_avg_sq_absmax=[vs], **kw)
    with pytest.raises(ValueError, match="not contiguous"):
        cpu_adam_step([p], [g], [m], [v], exp_avg_absmax=[torch.zeros(4)[::2]], exp_avg_sq_absmax=[vs], **kw)
    with pytest.raises(ValueError, match="shape"):
        cpu_adam_step([p], [g], [m[:299]], [v], exp_avg_absmax=[ms], exp_avg_sq_absmax=[vs], **kw)
    with pytest.raises(ValueError, match="pass them with state_format='int8'"):
        cpu_adam_step([p], [g], [m.float()], [v.float()], step=1, exp_avg_absmax=[ms], exp_avg_sq_absmax=[vs])
    with pytest.raises(ValueError, match="power of two"):
        cpu_adam_step([p], [g], [m], [v], exp_avg_absmax=[ms], exp_avg_sq_absmax=[vs], block_size=96, **kw)
    cpu_adam_step([p], [g], [m], [v], exp_avg_absmax=[ms], exp_avg_sq_absmax=[vs], **kw)


def test_native_entry_refuses_a_bad_block_before_any_pointer_is_read():
    ops = native.cpu_ops()
    if ops is None:
        pytest.skip(f"native CPU kernels unavailable: {native.cpu_ops_error()}")
    from fastzero.ops.adam import AdamHyperparams

    hyper = bytes(AdamHyperparams().c_struct())
    with pytest.raises(ValueError, match="block must be a power of two"):
        ops.adam_int8(0, [0], [0], [0], [0], [], [0], [0], [10], 0, 0, -1, hyper, 1.0, 1.0, 100, 0, False, 1)
    with pytest.raises(ValueError, match="differ in length"):
        ops.adam_int8(0, [0], [0], [0], [0], [], [0], [], [10], 0, 0, -1, hyper, 1.0, 1.0, 256, 0, False, 1)


def test_load_refuses_a_malformed_int8_record():
    model, opt = _trained("int8")
    sd = opt.state_dict()
    bad = dict(sd, state_format={"format": "int8", "seed": None})
    with pytest.raises(ValueError, match="block_size"):
        CPUAdam(model.parameters(), state_format="int8").load_state_dict(bad)
    pid = sd["param_groups"][0]["params"][0]
    state = dict(sd["state"])
    state[pid] = {k: v for k, v in state[pid].items() if k != "exp_avg_absmax"}
    with pytest.raises(ValueError, match="exp_avg_absmax.*missing"):
        CPUAdam(model.parameters()).load_state_dict(dict(sd, state=state))
