// Adam/AdamW over lists of tensors: one pass over memory that unscales the
// grads, applies weight decay, updates both moments and the param, and
// writes the optional low-precision param copy. The math is
// fastzero/ops/adam/reference.py's and lives in adam_math only; the storage
// dtypes instantiate it.
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
};

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
  return k;
}

// One element of the Adam step, in fp32, in the reference's order of
// operations (IEEE division and sqrt: no fast math in this library).
__device__ __forceinline__ void adam_math(float& p, float g, float& m, float& v, const AdamConsts& k) {
  g = g / k.grad_scale;  // fused unscale
  // Skipping the no-op terms keeps an inf param inf, instead of 0 * inf.
  if (k.l2 != 0.0f) g = g + k.l2 * p;        // Adam: L2 penalty through the gradient
  if (k.decay != 1.0f) p = p * k.decay;      // AdamW: decoupled decay
  m = fmaf(k.m_coeff, g - m, k.m_from_grad ? g : m);  // torch's lerp: m + (1 - beta1)(g - m)
  v = k.beta2 * v + k.one_minus_beta2 * g * g;
  const float denom = sqrtf(v) / k.sqrt_bc2 + k.eps;
  p = p + k.neg_step_size * (m / denom);
}

// Lists: 0 params, 1 grads, 2 exp_avgs, 3 exp_avg_sqs, 4 copies.
template <typename P, typename G, typename S, typename C>
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
      adam_math(pl.x[j], gl.x[j], ml.x[j], vl.x[j], k);
      cl.x[j] = pl.x[j];
    }
    pl.store(p, tile);
    ml.store(m, tile);
    vl.store(v, tile);
    cl.store(copy, tile);
  });
}

template <typename P, typename G, typename S, typename C>
int launch_adam(void* const* const (&lists)[5], const int64_t* numel, int n, const AdamArgs& args,
                cudaStream_t stream) {
  return multi_tensor_apply<5>(lists, numel, n, [&](const TensorListMeta<5>& meta, int blocks) {
    adam_kernel<P, G, S, C><<<blocks, kBlockSize, 0, stream>>>(meta, args);
    return check_launch("adam_kernel");
  });
}

}  // namespace
}  // namespace fz

extern "C" int fz_cuda_adam(void* const* p, void* const* g, void* const* m, void* const* v,
                            void* const* copy, const int64_t* numel, int n, int p_dtype, int g_dtype,
                            int s_dtype, int c_dtype, const fz_adam_hyper* hyper, const float* step,
                            const float* grad_scale, const float* found_inf, void* stream) {
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
    if (c_dtype != kNone && copy == nullptr)
      return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": a copy dtype without copies");
    int rc = check_list(fn, "params", p, numel, n, p_dtype);
    if (!rc) rc = check_list(fn, "grads", g, numel, n, g_dtype);
    if (!rc) rc = check_list(fn, "exp_avgs", m, numel, n, s_dtype);
    if (!rc) rc = check_list(fn, "exp_avg_sqs", v, numel, n, s_dtype);
    if (!rc && c_dtype != kNone) rc = check_list(fn, "param_copies", copy, numel, n, c_dtype);
    if (rc) return rc;
    const AdamArgs args{*hyper, step, grad_scale, found_inf};
    void* const* const lists[5] = {p, g, m, v, c_dtype == kNone ? nullptr : copy};
    const auto s = static_cast<cudaStream_t>(stream);
    (void)cudaGetLastError();  // forget a failure of an earlier call on this thread
    return dispatch_optimizer(fn, p_dtype, g_dtype, s_dtype, c_dtype, [&](auto pt, auto gt, auto st, auto ct) {
      return launch_adam<typename decltype(pt)::type, typename decltype(gt)::type, typename decltype(st)::type,
                         typename decltype(ct)::type>(lists, numel, n, args, s);
    });
  });
}
