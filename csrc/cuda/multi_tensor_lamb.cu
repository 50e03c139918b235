// LAMB (DeepSpeed's FusedLamb math, fastzero/ops/lamb/reference.py) over
// lists of tensors, without storing the update direction u:
//   clip     (when max_grad_norm > 0) the global grad norm's clip factor, from
//            the per-chunk partials of fz_cuda_l2norm_partials
//   phase 1  m, v <- moments of the (unscaled, clipped) grad; per chunk, the
//            sums of p^2 and u^2 into an fp64 scratch buffer
//   ratio    per tensor, r = clamp(||p|| / ||u||) (1 when a norm is 0), from
//            its chunks' sums in a fixed order: deterministic
//   phase 2  u recomputed from p and the stored m, v; p -= lr * sqrt(bc2) / bc1 * r * u
// The math lives in lamb_math only, and what LAMB derives from its
// hyperparameters (fz_lamb_hyper, passed by value to every kernel) in the
// __device__ functions below it; the storage dtypes instantiate it. With
// bf16/fp16 states, both phases see m and v as stored (rounded) where the
// reference uses them unrounded: a difference far below the rounding of the
// params of the same dtype that such states go with.
#include <cmath>

#include "common.cuh"

namespace fz {
namespace {

struct LambArgs {
  fz_lamb_hyper hyper;
  const float* step;
  const float* grad_scale;  // nullptr: 1
  const float* clip;        // nullptr: 1 (no gradient clipping)
  const float* found_inf;   // nullptr: never skip
  double* partials;         // phase 1 output: 2 per chunk (sum p^2, sum u^2)
  const double* ratio;      // phase 2 input: one per tensor of the call
};
static_assert(sizeof(LambArgs) < 300, "beside a chunk table, within the 4 KiB of kernel parameters (common.cuh)");

// Per-step constants, each rounded to fp32 as the reference's Python floats
// are when they meet an fp32 tensor.
struct LambConsts {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
  float grad_scale, clip;  // 1 when absent: dividing by 1 is exact
  int eps_inside_sqrt;
};

__device__ LambConsts lamb_consts(const LambArgs& a) {
  const fz_lamb_hyper& h = a.hyper;
  LambConsts k;
  k.beta1 = float(h.beta1);
  k.beta2 = float(h.beta2);
  k.one_minus_beta1 = float(1.0 - h.beta1);
  k.one_minus_beta2 = float(1.0 - h.beta2);
  k.eps = float(h.eps);
  k.weight_decay = float(h.weight_decay);
  k.grad_scale = a.grad_scale != nullptr ? *a.grad_scale : 1.0f;
  k.clip = a.clip != nullptr ? *a.clip : 1.0f;
  k.eps_inside_sqrt = h.eps_inside_sqrt;
  return k;
}

// One element of LAMB, fp32, in the reference's order of operations. Phase 1
// updates the moments m, v from the grad g; phase 2 takes them as stored (g
// unused). Both return the update direction u.
// Phase 1 measures u from m and v as they will be stored (rounded to S), so
// that its norm is the norm of the u phase 2 applies (the CPU kernel does the same).
template <int kPhase, typename S>
__device__ __forceinline__ float lamb_math(float p, float g, float& m, float& v, const LambConsts& k) {
  if constexpr (kPhase == 1) {
    g = g / k.grad_scale / k.clip;
    m = to_float(from_float<S>(k.beta1 * m + k.one_minus_beta1 * g));
    v = to_float(from_float<S>(k.beta2 * v + k.one_minus_beta2 * g * g));
  }
  const float denom = k.eps_inside_sqrt ? sqrtf(v + k.eps) : sqrtf(v) + k.eps;
  return m / denom + k.weight_decay * p;
}

// Phase 1. Lists: 0 params, 1 grads, 2 exp_avgs, 3 exp_avg_sqs.
template <typename P, typename G, typename S>
__global__ void __launch_bounds__(kBlockSize) lamb_phase1_kernel(TensorListMeta<4> meta, LambArgs args) {
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;  // skipped step
  __shared__ LambConsts shared;
  if (threadIdx.x == 0) shared = lamb_consts(args);
  __syncthreads();
  const LambConsts k = shared;

  const ChunkRef c = chunk_ref(meta);
  const P* p = chunk_ptr<P>(meta, 0, c);
  const G* g = chunk_ptr<G>(meta, 1, c);
  S* m = chunk_ptr<S>(meta, 2, c);
  S* v = chunk_ptr<S>(meta, 3, c);
  const bool aligned = aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v);
  constexpr int N = kVecWidth<P, G, S>;
  double sums[2] = {0.0, 0.0};  // p^2, u^2: fp64, as the reference's .double().norm()
  for_each_tile<N>(c.n, aligned, [&](const auto& tile) {
    Lanes<P, N> pl;
    Lanes<G, N> gl;
    Lanes<S, N> ml, vl;
    pl.load(p, tile);
    gl.load(g, tile);
    ml.load(m, tile);
    vl.load(v, tile);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float u = lamb_math<1, S>(pl.x[j], gl.x[j], ml.x[j], vl.x[j], k);
      if (tile.valid(j)) {
        sums[0] += double(pl.x[j]) * double(pl.x[j]);
        sums[1] += double(u) * double(u);
      }
    }
    ml.store(m, tile);
    vl.store(v, tile);
  });
  block_sum<kBlockSize>(sums);
  if (threadIdx.x == 0) {
    double* out = args.partials + 2 * (meta.first_chunk + blockIdx.x);
    out[0] = sums[0];
    out[1] = sums[1];
  }
}

// Trust ratios of up to kRatioTensors tensors per launch, one block each.
constexpr int kRatioTensors = 256;
constexpr int kRatioThreads = 256;

struct RatioTable {
  int64_t chunk_begin[kRatioTensors + 1];  // tensor t's chunks: [chunk_begin[t], chunk_begin[t + 1])
  int64_t first_tensor;                    // table entry t is tensor first_tensor + t of the call
  int32_t out_index[kRatioTensors];        // where its ratio goes in coeffs_out
};
static_assert(sizeof(RatioTable) < 3800, "fits in the 4 KiB of kernel parameters");

__global__ void __launch_bounds__(kRatioThreads)
    lamb_trust_ratio_kernel(RatioTable table, const double* partials, fz_lamb_hyper hyper, const float* found_inf,
                            double* ratio, float* coeffs_out) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;  // coeffs_out keeps its values
  const int t = blockIdx.x;
  double sums[2] = {0.0, 0.0};
  for (int64_t c = table.chunk_begin[t] + threadIdx.x; c < table.chunk_begin[t + 1]; c += kRatioThreads) {
    sums[0] += partials[2 * c];
    sums[1] += partials[2 * c + 1];
  }
  block_sum<kRatioThreads>(sums);
  if (threadIdx.x == 0) {
    const double r = fz_lamb_trust_ratio(&hyper, sums[0], sums[1]);
    ratio[table.first_tensor + t] = r;
    coeffs_out[table.out_index[t]] = float(r);
  }
}

// Phase 2. Lists: 0 params, 1 exp_avgs, 2 exp_avg_sqs, 3 copies.
template <typename P, typename S, typename C>
__global__ void __launch_bounds__(kBlockSize) lamb_phase2_kernel(TensorListMeta<4> meta, LambArgs args) {
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;
  const ChunkRef c = chunk_ref(meta);
  __shared__ LambConsts shared;
  __shared__ float shared_alpha;
  if (threadIdx.x == 0) {
    shared = lamb_consts(args);
    shared_alpha = float(-fz_lamb_step_size(&args.hyper, double(*args.step)) * args.ratio[meta.first_tensor + c.tensor]);
  }
  __syncthreads();
  const LambConsts k = shared;
  const float alpha = shared_alpha;

  P* p = chunk_ptr<P>(meta, 0, c);
  const S* m = chunk_ptr<S>(meta, 1, c);
  const S* v = chunk_ptr<S>(meta, 2, c);
  C* copy = chunk_ptr<C>(meta, 3, c);
  const bool aligned = aligned16(p) && aligned16(m) && aligned16(v) && aligned16(copy);
  constexpr int N = kVecWidth<P, S, C>;
  for_each_tile<N>(c.n, aligned, [&](const auto& tile) {
    Lanes<P, N> pl;
    Lanes<S, N> ml, vl;
    Lanes<C, N> cl;
    pl.load(p, tile);
    ml.load(m, tile);
    vl.load(v, tile);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float u = lamb_math<2, S>(pl.x[j], 0.0f, ml.x[j], vl.x[j], k);
      pl.x[j] = pl.x[j] + alpha * u;
      cl.x[j] = pl.x[j];
    }
    pl.store(p, tile);
    cl.store(copy, tile);
  });
}

// The clip factor from every partial of fz_cuda_l2norm_partials, added by one
// block in a fixed order (deterministic).
constexpr int kClipThreads = 1024;

__global__ void __launch_bounds__(kClipThreads)
    lamb_clip_factor_kernel(const double* partials, int64_t len, fz_lamb_hyper hyper, const float* found_inf,
                            float* clip) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  double sum[1] = {0.0};
  for (int64_t i = threadIdx.x; i < len; i += kClipThreads) sum[0] += partials[i];
  block_sum<kClipThreads>(sum);
  if (threadIdx.x == 0) *clip = float(fz_lamb_clip(&hyper, sum[0]));
}

struct LambCall {
  void* const* p;
  void* const* g;
  void* const* m;
  void* const* v;
  void* const* copy;
  const int64_t* numel;
  const int64_t* out_index;
  int n;
  double* ratio;
  float* coeffs_out;
  cudaStream_t stream;
};

template <typename P, typename G, typename S, typename C>
int launch_lamb(const LambCall& call, LambArgs args) {
  void* const* const phase1_lists[4] = {call.p, call.g, call.m, call.v};
  int rc = multi_tensor_apply<4>(phase1_lists, call.numel, call.n, [&](const TensorListMeta<4>& meta, int blocks) {
    lamb_phase1_kernel<P, G, S><<<blocks, kBlockSize, 0, call.stream>>>(meta, args);
    return check_launch("lamb_phase1_kernel");
  });
  if (rc) return rc;

  RatioTable table;
  int64_t chunk = 0;
  for (int first = 0; first < call.n; first += kRatioTensors) {
    const int count = call.n - first < kRatioTensors ? call.n - first : kRatioTensors;
    table.first_tensor = first;
    for (int t = 0; t < count; ++t) {
      table.chunk_begin[t] = chunk;
      chunk += num_chunks(call.numel[first + t]);
      table.out_index[t] = int32_t(call.out_index[first + t]);
    }
    table.chunk_begin[count] = chunk;
    lamb_trust_ratio_kernel<<<count, kRatioThreads, 0, call.stream>>>(
        table, args.partials, args.hyper, args.found_inf, call.ratio, call.coeffs_out);
    if ((rc = check_launch("lamb_trust_ratio_kernel"))) return rc;
  }

  args.ratio = call.ratio;
  void* const* const phase2_lists[4] = {call.p, call.m, call.v, call.copy};
  return multi_tensor_apply<4>(phase2_lists, call.numel, call.n, [&](const TensorListMeta<4>& meta, int blocks) {
    lamb_phase2_kernel<P, S, C><<<blocks, kBlockSize, 0, call.stream>>>(meta, args);
    return check_launch("lamb_phase2_kernel");
  });
}

}  // namespace
}  // namespace fz

extern "C" int fz_cuda_lamb_clip_factor(const double* partials, int64_t partials_len, const fz_lamb_hyper* hyper,
                                        const float* found_inf, float* clip_out, void* stream) {
  using namespace fz;
  constexpr const char* fn = "fz_cuda_lamb_clip_factor";
  return guarded(fn, [&]() -> int {
    auto invalid = [&](const std::string& why) {
      return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": " + why);
    };
    if (hyper == nullptr) return invalid("hyper is null (pass the hyperparameters as an fz_lamb_hyper)");
    if (clip_out == nullptr || partials_len < 0 || (partials_len > 0 && partials == nullptr))
      return invalid("null buffer or negative length");
    if (!(hyper->max_grad_norm > 0.0)) return invalid("max_grad_norm must be > 0 (0: no clipping, no clip factor)");
    (void)cudaGetLastError();
    lamb_clip_factor_kernel<<<1, kClipThreads, 0, static_cast<cudaStream_t>(stream)>>>(partials, partials_len,
                                                                                     *hyper, found_inf, clip_out);
    return check_launch("lamb_clip_factor_kernel");
  });
}

extern "C" int fz_cuda_lamb(void* const* p, void* const* g, void* const* m, void* const* v, void* const* copy,
                            const int64_t* numel, const int64_t* out_index, int n, int p_dtype, int g_dtype,
                            int s_dtype, int c_dtype, const fz_lamb_hyper* hyper, const float* step,
                            const float* grad_scale, const float* clip, const float* found_inf, double* partials,
                            int64_t partials_len, double* ratio_scratch, float* coeffs_out, void* stream) {
  using namespace fz;
  constexpr const char* fn = "fz_cuda_lamb";
  return guarded(fn, [&]() -> int {
    auto invalid = [&](const std::string& why) {
      return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": " + why);
    };
    if (hyper == nullptr) return invalid("hyper is null (pass the hyperparameters as an fz_lamb_hyper)");
    if (n < 0) return invalid("negative tensor count");
    if (n == 0) return FZ_OK;
    if (step == nullptr) return invalid("step is null (pass the device step counter)");
    if (c_dtype != kNone && copy == nullptr) return invalid("a copy dtype without copies");
    if (out_index == nullptr || ratio_scratch == nullptr || coeffs_out == nullptr)
      return invalid("null out_index, ratio_scratch or coeffs_out");
    int rc = check_list(fn, "params", p, numel, n, p_dtype);
    if (!rc) rc = check_list(fn, "grads", g, numel, n, g_dtype);
    if (!rc) rc = check_list(fn, "exp_avgs", m, numel, n, s_dtype);
    if (!rc) rc = check_list(fn, "exp_avg_sqs", v, numel, n, s_dtype);
    if (!rc && c_dtype != kNone) rc = check_list(fn, "param_copies", copy, numel, n, c_dtype);
    if (rc) return rc;
    int64_t chunks = 0;
    for (int i = 0; i < n; ++i) {
      chunks += num_chunks(numel[i]);
      if (out_index[i] < 0 || out_index[i] > INT32_MAX) return invalid("out_index out of range");
    }
    if (chunks > 0 && (partials == nullptr || partials_len < 2 * chunks))
      return invalid("the partials buffer holds " + std::to_string(partials_len) + " values, " +
                     std::to_string(2 * chunks) + " needed");
    const LambArgs args{*hyper, step, grad_scale, clip, found_inf, partials, nullptr};
    const LambCall call{p, g, m, v, c_dtype == kNone ? nullptr : copy, numel, out_index, n, ratio_scratch, coeffs_out,
                        static_cast<cudaStream_t>(stream)};
    (void)cudaGetLastError();  // forget a failure of an earlier call on this thread
    return dispatch_optimizer(fn, p_dtype, g_dtype, s_dtype, c_dtype, [&](auto pt, auto gt, auto st, auto ct) {
      return launch_lamb<typename decltype(pt)::type, typename decltype(gt)::type, typename decltype(st)::type,
                         typename decltype(ct)::type>(call, args);
    });
  });
}
