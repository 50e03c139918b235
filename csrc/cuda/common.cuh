// Shared pieces of the CUDA kernels: dtype codes and conversions, 16-byte
// vector loads and stores with a scalar fallback, block reductions, the
// multi-tensor chunk table and its host-side launcher, error reporting.
// No PyTorch header here (DESIGN.md rule 2).
//
// How a multi-tensor launch works (apex / ATen style): a list of tensors is
// cut into chunks of kChunkSize elements; one thread block updates one chunk.
// A TensorListMeta, passed to the kernel by value (kernel parameters, < 4 KiB),
// holds the pointers and sizes of up to kMaxTensors tensors and, per block, the
// tensor and chunk it works on. A list larger than one table takes several
// launches; a tensor may straddle two of them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <type_traits>

#include "fastzero_cuda.h"

namespace fz {

// Dtype codes shared with Python (fastzero/native/abi.py) and csrc/cpu/common.h.
enum DType : int { kNone = -1, kF32 = 0, kF16 = 1, kBF16 = 2 };

// ATen's fused-Adam numbers: 512 threads per block and 64 Ki elements per
// chunk, so 128 elements per thread in tiles of 4 or 8; up to 320 blocks per
// launch (a table's worth; about 1.2 waves of two blocks per SM on an H100).
constexpr int kBlockSize = 512;
constexpr int kChunkSize = 65536;
constexpr int kMaxBlocks = 320;
static_assert(kChunkSize % (kBlockSize * 8) == 0, "chunks hold whole vector rows");

// ---------------------------------------------------------------------------
// Error reporting (common.cu): a per-thread message behind fz_cuda_last_error.

int set_error(int code, const std::string& message);
int check_launch(const char* kernel);  // FZ_OK, or FZ_ERR_CUDA with CUDA's message

// Runs an entry point's body: C++ exceptions become error codes, never an abort.
template <typename Body>
int guarded(const char* name, Body&& body) noexcept {
  try {
    return body();
  } catch (const std::exception& e) {
    return set_error(FZ_ERR_INTERNAL, std::string(name) + ": " + e.what());
  } catch (...) {
    return set_error(FZ_ERR_INTERNAL, std::string(name) + ": unknown C++ exception");
  }
}

// ---------------------------------------------------------------------------
// Element types. NoneT stands for an absent tensor (no param copy): its loads
// and stores compile to nothing.

struct NoneT {};

template <typename T>
struct Dtype;
template <>
struct Dtype<float> {
  static constexpr int code = kF32, bytes = 4;
  static constexpr const char* name = "float32";
};
template <>
struct Dtype<__half> {
  static constexpr int code = kF16, bytes = 2;
  static constexpr const char* name = "float16";
};
template <>
struct Dtype<__nv_bfloat16> {
  static constexpr int code = kBF16, bytes = 2;
  static constexpr const char* name = "bfloat16";
};
template <>
struct Dtype<NoneT> {
  static constexpr int code = kNone, bytes = 4;  // 4: never narrows the vector width
  static constexpr const char* name = "none";
};

inline const char* dtype_name(int code) {
  switch (code) {
    case kF32: return "float32";
    case kF16: return "float16";
    case kBF16: return "bfloat16";
    case kNone: return "none";
  }
  return "invalid dtype code";
}

// Elements per thread per tile: one 16-byte access for the narrowest dtype
// (4 for all-fp32, 8 when any tensor is 16-bit; fp32 arrays then take two).
template <typename... Ts>
struct Narrowest;
template <typename T>
struct Narrowest<T> {
  static constexpr int bytes = Dtype<T>::bytes;
};
template <typename T, typename... Ts>
struct Narrowest<T, Ts...> {
  static constexpr int bytes =
      Dtype<T>::bytes < Narrowest<Ts...>::bytes ? Dtype<T>::bytes : Narrowest<Ts...>::bytes;
};
template <typename... Ts>
constexpr int kVecWidth = 16 / Narrowest<Ts...>::bytes;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Round to nearest even, as torch's .to(dtype); overflow to inf, NaN stays NaN.
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename T>
__host__ __device__ __forceinline__ bool aligned16(const T* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

// ---------------------------------------------------------------------------
// Tiles: one pass of a block over kBlockSize * N elements of its chunk.
// Vectorised tiles give each thread N consecutive elements (16-byte loads);
// strided tiles give it elements threadIdx.x + j * kBlockSize (coalesced
// scalar loads, N in flight per thread) and mask the ones past the end.

template <bool kVec, int N>
struct Tile {
  int base;  // first element of the tile, relative to the chunk
  int n;     // elements in the chunk
  __device__ __forceinline__ int index(int j) const {
    return kVec ? base + int(threadIdx.x) * N + j : base + int(threadIdx.x) + j * kBlockSize;
  }
  __device__ __forceinline__ bool valid(int j) const { return kVec || index(j) < n; }
};

// Calls body(tile) for every tile of a chunk of n elements: vectorised tiles
// where `aligned` (every pointer 16-byte aligned), a strided tail for the
// last n % N elements, and strided tiles throughout otherwise.
template <int N, typename Body>
__device__ __forceinline__ void for_each_tile(int n, bool aligned, Body&& body) {
  int done = 0;
  if (aligned) {
    done = n - n % N;
    for (int base = 0; base < done; base += kBlockSize * N)
      if (base + int(threadIdx.x) * N < done) body(Tile<true, N>{base, n});
  }
  for (int base = done; base < n; base += kBlockSize * N) body(Tile<false, N>{base, n});
}

// N values of one tensor in fp32 registers.
template <typename T, int N>
struct Lanes {
  float x[N];

  __device__ __forceinline__ void load(const T* src, const Tile<true, N>& t) {
    static_assert((N * sizeof(T)) % 16 == 0, "whole 16-byte words");
    constexpr int kWords = N * sizeof(T) / 16;
    uint4 words[kWords];
    const uint4* from = reinterpret_cast<const uint4*>(src + t.index(0));
#pragma unroll
    for (int w = 0; w < kWords; ++w) words[w] = from[w];
    T vals[N];
    memcpy(vals, words, sizeof(vals));  // register moves, no local memory
#pragma unroll
    for (int j = 0; j < N; ++j) x[j] = to_float(vals[j]);
  }
  __device__ __forceinline__ void load(const T* src, const Tile<false, N>& t) {
#pragma unroll
    for (int j = 0; j < N; ++j) x[j] = t.valid(j) ? to_float(src[t.index(j)]) : 0.0f;
  }
  __device__ __forceinline__ void store(T* dst, const Tile<true, N>& t) const {
    constexpr int kWords = N * sizeof(T) / 16;
    T vals[N];
#pragma unroll
    for (int j = 0; j < N; ++j) vals[j] = from_float<T>(x[j]);
    uint4 words[kWords];
    memcpy(words, vals, sizeof(vals));
    uint4* to = reinterpret_cast<uint4*>(dst + t.index(0));
#pragma unroll
    for (int w = 0; w < kWords; ++w) to[w] = words[w];
  }
  __device__ __forceinline__ void store(T* dst, const Tile<false, N>& t) const {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (t.valid(j)) dst[t.index(j)] = from_float<T>(x[j]);
  }
};

template <int N>
struct Lanes<NoneT, N> {
  float x[N];
  template <typename TileT>
  __device__ __forceinline__ void load(const NoneT*, const TileT&) {}
  template <typename TileT>
  __device__ __forceinline__ void store(NoneT*, const TileT&) const {}
};

// Sums K doubles over a block of kThreads threads, in a fixed order (the
// result does not depend on timing); the sums are valid in thread 0.
template <int kThreads, int K>
__device__ __forceinline__ void block_sum(double (&x)[K]) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps");
  __shared__ double warp_sums[K][kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // a previous call's readers are done with warp_sums
#pragma unroll
  for (int k = 0; k < K; ++k) {
    for (int offset = 16; offset > 0; offset /= 2) x[k] += __shfl_down_sync(0xffffffffu, x[k], offset);
    if (lane == 0) warp_sums[k][warp] = x[k];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      x[k] = lane < kThreads / 32 ? warp_sums[k][lane] : 0.0;
      for (int offset = 16; offset > 0; offset /= 2) x[k] += __shfl_down_sync(0xffffffffu, x[k], offset);
    }
  }
}

// ---------------------------------------------------------------------------
// The chunk table.

// Tensors per table by list depth (pointers per tensor): apex's numbers, which
// keep every table within the 4 KiB kernel-parameter limit of older drivers.
constexpr int max_tensors(int depth) {
  return depth == 1 ? 110 : depth == 2 ? 64 : depth == 3 ? 48 : depth == 4 ? 36 : 30;
}

template <int kDepth>
struct TensorListMeta {
  static constexpr int kMaxTensors = max_tensors(kDepth);
  void* addr[kDepth][kMaxTensors];
  int64_t numel[kMaxTensors];
  // Tensor i of this table is tensor first_tensor + i of the caller's list,
  // and block b works on the caller's chunk first_chunk + b (chunks numbered
  // across the whole list, tensor by tensor): per-tensor and per-chunk
  // outputs index with them.
  int first_tensor;
  int64_t first_chunk;
  uint8_t block_to_tensor[kMaxBlocks];
  int32_t block_to_chunk[kMaxBlocks];
};
static_assert(sizeof(TensorListMeta<1>) < 3800 && sizeof(TensorListMeta<2>) < 3800 &&
                  sizeof(TensorListMeta<3>) < 3800 && sizeof(TensorListMeta<4>) < 3800 &&
                  sizeof(TensorListMeta<5>) < 3800,
              "a table plus the kernel's other arguments (< 300 bytes) fit in 4 KiB");

// What one block of a multi-tensor kernel works on.
struct ChunkRef {
  int tensor;      // index in the table
  int64_t offset;  // first element of the chunk in the tensor
  int n;           // elements in the chunk
};

template <int kDepth>
__device__ __forceinline__ ChunkRef chunk_ref(const TensorListMeta<kDepth>& meta) {
  const int tensor = meta.block_to_tensor[blockIdx.x];
  const int64_t offset = int64_t(meta.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t left = meta.numel[tensor] - offset;
  return ChunkRef{tensor, offset, int(left < kChunkSize ? left : kChunkSize)};
}

template <typename T, int kDepth>
__device__ __forceinline__ T* chunk_ptr(const TensorListMeta<kDepth>& meta, int list, const ChunkRef& c) {
  if constexpr (std::is_same_v<T, NoneT>) {
    return nullptr;
  } else {
    return static_cast<T*>(meta.addr[list][c.tensor]) + c.offset;
  }
}

inline int64_t num_chunks(int64_t numel) { return (numel + kChunkSize - 1) / kChunkSize; }

// Fills tables with the tensors of `lists` (kDepth host arrays of n device
// pointers; a null array stands for an absent list) and calls
// launch(meta, blocks) once per full table. Returns the first error.
template <int kDepth, typename Launch>
int multi_tensor_apply(void* const* const (&lists)[kDepth], const int64_t* numel, int n,
                       Launch&& launch) {
  constexpr int kMaxTensors = TensorListMeta<kDepth>::kMaxTensors;
  TensorListMeta<kDepth> meta;
  std::memset(&meta, 0, sizeof(meta));
  int tensors = 0, blocks = 0;
  int64_t chunk = 0;  // chunks handed out so far, over the whole list
  auto restart = [&](int first_tensor) {
    tensors = 0;
    blocks = 0;
    meta.first_tensor = first_tensor;
    meta.first_chunk = chunk;
  };
  restart(0);
  for (int t = 0; t < n; ++t) {
    for (int d = 0; d < kDepth; ++d) meta.addr[d][tensors] = lists[d] ? lists[d][t] : nullptr;
    meta.numel[tensors] = numel[t];
    ++tensors;
    const int64_t chunks = num_chunks(numel[t]);
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_tensor[blocks] = uint8_t(tensors - 1);
      meta.block_to_chunk[blocks] = int32_t(c);
      ++blocks;
      ++chunk;
      const bool last_chunk = c == chunks - 1;
      if (blocks == kMaxBlocks || (tensors == kMaxTensors && last_chunk)) {
        if (int rc = launch(meta, blocks)) return rc;
        if (last_chunk) {
          restart(t + 1);
        } else {  // tensor t goes on in the next table, as its first tensor
          for (int d = 0; d < kDepth; ++d) meta.addr[d][0] = meta.addr[d][tensors - 1];
          meta.numel[0] = meta.numel[tensors - 1];
          restart(t);
          tensors = 1;
        }
      }
    }
    if (tensors == kMaxTensors) {  // full of tensors with no chunks left to run
      if (blocks > 0)
        if (int rc = launch(meta, blocks)) return rc;
      restart(t + 1);
    }
  }
  if (blocks > 0) return launch(meta, blocks);
  return FZ_OK;
}

// ---------------------------------------------------------------------------
// Host-side argument checks and dtype dispatch.

// Checks a list of n tensors of one dtype: element counts >= 0, a pointer
// for every non-empty tensor, aligned to its element size.
int check_list(const char* fn, const char* what, void* const* ptrs, const int64_t* numel, int n,
               int dtype);
// The same for elements of `elem_bytes` bytes named `elem` (int8 states' uint8 codes).
int check_list_of(const char* fn, const char* what, void* const* ptrs, const int64_t* numel, int n,
                  int64_t elem_bytes, const char* elem);

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) for the type of dtype code `code` (NoneT for kNone
// when allowed); false for a code it does not know.
template <bool kAllowNone, typename F>
bool visit_dtype(int code, F&& f) {
  switch (code) {
    case kF32: f(TypeTag<float>{}); return true;
    case kF16: f(TypeTag<__half>{}); return true;
    case kBF16: f(TypeTag<__nv_bfloat16>{}); return true;
    case kNone:
      if constexpr (kAllowNone) {
        f(TypeTag<NoneT>{});
        return true;
      }
      break;
  }
  return false;
}

// The storage combinations the optimizer kernels support (fastzero's rule for
// every backend): fp32 params with fp32 states and an optional fp16/bf16 copy;
// fp16/bf16 params with fp32 states or states of their own dtype, no copy.
// Grads of any of the three dtypes.
template <typename P, typename S, typename C>
constexpr bool optimizer_combo_ok() {
  if constexpr (std::is_same_v<P, float>)
    return std::is_same_v<S, float> && !std::is_same_v<C, float>;
  else
    return (std::is_same_v<S, float> || std::is_same_v<S, P>) && std::is_same_v<C, NoneT>;
}

// Resolves the four dtype codes of an optimizer call to types and calls
// f(TypeTag<P>, TypeTag<G>, TypeTag<S>, TypeTag<C>) for a supported
// combination; otherwise sets an error. Kernels are instantiated only for
// the supported combinations.
template <typename F>
int dispatch_optimizer(const char* fn, int p_dtype, int g_dtype, int s_dtype, int c_dtype, F&& f) {
  int rc = -1;
  visit_dtype<false>(p_dtype, [&](auto p) {
    visit_dtype<false>(g_dtype, [&](auto g) {
      visit_dtype<false>(s_dtype, [&](auto s) {
        visit_dtype<true>(c_dtype, [&](auto c) {
          using P = typename decltype(p)::type;
          using S = typename decltype(s)::type;
          using C = typename decltype(c)::type;
          if constexpr (optimizer_combo_ok<P, S, C>()) rc = f(p, g, s, c);
        });
      });
    });
  });
  if (rc >= 0) return rc;
  return set_error(FZ_ERR_INVALID_ARGUMENT,
                   std::string(fn) + ": unsupported dtypes (params " + dtype_name(p_dtype) + ", grads " +
                       dtype_name(g_dtype) + ", states " + dtype_name(s_dtype) + ", copies " +
                       dtype_name(c_dtype) +
                       "); supported: float32 params with float32 states and an optional "
                       "float16/bfloat16 copy, or float16/bfloat16 params with float32 states or states "
                       "of their own dtype; grads float32, float16 or bfloat16");
}

}  // namespace fz
