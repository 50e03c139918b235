// CPU Adam/AdamW kernels (see adam_kernel.inc for the math) and their
// multi-tensor, multi-thread driver.
#include "adam.h"

#include <array>
#include <cmath>
#include <cstring>
#include <immintrin.h>

#include "parallel.h"

#define FZ_KERNEL_BODY "adam_kernel.inc"
#include "isa_regions.inc"

namespace fz {

AdamSegmentFn adam_segment_fn(Isa isa, int p, int g, int s, int copy) {
  return FZ_ISA_PICK(isa, adam_pick(p, g, s, copy));
}

void adam_multi_tensor(AdamSegmentFn fn, const std::vector<uintptr_t>& p,
                       const std::vector<uintptr_t>& g, const std::vector<uintptr_t>& m,
                       const std::vector<uintptr_t>& v, const std::vector<uintptr_t>& copy,
                       const std::vector<int64_t>& numel, int p_dtype, int g_dtype,
                       int s_dtype, int c_dtype, const AdamHyper& h, int num_threads) {
  const int64_t ps = dtype_size(p_dtype), gs = dtype_size(g_dtype), ss = dtype_size(s_dtype),
                cs = dtype_size(c_dtype);
  for_each_segment(numel, num_threads, [&](size_t t, int64_t off, int64_t n) {
    char* c = copy.empty() ? nullptr : reinterpret_cast<char*>(copy[t]) + off * cs;
    fn(reinterpret_cast<char*>(p[t]) + off * ps, reinterpret_cast<const char*>(g[t]) + off * gs,
       reinterpret_cast<char*>(m[t]) + off * ss, reinterpret_cast<char*>(v[t]) + off * ss, c,
       n, h);
  });
}

}  // namespace fz
