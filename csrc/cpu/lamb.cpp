// CPU LAMB kernels (see lamb_kernel.inc for the math) and their multi-tensor,
// multi-thread drivers.
#include "lamb.h"

#include <array>
#include <cmath>
#include <cstring>
#include <immintrin.h>

#include "parallel.h"

namespace fz {

// Per-call constants of the kernels, each computed in double (as the
// reference's Python floats are) and rounded to float; 1 - beta too, as
// torch does. grad_mult = 1 / (grad_scale * clip). eps_inside_sqrt:
// d = sqrt(v + eps), else d = sqrt(v) + eps. u = m / d + weight_decay * p.
struct LambConsts {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, grad_mult;
  bool eps_inside_sqrt;
};

namespace {

// Everything LAMB derives from its hyperparameters, in one place.
LambConsts lamb_consts(const fz_lamb_hyper& h, double grad_mult) {
  LambConsts k;
  k.beta1 = float(h.beta1);
  k.beta2 = float(h.beta2);
  k.one_minus_beta1 = float(1.0 - h.beta1);
  k.one_minus_beta2 = float(1.0 - h.beta2);
  k.eps = float(h.eps);
  k.weight_decay = float(h.weight_decay);
  k.grad_mult = float(grad_mult);
  k.eps_inside_sqrt = h.eps_inside_sqrt != 0;
  return k;
}

}  // namespace
}  // namespace fz

#define FZ_KERNEL_BODY "lamb_kernel.inc"
#include "isa_regions.inc"

namespace fz {

double lamb_grad_sumsq(Isa isa, const std::vector<uintptr_t>& g, const std::vector<int64_t>& numel,
                       int g_dtype, double inv_grad_scale, int num_threads) {
  const auto fn = FZ_ISA_PICK(isa, grad_sumsq_pick(g_dtype));
  if (fn == nullptr) return NAN;
  const float mult = float(inv_grad_scale);
  const std::vector<Chunk> chunks = make_chunks(numel);
  std::vector<double> partial(chunks.size(), 0.0);
  const int64_t gs = dtype_size(g_dtype);
  parallel_chunks(chunks, num_threads, [&](int64_t i) {
    const Chunk& c = chunks[i];
    partial[i] = fn(reinterpret_cast<const char*>(g[c.tensor]) + c.offset * gs, c.count, mult);
  });
  double sum = 0.0;
  for (double x : partial) sum += x;
  return sum;
}

bool lamb_norms(Isa isa, const std::vector<uintptr_t>& p, const std::vector<uintptr_t>& g,
                const std::vector<uintptr_t>& m, const std::vector<uintptr_t>& v,
                const std::vector<int64_t>& numel, int p_dtype, int g_dtype, int s_dtype,
                const fz_lamb_hyper& hyper, double inv_grad_scale, double grad_sumsq, int num_threads,
                std::vector<double>* ratios) {
  const auto fn = FZ_ISA_PICK(isa, lamb_norms_pick(p_dtype, g_dtype, s_dtype));
  if (fn == nullptr) return false;
  const LambConsts k = lamb_consts(hyper, inv_grad_scale / fz_lamb_clip(&hyper, grad_sumsq));
  const std::vector<Chunk> chunks = make_chunks(numel);
  std::vector<double> partial(2 * chunks.size(), 0.0);
  const int64_t ps = dtype_size(p_dtype), gs = dtype_size(g_dtype), ss = dtype_size(s_dtype);
  parallel_chunks(chunks, num_threads, [&](int64_t i) {
    const Chunk& c = chunks[i];
    fn(reinterpret_cast<const char*>(p[c.tensor]) + c.offset * ps,
       reinterpret_cast<const char*>(g[c.tensor]) + c.offset * gs,
       reinterpret_cast<char*>(m[c.tensor]) + c.offset * ss,
       reinterpret_cast<char*>(v[c.tensor]) + c.offset * ss, c.count, k, &partial[2 * i]);
  });
  std::vector<double> sums(2 * numel.size(), 0.0);
  for (size_t i = 0; i < chunks.size(); ++i) {
    sums[2 * chunks[i].tensor] += partial[2 * i];
    sums[2 * chunks[i].tensor + 1] += partial[2 * i + 1];
  }
  ratios->resize(numel.size());
  for (size_t t = 0; t < numel.size(); ++t) (*ratios)[t] = fz_lamb_trust_ratio(&hyper, sums[2 * t], sums[2 * t + 1]);
  return true;
}

bool lamb_apply(Isa isa, const std::vector<uintptr_t>& p, const std::vector<uintptr_t>& m,
                const std::vector<uintptr_t>& v, const std::vector<uintptr_t>& copy,
                const std::vector<int64_t>& numel, int p_dtype, int s_dtype, int c_dtype,
                const fz_lamb_hyper& hyper, double step, const std::vector<double>& ratios,
                int num_threads) {
  const auto fn = FZ_ISA_PICK(isa, lamb_apply_pick(p_dtype, s_dtype, c_dtype));
  if (fn == nullptr) return false;
  const LambConsts k = lamb_consts(hyper, 1.0);
  const double step_size = fz_lamb_step_size(&hyper, step);
  std::vector<float> scale(ratios.size());  // p += scale * u
  for (size_t t = 0; t < ratios.size(); ++t) scale[t] = float(-step_size * ratios[t]);
  const int64_t ps = dtype_size(p_dtype), ss = dtype_size(s_dtype), cs = dtype_size(c_dtype);
  for_each_segment(numel, num_threads, [&](size_t t, int64_t off, int64_t n) {
    char* c = copy.empty() ? nullptr : reinterpret_cast<char*>(copy[t]) + off * cs;
    fn(reinterpret_cast<char*>(p[t]) + off * ps, reinterpret_cast<const char*>(m[t]) + off * ss,
       reinterpret_cast<const char*>(v[t]) + off * ss, c, n, k, scale[t]);
  });
  return true;
}

}  // namespace fz
