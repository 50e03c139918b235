// CPU LAMB kernels (see lamb_kernel.inc for the math) and their multi-tensor,
// multi-thread drivers.
#include "lamb.h"

#include <array>
#include <cmath>
#include <cstring>
#include <immintrin.h>

#include "parallel.h"

#define FZ_KERNEL_BODY "lamb_kernel.inc"
#include "isa_regions.inc"

namespace fz {

double lamb_grad_sumsq(Isa isa, const std::vector<uintptr_t>& g, const std::vector<int64_t>& numel,
                       int g_dtype, float grad_mult, int num_threads) {
  const auto fn = FZ_ISA_PICK(isa, grad_sumsq_pick(g_dtype));
  if (fn == nullptr) return NAN;
  const std::vector<Chunk> chunks = make_chunks(numel);
  std::vector<double> partial(chunks.size(), 0.0);
  const int64_t gs = dtype_size(g_dtype);
  parallel_chunks(chunks, num_threads, [&](int64_t i) {
    const Chunk& c = chunks[i];
    partial[i] = fn(reinterpret_cast<const char*>(g[c.tensor]) + c.offset * gs, c.count, grad_mult);
  });
  double sum = 0.0;
  for (double x : partial) sum += x;
  return sum;
}

bool lamb_norms(Isa isa, const std::vector<uintptr_t>& p, const std::vector<uintptr_t>& g,
                const std::vector<uintptr_t>& m, const std::vector<uintptr_t>& v,
                const std::vector<int64_t>& numel, int p_dtype, int g_dtype, int s_dtype,
                const LambHyper& h, int num_threads, std::vector<double>* sums) {
  const auto fn = FZ_ISA_PICK(isa, lamb_norms_pick(p_dtype, g_dtype, s_dtype));
  if (fn == nullptr) return false;
  const std::vector<Chunk> chunks = make_chunks(numel);
  std::vector<double> partial(2 * chunks.size(), 0.0);
  const int64_t ps = dtype_size(p_dtype), gs = dtype_size(g_dtype), ss = dtype_size(s_dtype);
  parallel_chunks(chunks, num_threads, [&](int64_t i) {
    const Chunk& c = chunks[i];
    fn(reinterpret_cast<const char*>(p[c.tensor]) + c.offset * ps,
       reinterpret_cast<const char*>(g[c.tensor]) + c.offset * gs,
       reinterpret_cast<char*>(m[c.tensor]) + c.offset * ss,
       reinterpret_cast<char*>(v[c.tensor]) + c.offset * ss, c.count, h, &partial[2 * i]);
  });
  sums->assign(2 * numel.size(), 0.0);
  for (size_t i = 0; i < chunks.size(); ++i) {
    (*sums)[2 * chunks[i].tensor] += partial[2 * i];
    (*sums)[2 * chunks[i].tensor + 1] += partial[2 * i + 1];
  }
  return true;
}

bool lamb_apply(Isa isa, const std::vector<uintptr_t>& p, const std::vector<uintptr_t>& m,
                const std::vector<uintptr_t>& v, const std::vector<uintptr_t>& copy,
                const std::vector<int64_t>& numel, int p_dtype, int s_dtype, int c_dtype,
                const LambHyper& h, const std::vector<float>& scale, int num_threads) {
  const auto fn = FZ_ISA_PICK(isa, lamb_apply_pick(p_dtype, s_dtype, c_dtype));
  if (fn == nullptr) return false;
  const int64_t ps = dtype_size(p_dtype), ss = dtype_size(s_dtype), cs = dtype_size(c_dtype);
  for_each_segment(numel, num_threads, [&](size_t t, int64_t off, int64_t n) {
    char* c = copy.empty() ? nullptr : reinterpret_cast<char*>(copy[t]) + off * cs;
    fn(reinterpret_cast<char*>(p[t]) + off * ps, reinterpret_cast<const char*>(m[t]) + off * ss,
       reinterpret_cast<const char*>(v[t]) + off * ss, c, n, h, scale[t]);
  });
  return true;
}

}  // namespace fz
