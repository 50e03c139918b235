#include "stream.h"

#include <array>
#include <cmath>
#include <cstring>
#include <immintrin.h>

#include "parallel.h"

#define FZ_KERNEL_BODY "stream_kernel.inc"
#include "isa_regions.inc"

namespace fz {

bool stream_update(Isa isa, const std::vector<uintptr_t>& a, const std::vector<uintptr_t>& b,
                   const std::vector<uintptr_t>& c, const std::vector<uintptr_t>& d,
                   const std::vector<int64_t>& numel, float s, int num_threads) {
  using Fn = void (*)(float*, const float*, float*, float*, int64_t, float);
  Fn fn = nullptr;
  switch (isa) {
#ifdef FZ_HAVE_X86_SIMD
    case kAvx512: fn = &avx512::stream_segment; break;
    case kAvx2: fn = &avx2::stream_segment; break;
#endif
    case kScalar: fn = &scalar::stream_segment; break;
    default: return false;
  }
  auto at = [](uintptr_t base, int64_t off) { return reinterpret_cast<float*>(base) + off; };
  for_each_segment(numel, num_threads, [&](size_t t, int64_t off, int64_t len) {
    fn(at(a[t], off), at(b[t], off), at(c[t], off), at(d[t], off), len, s);
  });
  return true;
}

bool stream_fill(Isa isa, const std::vector<uintptr_t>& a, const std::vector<int64_t>& numel, float s, bool nt,
                 int num_threads) {
  using Fn = void (*)(float*, int64_t, float, bool);
  Fn fn = nullptr;
  switch (isa) {
#ifdef FZ_HAVE_X86_SIMD
    case kAvx512: fn = &avx512::fill_segment; break;
    case kAvx2: fn = &avx2::fill_segment; break;
#endif
    case kScalar: fn = &scalar::fill_segment; break;
    default: return false;
  }
  for_each_segment(numel, num_threads, [&](size_t t, int64_t off, int64_t len) {
    fn(reinterpret_cast<float*>(a[t]) + off, len, s, nt);
  });
  return true;
}

}  // namespace fz
