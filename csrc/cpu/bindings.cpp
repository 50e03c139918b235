// Python bindings of the CPU kernels: plain integers for pointers, sizes and
// dtype codes. Python (fastzero/ops) checks tensors before calling; the
// checks here only keep a wrong call from reaching a kernel.
//
// An optimizer's hyperparameters arrive whole, as the bytes of its C struct
// (csrc/common/hyperparams.h; Python: bytes(hp.c_struct())), beside the
// per-call values that are not hyperparameters (step, grad scale, threads,
// pointers). This file never names a field: the kernels' own files derive
// their constants from the struct, so a new hyperparameter changes nothing here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "adam.h"
#include "lamb.h"
#include "onebit.h"
#include "quant.h"
#include "stream.h"

namespace py = pybind11;

namespace {

fz::Isa checked_isa(int isa) {
  if (isa < fz::kScalar || isa > fz::best_isa())
    throw std::invalid_argument("ISA code " + std::to_string(isa) +
                                " is not supported by this CPU (best: " +
                                std::to_string(int(fz::best_isa())) + ")");
  return fz::Isa(isa);
}

// The struct T from the bytes Python sent, refused unless the sizes agree
// (a dataclass and csrc/common/hyperparams.h that disagree, or a stale build).
template <typename T>
T hyper_from(const py::bytes& bytes, const char* op, const char* type) {
  char* data = nullptr;
  Py_ssize_t len = 0;
  if (PyBytes_AsStringAndSize(bytes.ptr(), &data, &len) != 0) throw py::error_already_set();
  if (size_t(len) != sizeof(T))
    throw std::invalid_argument(std::string(op) + ": the hyperparameters are " + std::to_string(len) +
                                " bytes, but this build's " + type + " is " + std::to_string(sizeof(T)) +
                                " (the Python dataclass and csrc/common/hyperparams.h disagree, or the "
                                "extension is stale: rebuild it)");
  T h;
  std::memcpy(&h, data, sizeof(T));
  return h;
}

// seed: of stochastic rounding, in [0, 2^32); sr_states: bf16 states written
// with it, sr_params: bf16 params written with it (else round to nearest).
void check_sr(const char* op, int64_t seed, bool sr_params, int p_dtype) {
  if (seed < 0 || seed > int64_t(0xffffffffu))
    throw std::invalid_argument(std::string(op) + ": seed must be in [0, 2^32)");
  if (sr_params && p_dtype != fz::kBF16)
    throw std::invalid_argument(std::string(op) + ": stochastic rounding of params needs bf16 params (dtype code " +
                                std::to_string(fz::kBF16) + "), got " + std::to_string(p_dtype));
}

void adam(int isa, const std::vector<uintptr_t>& p, const std::vector<uintptr_t>& g,
          const std::vector<uintptr_t>& m, const std::vector<uintptr_t>& v,
          const std::vector<uintptr_t>& copy, const std::vector<int64_t>& numel, int p_dtype,
          int g_dtype, int s_dtype, int c_dtype, const py::bytes& hyper, double step,
          double inv_grad_scale, int64_t seed, bool sr_states, bool sr_params, int num_threads) {
  const fz_adam_hyper h = hyper_from<fz_adam_hyper>(hyper, "adam", "fz_adam_hyper");
  const size_t n = numel.size();
  if (p.size() != n || g.size() != n || m.size() != n || v.size() != n ||
      (!copy.empty() && copy.size() != n) || (copy.empty() != (c_dtype == fz::kNone)))
    throw std::invalid_argument("adam: tensor lists differ in length");
  for (int64_t k : numel)
    if (k < 0) throw std::invalid_argument("adam: negative element count");
  check_sr("adam", seed, sr_params, p_dtype);
  if (sr_states && s_dtype != fz::kBF16)
    throw std::invalid_argument("adam: stochastic rounding needs bf16 states (state dtype code " +
                                std::to_string(fz::kBF16) + "), got " + std::to_string(s_dtype));
  const int s_code = sr_states ? fz::kAdamStatesBF16SR : s_dtype;
  fz::AdamSegmentFn fn = fz::adam_segment_fn(checked_isa(isa), p_dtype, g_dtype, s_code, c_dtype, sr_params);
  if (fn == nullptr)
    throw std::invalid_argument("adam: no kernel for dtype codes param=" + std::to_string(p_dtype) +
                                " grad=" + std::to_string(g_dtype) + " state=" +
                                std::to_string(s_dtype) + " copy=" + std::to_string(c_dtype));
  py::gil_scoped_release release;
  fz::adam_multi_tensor(fn, p, g, m, v, copy, numel, p_dtype, g_dtype, s_code, c_dtype, h, step,
                        inv_grad_scale, uint32_t(seed), num_threads);
}

void check_lists(const char* what, size_t n, std::initializer_list<size_t> sizes) {
  for (size_t k : sizes)
    if (k != n) throw std::invalid_argument(std::string(what) + ": tensor lists differ in length");
}

void adam_int8(int isa, const std::vector<uintptr_t>& p, const std::vector<uintptr_t>& g,
               const std::vector<uintptr_t>& m, const std::vector<uintptr_t>& v, const std::vector<uintptr_t>& copy,
               const std::vector<uintptr_t>& m_scale, const std::vector<uintptr_t>& v_scale,
               const std::vector<int64_t>& numel, int p_dtype, int g_dtype, int c_dtype, const py::bytes& hyper,
               double step, double inv_grad_scale, int64_t block, int64_t seed, bool sr_params, int num_threads) {
  const fz_adam_hyper h = hyper_from<fz_adam_hyper>(hyper, "adam_int8", "fz_adam_hyper");
  check_lists("adam_int8", numel.size(), {p.size(), g.size(), m.size(), v.size(), m_scale.size(), v_scale.size()});
  if (!copy.empty()) check_lists("adam_int8", numel.size(), {copy.size()});
  if (copy.empty() != (c_dtype == fz::kNone))
    throw std::invalid_argument("adam_int8: copy list and copy dtype disagree");
  for (int64_t k : numel)
    if (k < 0) throw std::invalid_argument("adam_int8: negative element count");
  if (block < 64 || block > 4096 || (block & (block - 1)) != 0)
    throw std::invalid_argument("adam_int8: block must be a power of two in [64, 4096], got " + std::to_string(block));
  check_sr("adam_int8", seed, sr_params, p_dtype);
  fz::AdamInt8Fn fn = fz::adam_int8_fn(checked_isa(isa), p_dtype, g_dtype, c_dtype, sr_params);
  if (fn == nullptr)
    throw std::invalid_argument("adam_int8: no kernel for dtype codes param=" + std::to_string(p_dtype) +
                                " grad=" + std::to_string(g_dtype) + " copy=" + std::to_string(c_dtype));
  py::gil_scoped_release release;
  fz::adam_int8_multi_tensor(fn, p, g, m, v, copy, m_scale, v_scale, numel, p_dtype, g_dtype, c_dtype, h, step,
                             inv_grad_scale, block, uint32_t(seed), num_threads);
}

double lamb_grad_sumsq(int isa, const std::vector<uintptr_t>& g, const std::vector<int64_t>& numel,
                       int g_dtype, double inv_grad_scale, int num_threads) {
  check_lists("lamb_grad_sumsq", numel.size(), {g.size()});
  if (g_dtype < fz::kF32 || g_dtype > fz::kBF16)
    throw std::invalid_argument("lamb_grad_sumsq: bad grad dtype code " + std::to_string(g_dtype));
  const fz::Isa checked = checked_isa(isa);
  py::gil_scoped_release release;
  return fz::lamb_grad_sumsq(checked, g, numel, g_dtype, inv_grad_scale, num_threads);
}

std::vector<double> lamb_norms(int isa, const py::bytes& hyper, const std::vector<uintptr_t>& p,
                               const std::vector<uintptr_t>& g, const std::vector<uintptr_t>& m,
                               const std::vector<uintptr_t>& v, const std::vector<int64_t>& numel, int p_dtype,
                               int g_dtype, int s_dtype, double inv_grad_scale, double grad_sumsq,
                               int num_threads) {
  const fz_lamb_hyper h = hyper_from<fz_lamb_hyper>(hyper, "lamb_norms", "fz_lamb_hyper");
  check_lists("lamb_norms", numel.size(), {p.size(), g.size(), m.size(), v.size()});
  const fz::Isa checked = checked_isa(isa);
  std::vector<double> ratios;
  bool ok;
  {
    py::gil_scoped_release release;
    ok = fz::lamb_norms(checked, p, g, m, v, numel, p_dtype, g_dtype, s_dtype, h, inv_grad_scale, grad_sumsq,
                        num_threads, &ratios);
  }
  if (!ok) throw std::invalid_argument("lamb_norms: no kernel for these dtype codes");
  return ratios;
}

void lamb_apply(int isa, const py::bytes& hyper, double step, const std::vector<uintptr_t>& p,
                const std::vector<uintptr_t>& m, const std::vector<uintptr_t>& v,
                const std::vector<uintptr_t>& copy, const std::vector<int64_t>& numel, int p_dtype, int s_dtype,
                int c_dtype, const std::vector<double>& ratios, int num_threads) {
  const fz_lamb_hyper h = hyper_from<fz_lamb_hyper>(hyper, "lamb_apply", "fz_lamb_hyper");
  check_lists("lamb_apply", numel.size(), {p.size(), m.size(), v.size(), ratios.size()});
  if (!copy.empty()) check_lists("lamb_apply", numel.size(), {copy.size()});
  if (copy.empty() != (c_dtype == fz::kNone))
    throw std::invalid_argument("lamb_apply: copy list and copy dtype disagree");
  const fz::Isa checked = checked_isa(isa);
  bool ok;
  {
    py::gil_scoped_release release;
    ok = fz::lamb_apply(checked, p, m, v, copy, numel, p_dtype, s_dtype, c_dtype, h, step, ratios, num_threads);
  }
  if (!ok) throw std::invalid_argument("lamb_apply: no kernel for these dtype codes");
}

void stream_update(int isa, const std::vector<uintptr_t>& a, const std::vector<uintptr_t>& b,
                   const std::vector<uintptr_t>& c, const std::vector<uintptr_t>& d,
                   const std::vector<int64_t>& numel, double s, int num_threads) {
  const size_t n = numel.size();
  if (a.size() != n || b.size() != n || c.size() != n || d.size() != n)
    throw std::invalid_argument("stream_update: tensor lists differ in length");
  for (int64_t k : numel)
    if (k < 0) throw std::invalid_argument("stream_update: negative element count");
  const fz::Isa checked = checked_isa(isa);
  py::gil_scoped_release release;
  fz::stream_update(checked, a, b, c, d, numel, float(s), num_threads);
}

void onebit_pack(int isa, uintptr_t x, int x_dtype, uintptr_t error, uintptr_t bits, uintptr_t scales,
                 int64_t numel, int64_t chunks, int num_threads) {
  if (chunks < 1 || numel < 0 || numel % (8 * chunks) != 0)
    throw std::invalid_argument("onebit_pack: " + std::to_string(numel) + " elements do not split into " +
                                std::to_string(chunks) + " chunks of whole bytes");
  if (x_dtype < fz::kF32 || x_dtype > fz::kBF16)
    throw std::invalid_argument("onebit_pack: bad dtype code " + std::to_string(x_dtype));
  const fz::Isa checked = checked_isa(isa);
  py::gil_scoped_release release;
  fz::onebit_pack(checked, reinterpret_cast<const void*>(x), x_dtype, reinterpret_cast<float*>(error),
                  reinterpret_cast<uint8_t*>(bits), reinterpret_cast<float*>(scales), numel, chunks, num_threads);
}

void onebit_unpack(int isa, uintptr_t bits, uintptr_t scales, uintptr_t out, int64_t rows, int64_t row_bytes,
                   bool average, int num_threads) {
  if (rows < 1 || row_bytes < 0)
    throw std::invalid_argument("onebit_unpack: need rows >= 1 and row_bytes >= 0");
  const fz::Isa checked = checked_isa(isa);
  py::gil_scoped_release release;
  fz::onebit_unpack(checked, reinterpret_cast<const uint8_t*>(bits), reinterpret_cast<const float*>(scales),
                    reinterpret_cast<float*>(out), rows, row_bytes, average, num_threads);
}

void mask_pack(int isa, uintptr_t x, int x_dtype, uintptr_t bits, int64_t numel, int num_threads) {
  if (numel < 0) throw std::invalid_argument("mask_pack: negative element count");
  if (x_dtype < fz::kF32 || x_dtype > fz::kBF16)
    throw std::invalid_argument("mask_pack: bad dtype code " + std::to_string(x_dtype));
  const fz::Isa checked = checked_isa(isa);
  py::gil_scoped_release release;
  fz::mask_pack(checked, reinterpret_cast<const void*>(x), x_dtype, reinterpret_cast<uint8_t*>(bits), numel,
                num_threads);
}

void mask_unpack(int isa, uintptr_t bits, uintptr_t out, int out_dtype, int64_t numel, int num_threads) {
  if (numel < 0) throw std::invalid_argument("mask_unpack: negative element count");
  if (out_dtype < fz::kF32 || out_dtype > fz::kBF16)
    throw std::invalid_argument("mask_unpack: bad dtype code " + std::to_string(out_dtype));
  const fz::Isa checked = checked_isa(isa);
  py::gil_scoped_release release;
  fz::mask_unpack(checked, reinterpret_cast<const uint8_t*>(bits), reinterpret_cast<void*>(out), out_dtype, numel,
                  num_threads);
}

void stream_fill(int isa, const std::vector<uintptr_t>& a, const std::vector<int64_t>& numel, double s, bool nt,
                 int num_threads) {
  if (a.size() != numel.size()) throw std::invalid_argument("stream_fill: tensor lists differ in length");
  for (int64_t k : numel)
    if (k < 0) throw std::invalid_argument("stream_fill: negative element count");
  const fz::Isa checked = checked_isa(isa);
  py::gil_scoped_release release;
  fz::stream_fill(checked, a, numel, float(s), nt, num_threads);
}

void stream_narrow(int isa, const std::vector<uintptr_t>& x, const std::vector<uintptr_t>& out,
                   const std::vector<int64_t>& numel, int bits, bool nt, int num_threads) {
  if (x.size() != numel.size() || out.size() != numel.size())
    throw std::invalid_argument("stream_narrow: tensor lists differ in length");
  if (bits != 8 && bits != 4) throw std::invalid_argument("stream_narrow: bits must be 8 or 4");
  for (int64_t k : numel)
    if (k < 0) throw std::invalid_argument("stream_narrow: negative element count");
  const fz::Isa checked = checked_isa(isa);
  py::gil_scoped_release release;
  fz::stream_narrow(checked, x, out, numel, bits, nt, num_threads);
}

void check_quant_format(const char* op, int64_t n, int64_t block, int bits, int dtype) {
  if (n < 0 || block < 1) throw std::invalid_argument(std::string(op) + ": need n >= 0 and block >= 1");
  if (bits != 8 && !(bits == 4 && block % 2 == 0))
    throw std::invalid_argument(std::string(op) + ": bits must be 8, or 4 with an even block");
  if (dtype < fz::kF32 || dtype > fz::kBF16)
    throw std::invalid_argument(std::string(op) + ": bad dtype code " + std::to_string(dtype));
}

void quant_quantize(int isa, uintptr_t x, int x_dtype, uintptr_t codes, uintptr_t scales, int64_t n, int64_t block,
                    int bits, bool stochastic, uint32_t seed, int num_threads) {
  check_quant_format("quant_quantize", n, block, bits, x_dtype);
  const fz::Isa checked = checked_isa(isa);
  py::gil_scoped_release release;
  fz::quant_quantize(checked, reinterpret_cast<const void*>(x), x_dtype, reinterpret_cast<void*>(codes),
                     reinterpret_cast<float*>(scales), n, block, bits, stochastic, seed, num_threads);
}

void quant_dequantize_sum(int isa, uintptr_t codes, int bits, int64_t code_stride, uintptr_t scales, int64_t ranks,
                          uintptr_t out, int out_dtype, int64_t n, int64_t block, int num_threads) {
  check_quant_format("quant_dequantize_sum", n, block, bits, out_dtype);
  if (ranks < 1 || code_stride < 0) throw std::invalid_argument("quant_dequantize_sum: need ranks >= 1, code_stride >= 0");
  const fz::Isa checked = checked_isa(isa);
  py::gil_scoped_release release;
  fz::quant_dequantize_sum(checked, reinterpret_cast<const void*>(codes), bits, code_stride,
                           reinterpret_cast<const float*>(scales), ranks, reinterpret_cast<void*>(out), out_dtype, n,
                           block, num_threads);
}

}  // namespace

// Read with ctypes before the module is imported: a stale extension is never
// imported, so a just-in-time build of the current sources can take its name.
extern "C" __attribute__((visibility("default"))) int fz_cpu_abi_version() { return FZ_CPU_ABI_VERSION; }

PYBIND11_MODULE(_cpu_ops, m) {
  m.doc() = "fastzero CPU kernels (SIMD + threads), torch-free";
  m.def("best_isa", [] { return int(fz::best_isa()); },
        "Best instruction set of this CPU: 0 scalar, 1 AVX2+FMA+F16C, 2 AVX-512.");
  m.def("hyper_sizes", [] {
    return py::dict(py::arg("adam") = sizeof(fz_adam_hyper), py::arg("lamb") = sizeof(fz_lamb_hyper));
  }, "sizeof each family's hyperparameter struct in this build (csrc/common/hyperparams.h).");
  m.def("adam", &adam,
        "Multi-tensor Adam/AdamW step (see csrc/cpu/adam.h); hyper: the bytes of an fz_adam_hyper; "
        "seed: of stochastic rounding; sr_states / sr_params: bf16 states / bf16 params written with it.");
  m.def("adam_int8", &adam_int8,
        "Multi-tensor Adam/AdamW step with int8 block-wise states: uint8 codes and fp32 block scales "
        "(see csrc/cpu/adam_int8_kernel.inc).");
  m.def("lamb_grad_sumsq", &lamb_grad_sumsq, "LAMB pass 0: sum of squares of the unscaled grads.");
  m.def("lamb_norms", &lamb_norms,
        "LAMB pass 1: update m, v; returns each tensor's trust ratio (hyper: an fz_lamb_hyper's bytes).");
  m.def("lamb_apply", &lamb_apply, "LAMB pass 2: p -= step_size * ratio * u, and the low-precision copy.");
  m.def("onebit_pack", &onebit_pack,
        "1-bit pack: y = x + error; per-chunk scale, sign bits, new error (see csrc/cpu/onebit.h).");
  m.def("onebit_unpack", &onebit_unpack, "1-bit unpack: signs times scales, per row or averaged over rows.");
  m.def("mask_pack", &mask_pack, "A 0/1 mask as bits: bit i % 8 of byte i / 8 is (x[i] != 0).");
  m.def("mask_unpack", &mask_unpack, "Bits back to a 0/1 mask in the output's dtype.");
  m.def("quant_quantize", &quant_quantize,
        "Block-wise quantize: per-block absmax scale, int8 or packed int4 codes (see csrc/cpu/quant.h).");
  m.def("quant_dequantize_sum", &quant_dequantize_sum,
        "Block-wise dequantize, summed over ranks in fp32 (ranks = 1: plain dequantize).");
  m.def("stream_fill", &stream_fill,
        "Write-bandwidth probe: a[:] = s over lists of fp32 tensors (cache-bypassing stores if nt).");
  m.def("stream_narrow", &stream_narrow,
        "Quantize-shaped probe: fp32 tensors to int8 (bits 8) or packed int4 codes of their bit patterns.");
  m.def("stream_update", &stream_update,
        "Bandwidth probe: a += s*b, c += s*b, d += s*b over lists of fp32 tensors.");
}
