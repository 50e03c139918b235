"""The Triton Adam kernel with int8 block-wise states (state_format="int8")
against the reference, to the bit: params, copies, codes (rounded
stochastically, keyed by the seed) and block scales; and the codes' mean over
seeds against the fp32 moments (unbiased). Without a GPU it runs on CPU
tensors under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py), the same multi-tensor code path a GPU runs."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from fastzero.ops import FusedAdam  # noqa: E402
from fastzero.ops.adam import AdamHyperparams, int8_codes, reference  # noqa: E402
from fastzero.triton_kernels import adam  # noqa: E402
from tests.helpers import make_model, train  # noqa: E402

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
M_CODE, V_CODE = int8_codes.EXP_AVG, int8_codes.EXP_AVG_SQ
# around each block size and the kernel's 2048-element tiles, and a few thousand
SIZES = [1, 7, 255, 256, 257, 1023, 4099, 3000]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
# (param, grad, copy) of one call: one launch per combination
MIXED = [(F32, BF16, None), (BF16, BF16, None), (F16, F32, None), (BF16, F32, None), (F16, F16, None)]
WITH_COPY = [(F32, BF16, BF16), (F32, F32, F16), (F32, F16, BF16)]
ROLES = ("param", "grad", "exp_avg", "exp_avg_sq", "copy", "exp_avg_absmax", "exp_avg_sq_absmax")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(8)


def spread(n: int, lo: float) -> torch.Tensor:
    """n random values whose magnitudes spread log-uniformly over [2^lo, 1]: through
    the codes' normal and subnormal ranges and below their smallest step."""
    return torch.randn(n) * torch.exp2(lo * torch.rand(n))


def make(sizes, combos, block, wide=False):
    """Lists of the seven roles; states encoded from random fp32 values (``wide``:
    magnitudes down to 2^-45 of each block's largest)."""
    out = [[] for _ in ROLES]
    for i, n in enumerate(sizes):
        p, g, c = combos[i % len(combos)]
        m = spread(n, -45.0) if wide else 0.1 * torch.randn(n)
        v = spread(n, -45.0).abs() if wide else 0.01 * torch.rand(n)
        m_codes, m_scales = int8_codes.quantize(M_CODE, m, block)
        v_codes, v_scales = int8_codes.quantize(V_CODE, v, block)
        tensors = (torch.randn(n).to(p), torch.randn(n).to(g), m_codes, v_codes, m_scales, v_scales)
        for k, t in zip((0, 1, 2, 3, 5, 6), tensors):
            out[k].append(t.to(DEVICE))
        out[4].append(None if c is None else torch.zeros(n, device=DEVICE, dtype=c))
    out[4] = None if not out[4] or out[4][0] is None else out[4]
    return out


def clone(lists):
    return [None if t is None else [x.cpu().clone() for x in t] for t in lists]


def kernel_step(lists, step, hp, block, grad_scale=None, found_inf=0.0, seed=None):
    p, g, m, v, c, ms, vs = lists
    adam.adam_step(
        p,
        g,
        m,
        v,
        step=torch.tensor(float(step), device=DEVICE),
        hp=hp,
        grad_scale=None if grad_scale is None else torch.tensor(grad_scale, device=DEVICE),
        found_inf=None if found_inf is None else torch.tensor(found_inf, device=DEVICE),
        param_copies=c,
        state_format="int8",
        exp_avg_absmax=ms,
        exp_avg_sq_absmax=vs,
        block_size=block,
        seed=seed,
    )


def reference_step(lists, step, hp, block, grad_scale=None, seed=None):
    p, g, m, v, c, ms, vs = lists
    reference.adam_step(
        p,
        g,
        m,
        v,
        step=step,
        hp=hp,
        grad_scale=grad_scale,
        param_copies=c,
        state_format="int8",
        exp_avg_absmax=ms,
        exp_avg_sq_absmax=vs,
        block_size=block,
        seed=seed,
    )


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit for bit, NaNs equal whatever their payloads: which NaN propagates is no part
    of the rule, nor of torch's conversion (fp32 NaN to bf16: 0x7FC0 or 0xFFFF)."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if a.dtype == torch.uint8:
        same = a == b
    else:
        same = (
            (a.view(torch.int32) == b.view(torch.int32))
            if a.dtype == F32
            else (a.view(torch.int16) == b.view(torch.int16))
        )
        same |= a.isnan() & b.isnan()
    bad = (~same).nonzero().flatten()
    if bad.numel():
        i = bad[0].item()
        raise AssertionError(f"{what}: {bad.numel()} of {a.numel()} differ; first at {i}: {a[i]} vs {b[i]}")


def assert_same(kernel, ref):
    """Every role to the bit: codes and scales exactly (a NaN scale is the reference's
    0x7FC00000), params and copies with NaNs equal."""
    for name, ks, rs in zip(ROLES, kernel, ref):
        for i, (k, r) in enumerate(zip(ks or [], rs or [])):
            what = f"{name} {i} (numel {k.numel()}, {k.dtype})"
            if name.endswith("absmax"):
                assert torch.equal(k.cpu().view(torch.int32), r.view(torch.int32)), f"{what}: {k} vs {r}"
            else:
                assert_same_bits(k.cpu(), r, what)


def run(
    combos, block, sizes=SIZES, steps=4, grad_scale=None, found_inf=0.0, wide=False, grads=None, seed=None, **hyper
):
    """`steps` steps of the kernel and the reference from the same lists, with
    fresh random grads each step (``grads``: a function of n that draws them),
    the codes rounded with the bits of ``seed`` (None: the default, 0)."""
    draw = grads or torch.randn
    kernel = make(sizes, combos, block, wide)
    ref = clone(kernel)
    hp = AdamHyperparams(**hyper)
    for step in range(1, steps + 1):
        for a, b in zip(kernel[1], ref[1]):
            a.copy_(draw(a.numel()).to(a.dtype))
            b.copy_(a.cpu())
        kernel_step(kernel, step, hp, block, grad_scale, found_inf, seed)
        reference_step(ref, step, hp, block, grad_scale, seed)
    assert_same(kernel, ref)
    return kernel


@pytest.mark.parametrize("block", [64, 256, 4096])
def test_mixed_dtypes_ragged_sizes_to_the_bit(block):
    run(MIXED, block, sizes=[0, *SIZES], **HYPER)


@pytest.mark.parametrize("block, seed", [(128, 7), (4096, 2**32 - 1)])
def test_fp32_masters_with_copies_to_the_bit(block, seed):
    run(WITH_COPY, block, sizes=SIZES[:6], seed=seed, **HYPER)


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("grad_scale", [None, 3.7])
def test_modes_and_grad_scale_to_the_bit(adamw_mode, bias_correction, grad_scale):
    hyper = {**HYPER, "adamw_mode": adamw_mode, "bias_correction": bias_correction}
    found_inf = None if grad_scale is None else 0.0  # the kernel with and without the flag
    run(MIXED[:2], 256, sizes=[5, 2305], steps=3, grad_scale=grad_scale, found_inf=found_inf, **hyper)


@pytest.mark.parametrize("block", [64, 512, 4096])
def test_values_spanning_the_subnormal_codes_to_the_bit(block):
    """States and grads whose magnitudes spread from each block's largest down to
    2^-45 of it (grads to 2^-40: v spans 2^-80): the codes' subnormal range (below
    2^-14 of the scale for exp_avg, 2^-30 for exp_avg_sq), their smallest steps,
    and values below them (exp_avg: code 0; exp_avg_sq: code 1)."""
    kernel = run(MIXED[:3], block, sizes=[4099, 700], steps=3, wide=True, grads=lambda n: spread(n, -40.0), **HYPER)
    codes = torch.cat([c.cpu() for c in kernel[2]]).long() & 0x7F
    sq_codes = torch.cat([c.cpu() for c in kernel[3]]).long()
    assert ((codes > 0) & (codes < 8)).any() and ((sq_codes > 1) & (sq_codes < 8)).any()
    assert (codes == 0).any() and (sq_codes == 1).any()


@pytest.mark.parametrize("seed", [0, 99])
def test_codes_are_the_rules_stochastic_rounding(seed):
    """beta1 = beta2 = 0 makes m = g and v = g * g exactly, so the codes are the
    rule's stochastic rounding of g and g * g (int8_codes.quantize) with the bits
    of reference.sr_bits: exp_avg the low half, exp_avg_sq the high. Elements
    2^-20 and 2^-40 of their block's largest, a hair above a midpoint of the
    subnormal codes, values on a code (never moved) and squares down to 2^-118."""
    block = 64
    g = 0.25 * torch.randn(5 * block)
    g[::block] = 2.0  # each block's largest, a power of two: y = |x| / 2 exactly
    g[1], g[2] = 2.0 * 2.0**-20, -2.0 * 2.0**-40
    g[block + 1] = 2.0**-14 * (1 + 2**-3 + 2**-23)  # exp_avg: y = (4.5 + 2^-21) 2^-17
    g[block + 2] = 2.0**-15 * (1 + 2**-3 + 2**-23)
    g[2 * block + 1 : 3 * block] = 2.0 * 2.0 ** -torch.randint(16, 60, (block - 1,)).float()  # v: 2^-32 .. 2^-118
    on_code = int8_codes.value(M_CODE, torch.randint(0, M_CODE.top + 1, (block - 1,)))
    g[3 * block + 1 : 4 * block] = 2.0 * on_code * torch.where(torch.rand(block - 1) < 0.5, -1.0, 1.0)
    lists = make([g.numel()], [(F32, F32, None)], block)
    ref = clone(lists)
    lists[1][0].copy_(g.to(DEVICE))
    ref[1][0].copy_(g)
    hp = AdamHyperparams(lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0)
    kernel_step(lists, 1, hp, block, seed=seed)
    reference_step(ref, 1, hp, block, seed=seed)
    assert_same(lists, ref)
    r_m, r_v = reference.sr_bits(seed, 1, torch.arange(g.numel()))
    for codes, code, x, r in ((lists[2][0], M_CODE, g, r_m), (lists[3][0], V_CODE, g * g, r_v)):
        assert torch.equal(codes.cpu(), int8_codes.quantize(code, x, block, r)[0]), code.name
    m_codes = lists[2][0].cpu().long()
    assert torch.equal(m_codes[3 * block + 1 : 4 * block] & 0x7F, int8_codes.encode(M_CODE, on_code)), "moved"


def test_the_seed_and_the_step_choose_the_bits():
    """The same seed and step give the same codes; another seed, or another step,
    other codes (as many as rounding decides), and each is the reference's."""
    hp = AdamHyperparams(**HYPER)
    base = make([3000], [(F32, F32, None)], 256)
    results = {}
    for seed, step in ((5, 1), (5, 1), (6, 1), (5, 2)):
        lists, ref = [None if t is None else [x.clone() for x in t] for t in base], clone(base)
        kernel_step(lists, step, hp, 256, seed=seed)
        reference_step(ref, step, hp, 256, seed=seed)
        assert_same(lists, ref)
        results.setdefault((seed, step), []).append(torch.cat([lists[2][0], lists[3][0]]).cpu())
    first, again = results[(5, 1)]
    assert torch.equal(first, again)
    for other in (results[(6, 1)][0], results[(5, 2)][0]):
        assert (first != other).float().mean() > 0.2


def test_stochastic_rounding_is_unbiased():
    """beta1 = beta2 = 0 and lr = 0: the step encodes exp_avg = g and exp_avg_sq =
    g * g. Each block's largest is 1 (a scale of 1: y is the value itself, and a
    code decodes to its value exactly) and its other elements all one value, so
    each seed draws each value's rounding many times. Over 100 seeds the mean of
    the decoded codes is the fp32 value within 6 standard deviations of the mean
    of two-point draws (step * sqrt(f (1 - f) / n), f the value's fraction of
    its code step) plus 2^-16 of a step (what 16 random bits resolve); a value
    on a code never moves. exp_avg_sq below its smallest step always gets code
    1, never 0 (the rule)."""
    block, copies, seeds = 64, 4, 100
    values = torch.tensor(
        [
            1 - 2.0**-10,  # in the top binade: code 119 or 120 (the value 1)
            0.3,
            -0.6,  # the sign bit
            2.0**-3 * (1 + 2.0**-4),  # a midpoint: f = 1/2
            2.0**-7 * (1 + 2.0**-15),  # f = 2^-12
            2.0**-7 * (1 + 2.0**-3 - 2.0**-15),  # f = 1 - 2^-12
            0.75,  # on a code (exp_avg's): never moves
            2.0**-14 * 1.0625,  # exp_avg's smallest normal binade
            3.3 * 2.0**-17,  # exp_avg's subnormal codes (steps of 2^-17)
            5.0 * 2.0**-17,  # on one
            -0.3 * 2.0**-17,  # below exp_avg's smallest step: code 0 or 1
            1.7 * 2.0**-16,  # exp_avg_sq: 5.78 of its subnormal steps (2^-33)
            0.9 * 2.0**-15,  # exp_avg_sq: in its smallest normal binade
            2.0**-17,  # exp_avg_sq: 2^-34, below its smallest step: code 1
            1e-3,
            -7e-2,
        ]
    )
    g = values.repeat_interleave(copies * block)
    g[::block] = 1.0
    n = g.numel()
    draws = seeds * copies * (block - 1)
    not_max = (torch.arange(n) % block != 0).double()
    sums = [torch.zeros(len(values), dtype=torch.float64) for _ in range(2)]
    hp = AdamHyperparams(lr=0.0, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0)
    for seed in range(seeds):
        lists = make([n], [(F32, F32, None)], block)
        lists[1][0].copy_(g.to(DEVICE))
        kernel_step(lists, 1, hp, block, seed=seed)
        for k, (code, total) in enumerate(zip((M_CODE, V_CODE), sums)):
            codes, scales = lists[2 + k][0].cpu(), lists[5 + k][0].cpu()
            assert torch.equal(scales, torch.ones_like(scales))
            x = int8_codes.dequantize(code, codes, scales, block).double() * not_max
            total += x.reshape(len(values), -1).sum(1)
    for code, x, total in ((M_CODE, values, sums[0]), (V_CODE, values * values, sums[1])):
        y, mean = x.abs(), total / draws
        lo = int8_codes.encode(code, y, torch.zeros(len(y), dtype=torch.int64))  # truncated: the code below y
        step = (int8_codes.value(code, lo + 1) - int8_codes.value(code, lo)).double()
        f = (y.double() - int8_codes.value(code, lo).double()) / step
        err = (mean - x.double()).abs()
        bound = 6 * step * torch.sqrt(f * (1 - f) / draws) + step * 2.0**-16
        rounded = (y >= 2.0 ** (code.emin - 3)) | code.signed  # exp_avg_sq below its smallest step: code 1
        assert bool((err[rounded] <= bound[rounded]).all()), (code.name, (err / step)[rounded])
        assert bool((err[f == 0] == 0).all()), f"{code.name}: a value on a code moved"
        assert bool((mean[~rounded] == 2.0 ** (code.emin - 3)).all()), f"{code.name}: below the smallest step"


def test_zero_and_subnormal_only_blocks_get_scale_zero():
    """A block of zeros (param, grad and states) and one whose moments are fp32
    subnormals only: scale 0 and codes 0, as the rule says, then decoded as zeros."""
    block = 256

    def grads(n):
        g = torch.randn(n)
        g[block : 2 * block] = 0.0
        g[2 * block : 3 * block] = 1e-38 * torch.randn(block)  # m = 0.1 g: subnormal; v: 0
        return g

    lists = make([3 * block + 5], [(F32, F32, None)], block)
    lists[0][0][block : 2 * block] = 0
    for k in (2, 3):
        lists[k][0][block : 3 * block] = 0  # codes 0: the moments of both blocks start at zero
    ref = clone(lists)
    hp = AdamHyperparams(**{**HYPER, "weight_decay": 0.0})
    for step in (1, 2):
        for a, b in zip(lists[1], ref[1]):
            a.copy_(grads(a.numel()).to(a.dtype))
            b.copy_(a.cpu())
        kernel_step(lists, step, hp, block)
        reference_step(ref, step, hp, block)
        assert_same(lists, ref)
    m_scales, v_scales = lists[5][0].cpu(), lists[6][0].cpu()
    assert m_scales[1] == 0 and v_scales[1] == 0 and m_scales[2] == 0 and v_scales[2] == 0
    assert (m_scales[[0, 3]] > 0).all() and not lists[2][0][block : 3 * block].any()


@pytest.mark.parametrize("p_dtype", [F32, BF16])
def test_non_finite_grads_give_nan_scales_as_the_reference(p_dtype):
    """An inf and a NaN grad: their blocks' scales become NaN and their codes 0, as
    in the reference; the next step decodes those blocks to NaN, and the others go on."""
    block = 64

    def grads(n):
        g = torch.randn(n)
        g[3], g[block + 5] = float("inf"), float("nan")
        return g

    run([(p_dtype, F32, None)], block, sizes=[4 * block + 9], steps=3, grads=grads, **HYPER)
    lists = make([4 * block + 9], [(p_dtype, F32, None)], block)
    lists[1][0].copy_(grads(lists[1][0].numel()).to(DEVICE))
    kernel_step(lists, 1, AdamHyperparams(**HYPER), block)
    for scales in (lists[5][0].cpu(), lists[6][0].cpu()):
        assert scales[:2].view(torch.int32).eq(0x7FC00000).all() and not scales[2:].isnan().any()
    assert not lists[2][0][: 2 * block].any() and not lists[3][0][: 2 * block].any()


@pytest.mark.parametrize("found_inf", [1.0, float("nan")])
def test_found_inf_changes_nothing(found_inf):
    lists = make([17, 2049, 300], MIXED, 64)
    before = clone(lists)
    kernel_step(lists, 1, AdamHyperparams(**HYPER), 64, grad_scale=2.0, found_inf=found_inf)
    assert_same(lists, before)


@pytest.mark.parametrize("block", [None, 64])
def test_fused_adam_through_triton_equals_the_reference(block):
    """The optimizer drives the Triton kernel (a device step counter) and the
    reference (an int) to the same bits: params, codes and block scales."""
    a, b = make_model(), make_model()
    fmt = dict(state_format="int8", block_size=block)
    opt_triton = FusedAdam(a.parameters(), lr=1e-2, weight_decay=0.01, backend="triton", **fmt)
    opt_ref = FusedAdam(b.parameters(), lr=1e-2, weight_decay=0.01, backend="reference", **fmt)
    train(a, opt_triton, 3)
    train(b, opt_ref, 3)
    assert opt_triton.last_backend == "triton" and opt_ref.last_backend == "reference"
    for p, q in zip(a.parameters(), b.parameters()):
        assert_same_bits(p.detach(), q.detach(), "param")
        for key in ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"):
            k, r = opt_triton.state[p][key], opt_ref.state[q][key]
            assert k.dtype == r.dtype and torch.equal(k.view(torch.uint8), r.view(torch.uint8)), key


def test_bad_int8_arguments_are_refused():
    lists = make([100], [(F32, F32, None)], 64)
    p, g, m, v, _, ms, vs = lists
    kw = dict(step=torch.tensor(1.0, device=DEVICE), hp=AdamHyperparams())
    with pytest.raises(ValueError, match="one scale per block"):
        adam.adam_step(p, g, m, v, state_format="int8", exp_avg_absmax=ms, exp_avg_sq_absmax=vs, **kw)  # 256
    with pytest.raises(ValueError, match="power of two"):
        adam.adam_step(p, g, m, v, state_format="int8", exp_avg_absmax=ms, exp_avg_sq_absmax=vs, block_size=100, **kw)
    with pytest.raises(ValueError, match="needs exp_avg_absmax"):
        adam.adam_step(p, g, m, v, state_format="int8", block_size=64, **kw)
    with pytest.raises(ValueError, match="only state_format='int8'"):
        adam.adam_step(p, g, [x.float() for x in m], [x.float() for x in v], block_size=64, **kw)
    with pytest.raises(TypeError, match="uint8 codes"):
        adam.adam_step(p, g, [x.float() for x in m], v, state_format="int8", exp_avg_absmax=ms, **kw)
