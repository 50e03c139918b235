// Adam/AdamW over lists of tensors: one pass over memory that unscales the
// grads, applies weight decay, updates both moments and the param, and
// writes the optional low-precision param copy. The math is
// fastzero/ops/adam/reference.py's and lives in adam_math only; the storage
// dtypes instantiate it. bf16 states written with stochastic rounding (SR:
// state_format="bf16") take the reference's pinned update (every op rounded
// on its own, with the _rn intrinsics nvcc never contracts) and its random
// bits, so they are the reference's to the bit.
#include "common.cuh"

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
  int64_t sr_seed;          // SR kernels: the seed of stochastic rounding
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
  k.sr_stream = fmix32(fmix32(uint32_t(a.sr_seed)) ^ t);
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

// Lists: 0 params, 1 grads, 2 exp_avgs, 3 exp_avg_sqs, 4 copies. SR: S is
// bf16, written by stochastic rounding keyed by each element's index in its
// tensor (a chunk never crosses a multiple of 2^32: one key per block).
template <typename P, typename G, typename S, typename C, bool SR>
__global__ void __launch_bounds__(kBlockSize) adam_kernel(TensorListMeta<5> meta, AdamArgs args) {
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
  const uint32_t key = SR ? fmix32(k.sr_stream + 0x9e3779b9u * uint32_t(uint64_t(c.offset) >> 32)) : 0u;
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
      adam_math<SR>(pl.x[j], gl.x[j], ml.x[j], vl.x[j], k);
      cl.x[j] = pl.x[j];
    }
    pl.store(p, tile);
    if constexpr (SR) {
      uint16_t mb[N], vb[N];
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const uint32_t h = fmix32(uint32_t(c.offset + tile.index(j)) ^ key);
        mb[j] = bf16_sr_bits(ml.x[j], h & 0xffffu);
        vb[j] = bf16_sr_bits(vl.x[j], h >> 16);
      }
      store_bits(m, mb, tile);
      store_bits(v, vb, tile);
    } else {
      ml.store(m, tile);
      vl.store(v, tile);
    }
    cl.store(copy, tile);
  });
}

template <typename P, typename G, typename S, typename C, bool SR = false>
int launch_adam(void* const* const (&lists)[5], const int64_t* numel, int n, const AdamArgs& args,
                cudaStream_t stream) {
  return multi_tensor_apply<5>(lists, numel, n, [&](const TensorListMeta<5>& meta, int blocks) {
    adam_kernel<P, G, S, C, SR><<<blocks, kBlockSize, 0, stream>>>(meta, args);
    return check_launch("adam_kernel");
  });
}

// The SR kernels: bf16 states for params of any dtype, copies as with fp32 states.
template <typename F>
int dispatch_sr(const char* fn, int p_dtype, int g_dtype, int s_dtype, int c_dtype, F&& f) {
  int rc = -1;
  if (s_dtype == kBF16) {
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
  }
  if (rc >= 0) return rc;
  return set_error(FZ_ERR_INVALID_ARGUMENT,
                   std::string(fn) + ": unsupported dtypes with stochastic rounding (params " +
                       dtype_name(p_dtype) + ", grads " + dtype_name(g_dtype) + ", states " +
                       dtype_name(s_dtype) + ", copies " + dtype_name(c_dtype) +
                       "); supported: bfloat16 states for float32, float16 or bfloat16 params, a "
                       "float16/bfloat16 copy of float32 params; grads float32, float16 or bfloat16");
}

}  // namespace
}  // namespace fz

extern "C" int fz_cuda_adam(void* const* p, void* const* g, void* const* m, void* const* v,
                            void* const* copy, const int64_t* numel, int n, int p_dtype, int g_dtype,
                            int s_dtype, int c_dtype, const fz_adam_hyper* hyper, const float* step,
                            const float* grad_scale, const float* found_inf, int64_t sr_seed,
                            void* stream) {
  using namespace fz;
  constexpr const char* fn = "fz_cuda_adam";
  return guarded(fn, [&]() -> int {
    if (hyper == nullptr)
      return set_error(FZ_ERR_INVALID_ARGUMENT,
                       std::string(fn) + ": hyper is null (pass the hyperparameters as an fz_adam_hyper)");
    if (n < 0) return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": negative tensor count");
    if (n == 0) return FZ_OK;
    if (step == nullptr)
      return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": step is null (pass the device step counter)");
    if (sr_seed < -1 || sr_seed > int64_t(0xffffffffu))
      return set_error(FZ_ERR_INVALID_ARGUMENT,
                       std::string(fn) + ": sr_seed must be -1 (round to nearest) or in [0, 2^32)");
    if (c_dtype != kNone && copy == nullptr)
      return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": a copy dtype without copies");
    int rc = check_list(fn, "params", p, numel, n, p_dtype);
    if (!rc) rc = check_list(fn, "grads", g, numel, n, g_dtype);
    if (!rc) rc = check_list(fn, "exp_avgs", m, numel, n, s_dtype);
    if (!rc) rc = check_list(fn, "exp_avg_sqs", v, numel, n, s_dtype);
    if (!rc && c_dtype != kNone) rc = check_list(fn, "param_copies", copy, numel, n, c_dtype);
    if (rc) return rc;
    const AdamArgs args{*hyper, step, grad_scale, found_inf, sr_seed};
    void* const* const lists[5] = {p, g, m, v, c_dtype == kNone ? nullptr : copy};
    const auto s = static_cast<cudaStream_t>(stream);
    (void)cudaGetLastError();  // forget a failure of an earlier call on this thread
    if (sr_seed >= 0)
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
