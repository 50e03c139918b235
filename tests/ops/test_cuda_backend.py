"""The CUDA backend (csrc/cuda, fastzero/ops/cuda.py).

Without a GPU: every CUDA source compiles for sm_80 and sm_90 with warnings
as errors, the library links, loads and exports exactly its C ABI, whose
errors come back as codes and messages; the Python side refuses bad input
before any pointer crosses and imports fine without CUDA.
On a GPU (``pytest -m gpu``): adam_step and lamb_step against the references
over several steps, for every dtype combination, awkward sizes, unaligned
views, long ragged lists, grad_scale, found_inf, clipping and param copies.
"""

import ctypes
import os
import shutil
import subprocess

import pytest
import torch

from fastzero.native import abi, build, loader
from fastzero.ops import reference
from fastzero.ops.adam import AdamHyperparams
from fastzero.ops.adam import cuda as adam_cuda
from fastzero.ops.lamb import LambHyperparams
from fastzero.ops.lamb import cuda as lamb_cuda
from fastzero.ops.tolerances import assert_close
from tests.kernel_checks import check_all, clone_all

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# ---------------------------------------------------------------------------
# Build checks (nvcc, no GPU)


def _nvcc_or_skip() -> str:
    try:
        return build.find_nvcc()
    except build.BuildError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must compile the CUDA sources, but: {exc}")
        pytest.skip(f"no CUDA compiler here: {exc}")


@pytest.fixture(scope="module")
def cuda_objects(tmp_path_factory):
    """Every source compiled once per arch (sm_80, sm_90), shared by the tests."""
    _nvcc_or_skip()
    return build.compile_check(build.CUDA_ARCHS, tmp_path_factory.mktemp("cuda-objects"))


@pytest.fixture(scope="module")
def cuda_library(cuda_objects, tmp_path_factory):
    """The shared library linked from the sm_90 objects, loaded with ctypes
    (it links cudart statically, so this works without a driver)."""
    path = build.link(cuda_objects["90"], tmp_path_factory.mktemp("cuda-lib") / build.CUDA_LIBRARY)
    return path, loader.bind_cuda(ctypes.CDLL(str(path)))


def test_every_cuda_source_compiles(cuda_objects):
    """compile_check refuses a .cu missing from SOURCES, so every one is here."""
    assert sorted(cuda_objects) == sorted(build.CUDA_ARCHS) == ["80", "90"]
    for arch, objects in cuda_objects.items():
        assert [o.name for o in objects] == [f"{n.removesuffix('.cu')}.sm_{arch}.o" for n in build.CUDA_SOURCES]
        for o in objects:
            assert o.stat().st_size > 0, o


def test_warnings_fail_the_build(tmp_path):
    """The flags turn device-code warnings into errors (a check that can fail)."""
    nvcc = _nvcc_or_skip()
    src = tmp_path / "warn.cu"
    src.write_text("__global__ void k(float* x) { int unused = 3; x[0] = 1.0f; }\n")
    with pytest.raises(build.BuildError, match="unused"):
        build.compile_source(src, tmp_path / "warn.o", ("90",), nvcc=nvcc)
    src.write_text("__global__ void k(float* x) { x[0] = 1.0f; }\n")
    build.compile_source(src, tmp_path / "ok.o", ("90",), nvcc=nvcc)


def test_library_exports_exactly_the_c_abi(cuda_library):
    path, lib = cuda_library
    assert lib.fz_cuda_abi_version() == abi.CUDA_ABI_VERSION
    assert lib.fz_cuda_chunk_elems() == 65536
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm to list the exported symbols")
    out = subprocess.run([nm, "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert exported == set(abi.CUDA_SIGNATURES)  # no cudart or C++ runtime symbol leaks out


def test_link_leaves_nothing_beside_the_library(cuda_library):
    """The linker's version script stays in a temporary folder (an in-place
    install links into the source tree)."""
    path, _ = cuda_library
    assert [p.name for p in path.parent.iterdir()] == [build.CUDA_LIBRARY]


def test_library_needs_no_cudart_at_load_time(cuda_library):
    path, _ = cuda_library
    ldd = shutil.which("ldd")
    if ldd is None:
        pytest.skip("no ldd")
    deps = subprocess.run([ldd, str(path)], capture_output=True, text=True).stdout
    assert "libcudart" not in deps and "libcuda.so" not in deps, deps


TABLES_CHECK = r"""
// Host-only: builds the chunk tables of many lists with a fake launch that
// checks every block's tensor, pointers, size, chunk and output slot.
#include <cstdio>
#include <random>
#include <vector>

#include "common.cuh"

using namespace fz;

int bad = 0;

void fail(const char* what, int64_t a, int64_t b) {
  if (bad++ < 10) std::printf("FAIL %s: %lld vs %lld\n", what, (long long)a, (long long)b);
}

template <int kDepth>
void check(const std::vector<int64_t>& numel) {
  const int n = int(numel.size());
  std::vector<std::vector<void*>> ptrs(kDepth, std::vector<void*>(n));
  void* const* lists[kDepth];
  for (int d = 0; d < kDepth; ++d) {
    for (int t = 0; t < n; ++t) ptrs[d][t] = reinterpret_cast<void*>(uintptr_t((d + 1) * 1000000 + t) * 256);
    lists[d] = ptrs[d].data();
  }
  std::vector<int64_t> first_slot(n + 1, 0);  // the caller's chunk numbering
  for (int t = 0; t < n; ++t) first_slot[t + 1] = first_slot[t] + num_chunks(numel[t]);
  std::vector<int> seen(first_slot[n], 0);
  auto launch = [&](const TensorListMeta<kDepth>& meta, int blocks) {
    if (blocks <= 0 || blocks > kMaxBlocks) fail("blocks", blocks, kMaxBlocks);
    for (int b = 0; b < blocks; ++b) {
      const int local = meta.block_to_tensor[b], t = meta.first_tensor + local;
      if (local >= TensorListMeta<kDepth>::kMaxTensors || t < 0 || t >= n) {
        fail("tensor", t, n);
        continue;
      }
      for (int d = 0; d < kDepth; ++d)
        if (meta.addr[d][local] != ptrs[d][t]) fail("addr", t, d);
      if (meta.numel[local] != numel[t]) fail("numel", meta.numel[local], numel[t]);
      const int64_t chunk = meta.block_to_chunk[b];
      if (meta.first_chunk + b != first_slot[t] + chunk) fail("slot", meta.first_chunk + b, first_slot[t] + chunk);
      if (chunk < 0 || chunk >= num_chunks(numel[t])) fail("chunk", chunk, t);
      else ++seen[first_slot[t] + chunk];
    }
    return 0;
  };
  if (multi_tensor_apply<kDepth>(lists, numel.data(), n, launch) != 0) fail("rc", 1, 0);
  for (size_t i = 0; i < seen.size(); ++i)
    if (seen[i] != 1) fail("coverage", int64_t(i), seen[i]);
}

int main() {
  const int64_t full = int64_t(kMaxBlocks) * kChunkSize;  // one launch's worth
  std::vector<std::vector<int64_t>> cases = {
      {}, {0}, {0, 0, 0}, {1}, {65536}, {65537}, {full}, {full, 5}, {full + 1, 5}, {3 * full + 7 * 65536 - 3, 0, 9},
      std::vector<int64_t>(500, 0), std::vector<int64_t>(1000, 1)};
  cases[10].push_back(3);
  std::mt19937_64 rng(7);
  for (int k = 0; k < 40; ++k) {
    std::vector<int64_t> v(1 + rng() % 400);
    for (auto& x : v) {
      const int r = int(rng() % 10);
      const int64_t top = r < 7 ? 70000 : r < 9 ? 5 * kChunkSize : 700 * int64_t(kChunkSize);
      x = r == 0 ? 0 : int64_t(rng() % top);
    }
    cases.push_back(v);
  }
  for (auto& c : cases) {
    check<1>(c);
    check<4>(c);
    check<5>(c);
    check<7>(c);  // int8 Adam: codes and scales beside the five lists
  }
  std::printf(bad ? "FAILED\n" : "ALL OK\n");
  return bad != 0;
}
"""


def test_chunk_tables_cover_every_chunk_once(tmp_path):
    """The host side of every multi-tensor launch, run on the CPU: over many
    ragged lists (empty tensors, tensors straddling launches, tables full of
    tensors or of blocks), each chunk of each tensor goes to exactly one
    block, with its tensor's pointers and size, and the per-tensor and
    per-chunk indices the kernels write their outputs with."""
    nvcc = _nvcc_or_skip()
    (tmp_path / "tables.cu").write_text(TABLES_CHECK)
    exe = tmp_path / "tables"
    includes = [f"-I{d}" for d in build.cuda_includes()]
    cmd = [nvcc, "-std=c++17", *includes, str(tmp_path / "tables.cu"), "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout[-3000:]


def _fake_list(n, value=1 << 20):
    """Device pointers that are never dereferenced: the calls below fail
    their checks (or their launch, without a driver) first."""
    return (ctypes.c_void_p * n)(*([value] * n))


def test_bad_arguments_are_error_codes_with_messages(cuda_library):
    _, lib = cuda_library
    ptrs, numel = _fake_list(2), (ctypes.c_int64 * 2)(5, 70000)
    args = [ptrs] * 4 + [None, numel, 2]
    adam_hp = ctypes.byref(AdamHyperparams().c_struct())
    rest = [None, None, 0, 0, 0, None]  # grad_scale, found_inf, seed, sr_states, sr_params, stream
    # fp32 params with bf16 states: not a supported combination, unless rounded stochastically
    assert lib.fz_cuda_adam(*args, 0, 0, 2, -1, adam_hp, 1 << 20, *rest) == 1
    assert b"unsupported dtypes" in lib.fz_cuda_last_error()
    # stochastic rounding: bf16 states only, and a seed in [0, 2^32)
    assert lib.fz_cuda_adam(*args, 0, 0, 0, -1, adam_hp, 1 << 20, None, None, 7, 1, 0, None) == 1
    assert b"unsupported dtypes with stochastic rounding" in lib.fz_cuda_last_error()
    assert lib.fz_cuda_adam(*args, 0, 0, 2, -1, adam_hp, 1 << 20, None, None, 1 << 32, 1, 0, None) == 1
    assert b"seed must be in [0, 2^32)" in lib.fz_cuda_last_error()
    # no step counter
    assert lib.fz_cuda_adam(*args, 0, 0, 0, -1, adam_hp, None, *rest) == 1
    assert b"step is null" in lib.fz_cuda_last_error()
    # no hyperparameters, even with nothing to do
    assert lib.fz_cuda_adam(*args, 0, 0, 0, -1, None, 1 << 20, *rest) == 1
    assert b"hyper is null" in lib.fz_cuda_last_error()
    assert lib.fz_cuda_adam(*args[:6], 0, 0, 0, 0, -1, None, 1 << 20, *rest) == 1
    lamb_args = [ptrs] * 4 + [None, numel, (ctypes.c_int64 * 2)(0, 1), 2, 0, 0, 0, -1]
    lamb_rest = [1 << 20, None, None, None, 1 << 20, 1 << 20, 1 << 20, 1 << 20, None]
    assert lib.fz_cuda_lamb(*lamb_args, None, *lamb_rest) == 1
    assert b"fz_cuda_lamb: hyper is null" in lib.fz_cuda_last_error()
    assert lib.fz_cuda_lamb_clip_factor(1 << 20, 1, None, None, 1 << 20, None) == 1
    assert b"hyper is null" in lib.fz_cuda_last_error()
    # the clip factor of LAMB without clipping
    no_clip = ctypes.byref(LambHyperparams(max_grad_norm=0.0).c_struct())
    assert lib.fz_cuda_lamb_clip_factor(1 << 20, 1, no_clip, None, 1 << 20, None) == 1
    assert b"max_grad_norm must be > 0" in lib.fz_cuda_last_error()
    # a copy dtype without copies
    assert lib.fz_cuda_adam(*args, 0, 0, 0, 2, adam_hp, 1 << 20, *rest) == 1
    # a null pointer for a non-empty tensor
    holes = (ctypes.c_void_p * 2)(1 << 20, None)
    assert lib.fz_cuda_adam(holes, *args[1:], 0, 0, 0, -1, adam_hp, 1 << 20, *rest) == 1
    assert b"params[1] is a null pointer" in lib.fz_cuda_last_error()
    # a partials buffer too small for the chunks (70000 elements: 2 chunks)
    assert lib.fz_cuda_l2norm_partials(ptrs, numel, 2, 0, None, None, 1 << 20, 2, None) == 1
    assert b"3 needed" in lib.fz_cuda_last_error()
    # nothing to do is fine, and touches no CUDA API
    assert lib.fz_cuda_adam(*args[:6], 0, 0, 0, 0, -1, adam_hp, None, *rest) == 0


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def test_launch_without_a_driver_is_an_error_not_a_crash(cuda_library):
    if _driver_present():
        pytest.skip("a CUDA driver is installed: launching at fake pointers would run")
    _, lib = cuda_library
    clipping = ctypes.byref(LambHyperparams(max_grad_norm=1.0).c_struct())
    rc = lib.fz_cuda_lamb_clip_factor(1 << 20, 0, clipping, None, 1 << 20, None)
    assert rc == 2
    assert b"clip_factor_kernel" in lib.fz_cuda_last_error() and b"cuda" in lib.fz_cuda_last_error().lower()
    assert lib.fz_cuda_check_device() == 2
    assert b"driver" in lib.fz_cuda_last_error()


def test_native_code_includes_no_pytorch_header():
    for path in build.cuda_source_dir().iterdir():
        includes = [line for line in path.read_text().splitlines() if line.lstrip().startswith("#include")]
        assert includes, path
        for line in includes:
            assert not any(name in line for name in ("torch", "ATen", "c10")), f"{path.name}: {line}"


# ---------------------------------------------------------------------------
# The Python side, on any machine


def _cpu_lists(n=5):
    return [torch.randn(n)], [torch.randn(n)], [torch.zeros(n)], [torch.zeros(n)]


ADAM_HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, bias_correction=True, adamw_mode=True)
LAMB_HYPER = dict(
    lr=1e-2,
    beta1=0.9,
    beta2=0.999,
    eps=1e-6,
    eps_inside_sqrt=False,
    weight_decay=0.01,
    bias_correction=True,
    max_grad_norm=0.0,
    max_coeff=10.0,
    min_coeff=0.01,
)


def test_import_and_available_never_crash():
    ok, why = loader.cuda_available()
    assert isinstance(ok, bool) and isinstance(why, str)
    if not torch.cuda.is_available():
        assert not ok and "CUDA" in why


def test_cpu_tensors_are_refused_with_a_pointer_to_the_cpu_path():
    step = torch.tensor(1.0)
    with pytest.raises(ValueError, match=r"params\[0\] is on cpu.*CPUAdam"):
        adam_cuda.adam_step(*_cpu_lists(), step=step, **ADAM_HYPER)
    with pytest.raises(ValueError, match=r"params\[0\] is on cpu.*FusedLamb"):
        lamb_cuda.lamb_step(*_cpu_lists(), step=step, coeffs_out=torch.ones(1), **LAMB_HYPER)


def test_step_must_be_a_device_tensor():
    with pytest.raises(TypeError, match="step must be a 0-d float32 tensor"):
        adam_cuda.adam_step(*_cpu_lists(), step=1, **ADAM_HYPER)
    with pytest.raises(TypeError, match="step must be one float32 value"):
        adam_cuda.adam_step(*_cpu_lists(), step=torch.tensor([1, 2]), **ADAM_HYPER)
    with pytest.raises(TypeError, match="found_inf must be one float32 value"):
        adam_cuda.adam_step(*_cpu_lists(), step=torch.tensor(1.0), found_inf=torch.tensor(True), **ADAM_HYPER)


def test_list_lengths_are_checked():
    p, g, m, v = _cpu_lists()
    with pytest.raises(ValueError, match="1 params but 2 grads"):
        adam_cuda.adam_step(p, g * 2, m, v, step=torch.tensor(1.0), **ADAM_HYPER)


def test_empty_lists_need_no_library():
    adam_cuda.adam_step([], [], [], [], step=torch.tensor(1.0), **ADAM_HYPER)
    lamb_cuda.lamb_step([], [], [], [], step=torch.tensor(1.0), coeffs_out=torch.empty(0), **LAMB_HYPER)


def test_unavailable_kernels_raise_with_the_cause(monkeypatch):
    monkeypatch.setattr(loader, "_load_cuda", lambda: (None, "nvcc (the CUDA compiler) was not found"))
    with pytest.raises(RuntimeError, match="adam_step: the CUDA kernels are unavailable: nvcc"):
        loader.cuda_lib("adam_step")


def test_missing_nvcc_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("NVCC", str(tmp_path / "no-such-nvcc"))
    monkeypatch.setenv("FASTZERO_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FASTZERO_CUDA_LIB", raising=False)
    with pytest.raises(build.BuildError, match="NVCC"):
        build.build_cuda()
    loader._load_cuda.cache_clear()
    try:
        lib, why = loader._load_cuda()
        if lib is None:  # unless an install-time build sits beside the package
            assert "no-such-nvcc" in why
    finally:
        loader._load_cuda.cache_clear()


# ---------------------------------------------------------------------------
# On a GPU: the kernels against the references

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SIZES = [1, 7, 17, 1023, 4099, (1 << 20) + 3]  # every vector tail; a million plus a ragged chunk
# (param, grad, state, copy) combinations the kernels support.
COMBOS = [
    (F32, F32, F32, None),
    (F32, BF16, F32, None),
    (F32, F16, F32, None),
    (F32, F32, F32, BF16),
    (F32, BF16, F32, BF16),
    (F32, F16, F32, F16),
    (BF16, BF16, F32, None),
    (BF16, F32, F32, None),
    (BF16, BF16, BF16, None),
    (BF16, F16, BF16, None),
    (F16, F16, F32, None),
    (F16, F32, F16, None),
    (F16, BF16, F16, None),
]


def combo_id(c):
    return "-".join(str(d).split(".")[-1] if d else "none" for d in c)


def make_tensors(sizes, combos, unaligned=False):
    """params, grads, exp_avgs, exp_avg_sqs, copies: tensor i has sizes[i]
    elements and the dtypes of combos[i % len(combos)]. ``unaligned``: views
    one element into their storage (not 16-byte aligned: the scalar path)."""

    def new(x, dtype):
        x = x.to(device="cuda", dtype=dtype)
        if not unaligned:
            return x
        return torch.cat([torch.zeros(1, dtype=dtype, device="cuda"), x])[1:]

    out = [[], [], [], [], []]
    for i, n in enumerate(sizes):
        p, g, s, c = combos[i % len(combos)]
        out[0].append(new(torch.randn(n), p))
        out[1].append(new(torch.randn(n), g))
        out[2].append(new(0.1 * torch.randn(n), s))
        out[3].append(new(0.01 * torch.rand(n), s))
        out[4].append(None if c is None else new(torch.zeros(n), c))
    if all(c is None for c in out[4]):
        out[4] = None
    elif any(c is None for c in out[4]):
        raise ValueError("copies for all tensors or none")
    return out


def fresh_grads(*sets):
    """New random grads, the same values in every set of tensors."""
    for gs in zip(*(s[1] for s in sets)):
        new = torch.randn(gs[0].shape, device="cuda").to(gs[0].dtype)
        for g in gs:
            g.copy_(new)


def run(kind, sizes, combos, *, steps=20, grad_scale=None, unaligned=False, **hyper):
    """The kernel, the reference in the same dtypes, and the reference in fp32
    storage (the ideal that low-precision storage approximates), over several
    steps with fresh grads. Returns them and, for LAMB, the last trust ratios
    (kernel's coeffs_out, reference's list)."""
    kernel = make_tensors(sizes, combos, unaligned)
    ref, ideal = clone_all(kernel), clone_all(kernel, F32)  # never aliases (x.float() would for fp32)
    coeffs = torch.full((len(sizes),), -1.0, device="cuda")
    ratios = None
    for step in range(1, steps + 1):
        if step > 1:
            fresh_grads(kernel, ref, ideal)
        t = torch.tensor(float(step), device="cuda")
        s = None if grad_scale is None else torch.tensor(grad_scale, device="cuda")
        if kind == "adam":
            adam_cuda.adam_step(*kernel[:4], step=t, grad_scale=s, param_copies=kernel[4], **hyper)
            for lists in (ref, ideal):
                reference.adam_step(*lists[:4], step=step, grad_scale=grad_scale, param_copies=lists[4], **hyper)
        else:
            lamb_cuda.lamb_step(*kernel[:4], step=t, grad_scale=s, param_copies=kernel[4], coeffs_out=coeffs, **hyper)
            ratios = reference.lamb_step(*ref[:4], step=step, grad_scale=grad_scale, param_copies=ref[4], **hyper)
            reference.lamb_step(*ideal[:4], step=step, grad_scale=grad_scale, param_copies=ideal[4], **hyper)
    torch.cuda.synchronize()
    return kernel, ref, ideal, (coeffs, ratios)


def check_ratios(coeffs, ratios, param_dtypes):
    for i, (c, r, dt) in enumerate(zip(coeffs.tolist(), ratios, param_dtypes)):
        assert_close(torch.tensor(c), torch.tensor(r, dtype=F32), dtype=dt, msg=f"trust ratio {i}")


@gpu
@needs_cuda
def test_available_on_a_gpu():
    ok, why = loader.cuda_available()
    assert ok, why


@gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_every_dtype_combo_every_size(kind, combo):
    torch.manual_seed(1234)
    hyper = ADAM_HYPER if kind == "adam" else LAMB_HYPER
    kernel, ref, ideal, (coeffs, ratios) = run(kind, SIZES, [combo], **hyper)
    check_all(kernel, ref, ideal)
    if kind == "lamb":
        check_ratios(coeffs, ratios, [combo[0]] * len(SIZES))


@gpu
@needs_cuda
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("grad_scale", [None, 1024.0, 3.7])
def test_adam_modes_and_grad_scale(adamw_mode, bias_correction, grad_scale):
    torch.manual_seed(1234)
    hyper = dict(ADAM_HYPER, adamw_mode=adamw_mode, bias_correction=bias_correction)
    kernel, ref, ideal, _ = run("adam", [17, 1023, 4099], [(F32, F32, F32, None)], grad_scale=grad_scale, **hyper)
    check_all(kernel, ref, ideal)


@gpu
@needs_cuda
@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("grad_scale", [None, 3.7])
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0, 1e9])  # none, clipping, a bound never reached
def test_lamb_modes_grad_scale_and_clipping(eps_inside_sqrt, bias_correction, grad_scale, max_grad_norm):
    torch.manual_seed(1234)
    hyper = dict(
        LAMB_HYPER, eps_inside_sqrt=eps_inside_sqrt, bias_correction=bias_correction, max_grad_norm=max_grad_norm
    )
    combos = [(F32, F32, F32, None), (F32, BF16, F32, None)]  # two grad dtypes: the norm spans both launches
    sizes = [17, 1023, 4099, 70001]
    kernel, ref, ideal, (coeffs, ratios) = run("lamb", sizes, combos, grad_scale=grad_scale, **hyper)
    check_all(kernel, ref, ideal)
    check_ratios(coeffs, ratios, [F32] * len(sizes))


@gpu
@needs_cuda
def test_lamb_trust_ratio_bounds_and_zero_norms():
    """Zero params (||p|| = 0) and zero grads with zero states (||u|| = 0)
    give r = 1; tight bounds clamp the ratio."""
    torch.manual_seed(1234)
    p = [torch.zeros(100, device="cuda"), torch.randn(100, device="cuda"), torch.randn(5000, device="cuda")]
    g = [torch.randn(100, device="cuda"), torch.zeros(100, device="cuda"), torch.randn(5000, device="cuda")]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    ref = [[x.clone() for x in lst] for lst in (p, g, m, v)]
    hyper = dict(LAMB_HYPER, weight_decay=0.0, max_coeff=0.25, min_coeff=0.1)  # tensor 2's ratio is about 0.32
    coeffs = torch.zeros(3, device="cuda")
    lamb_cuda.lamb_step(p, g, m, v, step=torch.tensor(1.0, device="cuda"), coeffs_out=coeffs, **hyper)
    ratios = reference.lamb_step(*ref, step=1, **hyper)
    assert ratios[0] == 1.0 and ratios[1] == 1.0
    check_ratios(coeffs, ratios, [F32] * 3)
    check_all([p, g, m, v, None], ref + [None], ref + [None])


@gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_unaligned_views_take_the_scalar_path(kind):
    torch.manual_seed(1234)
    hyper = ADAM_HYPER if kind == "adam" else LAMB_HYPER
    combos = [(F32, BF16, F32, BF16), (F32, F32, F32, F16)]
    kernel, ref, ideal, (coeffs, ratios) = run(kind, [1, 9, 4099, 70001], combos, unaligned=True, **hyper)
    assert kernel[0][0].data_ptr() % 16 != 0
    check_all(kernel, ref, ideal)
    if kind == "lamb":
        check_ratios(coeffs, ratios, [F32] * 4)


@gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_long_ragged_mixed_lists(kind):
    """More tensors than one chunk table holds, a tensor straddling two
    launches (more chunks than blocks per launch), empty tensors, and mixed
    dtype combinations in one call (several groups; coeffs_out in list order)."""
    torch.manual_seed(1234)
    gen = torch.Generator().manual_seed(0)
    sizes = [int(n) for n in torch.randint(1, 20000, (200,), generator=gen)]  # ~50 per group: 2 tables
    sizes[0] = 320 * 65536  # fills a launch's 320 blocks exactly at its last chunk
    sizes[4] = 330 * 65536 + 5  # 331 chunks: goes on in the next launch
    sizes[10] = sizes[11] = 0
    sizes += [0, 3, 0]
    combos = [(F32, F32, F32, None), (BF16, BF16, F32, None), (F32, F16, F32, None), (F16, F16, F16, None)]
    hyper = ADAM_HYPER if kind == "adam" else dict(LAMB_HYPER, max_grad_norm=1.0)
    kernel, ref, ideal, (coeffs, ratios) = run(kind, sizes, combos, steps=3, **hyper)
    check_all(kernel, ref, ideal)
    if kind == "lamb":
        check_ratios(coeffs, ratios, [combos[i % len(combos)][0] for i in range(len(sizes))])


@gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("flag", [1.0, float("inf"), float("nan")])
def test_found_inf_changes_nothing(kind, flag):
    torch.manual_seed(1234)
    combos = [(F32, F32, F32, BF16), (F32, F16, F32, F16)]
    tensors = make_tensors([7, 4099, 70001], combos)
    before = clone_all(tensors)
    coeffs = torch.full((3,), -7.0, device="cuda")
    step, found = torch.tensor(3.0, device="cuda"), torch.tensor(flag, device="cuda")
    if kind == "adam":
        adam_cuda.adam_step(*tensors[:4], step=step, found_inf=found, param_copies=tensors[4], **ADAM_HYPER)
    else:
        hyper = dict(LAMB_HYPER, max_grad_norm=1.0)
        lamb_cuda.lamb_step(
            *tensors[:4],
            step=step,
            found_inf=found,
            param_copies=tensors[4],
            coeffs_out=coeffs,
            grad_scale=torch.tensor(2.0, device="cuda"),
            **hyper,
        )
    for a, b in zip(sum(tensors, []), sum(before, [])):
        assert torch.equal(a, b)
    assert torch.equal(coeffs, torch.full((3,), -7.0, device="cuda"))
    # found_inf = 0 runs the step as if there were none
    found.zero_()
    kernel, ref = clone_all(before), clone_all(before)
    if kind == "adam":
        adam_cuda.adam_step(*kernel[:4], step=step, found_inf=found, param_copies=kernel[4], **ADAM_HYPER)
        reference.adam_step(*ref[:4], step=3, param_copies=ref[4], **ADAM_HYPER)
    else:
        lamb_cuda.lamb_step(
            *kernel[:4], step=step, found_inf=found, param_copies=kernel[4], coeffs_out=coeffs, **LAMB_HYPER
        )
        reference.lamb_step(*ref[:4], step=3, param_copies=ref[4], **LAMB_HYPER)
    check_all(kernel, ref, ref)


@gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("c_dtype", [BF16, F16])
def test_param_copies_are_the_rounded_params(kind, c_dtype):
    """The copy is written from the updated fp32 param: it equals
    param.to(dtype) bit for bit."""
    torch.manual_seed(1234)
    hyper = ADAM_HYPER if kind == "adam" else LAMB_HYPER
    kernel, _, _, _ = run(kind, [5, 4099, (1 << 20) + 3], [(F32, F32, F32, c_dtype)], steps=2, **hyper)
    for p, c in zip(kernel[0], kernel[4]):
        assert torch.equal(c.view(torch.int16), p.to(c_dtype).view(torch.int16))


@gpu
@needs_cuda
@pytest.mark.parametrize("p_dtype", [BF16, F16])
def test_low_precision_params_round_trip_exactly(p_dtype):
    """lr=0: every finite bf16/fp16 value, subnormals included, survives the
    kernel's load, fp32 math and rounding store unchanged."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    p = bits.view(p_dtype)
    p = p[torch.isfinite(p.float())].cuda()
    before = p.clone()
    g = torch.randn(p.shape, device="cuda")
    z = [torch.zeros(p.shape, device="cuda") for _ in range(2)]
    adam_cuda.adam_step([p], [g], z[:1], z[1:], step=torch.tensor(1.0, device="cuda"), **dict(ADAM_HYPER, lr=0.0))
    assert torch.equal(p, before)


@gpu
@needs_cuda
def test_results_are_deterministic():
    """Fixed reduction orders: the same inputs give the same bits."""
    torch.manual_seed(1234)
    base = make_tensors([4099, (1 << 20) + 3, 77], [(F32, BF16, F32, None)])
    outs = []
    for _ in range(2):
        t = clone_all(base)
        coeffs = torch.empty(3, device="cuda")
        lamb_cuda.lamb_step(
            *t[:4], step=torch.tensor(1.0, device="cuda"), coeffs_out=coeffs, **dict(LAMB_HYPER, max_grad_norm=1.0)
        )
        outs.append((t, coeffs))
    assert torch.equal(outs[0][1], outs[1][1])
    for a, b in zip(sum(outs[0][0][:4], []), sum(outs[1][0][:4], [])):
        assert torch.equal(a, b)


@gpu
@needs_cuda
def test_device_checks_on_a_gpu():
    p, g, m, v = ([x.cuda()] for x in (torch.randn(5), torch.randn(5), torch.zeros(5), torch.zeros(5)))
    with pytest.raises(ValueError, match="step is on cpu"):
        adam_cuda.adam_step(p, g, m, v, step=torch.tensor(1.0), **ADAM_HYPER)
    with pytest.raises(ValueError, match=r"grads\[0\] is on cpu"):
        adam_cuda.adam_step(p, [g[0].cpu()], m, v, step=torch.tensor(1.0, device="cuda"), **ADAM_HYPER)
    with pytest.raises(ValueError, match="not contiguous"):
        w = torch.randn(5, 2, device="cuda").t()
        adam_cuda.adam_step(
            [w], [w.clone()], [w.clone()], [w.clone()], step=torch.tensor(1.0, device="cuda"), **ADAM_HYPER
        )
    with pytest.raises(ValueError, match="coeffs_out must be float32 with one element per param"):
        lamb_cuda.lamb_step(
            p, g, m, v, step=torch.tensor(1.0, device="cuda"), coeffs_out=torch.ones(2, device="cuda"), **LAMB_HYPER
        )
