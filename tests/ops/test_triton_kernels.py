"""The Triton Adam and LAMB kernels against the plain-PyTorch reference. Without a
GPU they run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set
by tests/conftest.py before triton is imported), which runs the same
multi-tensor code path."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from fastzero.ops import AdamHyperparams, LambHyperparams, reference  # noqa: E402
from fastzero.ops.tolerances import assert_close  # noqa: E402
from fastzero.triton_kernels import _multi_tensor, adam, lamb  # noqa: E402
from tests import kernel_checks  # noqa: E402
from tests.kernel_checks import BF16, COMBOS, F16, F32, clone_all  # noqa: E402  (shared by every backend)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [1, 7, 17, 1023, 4099]  # under the interpreter 2048 elements an item, 1024 a block: loops and tails
NO_COPY = [(p, g, s, None) for p, g, s, _ in COMBOS]  # mixed lists: copies are all or none
WITH_COPY = [c for c in COMBOS if c[3] is not None] + [(F32, F32, F32, F16)]
MODES_MIX = [(F32, BF16, F32, None), (BF16, BF16, BF16, None), (F16, F32, F16, None)]  # 3 launches, not 12
ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, bias_correction=True, adamw_mode=True)
LAMB = dict(
    lr=1e-2,
    beta1=0.9,
    beta2=0.999,
    eps=1e-6,
    eps_inside_sqrt=False,
    weight_decay=0.05,
    bias_correction=True,
    max_grad_norm=1.0,
    max_coeff=10.0,
    min_coeff=0.01,
)
# ||p|| / ||u|| of ~1, ~100 (clamped to max_coeff) and ~1e-3 (clamped to min_coeff).
LAMB_SCALES = [1.0, 100.0, 1e-3]


def combo_id(c):
    return "-".join(str(d).split(".")[-1] if d else "none" for d in c)


def make_tensors(sizes, combos, scales=(1.0,)):
    """Tensor i has size sizes[i], and combos[i % len] (params times scales[i % len])."""
    out = [[], [], [], [], []]
    for i, n in enumerate(sizes):
        p_dt, g_dt, s_dt, c_dt = combos[i % len(combos)]
        out[0].append((torch.randn(n) * scales[i % len(scales)]).to(DEVICE, p_dt))
        out[1].append(torch.randn(n).to(DEVICE, g_dt))
        out[2].append((0.1 * torch.randn(n)).to(DEVICE, s_dt))
        out[3].append((0.01 * torch.rand(n) + 1e-4).to(DEVICE, s_dt))
        out[4].append(None if c_dt is None else torch.randn(n).to(DEVICE, c_dt))
    out[4] = None if out[4] and out[4][0] is None else out[4]
    return out


def scalar(x):
    return None if x is None else torch.tensor(float(x), device=DEVICE)


def _split(family, kwargs):
    """(the family's hyperparameters as its dataclass, the other keywords)."""
    names = set(family.names())
    return family(**{k: v for k, v in kwargs.items() if k in names}), {
        k: v for k, v in kwargs.items() if k not in names
    }


def adam_kernel(*tensors, **kwargs):
    hp, rest = _split(AdamHyperparams, kwargs)
    return adam.adam_step(*tensors, hp=hp, **rest)


def lamb_kernel(*tensors, **kwargs):
    hp, rest = _split(LambHyperparams, kwargs)
    return lamb.lamb_step(*tensors, hp=hp, **rest)


def run_all(opt, sizes, combos, steps=20, scales=(1.0,), grad_scale=3.0, **hyper):
    """The kernel, the reference in the same dtypes, and the reference in fp32 storage
    (the ideal that low-precision storage approximates), over ``steps`` steps with fresh
    grads; also the trust ratios of the last LAMB step (kernel, reference, ideal)."""
    kernel = make_tensors(sizes, combos, scales)
    ref, ideal = clone_all(kernel), clone_all(kernel, F32)
    coeffs = torch.full((len(sizes),), -1.0, device=DEVICE)
    ratios = [None, None]
    for step in range(1, steps + 1):
        if step > 1:
            for a, b, c in zip(kernel[1], ref[1], ideal[1]):
                a.copy_(torch.randn(a.shape).to(DEVICE, a.dtype))
                b.copy_(a)
                c.copy_(a)
        kw = dict(step=scalar(step), grad_scale=scalar(grad_scale), found_inf=scalar(0.0), param_copies=kernel[4])
        if opt == "adam":
            adam_kernel(*kernel[:4], **kw, **hyper)
            for t in (ref, ideal):
                reference.adam_step(*t[:4], step=step, grad_scale=grad_scale, param_copies=t[4], **hyper)
        else:
            lamb_kernel(*kernel[:4], **kw, coeffs_out=coeffs, **hyper)
            ratios = [
                reference.lamb_step(*t[:4], step=step, grad_scale=grad_scale, param_copies=t[4], **hyper)
                for t in (ref, ideal)
            ]
    return kernel, ref, ideal, (coeffs, *ratios)


def check_all(kernel, ref, ideal, coeffs=None):
    """tests/kernel_checks.check_all, and the trust ratios against the reference's."""
    kernel_checks.check_all(kernel, ref, ideal)
    if coeffs is not None:
        got, want, _ = coeffs
        for i, (p, w) in enumerate(zip(kernel[0], want)):
            assert_close(got[i].cpu(), torch.tensor(w, dtype=F32), dtype=p.dtype, msg=f"trust ratio {i}")


# ------------------------------------------------------------------------------------------------ Adam


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_adam_every_dtype_combo_ragged_sizes(combo):
    check_all(*run_all("adam", SIZES, [combo], **ADAM)[:3])


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("grad_scale", [None, 3.0])
def test_adam_modes_on_a_mixed_dtype_list(adamw_mode, bias_correction, grad_scale):
    hyper = dict(ADAM, adamw_mode=adamw_mode, bias_correction=bias_correction)
    check_all(*run_all("adam", SIZES * 2, MODES_MIX, grad_scale=grad_scale, **hyper)[:3])


def test_adam_every_dtype_combo_in_one_call():
    """One launch per dtype combination, sizes ragged."""
    check_all(*run_all("adam", SIZES * 3, NO_COPY, **ADAM)[:3])


def test_adam_mixed_copy_dtypes_and_empty_tensors():
    check_all(*run_all("adam", [0, *SIZES, 0, 4099], WITH_COPY, **ADAM)[:3])


def test_adam_unaligned_views_of_a_flat_buffer():
    """Params and states as views of flat buffers at odd offsets (as ZeRO partitions are):
    a launch without the 16-byte alignment hint, beside an aligned one."""
    sizes, offsets = [1023, 4099, 17], [1, 1030, 5201]
    kernel = make_tensors(sizes, [(F32, BF16, F32, None)])
    flat = [torch.zeros(6000, dtype=ts[0].dtype, device=DEVICE) for ts in kernel[:4]]
    views = [[f[o : o + t.numel()].copy_(t) for o, t in zip(offsets, ts)] for f, ts in zip(flat, kernel[:4])]
    lists = [v + a for v, a in zip(views, make_tensors([4099], [(F32, BF16, F32, None)])[:4])]
    ref = clone_all(lists)
    adam_kernel(*lists, step=scalar(3), **ADAM)
    reference.adam_step(*ref, step=3, **ADAM)
    for k, r in zip(sum(lists, []), sum(ref, [])):
        assert_close(k, r)
    assert [g.aligned for g in _multi_tensor.work_list([*lists, None], 2048).groups] == [False, True]


def test_adam_bias_correction_is_exact_to_fp32():
    """From m = v = 0 with wd = 0 and eps ~ 0: p = -lr (1-b1) g / bc1 / (sqrt((1-b2) g^2) / sqrt(bc2)).
    bc2 = 1 - 0.999**t in fp32 would be 1e-5 off at t = 1."""
    steps = [1, 2, 10, 1000, 100000]
    for t in steps:
        p, g = torch.zeros(5, device=DEVICE), torch.full((5,), 0.5, device=DEVICE)
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        adam_kernel([p], [g], [m], [v], step=scalar(t), **dict(ADAM, lr=1.0, weight_decay=0.0, eps=1e-30))
        bc1, bc2 = 1 - 0.9**t, 1 - 0.999**t
        want = -(0.1 * 0.5 / bc1) / (math.sqrt(0.001 * 0.25) / math.sqrt(bc2))
        torch.testing.assert_close(p.double().cpu(), torch.full((5,), want, dtype=torch.float64), rtol=2e-6, atol=0)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's numpy, at 65520 -> inf
@pytest.mark.parametrize("c_dtype", [BF16, F16])
def test_adam_copy_rounds_exactly_like_torch(c_dtype):
    """lr = 0 leaves the fp32 master unchanged, so the copy must equal master.to(dtype)
    bit for bit: round to nearest even (ties too), subnormals, overflow."""
    ties = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 2.0 - 2**-9])
    special = torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, -70000.0, 6e-8, 3e-8, 1e-5, 3e38, float("inf")])
    master = torch.cat([torch.randn(9000) * torch.logspace(-9, 5, 9000), special, ties, -ties]).to(DEVICE)
    copy = torch.empty_like(master, dtype=c_dtype)
    m, v = torch.randn_like(master), torch.rand_like(master)
    adam_kernel(
        [master], [torch.randn_like(master)], [m], [v], step=scalar(3), param_copies=[copy], **dict(ADAM, lr=0.0)
    )
    assert torch.equal(copy.view(torch.int16), master.to(c_dtype).view(torch.int16))


@pytest.mark.parametrize("p_dtype", [BF16, F16])
def test_low_precision_params_round_trip_exactly(p_dtype):
    """With lr = 0 every finite bf16/fp16 value, subnormals included, survives the
    load, the fp32 math and the rounding store unchanged."""
    p = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(p_dtype)
    p = p[torch.isfinite(p.float())].to(DEVICE)
    before = p.clone()
    zeros = torch.zeros(p.shape, device=DEVICE)
    adam_kernel(
        [p], [torch.randn(p.shape, device=DEVICE)], [zeros], [zeros.clone()], step=scalar(1), **dict(ADAM, lr=0.0)
    )
    assert torch.equal(p, before)


# ------------------------------------------------------------------------------------------------ LAMB


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_lamb_every_dtype_combo_ragged_sizes(combo):
    """Clipping active (||g|| ~ 70 > max_grad_norm = 1), trust ratios clamped both ways."""
    kernel, ref, ideal, coeffs = run_all("lamb", SIZES + [300, 300], [combo], scales=LAMB_SCALES, **LAMB)
    check_all(kernel, ref, ideal, coeffs)
    assert max(coeffs[1]) == 10.0 and min(coeffs[1]) == 0.01, "both clamps were meant to be exercised"


@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_modes_on_a_mixed_dtype_list(eps_inside_sqrt, max_grad_norm, bias_correction):
    """An empty tensor gets ratio 1."""
    hyper = dict(LAMB, eps_inside_sqrt=eps_inside_sqrt, max_grad_norm=max_grad_norm, bias_correction=bias_correction)
    kernel, ref, ideal, coeffs = run_all("lamb", [0, *SIZES * 2], MODES_MIX, scales=LAMB_SCALES, **hyper)
    check_all(kernel, ref, ideal, coeffs)
    assert coeffs[0][0] == 1.0


def test_lamb_every_dtype_combo_in_one_call():
    """One launch per dtype combination and phase; the global grad norm spans them all."""
    check_all(*run_all("lamb", SIZES * 3, NO_COPY, scales=LAMB_SCALES, **LAMB))


def test_lamb_copies_and_a_zero_param():
    """Copies of mixed dtypes; a param of zeros has ||p|| = 0, so r = 1; a max_grad_norm
    above the norm (no clipping)."""
    kernel = make_tensors(SIZES, WITH_COPY)
    kernel[0][2].zero_()
    ref = clone_all(kernel)
    coeffs = torch.zeros(len(SIZES), device=DEVICE)
    hyper = dict(LAMB, max_grad_norm=1e4)
    lamb_kernel(*kernel[:4], step=scalar(1), param_copies=kernel[4], coeffs_out=coeffs, **hyper)
    want = reference.lamb_step(*ref[:4], step=1, param_copies=ref[4], **hyper)
    check_all(kernel, ref, ref, (coeffs, want, None))
    assert coeffs[2] == 1.0


# ------------------------------------------------------------------------------------------------ both


@pytest.mark.parametrize("opt", ["adam", "lamb"])
def test_found_inf_changes_nothing(opt):
    tensors = make_tensors(SIZES, WITH_COPY)
    coeffs = torch.full((len(SIZES),), -1.0, device=DEVICE)
    before = clone_all(tensors) + [[coeffs.clone()]]
    kw = dict(step=scalar(2), grad_scale=scalar(2.0), found_inf=scalar(1.0), param_copies=tensors[4])
    if opt == "adam":
        adam_kernel(*tensors[:4], **kw, **ADAM)
    else:
        lamb_kernel(*tensors[:4], **kw, coeffs_out=coeffs, **LAMB)
    for a, b in zip(sum(tensors, []) + [coeffs], sum(before, [])):
        assert torch.equal(a, b)


def test_bad_inputs_raise_clear_errors():
    p, g, m, v = make_tensors([7, 9], [(F32, F32, F32, None)])[:4]
    kw = dict(step=scalar(1), **ADAM)
    with pytest.raises(ValueError, match="2 params but 1 grads"):
        adam_kernel(p, g[:1], m, v, **kw)
    with pytest.raises(TypeError, match=r"exp_avgs\[1\] is torch.float16; optimizer states must be float32"):
        adam_kernel(p, g, [m[0], m[1].half()], v, **kw)
    with pytest.raises(TypeError, match="copies are bf16/fp16 copies of fp32 master params"):
        adam_kernel(p, g, m, v, param_copies=[x.clone() for x in p], **kw)
    with pytest.raises(ValueError, match=r"grads\[1\] has shape \(8,\)"):
        adam_kernel(p, [g[0], g[1][:8]], m, v, **kw)
    with pytest.raises(ValueError, match="contiguous"):
        adam_kernel([p[0], torch.randn(18, device=DEVICE)[::2]], g, m, v, **kw)
    with pytest.raises(TypeError, match="step must be a 0-d float32 tensor"):
        adam_kernel(p, g, m, v, **dict(kw, step=3))
    with pytest.raises(TypeError, match="coeffs_out must be a float32 tensor of shape"):
        lamb_kernel(p, g, m, v, step=scalar(1), coeffs_out=torch.zeros(3, device=DEVICE), **LAMB)


def test_work_list_covers_every_element_once_grouped_by_dtype():
    tensors = make_tensors([4099, 0, 1, 2048, 2049, 7], [(F32, F32, F32, None), (BF16, BF16, F32, None)])
    wl = _multi_tensor.work_list([*tensors[:4], None], 2048)
    assert [g.dtypes[0] for g in wl.groups] == [_multi_tensor.tl.float32, _multi_tensor.tl.bfloat16]
    assert wl.groups[0].begin == 0 and wl.groups[0].end == wl.groups[1].begin and wl.groups[1].end == wl.n_items
    covered = {}
    for t, s in zip(wl.item_tensor.tolist(), wl.item_start.tolist()):
        covered.setdefault(t, []).append(s)
    assert covered == {0: [0, 2048, 4096], 2: [0], 3: [0], 4: [0, 2048], 5: [0]}
    assert [sorted(wl.item_tensor[wl.groups[k].begin : wl.groups[k].end].tolist()) for k in (0, 1)] == [
        [0, 0, 0, 2, 4, 4],
        [3, 5],
    ]
    assert wl is _multi_tensor.work_list([*tensors[:4], None], 2048)  # cached: same tensors every step


_COMPILE_FOR_SM90 = """
import re, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastzero.triton_kernels import adam, lamb
F32_PTRS = {"step_ptr", "grad_scale_ptr", "found_inf_ptr", "clip_ptr", "coeffs_ptr", "sq_ptr", "g_sq_ptr", "out_ptr"}
def ptx(fn, fusion=True, num_warps=4, **const):
    sig = {n: "constexpr" if n in const else ("*fp32" if n in F32_PTRS else "*i64") if n.endswith("_ptr")
           else "i32" if n.startswith("n_") else "i64" if n.endswith("_bits") or n == "seed_mix" else "fp32"
           for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    options = {"num_warps": num_warps, "enable_fp_fusion": fusion}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
B = dict(BLOCK_SIZE=1024, BLOCKS_PER_ITEM=8)
A = dict(P_DTYPE=tl.float32, M_DTYPE=tl.float32, V_DTYPE=tl.float32, ALIGNED=True)
F = dict(HAS_GRAD_SCALE=True, HAS_FOUND_INF=True)
out = [ptx(adam._adam_kernel, **A, G_DTYPE=tl.bfloat16, C_DTYPE=tl.bfloat16, **F, ADAMW=True, BIAS_CORRECTION=True,
           STOCHASTIC=False, SR_PARAMS=False, **B),
       ptx(lamb._grad_sq_kernel, G_DTYPE=tl.float16, ALIGNED=True, HAS_GRAD_SCALE=True, **B),
       ptx(lamb._clip_kernel, BLOCK_SIZE=1024),
       ptx(lamb._phase1_kernel, **A, G_DTYPE=tl.float32, **F, HAS_CLIP=True, EPS_INSIDE_SQRT=False, **B),
       ptx(lamb._ratio_kernel, HAS_FOUND_INF=True, BLOCK_SIZE=1024),
       ptx(lamb._phase3_kernel, **A, G_DTYPE=tl.bfloat16, C_DTYPE=tl.float16, **F, HAS_CLIP=True,
           BIAS_CORRECTION=True, EPS_INSIDE_SQRT=True, **B),
       ptx(lamb._phase3_kernel, P_DTYPE=tl.bfloat16, G_DTYPE=tl.bfloat16, M_DTYPE=tl.bfloat16, V_DTYPE=tl.bfloat16,
           C_DTYPE=None, ALIGNED=False, HAS_GRAD_SCALE=False, HAS_FOUND_INF=False, HAS_CLIP=False,
           BIAS_CORRECTION=False, EPS_INSIDE_SQRT=False, **B)]
# bf16 states by stochastic rounding: the pinned update (launched without fp fusion) has no fp32 multiply-add
sr = ptx(adam._adam_kernel, False, P_DTYPE=tl.float32, G_DTYPE=tl.bfloat16, M_DTYPE=tl.bfloat16,
         V_DTYPE=tl.bfloat16, C_DTYPE=tl.bfloat16, ALIGNED=True, **F, ADAMW=False, BIAS_CORRECTION=True,
         STOCHASTIC=True, SR_PARAMS=False, **B)
assert "fma.rn.f32" not in sr, "a multiply-add in the pinned update"
out.append(sr)
# bf16 params by stochastic rounding (bf16_stochastic_round): the pinned update with fp32 states (rounded to
# nearest) and with bf16 states by stochastic rounding; full blocks still load 16 bytes at a time
for s_dt, stochastic in ((tl.float32, False), (tl.bfloat16, True)):
    s = ptx(adam._adam_kernel, False, P_DTYPE=tl.bfloat16, G_DTYPE=tl.float32, M_DTYPE=s_dt, V_DTYPE=s_dt,
            C_DTYPE=None, ALIGNED=True, **F, ADAMW=True, M_FROM_GRAD=False, BIAS_CORRECTION=True,
            STOCHASTIC=stochastic, SR_PARAMS=True, **B)
    assert "fma.rn.f32" not in s, "a multiply-add in the pinned update of stochastically rounded params"
    assert not re.search(r"(add|sub|mul|div|sqrt|neg)(\\.rn)?\\.ftz\\.f32", s), "fp32 flushed to zero"
    assert "ld.global.v4" in s, "SR params: loads not vectorized"
    out.append(s)
# int8 states: the pinned update too, and fp32 subnormals kept (no .ftz on fp32 arithmetic: the
# decode's product and y = |x| / scale may be subnormal, and y * 2^(23 - emin) must stay exact);
# the subnormal codes' fraction truncated (cvt.rzi); codes load 16 to a thread in full tiles
# (and bf16 params by stochastic rounding: SR_PARAMS)
for block, p_dt, c_dt, srp in ((256, tl.float32, tl.bfloat16, False), (4096, tl.bfloat16, None, False),
                               (256, tl.bfloat16, None, True)):
    rows, warps = adam.int8_launch_config(block)
    s = ptx(adam._adam_int8_kernel, False, warps, P_DTYPE=p_dt, G_DTYPE=tl.float16, C_DTYPE=c_dt, ALIGNED=True, **F,
            ADAMW=True, M_FROM_GRAD=False, BIAS_CORRECTION=True, SR_PARAMS=srp, BLOCK=block, ROWS=rows)
    assert "fma.rn.f32" not in s, "a multiply-add in the int8 kernel's pinned update"
    assert not re.search(r"(add|sub|mul|div|sqrt|min|max|neg)(\\.rn)?\\.ftz\\.f32", s), "fp32 flushed to zero"
    assert "cvt.rzi.s32.f32" in s and not re.search(r"cvt(\\.\\w+)*\\.ftz", s), "int8 codes: truncation flushed"
    assert "ld.global.v4.b32" in s, "int8 kernel: loads not vectorized"
    out.append(s)
for i in (0, 1, 3, 5, 7):
    assert "ld.global.v4" in out[i], f"kernel {i}: loads not vectorized"
assert not any(re.search(r"(div|sqrt)\\.(approx|full)\\.f32", s) for s in out), "approximate div/sqrt"
print("ok")
"""


def test_kernels_compile_for_sm90_with_vectorized_loads():
    """The interpreter does not compile: compile every kernel for an H100 (sm_90) with
    Triton's bundled ptxas, no GPU needed. Full blocks must use 16-byte loads, and no
    approximate division or square root may slip in."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton was installed without its NVIDIA backend (ptxas)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_COMPILE_FOR_SM90)], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
