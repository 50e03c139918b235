#include "stream.h"

#include <cmath>
#include <cstring>
#include <immintrin.h>

#include "parallel.h"

#define FZ_KERNEL_BODY "stream_kernel.inc"
#include "isa_regions.inc"

namespace fz {

bool stream_update(Isa isa, float* a, const float* b, float* c, float* d, int64_t n, float s,
                   int num_threads) {
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
  for_each_segment({n}, num_threads, [&](size_t, int64_t off, int64_t len) {
    fn(a + off, b + off, c + off, d + off, len, s);
  });
  return true;
}

}  // namespace fz
