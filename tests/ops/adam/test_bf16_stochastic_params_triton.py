"""The Triton Adam kernels with bf16 params written by stochastic rounding
(bf16_stochastic_round=True) against the reference, to the bit, with every
state format: fp32, param_dtype, bf16 (stochastic) and int8. Without a GPU they
run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py), the same multi-tensor code path a GPU runs;
tests/ops/test_triton_kernels.py compiles the new variants for sm_90."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from fastzero.ops import FusedAdam  # noqa: E402
from fastzero.ops.adam import AdamHyperparams, int8_codes, reference  # noqa: E402
from fastzero.triton_kernels import adam  # noqa: E402
from tests.helpers import make_model, train  # noqa: E402
from tests.ops.adam.test_int8_states_triton import assert_same_bits  # noqa: E402

F32, BF16, F16, U8 = torch.float32, torch.bfloat16, torch.float16, torch.uint8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = ["fp32", "param_dtype", "bf16", "int8"]
# the interpreter's 1024-element blocks and 2048-element items, int8's 2048-element tiles, tails
SIZES = [0, 1, 7, 255, 1023, 2048, 4099]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
ROLES = ("param", "grad", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(5)


def make(fmt, sizes, grad_dtypes=(F32, BF16, F16), block=256):
    """Lists of the six roles for bf16 params (the scales None but for int8), on DEVICE."""
    out = [[] for _ in ROLES]
    for i, n in enumerate(sizes):
        m, v = 0.1 * torch.randn(n), 0.01 * torch.rand(n)
        if fmt == "int8":
            m, ms = int8_codes.quantize(int8_codes.EXP_AVG, m, block)
            v, vs = int8_codes.quantize(int8_codes.EXP_AVG_SQ, v, block)
            out[4].append(ms.to(DEVICE))
            out[5].append(vs.to(DEVICE))
        else:
            dtype = F32 if fmt == "fp32" else BF16
            m, v = m.to(dtype), v.to(dtype)
        g = torch.randn(n).to(grad_dtypes[i % len(grad_dtypes)])
        for k, t in enumerate((torch.randn(n).to(BF16), g, m, v)):
            out[k].append(t.to(DEVICE))
    if fmt != "int8":
        out[4] = out[5] = None
    return out


def clone(lists):
    return [None if ts is None else [t.cpu().clone() for t in ts] for ts in lists]


def format_args(fmt, lists, block):
    if fmt == "int8":
        return dict(state_format="int8", exp_avg_absmax=lists[4], exp_avg_sq_absmax=lists[5], block_size=block)
    return dict(state_format=fmt)


def kernel_step(fmt, lists, step, hp, block=256, grad_scale=None, found_inf=0.0, seed=11, sr=True):
    adam.adam_step(
        *lists[:4],
        step=torch.tensor(float(step), device=DEVICE),
        hp=hp,
        grad_scale=None if grad_scale is None else torch.tensor(grad_scale, device=DEVICE),
        found_inf=None if found_inf is None else torch.tensor(found_inf, device=DEVICE),
        seed=seed if sr or fmt in ("bf16", "int8") else None,
        bf16_stochastic_round=sr,
        **format_args(fmt, lists, block),
    )


def reference_step(fmt, lists, step, hp, block=256, grad_scale=None, seed=11):
    reference.adam_step(
        *lists[:4],
        step=step,
        hp=hp,
        grad_scale=grad_scale,
        seed=seed,
        bf16_stochastic_round=True,
        **format_args(fmt, lists, block),
    )


def assert_same(kernel, ref):
    for name, ks, rs in zip(ROLES, kernel, ref):
        for i, (k, r) in enumerate(zip(ks or [], rs or [])):
            assert_same_bits(k.cpu(), r, f"{name} {i} (numel {k.numel()}, {k.dtype})")


def run(fmt, sizes=SIZES, steps=4, block=256, grad_scale=None, found_inf=0.0, **hyper):
    """`steps` steps of the kernel and the reference from the same lists, fresh random grads each step."""
    kernel = make(fmt, sizes, block=block)
    ref = clone(kernel)
    hp = AdamHyperparams(**hyper)
    for step in range(1, steps + 1):
        for a, b in zip(kernel[1], ref[1]):
            a.copy_(torch.randn(a.numel()).to(a.dtype))
            b.copy_(a.cpu())
        kernel_step(fmt, kernel, step, hp, block, grad_scale, found_inf)
        reference_step(fmt, ref, step, hp, block, grad_scale)
    assert_same(kernel, ref)
    return kernel


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_state_format_ragged_sizes_to_the_bit(fmt):
    run(fmt, **HYPER)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("grad_scale", [None, 3.7])
def test_modes_and_grad_scale_to_the_bit(fmt, adamw_mode, grad_scale):
    found_inf = None if grad_scale is None else 0.0  # the kernel with and without the flag
    run(fmt, sizes=[5, 2049], steps=3, grad_scale=grad_scale, found_inf=found_inf, adamw_mode=adamw_mode, **HYPER)


@pytest.mark.parametrize("block", [64, 4096])
def test_int8_block_sizes_to_the_bit(block):
    run("int8", sizes=[7, 4099], steps=3, block=block, bias_correction=False, **HYPER)


def test_the_params_are_rounded_stochastically():
    """Updates of about 1% of a bf16 ulp: round to nearest leaves every param
    where it was, stochastic rounding moves some of them (a test of the rule
    being applied, not only of two implementations agreeing)."""
    n = 4099
    hp = AdamHyperparams(lr=1e-4, beta1=0.0, beta2=0.0, eps=1e-12, weight_decay=0.0)
    moved = {}
    for sr in (False, True):
        lists = make("fp32", [n], grad_dtypes=(F32,))
        lists[0][0].fill_(1.0)
        kernel_step("fp32", lists, 1, hp, sr=sr)
        moved[sr] = (lists[0][0] != 1.0).sum().item()
    assert moved[False] == 0 and 0 < moved[True] < n // 10, moved


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
def test_other_param_dtypes_are_written_as_without_it(fmt):
    """fp32 and fp16 params beside bf16 ones in one call: written as by a
    call without bf16_stochastic_round (bf16 and int8 states round with the seed either way)."""
    sizes = [257, 1030, 3000]
    lists = make(fmt, sizes, grad_dtypes=(F32,))
    lists[0][0] = torch.randn(sizes[0], device=DEVICE)
    lists[0][2] = torch.randn(sizes[2], device=DEVICE).to(F16)
    plain = [None if ts is None else [t.clone() for t in ts] for ts in lists]
    hp = AdamHyperparams(**HYPER)
    kernel_step(fmt, lists, 1, hp)
    kernel_step(fmt, plain, 1, hp, sr=False)
    for i in (0, 2):
        assert_same_bits(lists[0][i].cpu(), plain[0][i].cpu(), f"param {i} ({lists[0][i].dtype})")
    assert not torch.equal(lists[0][1].cpu(), plain[0][1].cpu())  # the bf16 one: rounded otherwise


@pytest.mark.parametrize("found_inf", [1.0, float("nan")])
@pytest.mark.parametrize("fmt", FORMATS)
def test_found_inf_changes_nothing(fmt, found_inf):
    lists = make(fmt, [17, 2049])
    before = clone(lists)
    kernel_step(fmt, lists, 1, AdamHyperparams(**HYPER), grad_scale=2.0, found_inf=found_inf)
    assert_same(lists, before)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_adam_through_triton_equals_the_reference(fmt):
    """FusedAdam drives the Triton kernel (a device step counter) and the
    reference (an int) to the same bits: params and every state."""
    a, b = make_model(BF16), make_model(BF16)
    kw = dict(lr=1e-2, weight_decay=0.01, state_format=fmt, bf16_stochastic_round=True, seed=23)
    opt_triton = FusedAdam(a.parameters(), backend="triton", **kw)
    opt_ref = FusedAdam(b.parameters(), backend="reference", **kw)
    train(a, opt_triton, 3)
    train(b, opt_ref, 3)
    assert opt_triton.last_backend == "triton" and opt_ref.last_backend == "reference"
    for p, q in zip(a.parameters(), b.parameters()):
        assert_same_bits(p.detach().cpu(), q.detach(), "param")
        for key, k in opt_triton.state[p].items():
            if key != "step":
                assert_same_bits(k.cpu(), opt_ref.state[q][key], key)


def test_bad_arguments_are_refused():
    lists = make("fp32", [8])
    kw = dict(step=torch.tensor(1.0, device=DEVICE), hp=AdamHyperparams())
    with pytest.raises(TypeError, match="must be True or False"):
        adam.adam_step(*lists[:4], bf16_stochastic_round="yes", **kw)
    with pytest.raises(ValueError, match="seed must be an int in"):
        adam.adam_step(*lists[:4], bf16_stochastic_round=True, seed=2**32, **kw)
    with pytest.raises(ValueError, match="only state_format='bf16', 'int8'\\s+and\\s+bf16_stochastic_round"):
        adam.adam_step(*lists[:4], seed=3, **kw)
