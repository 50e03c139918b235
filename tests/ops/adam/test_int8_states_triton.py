"""The Triton Adam kernel with int8 block-wise states (state_format="int8")
against the reference, to the bit: params, copies, codes and block scales.
Without a GPU it runs on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1, set by tests/conftest.py), the same multi-tensor code path
a GPU runs."""

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


def kernel_step(lists, step, hp, block, grad_scale=None, found_inf=0.0):
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
    )


def reference_step(lists, step, hp, block, grad_scale=None):
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


def run(combos, block, sizes=SIZES, steps=4, grad_scale=None, found_inf=0.0, wide=False, grads=None, **hyper):
    """`steps` steps of the kernel and the reference from the same lists, with
    fresh random grads each step (``grads``: a function of n that draws them)."""
    draw = grads or torch.randn
    kernel = make(sizes, combos, block, wide)
    ref = clone(kernel)
    hp = AdamHyperparams(**hyper)
    for step in range(1, steps + 1):
        for a, b in zip(kernel[1], ref[1]):
            a.copy_(draw(a.numel()).to(a.dtype))
            b.copy_(a.cpu())
        kernel_step(kernel, step, hp, block, grad_scale, found_inf)
        reference_step(ref, step, hp, block, grad_scale)
    assert_same(kernel, ref)
    return kernel


@pytest.mark.parametrize("block", [64, 256, 4096])
def test_mixed_dtypes_ragged_sizes_to_the_bit(block):
    run(MIXED, block, sizes=[0, *SIZES], **HYPER)


@pytest.mark.parametrize("block", [128, 4096])
def test_fp32_masters_with_copies_to_the_bit(block):
    run(WITH_COPY, block, sizes=SIZES[:6], **HYPER)


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


def test_block_max_fractions_and_codes_that_round_once():
    """beta1 = beta2 = 0 makes m = g and v = g * g exactly: elements 2^-20 and 2^-40 of
    their block's largest, and ones a hair above a rounding midpoint of the subnormal
    codes, where rounding twice (through fp32's subnormals, then to the code) goes down."""
    block = 64
    g = 0.25 * torch.randn(4 * block)
    g[::block] = 2.0  # each block's largest, a power of two: y = |x| / 2 exactly
    g[1], g[2] = 2.0 * 2.0**-20, -2.0 * 2.0**-40
    g[block + 1] = 2.0**-14 * (1 + 2**-3 + 2**-23)  # exp_avg: y = (4.5 + 2^-21) 2^-17: code 5
    g[block + 2] = 2.0**-15 * (1 + 2**-3 + 2**-23)
    g[2 * block + 1 : 3 * block] = 2.0 * 2.0 ** -torch.randint(16, 60, (block - 1,)).float()  # v: 2^-32 .. 2^-118
    lists = make([g.numel()], [(F32, F32, None)], block)
    ref = clone(lists)
    lists[1][0].copy_(g.to(DEVICE))
    ref[1][0].copy_(g)
    hp = AdamHyperparams(lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0)
    kernel_step(lists, 1, hp, block)
    reference_step(ref, 1, hp, block)
    assert_same(lists, ref)
    m_codes = lists[2][0].cpu().long()
    assert m_codes[block + 1].item() == 5, "exp_avg's subnormal code rounded twice"
    expected = int8_codes.quantize(M_CODE, g, block)[0]
    assert torch.equal(m_codes, expected.long())


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
