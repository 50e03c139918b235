// CPU 1-bit pack and unpack (see onebit_kernel.inc for the loops) and their
// multi-thread drivers: chunks are cut into segments that threads claim.
#include "onebit.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <immintrin.h>
#include <vector>

#include "parallel.h"

#define FZ_KERNEL_BODY "onebit_kernel.inc"
#include "isa_regions.inc"

namespace fz {

bool onebit_pack(Isa isa, const void* x, int x_dtype, float* error, uint8_t* bits, float* scales,
                 int64_t numel, int64_t chunks, int num_threads) {
  if (chunks < 1 || numel % (8 * chunks) != 0) return false;
  const auto sumsq = FZ_ISA_PICK(isa, pick_sumsq(x_dtype));
  const auto signs = FZ_ISA_PICK(isa, pick_signs(x_dtype));
  if (sumsq == nullptr || signs == nullptr) return false;
  const int64_t len = numel / chunks, xs = dtype_size(x_dtype);
  // Segments never cross a chunk and start at multiples of kChunkElements
  // within it, so each one writes whole bytes of bits.
  const std::vector<Chunk> segs = make_chunks(std::vector<int64_t>(size_t(chunks), len));
  auto x_at = [&](const Chunk& s) { return static_cast<const char*>(x) + (int64_t(s.tensor) * len + s.offset) * xs; };
  auto at = [&](const Chunk& s) { return int64_t(s.tensor) * len + s.offset; };
  std::vector<double> partial(segs.size(), 0.0);
  parallel_chunks(segs, num_threads, [&](int64_t i) { partial[i] = sumsq(x_at(segs[i]), error + at(segs[i]), segs[i].count); });
  std::vector<double> total(size_t(chunks), 0.0);
  for (size_t i = 0; i < segs.size(); ++i) total[segs[i].tensor] += partial[i];  // in order: deterministic
  for (int64_t c = 0; c < chunks; ++c) scales[c] = float(std::sqrt(total[c] / double(len)));
  parallel_chunks(segs, num_threads, [&](int64_t i) {
    const Chunk& s = segs[i];
    signs(x_at(s), error + at(s), bits + at(s) / 8, s.count, scales[s.tensor]);
  });
  return true;
}

// Outputs at least this big (a few L2s) are written with cache-bypassing
// stores: a plain store first reads each line from memory, which for a
// large, cold output costs as much as the write. Smaller ones stay in cache
// for the pack that reads them next.
constexpr int64_t kStreamOutBytes = int64_t(8) << 20;

// Whether every segment's output starts on a 64-byte line: row starts
// (multiples of 8 elements) and segment offsets (multiples of
// kChunkElements) from a 64-byte aligned out, with rows of whole lines.
bool streamable(const float* out, int64_t total, int64_t len) {
  return total * 4 >= kStreamOutBytes && reinterpret_cast<uintptr_t>(out) % 64 == 0 && len % 16 == 0;
}

bool onebit_unpack(Isa isa, const uint8_t* bits, const float* scales, float* out, int64_t rows,
                   int64_t row_bytes, bool average, int num_threads) {
  if (rows < 1 || row_bytes < 0) return false;
  const int64_t len = 8 * row_bytes;
  const bool nt = streamable(out, average ? len : rows * len, len);
  if (average) {
    const auto fn = FZ_ISA_PICK(isa, pick_average(nt));
    if (fn == nullptr) return false;
    for_each_segment({len}, num_threads, [&](size_t, int64_t off, int64_t n) {
      fn(bits + off / 8, row_bytes, scales, rows, out + off, n);
    });
  } else {
    const auto fn = FZ_ISA_PICK(isa, pick_scale_signs(nt));
    if (fn == nullptr) return false;
    for_each_segment(std::vector<int64_t>(size_t(rows), len), num_threads, [&](size_t r, int64_t off, int64_t n) {
      fn(bits + int64_t(r) * row_bytes + off / 8, scales[r], out + int64_t(r) * len + off, n);
    });
  }
  return true;
}

// Segments start at multiples of kChunkElements (whole bytes of bits).
bool mask_pack(Isa isa, const void* x, int x_dtype, uint8_t* bits, int64_t numel, int num_threads) {
  const auto fn = FZ_ISA_PICK(isa, pick_mask_pack(x_dtype));
  if (fn == nullptr || numel < 0) return false;
  const char* xp = static_cast<const char*>(x);
  const int64_t xs = dtype_size(x_dtype);
  for_each_segment({numel}, num_threads, [&](size_t, int64_t off, int64_t n) { fn(xp + off * xs, bits + off / 8, n); });
  return true;
}

bool mask_unpack(Isa isa, const uint8_t* bits, void* out, int out_dtype, int64_t numel, int num_threads) {
  const auto fn = FZ_ISA_PICK(isa, pick_mask_unpack(out_dtype));
  if (fn == nullptr || numel < 0) return false;
  char* op = static_cast<char*>(out);
  const int64_t os = dtype_size(out_dtype);
  for_each_segment({numel}, num_threads, [&](size_t, int64_t off, int64_t n) { fn(bits + off / 8, op + off * os, n); });
  return true;
}

}  // namespace fz
