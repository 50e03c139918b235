// 1-bit compression with error feedback (1-bit Adam's): pack and unpack. The
// math is fastzero/ops/reference/onebit.py; sign bits are packed eight to a
// byte, element i of a chunk in bit i % 8 of byte i / 8.
//
// pack, in three launches on one stream and without a host sync:
//  1. sumsq: y = x + error per element, sum of y^2 in fp64 over one block's
//     kChunkSize elements of a chunk, into partials[chunk * tiles + tile];
//  2. scales: one block per chunk adds its partials in a fixed order (the
//     scales do not depend on timing) and writes sqrt(sum / len) as fp32;
//  3. signs: y again; a warp takes 32 consecutive elements of one chunk (lane
//     j element 32 w + j), whose __ballot_sync of (y >= 0) is 4 bytes of bits
//     in little-endian order; lanes 0-3 store them (fewer for the last 8, 16
//     or 24 elements of a chunk), and every lane stores y - (+-scale).
// unpack: one thread per byte of bits writes its 8 values, either row by row
// (scales[row] * sign) or, for the average, the fp32 sum over the rows in row
// order divided by the number of rows (the CPU kernel's arithmetic).
#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

#include "common.cuh"

namespace fz {
namespace {

constexpr int kFinalThreads = 256;
constexpr int kWarps = kBlockSize / 32;
constexpr int kSegments = 8;                        // 32-element segments per warp in a signs block
constexpr int kSignsTile = kBlockSize * kSegments;  // elements per signs block: 4096
constexpr int kUnpackThreads = 256;
constexpr int64_t kMaxGrid = int64_t(1) << 20;  // unpack blocks per launch (grid-stride loops beyond)

// Block b of a launch over `chunks` chunks of `tiles` tiles each works on
// tile b % tiles of chunk b / tiles.
struct TileRef {
  int64_t chunk, tile;
};
__device__ __forceinline__ TileRef tile_ref(int64_t tiles) {
  return {int64_t(blockIdx.x) / tiles, int64_t(blockIdx.x) % tiles};
}

template <typename T>
__global__ void __launch_bounds__(kBlockSize)
    onebit_sumsq_kernel(const T* __restrict__ x, const float* __restrict__ error, double* __restrict__ partials,
                        int64_t len, int64_t tiles) {
  const TileRef r = tile_ref(tiles);
  const int64_t start = r.chunk * len + r.tile * kChunkSize;
  const int n = int(len - r.tile * kChunkSize < kChunkSize ? len - r.tile * kChunkSize : kChunkSize);
  const T* xs = x + start;
  const float* es = error + start;
  constexpr int N = kVecWidth<T, float>;
  double sum[1] = {0.0};
  for_each_tile<N>(n, aligned16(xs) && aligned16(es), [&](const auto& tile) {
    Lanes<T, N> xl;
    Lanes<float, N> el;
    xl.load(xs, tile);
    el.load(es, tile);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float y = xl.x[j] + el.x[j];  // the reference's fp32 x.float() + error
      if (tile.valid(j)) sum[0] += double(y) * double(y);
    }
  });
  block_sum<kBlockSize>(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum[0];
}

// scales[c] = sqrt(sum of chunk c's partials / len); NaN for empty chunks
// (0 / 0, as the reference's norm / sqrt(0)).
__global__ void __launch_bounds__(kFinalThreads)
    onebit_scales_kernel(const double* __restrict__ partials, int64_t tiles, int64_t len, float* __restrict__ scales) {
  const int64_t chunk = blockIdx.x;
  double sum[1] = {0.0};
  for (int64_t i = threadIdx.x; i < tiles; i += kFinalThreads) sum[0] += partials[chunk * tiles + i];
  block_sum<kFinalThreads>(sum);
  if (threadIdx.x == 0) scales[chunk] = float(sqrt(sum[0] / double(len)));
}

template <typename T>
__global__ void __launch_bounds__(kBlockSize)
    onebit_signs_kernel(const T* __restrict__ x, float* __restrict__ error, uint8_t* __restrict__ bits,
                        const float* __restrict__ scales, int64_t len, int64_t tiles) {
  const TileRef r = tile_ref(tiles);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t first = r.chunk * len;  // the chunk's first element
  const float scale = scales[r.chunk];
  // Segment k of this warp starts at element seg(k) of the chunk; for one k
  // the block's warps cover kBlockSize consecutive elements (coalesced).
  auto seg = [&](int k) { return r.tile * kSignsTile + int64_t(k * kWarps + warp) * 32; };
  float y[kSegments];
#pragma unroll
  for (int k = 0; k < kSegments; ++k) {  // every load in flight before the first use
    const int64_t i = seg(k) + lane;
    y[k] = i < len ? to_float(x[first + i]) + error[first + i] : 0.0f;
  }
#pragma unroll
  for (int k = 0; k < kSegments; ++k) {
    const int64_t s = seg(k);
    if (s >= len) break;  // the same for the whole warp: the ballot below sees every lane
    const bool in = s + lane < len;
    const bool bit = y[k] >= 0.0f;  // -0 gives 1, NaN gives 0, as torch's y >= 0
    const unsigned word = __ballot_sync(0xffffffffu, in && bit);
    if (in) error[first + s + lane] = y[k] - (bit ? scale : -scale);
    const int64_t valid = len - s < 32 ? len - s : 32;  // a multiple of 8
    if (lane < valid / 8) bits[(first + s) / 8 + lane] = uint8_t(word >> (8 * lane));
  }
}

template <bool kAligned>
__device__ __forceinline__ void store8(float* dst, const float (&v)[8]) {
  if constexpr (kAligned) {
    reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) dst[k] = v[k];
  }
}

// out[8 b + k] = scales[b / row_bytes] * (bit k of byte b ? 1 : -1).
template <bool kAligned>
__global__ void __launch_bounds__(kUnpackThreads)
    onebit_unpack_rows_kernel(const uint8_t* __restrict__ bits, const float* __restrict__ scales,
                              float* __restrict__ out, int64_t row_bytes, int64_t total_bytes) {
  for (int64_t b = int64_t(blockIdx.x) * kUnpackThreads + threadIdx.x; b < total_bytes;
       b += int64_t(gridDim.x) * kUnpackThreads) {
    const float s = scales[b / row_bytes];
    const unsigned byte = bits[b];
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = (byte >> k) & 1u ? s : -s;
    store8<kAligned>(out + 8 * b, v);
  }
}

// out[8 b + k] = (sum over rows r, in order, of scales[r] * sign) / rows.
template <bool kAligned>
__global__ void __launch_bounds__(kUnpackThreads)
    onebit_unpack_average_kernel(const uint8_t* __restrict__ bits, const float* __restrict__ scales,
                                 float* __restrict__ out, int64_t rows, int64_t row_bytes) {
  const float count = float(rows);
  for (int64_t b = int64_t(blockIdx.x) * kUnpackThreads + threadIdx.x; b < row_bytes;
       b += int64_t(gridDim.x) * kUnpackThreads) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t r = 0; r < rows; ++r) {
      const float s = scales[r];
      const unsigned byte = bits[r * row_bytes + b];
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] += (byte >> k) & 1u ? s : -s;
    }
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = acc[k] / count;  // IEEE division, as the CPU kernel's
    store8<kAligned>(out + 8 * b, v);
  }
}

int invalid(const char* fn, const std::string& what) {
  return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": " + what);
}

bool misaligned(const void* p, int64_t size) { return reinterpret_cast<uintptr_t>(p) % size != 0; }

int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace
}  // namespace fz

extern "C" int fz_cuda_onebit_pack(const void* x, int x_dtype, float* error, uint8_t* bits, float* scales,
                                   int64_t numel, int64_t chunks, double* partials, int64_t partials_len,
                                   void* stream) {
  using namespace fz;
  constexpr const char* fn = "fz_cuda_onebit_pack";
  return guarded(fn, [&]() -> int {
    if (x_dtype != kF32 && x_dtype != kF16 && x_dtype != kBF16)
      return invalid(fn, std::string("unsupported dtype ") + dtype_name(x_dtype) +
                             " for x; supported: float32, float16, bfloat16");
    if (numel < 0 || chunks < 1)
      return invalid(fn, std::to_string(numel) + " elements in " + std::to_string(chunks) + " chunks");
    if (numel % chunks != 0 || (numel / chunks) % 8 != 0)
      return invalid(fn, std::to_string(numel) + " elements do not split into " + std::to_string(chunks) +
                             " chunks of whole bytes");
    if (chunks > INT_MAX) return invalid(fn, "too many chunks (" + std::to_string(chunks) + ")");
    const int64_t len = numel / chunks;
    const int64_t sumsq_tiles = div_up(len, kChunkSize), signs_tiles = div_up(len, kSignsTile);
    if (signs_tiles > INT_MAX / chunks) return invalid(fn, std::to_string(numel) + " elements are too many");
    const int64_t needed = chunks * sumsq_tiles;
    if (scales == nullptr || misaligned(scales, 4)) return invalid(fn, "scales is null or not aligned to float32");
    if (numel > 0) {
      if (x == nullptr || error == nullptr || bits == nullptr) return invalid(fn, "x, error or bits is null");
      if (misaligned(x, x_dtype == kF32 ? 4 : 2) || misaligned(error, 4))
        return invalid(fn, "x or error is not aligned to its elements");
      if (partials == nullptr || partials_len < needed || misaligned(partials, 8))
        return invalid(fn, "the partials buffer holds " + std::to_string(partials_len) + " values, " +
                               std::to_string(needed) + " needed");
    }
    const auto s = static_cast<cudaStream_t>(stream);
    (void)cudaGetLastError();  // forget a failure of an earlier call on this thread
    int rc = FZ_OK;
    visit_dtype<false>(x_dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* xt = static_cast<const T*>(x);
      if (numel > 0) {
        onebit_sumsq_kernel<T><<<unsigned(needed), kBlockSize, 0, s>>>(xt, error, partials, len, sumsq_tiles);
        if ((rc = check_launch("onebit_sumsq_kernel"))) return;
      }
      onebit_scales_kernel<<<unsigned(chunks), kFinalThreads, 0, s>>>(partials, sumsq_tiles, len, scales);
      if ((rc = check_launch("onebit_scales_kernel"))) return;
      if (numel > 0) {
        onebit_signs_kernel<T><<<unsigned(chunks * signs_tiles), kBlockSize, 0, s>>>(xt, error, bits, scales, len,
                                                                                      signs_tiles);
        rc = check_launch("onebit_signs_kernel");
      }
    });
    return rc;
  });
}

extern "C" int fz_cuda_onebit_unpack(const uint8_t* bits, const float* scales, float* out, int64_t rows,
                                     int64_t row_bytes, int average, void* stream) {
  using namespace fz;
  constexpr const char* fn = "fz_cuda_onebit_unpack";
  return guarded(fn, [&]() -> int {
    if (rows < 1 || row_bytes < 0)
      return invalid(fn, std::to_string(rows) + " rows of " + std::to_string(row_bytes) + " bytes");
    if (row_bytes > INT64_MAX / 8 / rows) return invalid(fn, "too many elements");
    if (row_bytes == 0) return FZ_OK;  // nothing to write
    if (bits == nullptr || scales == nullptr || out == nullptr) return invalid(fn, "bits, scales or out is null");
    if (misaligned(scales, 4) || misaligned(out, 4)) return invalid(fn, "scales or out is not aligned to float32");
    const auto s = static_cast<cudaStream_t>(stream);
    const int64_t work = average ? row_bytes : rows * row_bytes;  // bytes, one thread each
    const auto blocks = unsigned(std::min(div_up(work, kUnpackThreads), kMaxGrid));
    const bool aligned = aligned16(out);
    (void)cudaGetLastError();
    if (average) {
      if (aligned)
        onebit_unpack_average_kernel<true><<<blocks, kUnpackThreads, 0, s>>>(bits, scales, out, rows, row_bytes);
      else
        onebit_unpack_average_kernel<false><<<blocks, kUnpackThreads, 0, s>>>(bits, scales, out, rows, row_bytes);
      return check_launch("onebit_unpack_average_kernel");
    }
    if (aligned)
      onebit_unpack_rows_kernel<true><<<blocks, kUnpackThreads, 0, s>>>(bits, scales, out, row_bytes, work);
    else
      onebit_unpack_rows_kernel<false><<<blocks, kUnpackThreads, 0, s>>>(bits, scales, out, row_bytes, work);
    return check_launch("onebit_unpack_rows_kernel");
  });
}
