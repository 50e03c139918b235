// Adam/AdamW over lists of tensors: one pass over memory that unscales the
// grads, applies weight decay, updates both moments and the param, and
// writes the optional low-precision param copy. The math is
// fastzero/ops/adam/reference.py's and lives in adam_math only; the storage
// dtypes instantiate it. bf16 states written with stochastic rounding (SR:
// state_format="bf16") take the reference's pinned update (every op rounded
// on its own, with the _rn intrinsics nvcc never contracts) and its random
// bits, so they are the reference's to the bit. int8 block-wise states
// (state_format="int8") take the same pinned update between decoding and
// encoding (int8_codes.cuh), the codes rounded stochastically with the same
// random bits as bf16 states, to the bit as well. bf16 params written with
// stochastic rounding (SRP: bf16_stochastic_round) take the pinned update
// too, whatever the states, rounded with the low 16 bits of a second hash of
// each element's hash (reference sr_param_bits).
#include <vector>

#include "common.cuh"
#include "int8_codes.cuh"

namespace fz {
namespace {

// Raw arguments of one call: the hyperparameters by value (kernel
// parameters); step, grad_scale and found_inf point to device scalars, read
// by the kernel (no host sync).
struct AdamArgs {
  fz_adam_hyper hyper;
  const float* step;
  const float* grad_scale;  // nullptr: 1
  const float* found_inf;   // nullptr: never skip
  uint32_t seed;            // SR, SRP and int8 kernels: the seed of stochastic rounding
};
static_assert(sizeof(AdamArgs) < 300, "beside a chunk table, within the 4 KiB of kernel parameters (common.cuh)");

// Per-step constants, each rounded to fp32 as the reference's Python floats
// are when they meet an fp32 tensor (1 - beta and -lr / bc1 in fp64 first).
struct AdamConsts {
  float m_coeff;     // the first moment is torch's lerp: fma(m_coeff, g - m, m_from_grad ? g : m)
  bool m_from_grad;  // (fz_lerp_coeff)
  float beta2, one_minus_beta2, eps;
  float neg_step_size;  // -lr / bc1
  float sqrt_bc2;
  float decay;       // AdamW: 1 - lr * wd; Adam: 1
  float l2;          // Adam: wd; AdamW: 0
  float grad_scale;  // 1 without one: dividing by 1 is exact
  // SR's pinned update multiplies where the others divide, as the CPU kernels do:
  float step_size, bc2_rsqrt;  // lr / bc1, 1 / sqrt(bc2) (rounded from fp64)
  float inv_grad_scale;        // 1 / grad_scale rounded to fp32, 1 without one
  uint32_t sr_stream;          // fmix32(fmix32(seed) ^ step): the step's hash key
};

// MurmurHash3's 32-bit finalizer: the counter hash of the reference's sr_bits.
__device__ __forceinline__ uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  return h ^ (h >> 16);
}

// fp32 to bf16 bits by stochastic rounding with the 16-bit integer r: the
// top 16 bits of x's pattern plus r; NaN -> 0x7FC0 (reference.round_bf16_stochastic).
__device__ __forceinline__ uint16_t bf16_sr_bits(float x, uint32_t r) {
  const uint32_t b = __float_as_uint(x);
  return (b & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0) : uint16_t((b + r) >> 16);
}

// The hash key of a chunk's elements (a chunk never crosses a multiple of 2^32).
__device__ __forceinline__ uint32_t sr_key(const AdamConsts& k, int64_t offset) {
  return fmix32(k.sr_stream + 0x9e3779b9u * uint32_t(uint64_t(offset) >> 32));
}

// Which 16 random bits of an element's hash h round what: exp_avg the low
// half, exp_avg_sq the high half, a bf16 param (SRP) the low half of a
// second hash (reference sr_bits, sr_param_bits).
enum class SrBits { kExpAvg, kExpAvgSq, kParam };
constexpr uint32_t kParamSalt = 0x6a09e667u;

template <SrBits kWhich>
__device__ __forceinline__ uint32_t sr_bits(uint32_t h) {
  if constexpr (kWhich == SrBits::kExpAvg) return h & 0xffffu;
  if constexpr (kWhich == SrBits::kExpAvgSq) return h >> 16;
  return fmix32(h ^ kParamSalt) & 0xffffu;
}

// Everything Adam derives from its hyperparameters, in one place.
__device__ AdamConsts adam_consts(const AdamArgs& a) {
  const fz_adam_hyper& h = a.hyper;
  const fz_adam_derived d = fz_adam_derive(&h, double(*a.step));
  AdamConsts k;
  const float w = float(d.one_minus_beta1);
  k.m_coeff = fz_lerp_coeff(w);
  k.m_from_grad = !(w < 0.5f);
  k.beta2 = float(h.beta2);
  k.one_minus_beta2 = float(d.one_minus_beta2);
  k.eps = float(h.eps);
  k.neg_step_size = float(-d.step_size);
  k.sqrt_bc2 = float(d.sqrt_bc2);
  k.decay = float(d.decay);
  k.l2 = float(d.l2);
  k.grad_scale = a.grad_scale != nullptr ? *a.grad_scale : 1.0f;
  k.step_size = float(d.step_size);
  k.bc2_rsqrt = float(1.0 / d.sqrt_bc2);
  k.inv_grad_scale = a.grad_scale != nullptr ? __fdiv_rn(1.0f, *a.grad_scale) : 1.0f;
  const uint32_t t = uint32_t(uint64_t(*a.step));
  k.sr_stream = fmix32(fmix32(a.seed) ^ t);
  return k;
}

// One element of the Adam step, in fp32, in the reference's order of
// operations (IEEE division and sqrt: no fast math in this library). SR: the
// reference's _pinned_update, each operation rounded on its own.
template <bool SR>
__device__ __forceinline__ void adam_math(float& p, float g, float& m, float& v, const AdamConsts& k) {
  if constexpr (SR) {
    g = __fmul_rn(g, k.inv_grad_scale);
    if (k.l2 != 0.0f) g = __fadd_rn(__fmul_rn(k.l2, p), g);
    if (k.decay != 1.0f) p = __fmul_rn(p, k.decay);
    m = __fadd_rn(__fmul_rn(k.m_coeff, __fsub_rn(g, m)), k.m_from_grad ? g : m);
    v = __fadd_rn(__fmul_rn(k.beta2, v), __fmul_rn(__fmul_rn(k.one_minus_beta2, g), g));
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), k.bc2_rsqrt), k.eps);
    p = __fsub_rn(p, __fmul_rn(k.step_size, __fdiv_rn(m, denom)));
    return;
  }
  g = g / k.grad_scale;  // fused unscale
  // Skipping the no-op terms keeps an inf param inf, instead of 0 * inf.
  if (k.l2 != 0.0f) g = g + k.l2 * p;        // Adam: L2 penalty through the gradient
  if (k.decay != 1.0f) p = p * k.decay;      // AdamW: decoupled decay
  m = fmaf(k.m_coeff, g - m, k.m_from_grad ? g : m);  // torch's lerp: m + (1 - beta1)(g - m)
  v = k.beta2 * v + k.one_minus_beta2 * g * g;
  const float denom = sqrtf(v) / k.sqrt_bc2 + k.eps;
  p = p + k.neg_step_size * (m / denom);
}

// Stores bf16 bit patterns: a vectorised tile's N consecutive elements as
// 16-byte words, a strided tile's valid ones one by one.
template <bool kVec, int N>
__device__ __forceinline__ void store_bits(__nv_bfloat16* dst, const uint16_t (&b)[N], const Tile<kVec, N>& t) {
  uint16_t* to = reinterpret_cast<uint16_t*>(dst);
  if constexpr (kVec) {
    static_assert((N * 2) % 16 == 0, "whole 16-byte words");
    uint4 words[N * 2 / 16];
    memcpy(words, b, sizeof(words));
    uint4* w = reinterpret_cast<uint4*>(to + t.index(0));
#pragma unroll
    for (int k = 0; k < N * 2 / 16; ++k) w[k] = words[k];
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (t.valid(j)) to[t.index(j)] = b[j];
  }
}

// Stores lanes x as bf16 by stochastic rounding with the kWhich bits of each lane's hash h.
template <SrBits kWhich, bool kVec, int N>
__device__ __forceinline__ void store_sr(__nv_bfloat16* dst, const float (&x)[N], const uint32_t (&h)[N],
                                         const Tile<kVec, N>& t) {
  uint16_t b[N];
#pragma unroll
  for (int j = 0; j < N; ++j) b[j] = bf16_sr_bits(x[j], sr_bits<kWhich>(h[j]));
  store_bits(dst, b, t);
}

// Lists: 0 params, 1 grads, 2 exp_avgs, 3 exp_avg_sqs, 4 copies. SR: S is
// bf16, written by stochastic rounding keyed by each element's index in its
// tensor (a chunk never crosses a multiple of 2^32: one key per block). SRP:
// P is bf16, written by stochastic rounding the same way. Either: the pinned update.
template <typename P, typename G, typename S, typename C, bool SR, bool SRP>
__global__ void __launch_bounds__(kBlockSize) adam_kernel(TensorListMeta<5> meta, AdamArgs args) {
  constexpr bool kPinned = SR || SRP;
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;  // skipped step
  __shared__ AdamConsts shared;
  if (threadIdx.x == 0) shared = adam_consts(args);  // once per block: pow in fp64
  __syncthreads();
  const AdamConsts k = shared;

  const ChunkRef c = chunk_ref(meta);
  P* p = chunk_ptr<P>(meta, 0, c);
  G* g = chunk_ptr<G>(meta, 1, c);
  S* m = chunk_ptr<S>(meta, 2, c);
  S* v = chunk_ptr<S>(meta, 3, c);
  C* copy = chunk_ptr<C>(meta, 4, c);
  const bool aligned = aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v) && aligned16(copy);
  constexpr int N = kVecWidth<P, G, S, C>;
  static_assert((int64_t(1) << 32) % kChunkSize == 0, "chunks never straddle 2^32");
  const uint32_t key = kPinned ? sr_key(k, c.offset) : 0u;
  for_each_tile<N>(c.n, aligned, [&](const auto& tile) {
    Lanes<P, N> pl;
    Lanes<G, N> gl;
    Lanes<S, N> ml, vl;
    Lanes<C, N> cl;
    pl.load(p, tile);
    gl.load(g, tile);
    ml.load(m, tile);
    vl.load(v, tile);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      adam_math<kPinned>(pl.x[j], gl.x[j], ml.x[j], vl.x[j], k);
      cl.x[j] = pl.x[j];
    }
    if constexpr (kPinned) {
      uint32_t h[N];  // each element's hash, from its index in its tensor
#pragma unroll
      for (int j = 0; j < N; ++j) h[j] = fmix32(uint32_t(c.offset + tile.index(j)) ^ key);
      if constexpr (SRP) store_sr<SrBits::kParam>(p, pl.x, h, tile);
      else pl.store(p, tile);
      if constexpr (SR) {
        store_sr<SrBits::kExpAvg>(m, ml.x, h, tile);
        store_sr<SrBits::kExpAvgSq>(v, vl.x, h, tile);
      } else {
        ml.store(m, tile);
        vl.store(v, tile);
      }
    } else {
      pl.store(p, tile);
      ml.store(m, tile);
      vl.store(v, tile);
    }
    cl.store(copy, tile);
  });
}

template <typename P, typename G, typename S, typename C, bool SR = false, bool SRP = false>
int launch_adam(void* const* const (&lists)[5], const int64_t* numel, int n, const AdamArgs& args,
                cudaStream_t stream) {
  return multi_tensor_apply<5>(lists, numel, n, [&](const TensorListMeta<5>& meta, int blocks) {
    adam_kernel<P, G, S, C, SR, SRP><<<blocks, kBlockSize, 0, stream>>>(meta, args);
    return check_launch("adam_kernel");
  });
}

// Params of any dtype with states of a format of their own (bf16 SR, int8):
// f(TypeTag<P>, TypeTag<G>, TypeTag<C>) for fp32/fp16/bf16 params, grads of
// any of these, a fp16/bf16 copy only of fp32 params. -1 for another combination.
template <typename F>
int dispatch_params(int p_dtype, int g_dtype, int c_dtype, F&& f) {
  int rc = -1;
  visit_dtype<false>(p_dtype, [&](auto p) {
    visit_dtype<false>(g_dtype, [&](auto g) {
      visit_dtype<true>(c_dtype, [&](auto c) {
        using P = typename decltype(p)::type;
        using C = typename decltype(c)::type;
        if constexpr (std::is_same_v<P, float> ? !std::is_same_v<C, float> : std::is_same_v<C, NoneT>)
          rc = f(p, g, c);
      });
    });
  });
  return rc;
}

constexpr const char* kParamCombos =
    "float32, float16 or bfloat16 params, a float16/bfloat16 copy of float32 params; grads float32, float16 or "
    "bfloat16";

// The SR kernels: bf16 states for params of any dtype, copies as with fp32 states.
template <typename F>
int dispatch_sr(const char* fn, int p_dtype, int g_dtype, int s_dtype, int c_dtype, F&& f) {
  const int rc = s_dtype == kBF16 ? dispatch_params(p_dtype, g_dtype, c_dtype, f) : -1;
  if (rc >= 0) return rc;
  return set_error(FZ_ERR_INVALID_ARGUMENT,
                   std::string(fn) + ": unsupported dtypes with stochastic rounding (params " +
                       dtype_name(p_dtype) + ", grads " + dtype_name(g_dtype) + ", states " +
                       dtype_name(s_dtype) + ", copies " + dtype_name(c_dtype) +
                       "); supported: bfloat16 states for " + kParamCombos);
}

// bf16 params written with stochastic rounding (SRP): f(TypeTag<G>,
// TypeTag<S>, std::bool_constant<SR>) for grads of any dtype, no copy, and
// fp32 or bf16 states rounded to nearest, or bf16 states by stochastic
// rounding (sr_states). The params' dtype is checked by the caller.
template <typename F>
int dispatch_srp(const char* fn, int g_dtype, int s_dtype, int c_dtype, bool sr_states, F&& f) {
  int rc = -1;
  if (c_dtype == kNone)
    visit_dtype<false>(g_dtype, [&](auto g) {
      if (s_dtype == kBF16 && sr_states) rc = f(g, TypeTag<__nv_bfloat16>{}, std::true_type{});
      else if (s_dtype == kBF16) rc = f(g, TypeTag<__nv_bfloat16>{}, std::false_type{});
      else if (s_dtype == kF32 && !sr_states) rc = f(g, TypeTag<float>{}, std::false_type{});
    });
  if (rc >= 0) return rc;
  const std::string states = std::string(dtype_name(s_dtype)) + (sr_states ? " rounded stochastically" : "");
  return set_error(FZ_ERR_INVALID_ARGUMENT,
                   std::string(fn) + ": unsupported dtypes with stochastic rounding of params (grads " +
                       dtype_name(g_dtype) + ", states " + states + ", copies " + dtype_name(c_dtype) +
                       "); supported: bfloat16 params without copies, grads float32, float16 or bfloat16, states "
                       "float32 or bfloat16 (rounded stochastically: bfloat16)");
}

// ---------------------------------------------------------------------------
// int8 block-wise states (state_format="int8"): uint8 codes of exp_avg and
// exp_avg_sq and one fp32 scale per block of `block` elements of each
// tensor (fastzero/ops/adam/int8_codes.py).
//
// The mapping: one thread block per 64 Ki chunk (chunks start on
// quantization-block boundaries: block divides kChunkSize); each pass over
// the chunk gives every thread kInt8Lanes consecutive elements, so a
// quantization block belongs to `block / kInt8Lanes` consecutive threads (8
// to 512), a pass of 4096 elements to 4096 / block whole blocks. Each
// thread decodes with the old scale, runs the pinned update, writes p and
// its copy, then its group takes the max of |m| and |v| as unsigned bit
// patterns (NaN and inf rank above every finite value, as the rule needs):
// butterfly shuffles within a warp, shared memory across a group's warps.
// Every thread then encodes with the new scales, rounding stochastically
// with its elements' hashes (the bf16 format's bits), and the group's first
// thread writes the scales. The old scale is read before the group's reduction,
// which waits for every thread of the group, so its overwrite races nothing.

constexpr int kInt8Lanes = 8;  // 8 code bytes per thread (one 8-byte access), 4096 elements per pass
static_assert(kBlockSize * kInt8Lanes == 4096, "a pass covers the largest block, 4096");
static_assert(kChunkSize % 4096 == 0, "every block size divides a chunk: chunks start on block boundaries");
static_assert(sizeof(TensorListMeta<7>) + sizeof(AdamArgs) + sizeof(int) <= 4096, "kernel parameters in 4 KiB");

// The largest of a group's a and b (its quantization block's |m|, |v| bits)
// in every thread of the group: `group` consecutive threads, a power of two
// from 8 to kBlockSize, the same in the whole thread block.
__device__ __forceinline__ void group_max(uint32_t& a, uint32_t& b, int group) {
  for (int offset = (group < 32 ? group : 32) / 2; offset > 0; offset /= 2) {
    a = max(a, __shfl_xor_sync(0xffffffffu, a, offset));
    b = max(b, __shfl_xor_sync(0xffffffffu, b, offset));
  }
  if (group <= 32) return;
  __shared__ uint32_t warp_max[2][kBlockSize / 32];
  const int warp = threadIdx.x / 32, warps = group / 32, first = warp / warps * warps;
  if (threadIdx.x % 32 == 0) {
    warp_max[0][warp] = a;
    warp_max[1][warp] = b;
  }
  __syncthreads();
  for (int w = first; w < first + warps; ++w) {
    a = max(a, warp_max[0][w]);
    b = max(b, warp_max[1][w]);
  }
  __syncthreads();  // read before the next pass writes
}

// A thread's kInt8Lanes consecutive elements [first, first + valid) of one
// tensor: 16-byte words where `vec` (aligned and all valid), else one by one
// (0 past the end).
template <typename T>
__device__ __forceinline__ void load_run(Lanes<T, kInt8Lanes>& l, const T* src, int base, int first, int valid,
                                         bool vec) {
  if (vec) return l.load(src, Tile<true, kInt8Lanes>{base, 0});
#pragma unroll
  for (int j = 0; j < kInt8Lanes; ++j) l.x[j] = j < valid ? to_float(src[first + j]) : 0.0f;
}

template <typename T>
__device__ __forceinline__ void store_run(const Lanes<T, kInt8Lanes>& l, T* dst, int base, int first, int valid,
                                          bool vec) {
  if constexpr (!std::is_same_v<T, NoneT>) {
    if (vec) return l.store(dst, Tile<true, kInt8Lanes>{base, 0});
#pragma unroll
    for (int j = 0; j < kInt8Lanes; ++j)
      if (j < valid) dst[first + j] = from_float<T>(l.x[j]);
  }
}

// store_run of bf16 params by stochastic rounding (SRP), keyed by `key`: the
// run's elements are [offset + first, ...) of their tensor.
__device__ __forceinline__ void store_run_sr(const Lanes<__nv_bfloat16, kInt8Lanes>& l, __nv_bfloat16* dst, int base,
                                             int first, int valid, bool vec, int64_t offset, uint32_t key) {
  uint32_t h[kInt8Lanes];
#pragma unroll
  for (int j = 0; j < kInt8Lanes; ++j) h[j] = fmix32(uint32_t(offset + first + j) ^ key);
  if (vec) return store_sr<SrBits::kParam>(dst, l.x, h, Tile<true, kInt8Lanes>{base, 0});
  uint16_t* to = reinterpret_cast<uint16_t*>(dst);
#pragma unroll
  for (int j = 0; j < kInt8Lanes; ++j)
    if (j < valid) to[first + j] = bf16_sr_bits(l.x[j], sr_bits<SrBits::kParam>(h[j]));
}

__device__ __forceinline__ void load_codes(uint32_t (&c)[kInt8Lanes], const uint8_t* src, int first, int valid,
                                           bool vec) {
  if (vec) {
    const uint2 w = *reinterpret_cast<const uint2*>(src + first);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      c[j] = (w.x >> (8 * j)) & 0xffu;
      c[j + 4] = (w.y >> (8 * j)) & 0xffu;
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < kInt8Lanes; ++j) c[j] = j < valid ? src[first + j] : 0u;
}

__device__ __forceinline__ void store_codes(const uint32_t (&c)[kInt8Lanes], uint8_t* dst, int first, int valid,
                                            bool vec) {
  if (vec) {
    uint2 w{0u, 0u};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w.x |= c[j] << (8 * j);
      w.y |= c[j + 4] << (8 * j);
    }
    *reinterpret_cast<uint2*>(dst + first) = w;
    return;
  }
#pragma unroll
  for (int j = 0; j < kInt8Lanes; ++j)
    if (j < valid) dst[first + j] = uint8_t(c[j]);
}

// Lists: 0 params, 1 grads, 2 exp_avg codes, 3 exp_avg_sq codes, 4 copies,
// 5 exp_avg scales, 6 exp_avg_sq scales (one per block of the whole tensor).
// The codes are rounded stochastically keyed by each element's index in its
// tensor (a chunk never crosses a multiple of 2^32: one key per chunk).
// SRP: P is bf16, written by stochastic rounding the same way.
template <typename P, typename G, typename C, bool SRP>
__global__ void __launch_bounds__(kBlockSize) adam_int8_kernel(TensorListMeta<7> meta, AdamArgs args, int block) {
  using int8::ExpAvgCode;
  using int8::ExpAvgSqCode;
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;  // skipped step
  __shared__ AdamConsts shared;
  if (threadIdx.x == 0) shared = adam_consts(args);
  __syncthreads();
  const AdamConsts k = shared;

  const ChunkRef c = chunk_ref(meta);
  P* p = chunk_ptr<P>(meta, 0, c);
  const G* g = chunk_ptr<G>(meta, 1, c);
  uint8_t* m = chunk_ptr<uint8_t>(meta, 2, c);
  uint8_t* v = chunk_ptr<uint8_t>(meta, 3, c);
  C* copy = chunk_ptr<C>(meta, 4, c);
  float* m_scales = static_cast<float*>(meta.addr[5][c.tensor]) + c.offset / block;
  float* v_scales = static_cast<float*>(meta.addr[6][c.tensor]) + c.offset / block;
  const bool aligned = aligned16(p) && aligned16(g) && aligned16(copy) && reinterpret_cast<uintptr_t>(m) % 8 == 0 &&
                       reinterpret_cast<uintptr_t>(v) % 8 == 0;
  const int group = block / kInt8Lanes;
  const uint32_t key = sr_key(k, c.offset);
  for (int base = 0; base < c.n; base += kBlockSize * kInt8Lanes) {  // the same passes in every thread
    const int first = base + int(threadIdx.x) * kInt8Lanes;
    const int valid = min(max(c.n - first, 0), kInt8Lanes);
    const bool vec = aligned && valid == kInt8Lanes;
    const int q = first / block;  // the quantization block, within the chunk
    const float old_ms = valid > 0 ? m_scales[q] : 0.0f, old_vs = valid > 0 ? v_scales[q] : 0.0f;
    Lanes<P, kInt8Lanes> pl;
    Lanes<G, kInt8Lanes> gl;
    Lanes<C, kInt8Lanes> cl;
    uint32_t mc[kInt8Lanes], vc[kInt8Lanes];
    load_run(pl, p, base, first, valid, vec);
    load_run(gl, g, base, first, valid, vec);
    load_codes(mc, m, first, valid, vec);
    load_codes(vc, v, first, valid, vec);
    float mx[kInt8Lanes], vx[kInt8Lanes];
    uint32_t m_max = 0, v_max = 0;
#pragma unroll
    for (int j = 0; j < kInt8Lanes; ++j) {
      mx[j] = ExpAvgCode::decode(mc[j], old_ms);
      vx[j] = ExpAvgSqCode::decode(vc[j], old_vs);
      adam_math<true>(pl.x[j], gl.x[j], mx[j], vx[j], k);
      cl.x[j] = pl.x[j];
      if (j < valid) {  // past the end: not part of the block
        m_max = max(m_max, int8::bits_of(mx[j]) & int8::kAbsMask);
        v_max = max(v_max, int8::bits_of(vx[j]) & int8::kAbsMask);
      }
    }
    if constexpr (SRP) store_run_sr(pl, p, base, first, valid, vec, c.offset, key);
    else store_run(pl, p, base, first, valid, vec);
    store_run(cl, copy, base, first, valid, vec);
    group_max(m_max, v_max, group);
    const int8::Scale ms = int8::scale_of(m_max), vs = int8::scale_of(v_max);
#pragma unroll
    for (int j = 0; j < kInt8Lanes; ++j) {
      // each element's hash, from its index in its tensor (drawn here, not held across the reduction)
      const uint32_t h = fmix32(uint32_t(c.offset + first + j) ^ key);
      mc[j] = int8::encode<ExpAvgCode>(mx[j], ms, sr_bits<SrBits::kExpAvg>(h));
      vc[j] = int8::encode<ExpAvgSqCode>(vx[j], vs, sr_bits<SrBits::kExpAvgSq>(h));
    }
    store_codes(mc, m, first, valid, vec);
    store_codes(vc, v, first, valid, vec);
    if (valid > 0 && threadIdx.x % group == 0) {
      m_scales[q] = ms.scale;
      v_scales[q] = vs.scale;
    }
  }
}

template <typename P, typename G, typename C, bool SRP = false>
int launch_adam_int8(void* const* const (&lists)[7], const int64_t* numel, int n, const AdamArgs& args, int block,
                     cudaStream_t stream) {
  return multi_tensor_apply<7>(lists, numel, n, [&](const TensorListMeta<7>& meta, int blocks) {
    adam_int8_kernel<P, G, C, SRP><<<blocks, kBlockSize, 0, stream>>>(meta, args, block);
    return check_launch("adam_int8_kernel");
  });
}

// The stochastic-rounding arguments of both entries: a seed in [0, 2^32),
// and sr_params only for bf16 params. FZ_OK or an error.
int check_sr(const char* fn, int64_t seed, int sr_params, int p_dtype) {
  if (seed < 0 || seed > int64_t(0xffffffffu))
    return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": seed must be in [0, 2^32), got " +
                                                  std::to_string(seed));
  if (sr_params && p_dtype != kBF16)
    return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": stochastic rounding of params needs bfloat16 "
                                                  "params, got " + dtype_name(p_dtype));
  return FZ_OK;
}

// The checks both Adam entries share, for n > 0 (their state lists differ):
// the step, the stochastic-rounding arguments, params, grads and copies.
int check_step_args(const char* fn, const float* step, int64_t seed, int sr_params, void* const* p,
                    void* const* g, void* const* copy, const int64_t* numel, int n, int p_dtype, int g_dtype,
                    int c_dtype) {
  if (step == nullptr)
    return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": step is null (pass the device step counter)");
  if (int rc = check_sr(fn, seed, sr_params, p_dtype)) return rc;
  if (c_dtype != kNone && copy == nullptr)
    return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": a copy dtype without copies");
  int rc = check_list(fn, "params", p, numel, n, p_dtype);
  if (!rc) rc = check_list(fn, "grads", g, numel, n, g_dtype);
  if (!rc && c_dtype != kNone) rc = check_list(fn, "param_copies", copy, numel, n, c_dtype);
  return rc;
}

}  // namespace
}  // namespace fz

extern "C" int fz_cuda_adam(void* const* p, void* const* g, void* const* m, void* const* v,
                            void* const* copy, const int64_t* numel, int n, int p_dtype, int g_dtype,
                            int s_dtype, int c_dtype, const fz_adam_hyper* hyper, const float* step,
                            const float* grad_scale, const float* found_inf, int64_t seed, int sr_states,
                            int sr_params, void* stream) {
  using namespace fz;
  constexpr const char* fn = "fz_cuda_adam";
  return guarded(fn, [&]() -> int {
    if (hyper == nullptr)
      return set_error(FZ_ERR_INVALID_ARGUMENT,
                       std::string(fn) + ": hyper is null (pass the hyperparameters as an fz_adam_hyper)");
    if (n < 0) return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": negative tensor count");
    if (n == 0) return FZ_OK;
    int rc = check_step_args(fn, step, seed, sr_params, p, g, copy, numel, n, p_dtype, g_dtype, c_dtype);
    if (!rc) rc = check_list(fn, "exp_avgs", m, numel, n, s_dtype);
    if (!rc) rc = check_list(fn, "exp_avg_sqs", v, numel, n, s_dtype);
    if (rc) return rc;
    const AdamArgs args{*hyper, step, grad_scale, found_inf, uint32_t(seed)};
    void* const* const lists[5] = {p, g, m, v, c_dtype == kNone ? nullptr : copy};
    const auto s = static_cast<cudaStream_t>(stream);
    (void)cudaGetLastError();  // forget a failure of an earlier call on this thread
    if (sr_params)  // bf16 params (checked above)
      return dispatch_srp(fn, g_dtype, s_dtype, c_dtype, sr_states, [&](auto gt, auto st, auto sr) {
        return launch_adam<__nv_bfloat16, typename decltype(gt)::type, typename decltype(st)::type, NoneT,
                           decltype(sr)::value, true>(lists, numel, n, args, s);
      });
    if (sr_states)
      return dispatch_sr(fn, p_dtype, g_dtype, s_dtype, c_dtype, [&](auto pt, auto gt, auto ct) {
        return launch_adam<typename decltype(pt)::type, typename decltype(gt)::type, __nv_bfloat16,
                           typename decltype(ct)::type, true>(lists, numel, n, args, s);
      });
    return dispatch_optimizer(fn, p_dtype, g_dtype, s_dtype, c_dtype, [&](auto pt, auto gt, auto st, auto ct) {
      return launch_adam<typename decltype(pt)::type, typename decltype(gt)::type, typename decltype(st)::type,
                         typename decltype(ct)::type>(lists, numel, n, args, s);
    });
  });
}

extern "C" int fz_cuda_adam_int8(void* const* p, void* const* g, void* const* m, void* const* v,
                                 void* const* copy, void* const* m_scales, void* const* v_scales,
                                 const int64_t* numel, int n, int p_dtype, int g_dtype, int c_dtype,
                                 int64_t block_size, const fz_adam_hyper* hyper, const float* step,
                                 const float* grad_scale, const float* found_inf, int64_t seed, int sr_params,
                                 void* stream) {
  using namespace fz;
  constexpr const char* fn = "fz_cuda_adam_int8";
  return guarded(fn, [&]() -> int {
    if (hyper == nullptr)
      return set_error(FZ_ERR_INVALID_ARGUMENT,
                       std::string(fn) + ": hyper is null (pass the hyperparameters as an fz_adam_hyper)");
    if (block_size < 64 || block_size > 4096 || (block_size & (block_size - 1)) != 0)
      return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": block_size " + std::to_string(block_size) +
                                                    " is not a power of two from 64 to 4096");
    if (n < 0) return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": negative tensor count");
    if (n == 0) return FZ_OK;
    int rc = check_step_args(fn, step, seed, sr_params, p, g, copy, numel, n, p_dtype, g_dtype, c_dtype);
    if (!rc) rc = check_list_of(fn, "exp_avgs", m, numel, n, 1, "uint8");
    if (!rc) rc = check_list_of(fn, "exp_avg_sqs", v, numel, n, 1, "uint8");
    if (rc) return rc;
    std::vector<int64_t> blocks(static_cast<size_t>(n));  // scales per tensor (numel >= 0: checked above)
    for (int i = 0; i < n; ++i) blocks[i] = (numel[i] + block_size - 1) / block_size;
    rc = check_list(fn, "exp_avg_absmax", m_scales, blocks.data(), n, kF32);
    if (!rc) rc = check_list(fn, "exp_avg_sq_absmax", v_scales, blocks.data(), n, kF32);
    if (rc) return rc;
    const AdamArgs args{*hyper, step, grad_scale, found_inf, uint32_t(seed)};
    void* const* const lists[7] = {p, g, m, v, c_dtype == kNone ? nullptr : copy, m_scales, v_scales};
    const auto s = static_cast<cudaStream_t>(stream);
    (void)cudaGetLastError();  // forget a failure of an earlier call on this thread
    rc = dispatch_params(p_dtype, g_dtype, c_dtype, [&](auto pt, auto gt, auto ct) {
      using P = typename decltype(pt)::type;
      using G = typename decltype(gt)::type;
      using C = typename decltype(ct)::type;
      if constexpr (std::is_same_v<P, __nv_bfloat16>)  // bf16 params (no copy): by stochastic rounding or not
        if (sr_params) return launch_adam_int8<P, G, C, true>(lists, numel, n, args, int(block_size), s);
      return launch_adam_int8<P, G, C>(lists, numel, n, args, int(block_size), s);
    });
    if (rc >= 0) return rc;
    return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": unsupported dtypes (params " +
                                                  dtype_name(p_dtype) + ", grads " + dtype_name(g_dtype) +
                                                  ", copies " + dtype_name(c_dtype) + "); supported: uint8 codes for " +
                                                  kParamCombos);
  });
}
