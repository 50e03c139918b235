"""The CUDA Adam kernel with int8 block-wise states (state_format="int8":
fz_cuda_adam_int8 in csrc/cuda/multi_tensor_adam.cu, the codes in
csrc/cuda/int8_codes.cuh) against the rule (fastzero/ops/adam/int8_codes.py)
and the reference step, to the bit.

Without a GPU: int8_codes.cuh's encode (stochastic rounding, the step's) and
decode, the very functions the kernel calls, built for the host and checked
against the Python rule on every code, its midpoints and neighbours with the
extreme and random 16-bit integers, on subnormal codes and special blocks;
the C entry, linked and loaded without a driver, refusing bad arguments with
codes and messages; the Python side refusing bad input before any pointer
crosses (fake CUDA tensors). tests/ops/test_cuda_backend.py compiles every source for sm_80 and
sm_90 with warnings as errors.
On a GPU (``pytest -m gpu``): params, codes, scales and copies equal the
reference's (run on CPU copies) after several steps with fresh random grads,
the codes rounded with the bits of the seed.
The per-step constants come from fp64 on the device (libdevice's pow) and on
the host (glibc's): they agree after rounding to fp32 except with a
probability of about 1e-9 per constant, which these fixed hyperparameters and
steps do not meet (as in test_bf16_states_cuda.py)."""

import ctypes
import subprocess

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fastzero.native import abi, build
from fastzero.ops import FusedAdam
from fastzero.ops.adam import AdamHyperparams, reference
from fastzero.ops.adam import cuda as adam_cuda
from fastzero.ops.adam import int8_codes as ic
from tests.helpers import make_model, train
from tests.ops.test_cuda_backend import _driver_present, _nvcc_or_skip

F32, BF16, F16, U8 = torch.float32, torch.bfloat16, torch.float16, torch.uint8
FAKE = 1 << 20  # a device address never dereferenced: the calls below fail their checks first
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)


def same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit for bit, except that NaNs of a float dtype compare equal whatever
    their sign and payload (the GPU's NaN is not x86's)."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    a, b = a.reshape(-1), b.reshape(-1)
    view = {F32: torch.int32, BF16: torch.int16, F16: torch.int16, U8: U8}[a.dtype]
    same = a.view(view) == b.view(view)
    if a.dtype != U8:
        same |= a.isnan() & b.isnan()
    bad = (~same).nonzero().flatten()
    if bad.numel():
        i = bad[0].item()
        raise AssertionError(f"{what}: {bad.numel()} of {a.numel()} differ; first at {i}: {a[i]} vs {b[i]}")


# ---------------------------------------------------------------------------
# The codes, on the host: int8_codes.cuh against int8_codes.py

HOST_CODES = r"""
// The kernel's encode/decode, run on the host: a block's scale from the
// unsigned max of its |x| bits, then each element's code rounded with its
// 16-bit integer r, as adam_int8_kernel.
#include <algorithm>

#include "int8_codes.cuh"

using namespace fz::int8;

template <class Code>
void quantize(const float* x, const int32_t* r, int64_t n, int64_t block, uint8_t* codes, float* scales) {
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const int64_t len = std::min(block, n - b0);
    uint32_t absmax = 0;
    for (int64_t i = 0; i < len; ++i) absmax = std::max(absmax, bits_of(x[b0 + i]) & kAbsMask);
    const Scale s = scale_of(absmax);
    for (int64_t i = 0; i < len; ++i) codes[b0 + i] = uint8_t(encode<Code>(x[b0 + i], s, uint32_t(r[b0 + i])));
    scales[b0 / block] = s.scale;
  }
}

template <class Code>
void dequantize(const uint8_t* codes, const float* scales, int64_t n, int64_t block, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = Code::decode(codes[i], scales[i / block]);
}

extern "C" {
void fzt_quantize(int sq, const float* x, const int32_t* r, int64_t n, int64_t block, uint8_t* codes,
                  float* scales) {
  sq ? quantize<ExpAvgSqCode>(x, r, n, block, codes, scales) : quantize<ExpAvgCode>(x, r, n, block, codes, scales);
}
void fzt_dequantize(int sq, const uint8_t* codes, const float* scales, int64_t n, int64_t block, float* out) {
  sq ? dequantize<ExpAvgSqCode>(codes, scales, n, block, out) : dequantize<ExpAvgCode>(codes, scales, n, block, out);
}
}
"""


@pytest.fixture(scope="module")
def host_codes(tmp_path_factory):
    """int8_codes.cuh compiled by nvcc for the host: plain IEEE fp32 on x86,
    no contraction (as the _rn intrinsics on the device), subnormals kept."""
    nvcc = _nvcc_or_skip()
    out = tmp_path_factory.mktemp("int8-host")
    (out / "codes.cu").write_text(HOST_CODES)
    lib = out / "libcodes.so"
    includes = [f"-I{d}" for d in build.cuda_includes()]
    flags = ["-std=c++17", "-O2", "-shared", "-Xcompiler=-fPIC,-ffp-contract=off", "-Werror=all-warnings"]
    subprocess.run([nvcc, *flags, *includes, str(out / "codes.cu"), "-o", str(lib)], check=True, capture_output=True)
    return ctypes.CDLL(str(lib))


def host_quantize(lib, code, x, block, r):
    x, r = x.float().contiguous(), r.to(torch.int32).contiguous()
    assert r.numel() == x.numel()
    codes = torch.zeros(x.numel(), dtype=U8)
    scales = torch.zeros(ic.blocks_of(x.numel(), block))
    lib.fzt_quantize(
        int(not code.signed), ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(r.data_ptr()), ctypes.c_int64(x.numel()),
        ctypes.c_int64(block), ctypes.c_void_p(codes.data_ptr()), ctypes.c_void_p(scales.data_ptr()),
    )  # fmt: skip
    return codes, scales


def host_dequantize(lib, code, codes, scales, block):
    out = torch.empty(codes.numel())
    lib.fzt_dequantize(
        int(not code.signed), ctypes.c_void_p(codes.data_ptr()), ctypes.c_void_p(scales.data_ptr()),
        ctypes.c_int64(codes.numel()), ctypes.c_int64(block), ctypes.c_void_p(out.data_ptr()),
    )  # fmt: skip
    return out


def code_values(code) -> torch.Tensor:
    """Every magnitude code's value, 0 to 1 (the code of 1.0)."""
    return ic.value(code, torch.arange(code.top + 1))


def tie_cases(code) -> torch.Tensor:
    """y in [0, 1] on every code, at every midpoint between two codes, and next
    to both: where rounding decides (a value on a code never moves, a midpoint
    moves up for r >= 2^15; the top subnormal binade holds y one bit finer
    than the subnormal grid)."""
    vals = code_values(code)
    mids = (vals[:-1].double() + vals[1:].double()).div(2).float()  # exact: one bit more than a code
    pts = torch.cat([vals, mids])
    inf = torch.tensor(float("inf"))
    ys = torch.cat([pts, torch.nextafter(pts, inf), torch.nextafter(pts, -inf)]).clamp(0, 1)
    return ys


def special_blocks(block: int) -> torch.Tensor:
    """Blocks of `block` elements, each with its own case; the last one partial."""
    gen = torch.Generator().manual_seed(3)
    rand = lambda: torch.randn(block, generator=gen)  # noqa: E731
    wide = lambda: rand() * torch.exp2(-40 * torch.rand(block, generator=gen))  # noqa: E731  (every subnormal code)
    tiny = torch.full((block,), 2.0**-140)  # fp32 subnormals only: scale 0
    tiny[1::2] *= -1
    blocks = [
        wide(),
        wide() * 2.0**-100,
        wide() * 2.0**120,
        torch.zeros(block),
        -torch.zeros(block),  # -0.0: exp_avg keeps the sign bit
        tiny,
        torch.where(torch.arange(block) == 5, 2.0**-126, wide() * 2.0**-127),  # smallest normal scale
        torch.where(torch.arange(block) == 7, 3.0e38, wide() * 3.0e38),  # 1 / scale is an fp32 subnormal
        torch.where(torch.arange(block) == 3, float("inf"), rand()),
        torch.where(torch.arange(block) == 9, float("-inf"), rand()),
        torch.where(torch.arange(block) == 0, float("nan"), rand()),
        wide()[: block // 2 + 3],  # a partial last block
    ]
    return torch.cat(blocks)


# 16-bit integers at the ends and the middle of their range: truncation (0), all but a hair up (0xFFFF)
EDGE_R = (0, 1, 0x7FFF, 0x8000, 0xFFFF)


def random_r(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1 << 16, (n,), generator=torch.Generator().manual_seed(seed))


def check_quantize(lib, code, x, block, r):
    got = host_quantize(lib, code, x, block, r)
    want = ic.quantize(code, x, block, r)
    same_bits(got[1], want[1], f"{code.name} scales (block {block})")
    same_bits(got[0], want[0], f"{code.name} codes (block {block})")


@pytest.mark.parametrize("code", ic.CODES, ids=lambda c: c.name)
def test_host_decode_is_the_rule_on_every_code(host_codes, code):
    scales = torch.tensor([1.0, 0.0, float("nan"), 2.0**-126, 3.0e38, 0.37, 1.0e-20, 7.5e10, 2.0**-140])
    block = 256
    codes = torch.arange(256).repeat(len(scales)).to(U8)  # every byte, those above the code of 1 too
    got = host_dequantize(host_codes, code, codes, scales, block)
    same_bits(got, ic.dequantize(code, codes, scales, block), f"{code.name} decoded")


@pytest.mark.parametrize("code", ic.CODES, ids=lambda c: c.name)
def test_host_encode_of_every_code_its_midpoints_and_neighbours(host_codes, code):
    """Every code byte's value, the midpoints and their fp32 neighbours, with
    each r of EDGE_R for all of them and then random r."""
    ys = tie_cases(code)
    block = 4096
    for scale in (1.0, 2.0**-120, 0.37):  # the block's max (ys holds 1); a power of two keeps y exact
        x = ys * scale
        if code.signed:
            x[1::2] *= -1
        for r in EDGE_R:
            check_quantize(host_codes, code, x, block, torch.full_like(x, r, dtype=torch.int64))
        for seed in range(4):
            check_quantize(host_codes, code, x, block, random_r(x.numel(), seed))


@pytest.mark.parametrize("code", ic.CODES, ids=lambda c: c.name)
@pytest.mark.parametrize("block", [64, 256, 4096])
def test_host_encode_of_special_blocks(host_codes, code, block):
    x = special_blocks(block)
    for r in (torch.zeros(x.numel(), dtype=torch.int64), random_r(x.numel(), block)):
        check_quantize(host_codes, code, x, block, r)


@pytest.mark.parametrize("code", ic.CODES, ids=lambda c: c.name)
def test_host_encode_of_random_states(host_codes, code):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(100003, generator=gen) * torch.exp2(-30 * torch.rand(100003, generator=gen))
    check_quantize(host_codes, code, x if code.signed else x * x, 256, random_r(x.numel(), 12))


def test_cuda_build_keeps_subnormals():
    """The kernel's update and codes keep fp32 subnormals (as the reference's
    CPU math does): no flush-to-zero, no fast math in the CUDA flags."""
    flags = " ".join(build.NVCCFLAGS)
    assert "-ftz=true" not in flags and "use_fast_math" not in flags, flags


# ---------------------------------------------------------------------------
# The C entry, without a GPU


@pytest.fixture(scope="module")
def adam_lib(tmp_path_factory):
    """common.cu and multi_tensor_adam.cu for sm_90, linked and loaded (cudart
    is static: this works without a driver), with the signatures of
    fastzero.native.abi."""
    nvcc = _nvcc_or_skip()
    out = tmp_path_factory.mktemp("adam-lib")
    src = build.cuda_source_dir()
    names = ("common.cu", "multi_tensor_adam.cu")
    objects = [build.compile_source(src / n, out / f"{n}.o", ("90",), nvcc=nvcc) for n in names]
    lib = ctypes.CDLL(str(build.link(objects, out / build.CUDA_LIBRARY, nvcc)))
    for name in ("fz_cuda_last_error", "fz_cuda_adam_int8"):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = abi.CUDA_SIGNATURES[name]
    return lib


def _ptrs(*values):
    return (ctypes.c_void_p * len(values))(*values)


def _int8(lib, *, numel=(5, 70000), dtypes=(0, 0, -1), block=256, copy=None, m_scales=None, hyper=True, step=FAKE,
          m=None, p=None, seed=0, sr_params=0):  # fmt: skip
    n = len(numel)
    fake = _ptrs(*[FAKE] * n)
    hp = ctypes.byref(AdamHyperparams().c_struct()) if hyper else None
    return lib.fz_cuda_adam_int8(
        p or fake, fake, m or fake, fake, copy, m_scales or fake, fake, (ctypes.c_int64 * n)(*numel), n,
        *dtypes, block, hp, step, None, None, seed, sr_params, None,
    )  # fmt: skip


def test_entry_refuses_bad_arguments(adam_lib):
    lib = adam_lib
    for block in (0, 32, 100, 8192, -256):
        assert _int8(lib, block=block) == 1
        assert b"block_size" in lib.fz_cuda_last_error() and b"power of two from 64 to 4096" in lib.fz_cuda_last_error()
    assert _int8(lib, hyper=False) == 1
    assert b"hyper is null" in lib.fz_cuda_last_error()
    assert _int8(lib, step=None) == 1
    assert b"step is null" in lib.fz_cuda_last_error()
    assert _int8(lib, dtypes=(0, 0, 2)) == 1
    assert b"a copy dtype without copies" in lib.fz_cuda_last_error()
    assert _int8(lib, numel=(5, -1)) == 1
    assert b"params[1] has -1 elements" in lib.fz_cuda_last_error()
    assert _int8(lib, p=_ptrs(FAKE, None)) == 1
    assert b"params[1] is a null pointer" in lib.fz_cuda_last_error()
    assert _int8(lib, m=_ptrs(None, FAKE)) == 1
    assert b"exp_avgs[0] is a null pointer" in lib.fz_cuda_last_error()
    assert _int8(lib, m_scales=_ptrs(FAKE, None)) == 1
    assert b"exp_avg_absmax[1] is a null pointer" in lib.fz_cuda_last_error()
    assert _int8(lib, m_scales=_ptrs(FAKE, FAKE + 2)) == 1
    assert b"exp_avg_absmax[1] is not aligned to its float32 elements" in lib.fz_cuda_last_error()
    # params of one dtype with copies of another, or of no known dtype
    for dtypes in ((0, 0, 0), (1, 0, 1), (2, 0, 1), (3, 0, -1), (0, 7, -1)):
        assert _int8(lib, dtypes=dtypes, copy=_ptrs(FAKE, FAKE)) == 1
        assert b"fz_cuda_adam_int8: unsupported dtypes" in lib.fz_cuda_last_error()
    # an empty tensor needs no pointers, nor scales
    assert _int8(lib, numel=(0,), p=_ptrs(None), m=_ptrs(None), m_scales=_ptrs(None)) == 0
    # nothing to do is fine, and touches no CUDA API
    assert _int8(lib, numel=(), step=None) == 0


def test_codes_need_no_alignment_and_the_launch_fails_without_a_driver(adam_lib):
    if _driver_present():
        pytest.skip("a CUDA driver is installed: launching at fake pointers would run")
    lib = adam_lib
    assert _int8(lib, m=_ptrs(FAKE + 1, FAKE + 3), dtypes=(0, 2, 1), copy=_ptrs(FAKE, FAKE)) == 2
    assert b"adam_int8_kernel" in lib.fz_cuda_last_error()
    for block in (64, 4096):
        assert _int8(lib, block=block, dtypes=(2, 1, -1)) == 2


# ---------------------------------------------------------------------------
# The Python side, on any machine: fake CUDA tensors (shapes, dtypes and
# devices, no memory) reach every check; past them, the call needs the library.


def fake_lists(sizes=(5, 300), block=256, *, p_dtype=F32, devices=("cuda:0",) * 7, code_dtype=U8, blocks=None):
    with FakeTensorMode():
        p = [torch.zeros(n, dtype=p_dtype, device=devices[0]) for n in sizes]
        g = [torch.zeros(n, device=devices[1]) for n in sizes]
        m = [torch.zeros(n, dtype=code_dtype, device=devices[2]) for n in sizes]
        v = [torch.zeros(n, dtype=code_dtype, device=devices[3]) for n in sizes]
        counts = blocks or [ic.blocks_of(n, block) for n in sizes]
        ms = [torch.zeros(k, device=devices[5]) for k in counts]
        vs = [torch.zeros(k, device=devices[6]) for k in counts]
        step = torch.zeros((), device=devices[4])
    return p, g, m, v, ms, vs, step


def fake_step(lists, **kw):
    p, g, m, v, ms, vs, step = lists
    args = dict(state_format="int8", exp_avg_absmax=ms, exp_avg_sq_absmax=vs, **HYPER)
    args.update(kw)
    adam_cuda.adam_step(p, g, m, v, step=step, **args)


@pytest.mark.parametrize(
    "lists, kw, error, match",
    [
        (dict(code_dtype=F32), {}, TypeError, r"exp_avgs\[0\] is torch.float32; int8 states .* are uint8 codes"),
        (dict(blocks=[1, 1]), {}, ValueError, r"exp_avg_absmax\[1\] has 1 elements; params\[1\] \(300 elements\)"),
        ({}, dict(block_size=64), ValueError, r"exp_avg_absmax\[1\] has 2 elements; .* has 5 blocks of 64"),
        ({}, dict(block_size=100), ValueError, r"block_size=100; int8 states take a power of two from 64 to 4096"),
        ({}, dict(block_size=8192), ValueError, "a power of two from 64 to 4096"),
        ({}, dict(block_size=True), ValueError, "a power of two from 64 to 4096"),
        ({}, dict(exp_avg_absmax=None), ValueError, "state_format='int8' needs exp_avg_absmax"),
        ({}, dict(state_format="bf16"), ValueError, "exp_avg_absmax / exp_avg_sq_absmax are the block scales"),
        ({}, dict(seed=-1), ValueError, "seed must be an int in"),
        ({}, dict(seed=1 << 32), ValueError, "seed must be an int in"),
        (dict(devices=("cuda:0",) * 6 + ("cuda:1",)), {}, ValueError, r"exp_avg_sq_absmax\[0\] is on cuda:1"),
        (dict(devices=("cuda:0", "cuda:1") + ("cuda:0",) * 5), {}, ValueError, r"grads\[0\] is on cuda:1 but params"),
        (
            dict(devices=("cuda:0",) * 3 + ("cuda:1",) + ("cuda:0",) * 3),
            {},
            ValueError,
            r"exp_avg_sqs\[0\] is on cuda:1",
        ),
        (
            dict(devices=("cuda:0",) * 4 + ("cuda:1",) + ("cuda:0",) * 2),
            {},
            ValueError,
            "step is on cuda:1 but the params",
        ),
    ],
)
def test_python_checks_refuse_bad_input(lists, kw, error, match):
    with pytest.raises(error, match=match):
        fake_step(fake_lists(**lists), **kw)


def test_cpu_tensors_are_refused_with_a_pointer_to_the_cpu_path():
    p, g = [torch.zeros(5)], [torch.zeros(5)]
    m, v = [torch.zeros(5, dtype=U8)], [torch.zeros(5, dtype=U8)]
    scales = dict(exp_avg_absmax=[torch.zeros(1)], exp_avg_sq_absmax=[torch.zeros(1)])
    with pytest.raises(ValueError, match=r"params\[0\] is on cpu.*CPUAdam"):
        adam_cuda.adam_step(p, g, m, v, step=torch.tensor(1.0), state_format="int8", **scales, **HYPER)
    p, g, m, v, _, _, step = fake_lists((5,))
    with pytest.raises(ValueError, match=r"exp_avg_absmax\[0\] is on cpu; it must be on the param's device"):
        adam_cuda.adam_step(p, g, m, v, step=step, state_format="int8", **scales, **HYPER)


def test_good_input_passes_every_check_and_reaches_the_launch(monkeypatch):
    seen = {}
    monkeypatch.setattr(adam_cuda, "launch", lambda *a, **kw: seen.update(kw))
    lists = fake_lists(block=64)
    fake_step(lists, block_size=64, seed=9)
    assert seen["state_format"] == "int8" and seen["block_size"] == 64 and seen["seed"] == 9
    assert seen["exp_avg_absmax"] is lists[4] and seen["exp_avg_sq_absmax"] is lists[5]


# ---------------------------------------------------------------------------
# On a GPU: the kernel against the reference, to the bit

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SIZES = [0, 1, 7, 63, 64, 65, 1000, 4099, 65536 + 4096 + 13, 3 * 65536 + 77]  # tails, chunks, ragged blocks
COMBOS = [(F32, F32, None), (F32, BF16, BF16), (F32, F16, F16), (BF16, BF16, None), (F16, F32, None), (BF16, F16, None)]
STEPS = 5


def combo_id(c):
    return "-".join(str(d).split(".")[-1] if d else "none" for d in c)


def wide(n, gen=None):
    """Normal values times 2^-U(0, 40): blocks whose small elements take
    every subnormal code of both states."""
    return torch.randn(n, generator=gen) * torch.exp2(-40 * torch.rand(n, generator=gen))


def make(sizes, combo, block, *, grads=torch.randn):
    """params, grads, exp_avg codes, exp_avg_sq codes, copies, their scales
    (CPU tensors): states quantized from random fp32 moments."""
    p_dt, g_dt, c_dt = combo
    m = [ic.quantize(ic.EXP_AVG, 0.1 * wide(n), block) for n in sizes]
    v = [ic.quantize(ic.EXP_AVG_SQ, 0.01 * wide(n) ** 2, block) for n in sizes]
    return [
        [torch.randn(n).to(p_dt) for n in sizes],
        [grads(n).to(g_dt) for n in sizes],
        [c for c, _ in m],
        [c for c, _ in v],
        None if c_dt is None else [torch.zeros(n, dtype=c_dt) for n in sizes],
        [s for _, s in m],
        [s for _, s in v],
    ]


def to_cuda(lists, unaligned=False):
    def move(x):
        x = x.cuda()
        return torch.cat([x.new_zeros(1), x])[1:] if unaligned else x  # one element in: the scalar path

    return [None if ts is None else [move(x) for x in ts] for ts in lists]


def step_both(kernel, ref, step, block, grad_scale=None, found_inf=None, seed=None, **hyper):
    scale = None if grad_scale is None else torch.tensor(grad_scale, device="cuda")
    adam_cuda.adam_step(
        *kernel[:4],
        step=torch.tensor(float(step), device="cuda"),
        grad_scale=scale,
        found_inf=found_inf,
        param_copies=kernel[4],
        state_format="int8",
        exp_avg_absmax=kernel[5],
        exp_avg_sq_absmax=kernel[6],
        block_size=block,
        seed=seed,
        **hyper,
    )
    reference.adam_step(
        *ref[:4],
        step=step,
        grad_scale=None if scale is None else scale.item(),  # the fp32 value the kernel reads
        param_copies=ref[4],
        state_format="int8",
        exp_avg_absmax=ref[5],
        exp_avg_sq_absmax=ref[6],
        block_size=block,
        seed=seed,
        **hyper,
    )


def check(kernel, ref):
    torch.cuda.synchronize()
    names = ("param", "grad", "exp_avg", "exp_avg_sq", "copy", "exp_avg_absmax", "exp_avg_sq_absmax")
    for name, ks, rs in zip(names, kernel, ref):
        for i, (k, r) in enumerate(zip(ks or [], rs or [])):
            same_bits(k.cpu(), r, f"{name} {i} (numel {k.numel()}, {k.dtype})")


def run(sizes, combo, block, *, steps=STEPS, grads=torch.randn, unaligned=False, grad_scale=None, seed=None, **hyper):
    ref = make(sizes, combo, block, grads=grads)
    kernel = to_cuda(ref, unaligned)
    for step in range(1, steps + 1):
        if step > 1:
            for k, r in zip(kernel[1], ref[1]):
                r.copy_(grads(r.numel()).to(r.dtype))
                k.copy_(r)
        step_both(kernel, ref, step, block, grad_scale, seed=seed, **hyper)
    check(kernel, ref)
    return kernel


@gpu
@needs_cuda
@pytest.mark.parametrize("block", [64, 256, 4096])
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_every_combo_size_and_block_to_the_bit(combo, block):
    torch.manual_seed(1)
    run(SIZES, combo, block, **HYPER)


@gpu
@needs_cuda
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("grad_scale", [None, 1024.0, 3.7])
def test_modes_and_grad_scale(adamw_mode, bias_correction, grad_scale):
    torch.manual_seed(2)
    hyper = dict(HYPER, adamw_mode=adamw_mode, bias_correction=bias_correction)
    run([17, 4099, 70001], (F32, BF16, BF16), 256, grad_scale=grad_scale, seed=2**32 - 1, **hyper)


@gpu
@needs_cuda
@pytest.mark.parametrize("block", [64, 4096])
def test_wide_grads_take_every_subnormal_code(block):
    torch.manual_seed(3)
    kernel = run([5000, 70001], (F32, F32, None), block, grads=wide, seed=17, **HYPER)
    for codes in (kernel[2][1] & 0x7F, kernel[3][1]):
        assert set(range(8)) <= set(codes.unique().tolist())  # codes 0-7: every subnormal one


@gpu
@needs_cuda
def test_unaligned_views_take_the_scalar_path():
    torch.manual_seed(4)
    kernel = run([1, 9, 4099, 70001], (F32, BF16, F16), 64, unaligned=True, **HYPER)
    assert kernel[2][0].data_ptr() % 8 != 0 and kernel[0][0].data_ptr() % 16 != 0


@gpu
@needs_cuda
def test_long_ragged_mixed_lists():
    """More tensors than one table holds (30), a tensor over more chunks than
    one launch runs (320), and several dtype groups in one call."""
    torch.manual_seed(5)
    gen = torch.Generator().manual_seed(0)
    sizes = [int(n) for n in torch.randint(1, 5000, (70,), generator=gen)]
    sizes[3] = 321 * 65536 + 5
    ref = make(sizes, (F32, F32, None), 256)
    for i in range(1, len(sizes), 2):  # every other tensor: bf16 params and fp16 grads
        ref[0][i], ref[1][i] = ref[0][i].to(BF16), ref[1][i].to(F16)
    kernel = to_cuda(ref)
    for step in (1, 2):
        step_both(kernel, ref, step, 256, **HYPER)
    check(kernel, ref)


@gpu
@needs_cuda
def test_ties_through_the_whole_step():
    """beta1 = 0 and lr = 0: the new exp_avg is the grad itself; a block's max
    of 1 makes y the grad, set at and next to every midpoint of the codes."""
    ys = tie_cases(ic.EXP_AVG)
    g = torch.cat([torch.ones(1), ys])
    g[1::3] *= -1
    ref = make([g.numel()], (F32, F32, None), 4096)
    ref[1][0] = g
    ref[2][0].zero_()  # exp_avg 0: m = g exactly
    ref[5][0].zero_()
    kernel = to_cuda(ref)
    step_both(kernel, ref, 1, 4096, **dict(HYPER, lr=0.0, beta1=0.0, weight_decay=0.0))
    check(kernel, ref)


@gpu
@needs_cuda
def test_zero_subnormal_and_non_finite_blocks():
    """A zero block (scale 0), a block of fp32 subnormals (scale 0), blocks
    with an inf or a NaN grad (scale NaN, codes 0, NaN from then on), and
    untouched blocks beside them."""
    block = 64
    g = torch.randn(8 * block + 5)
    g[:block] = 0.0
    g[block : 2 * block] = 2.0**-140
    g[2 * block + 3] = float("inf")
    g[4 * block + 7] = float("nan")
    g[6 * block] = float("-inf")
    ref = make([g.numel()], (F32, F32, BF16), block)
    ref[1][0] = g
    for states, scales in ((ref[2][0], ref[5][0]), (ref[3][0], ref[6][0])):
        states[: 2 * block].zero_()
        scales[:2].zero_()
    kernel = to_cuda(ref)
    for step in (1, 2, 3):
        step_both(kernel, ref, step, block, **HYPER)
    check(kernel, ref)
    scales = kernel[5][0].cpu()
    assert scales[0] == 0 and scales[1] == 0 and scales[2].isnan() and scales[4].isnan() and scales[6].isnan()
    assert scales[3].isfinite() and scales[5].isfinite()


@gpu
@needs_cuda
@pytest.mark.parametrize("flag", [1.0, float("inf"), float("nan")])
def test_found_inf_changes_nothing(flag):
    torch.manual_seed(6)
    ref = make([7, 4099, 70001], (F32, F16, BF16), 256)
    kernel = to_cuda(ref)
    before = [None if ts is None else [x.clone() for x in ts] for ts in kernel]
    found = torch.tensor(flag, device="cuda")
    adam_cuda.adam_step(
        *kernel[:4],
        step=torch.tensor(3.0, device="cuda"),
        found_inf=found,
        param_copies=kernel[4],
        state_format="int8",
        exp_avg_absmax=kernel[5],
        exp_avg_sq_absmax=kernel[6],
        **HYPER,
    )
    check(kernel, [[x.cpu() for x in ts] for ts in before])
    found.zero_()  # 0: the step runs as without one
    step_both(kernel, ref, 3, 256, found_inf=found, **HYPER)
    check(kernel, ref)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype, master", [(F32, False), (BF16, True)])
def test_fused_adam_on_a_gpu_equals_the_reference_to_the_bit(dtype, master):
    a, b = make_model(dtype).cuda(), make_model(dtype)
    kw = dict(lr=1e-2, weight_decay=0.01, state_format="int8", block_size=64, master_weights=master)
    opt_gpu, opt_ref = FusedAdam(a.parameters(), **kw), FusedAdam(b.parameters(), backend="reference", **kw)
    train(a, opt_gpu, 4)
    train(b, opt_ref, 4)
    assert opt_gpu.last_backend == "cuda"
    keys = ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax") + (("master_param",) if master else ())
    for p, q in zip(a.parameters(), b.parameters()):
        same_bits(p.detach().cpu(), q.detach(), "param")
        for key in keys:
            same_bits(opt_gpu.state[p][key].cpu(), opt_ref.state[q][key], key)
