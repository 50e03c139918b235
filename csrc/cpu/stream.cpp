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
  const auto fn = FZ_ISA_PICK(isa, stream_segment);
  if (fn == nullptr) return false;
  auto at = [](uintptr_t base, int64_t off) { return reinterpret_cast<float*>(base) + off; };
  for_each_segment(numel, num_threads, [&](size_t t, int64_t off, int64_t len) {
    fn(at(a[t], off), at(b[t], off), at(c[t], off), at(d[t], off), len, s);
  });
  return true;
}

bool stream_fill(Isa isa, const std::vector<uintptr_t>& a, const std::vector<int64_t>& numel, float s, bool nt,
                 int num_threads) {
  const auto fn = FZ_ISA_PICK(isa, fill_segment);
  if (fn == nullptr) return false;
  for_each_segment(numel, num_threads, [&](size_t t, int64_t off, int64_t len) {
    fn(reinterpret_cast<float*>(a[t]) + off, len, s, nt);
  });
  return true;
}

bool stream_narrow(Isa isa, const std::vector<uintptr_t>& x, const std::vector<uintptr_t>& out,
                   const std::vector<int64_t>& numel, int bits, bool nt, int num_threads) {
  const auto fn = FZ_ISA_PICK(isa, narrow_segment);
  if (fn == nullptr) return false;
  // chunk offsets are multiples of kChunkElements (even): int4 chunks start on a byte
  for_each_segment(numel, num_threads, [&](size_t t, int64_t off, int64_t len) {
    fn(reinterpret_cast<const float*>(x[t]) + off, reinterpret_cast<uint8_t*>(out[t]) + off * bits / 8, len, bits,
       nt);
  });
  return true;
}

}  // namespace fz
