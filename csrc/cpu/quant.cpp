// CPU block-wise quantization (see quant_kernel.inc for the loops) and its
// multi-thread drivers: work items are runs of whole blocks.
#include "quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <immintrin.h>
#include <limits>
#include <vector>

#include "parallel.h"

// The dequantized sum must add q * scale after rounding the product, as the
// reference does: no fused multiply-add, whatever the target allows.
#if defined(__clang__)
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif

// GCC 12 warns, inside avx512fintrin.h, that the self-initialized
// _mm512_undefined_* operands of the intrinsics these kernels inline are
// uninitialized (a false positive, as -Wno-maybe-uninitialized in build.py).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#define FZ_KERNEL_BODY "quant_kernel.inc"
#include "isa_regions.inc"

namespace fz {

namespace {

// Runs of whole blocks of about kChunkElements values: item i covers blocks
// [i * per, (i + 1) * per).
int64_t blocks_per_item(int64_t block) { return std::max<int64_t>(1, kChunkElements / block); }

std::vector<Chunk> block_items(int64_t n, int64_t block) {
  const int64_t step = blocks_per_item(block) * block;
  std::vector<Chunk> items;
  for (int64_t off = 0; off < n; off += step) items.push_back({0, off, std::min(step, n - off)});
  return items;
}

// Codes of at least this many bytes (a core's L2) are written with
// cache-bypassing stores, in whole groups that start on their size: a plain
// store first reads each line (a write-allocate). Measured on the AVX-512
// machine of docs/quant.md: 2% to 10% faster for int8 codes from 1M to 16M
// values, int4 about even. Smaller outputs stay in the cache.
constexpr int64_t kStreamCodesBytes = int64_t(1) << 20;

bool good_format(int64_t n, int64_t block, int bits) {
  return n >= 0 && block >= 1 && (bits == 8 || (bits == 4 && block % 2 == 0));
}

}  // namespace

bool quant_quantize(Isa isa, const void* x, int x_dtype, void* codes, float* scales, int64_t n, int64_t block,
                    int bits, bool stochastic, uint32_t seed, int num_threads) {
  if (!good_format(n, block, bits)) return false;
  const auto fn = FZ_ISA_PICK(isa, pick_quantize(x_dtype));
  if (fn == nullptr) return false;
  const int64_t xs = dtype_size(x_dtype);
  const std::vector<Chunk> items = block_items(n, block);
  const bool stream = n * bits / 8 >= kStreamCodesBytes;
  parallel_chunks(items, num_threads, [&](int64_t i) {
    const int64_t off = items[i].offset;  // a block's first element (even for int4)
    fn(static_cast<const char*>(x) + off * xs, static_cast<char*>(codes) + off * bits / 8, scales + off / block,
       items[i].count, block, uint64_t(off), bits, stochastic, seed, stream);
  });
  return true;
}

bool quant_dequantize_sum(Isa isa, const void* codes, int bits, int64_t code_stride, const float* scales,
                          int64_t ranks, void* out, int out_dtype, int64_t n, int64_t block, int num_threads) {
  if (!good_format(n, block, bits) || ranks < 1) return false;
  const auto fn = FZ_ISA_PICK(isa, pick_dequantize(out_dtype));
  if (fn == nullptr) return false;
  const int64_t blocks = (n + block - 1) / block;
  // Items of whole tiles (even offsets, for int4) rather than whole blocks: a
  // span may cut a block, dequantize_span finds each element's scale.
  std::vector<Chunk> items;
  for (int64_t off = 0; off < n; off += kChunkElements) items.push_back({0, off, std::min(kChunkElements, n - off)});
  parallel_chunks(items, num_threads, [&](int64_t i) {
    fn(codes, bits, code_stride, scales, blocks, ranks, out, items[i].offset, items[i].count, block);
  });
  return true;
}

bool quant_dequantize(Isa isa, const void* codes, int bits, const float* scales, void* out, int out_dtype,
                      int64_t n, int64_t block, int num_threads) {
  return quant_dequantize_sum(isa, codes, bits, 0, scales, 1, out, out_dtype, n, block, num_threads);
}

}  // namespace fz
