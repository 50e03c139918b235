// Block-wise symmetric quantization (ZeRO++'s qwZ / qgZ): quantize,
// dequantize and the dequantized sum over ranks. The math and formats are
// fastzero/ops/quant/reference.py (docs/quant.md):
//  quantize: one thread block per quantization block (grid-stride beyond
//    kMaxGrid). Pass 1: the largest |x| as the max of the fp32 bit patterns
//    without the sign (integer order = |x| order for non-NaN values; a max >=
//    0x7f800000 flags inf or NaN), reduced over the block. Pass 2: each thread
//    writes codes of its elements (int8) or of its bytes (int4: the even
//    element in the low nibble). Division, add and rounding use the explicit
//    IEEE intrinsics (__fdiv_rn, __fadd_rn, rintf), so codes equal the CPU's.
//  dequantize_sum: one thread per element, the fp32 sum over ranks in rank
//    order of q * s with __fmul_rn / __fadd_rn (never contracted to an FMA,
//    as the reference rounds the product first).
#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

#include "common.cuh"

namespace fz {
namespace {

constexpr int kQuantThreads = 256;
constexpr int kDequantThreads = 256;
constexpr int64_t kMaxGrid = int64_t(1) << 20;  // blocks per launch; grid-stride loops beyond

__device__ __forceinline__ uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  return h ^ (h >> 16);
}

// The reference's u(seed, i) in [0, 1): exact multiples of 2^-24.
__device__ __forceinline__ float uniform(uint32_t seed, uint64_t i) {
  const uint32_t key = fmix32(seed + 0x9e3779b9u * uint32_t(i >> 32));
  return float(fmix32(uint32_t(i) ^ key) >> 8) * 5.9604644775390625e-08f;
}

// One code: rne(clamp(x / s, -qm, qm)) or floor(clamp(x / s + u, -qm, qm)).
template <bool kStochastic>
__device__ __forceinline__ int code_of(float x, float s, float qm, uint32_t seed, uint64_t i) {
  float r = __fdiv_rn(x, s);
  if (kStochastic) r = __fadd_rn(r, uniform(seed, i));
  r = fminf(fmaxf(r, -qm), qm);
  return int(kStochastic ? floorf(r) : rintf(r));
}

template <typename T, int kBits, bool kStochastic>
__global__ void __launch_bounds__(kQuantThreads)
    quant_quantize_kernel(const T* __restrict__ x, void* __restrict__ codes, float* __restrict__ scales, int64_t n,
                          int64_t block, int64_t blocks, uint32_t seed) {
  __shared__ uint32_t warp_max[kQuantThreads / 32];
  constexpr float qm = kBits == 8 ? 127.0f : 7.0f;
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const int64_t start = b * block;
    const int64_t len = min(block, n - start);
    uint32_t m = 0;
    for (int64_t i = threadIdx.x; i < len; i += kQuantThreads)
      m = max(m, __float_as_uint(to_float(x[start + i])) & 0x7fffffffu);
    m = __reduce_max_sync(0xffffffffu, m);
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    m = 0;
#pragma unroll
    for (int w = 0; w < kQuantThreads / 32; ++w) m = max(m, warp_max[w]);
    __syncthreads();  // warp_max is reused by the next block of the grid-stride loop
    const bool finite = m < 0x7f800000u;
    const float s = finite ? __fdiv_rn(__uint_as_float(m), qm) : __uint_as_float(0x7fc00000u);
    if (threadIdx.x == 0) scales[b] = s;
    const bool live = finite && s != 0.0f;  // otherwise codes 0: no division by 0 or NaN
    if (kBits == 8) {
      int8_t* c = static_cast<int8_t*>(codes) + start;
      for (int64_t i = threadIdx.x; i < len; i += kQuantThreads)
        c[i] = int8_t(live ? code_of<kStochastic>(to_float(x[start + i]), s, qm, seed, uint64_t(start + i)) : 0);
    } else {  // block is even: this block's bytes start at start / 2
      uint8_t* c = static_cast<uint8_t*>(codes) + start / 2;
      for (int64_t k = threadIdx.x; 2 * k < len; k += kQuantThreads) {
        const int64_t i = start + 2 * k;
        int lo = 0, hi = 0;
        if (live) {
          lo = code_of<kStochastic>(to_float(x[i]), s, qm, seed, uint64_t(i));
          if (2 * k + 1 < len) hi = code_of<kStochastic>(to_float(x[i + 1]), s, qm, seed, uint64_t(i + 1));
        }
        c[k] = uint8_t((lo & 0xf) | ((hi & 0xf) << 4));
      }
    }
  }
}

template <typename T, int kBits>
__global__ void __launch_bounds__(kDequantThreads)
    quant_dequantize_sum_kernel(const void* __restrict__ codes, int64_t code_stride, const float* __restrict__ scales,
                                int64_t blocks, int64_t ranks, T* __restrict__ out, int64_t n, int64_t block) {
  const int64_t step = int64_t(gridDim.x) * kDequantThreads;
  for (int64_t i = int64_t(blockIdx.x) * kDequantThreads + threadIdx.x; i < n; i += step) {
    const int64_t b = i / block;
    float acc = 0.0f;
    for (int64_t r = 0; r < ranks; ++r) {
      const char* row = static_cast<const char*>(codes) + r * code_stride;
      int q;
      if (kBits == 8) {
        q = reinterpret_cast<const int8_t*>(row)[i];
      } else {
        const int nib = (reinterpret_cast<const uint8_t*>(row)[i / 2] >> (4 * (i % 2))) & 0xf;
        q = nib >= 8 ? nib - 16 : nib;
      }
      const float v = __fmul_rn(float(q), scales[r * blocks + b]);
      acc = r == 0 ? v : __fadd_rn(acc, v);
    }
    out[i] = from_float<T>(acc);
  }
}

int invalid(const char* fn, const std::string& what) {
  return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": " + what);
}

bool misaligned(const void* p, int64_t size) { return reinterpret_cast<uintptr_t>(p) % size != 0; }

int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The format checks both entry points share; an empty string when fine.
std::string bad_format(int64_t n, int64_t block, int bits, int dtype) {
  if (dtype != kF32 && dtype != kF16 && dtype != kBF16)
    return std::string("unsupported dtype ") + dtype_name(dtype) + "; supported: float32, float16, bfloat16";
  if (n < 0 || block < 1) return std::to_string(n) + " elements in blocks of " + std::to_string(block);
  if (bits != 8 && bits != 4) return "bits must be 8 or 4, got " + std::to_string(bits);
  if (bits == 4 && block % 2) return "int4 needs an even block, got " + std::to_string(block);
  return "";
}

}  // namespace
}  // namespace fz

extern "C" int fz_cuda_quant_quantize(const void* x, int x_dtype, void* codes, float* scales, int64_t n,
                                      int64_t block, int bits, int stochastic, uint32_t seed, void* stream) {
  using namespace fz;
  constexpr const char* fn = "fz_cuda_quant_quantize";
  return guarded(fn, [&]() -> int {
    const std::string bad = bad_format(n, block, bits, x_dtype);
    if (!bad.empty()) return invalid(fn, bad);
    if (n == 0) return FZ_OK;
    if (x == nullptr || codes == nullptr || scales == nullptr) return invalid(fn, "x, codes or scales is null");
    if (misaligned(x, x_dtype == kF32 ? 4 : 2) || misaligned(scales, 4))
      return invalid(fn, "x or scales is not aligned to its elements");
    const int64_t blocks = div_up(n, block);
    const auto grid = unsigned(std::min(blocks, kMaxGrid));
    const auto s = static_cast<cudaStream_t>(stream);
    (void)cudaGetLastError();  // forget a failure of an earlier call on this thread
    int rc = FZ_OK;
    visit_dtype<false>(x_dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* xt = static_cast<const T*>(x);
      auto launch = [&](auto kernel) {
        kernel<<<grid, kQuantThreads, 0, s>>>(xt, codes, scales, n, block, blocks, seed);
        rc = check_launch("quant_quantize_kernel");
      };
      if (bits == 8) {
        if (stochastic) launch(quant_quantize_kernel<T, 8, true>);
        else launch(quant_quantize_kernel<T, 8, false>);
      } else {
        if (stochastic) launch(quant_quantize_kernel<T, 4, true>);
        else launch(quant_quantize_kernel<T, 4, false>);
      }
    });
    return rc;
  });
}

extern "C" int fz_cuda_quant_dequantize_sum(const void* codes, int bits, int64_t code_stride, const float* scales,
                                            int64_t ranks, void* out, int out_dtype, int64_t n, int64_t block,
                                            void* stream) {
  using namespace fz;
  constexpr const char* fn = "fz_cuda_quant_dequantize_sum";
  return guarded(fn, [&]() -> int {
    const std::string bad = bad_format(n, block, bits, out_dtype);
    if (!bad.empty()) return invalid(fn, bad);
    if (ranks < 1 || code_stride < 0) return invalid(fn, "need ranks >= 1 and code_stride >= 0");
    if (n == 0) return FZ_OK;
    if (codes == nullptr || scales == nullptr || out == nullptr) return invalid(fn, "codes, scales or out is null");
    if (misaligned(scales, 4) || misaligned(out, out_dtype == kF32 ? 4 : 2))
      return invalid(fn, "scales or out is not aligned to its elements");
    const int64_t blocks = div_up(n, block);
    const auto grid = unsigned(std::min(div_up(n, kDequantThreads), kMaxGrid));
    const auto s = static_cast<cudaStream_t>(stream);
    (void)cudaGetLastError();
    int rc = FZ_OK;
    visit_dtype<false>(out_dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      T* o = static_cast<T*>(out);
      if (bits == 8)
        quant_dequantize_sum_kernel<T, 8><<<grid, kDequantThreads, 0, s>>>(codes, code_stride, scales, blocks, ranks,
                                                                          o, n, block);
      else
        quant_dequantize_sum_kernel<T, 4><<<grid, kDequantThreads, 0, s>>>(codes, code_stride, scales, blocks, ranks,
                                                                          o, n, block);
      rc = check_launch("quant_dequantize_sum_kernel");
    });
    return rc;
  });
}
