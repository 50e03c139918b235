// The L2 norm of a list of tensors, in two deterministic passes: per-chunk
// sums of squares into a caller's fp64 buffer (one launch per dtype), then
// one block that adds them all in a fixed order (the second pass is the
// caller's: LAMB's global gradient clipping, fz_cuda_lamb_clip_factor in
// multi_tensor_lamb.cu, clip = max(1, ||g / grad_scale|| / max_grad_norm)).
#include <cmath>

#include "common.cuh"

namespace fz {
namespace {

// The squared norm's contribution of one element: x / scale in fp32 (the
// reference's unscaled grad), squared and summed in fp64 (as its .double()).
__device__ __forceinline__ double l2norm_term(float x, float scale) {
  const float y = x / scale;
  return double(y) * double(y);
}

template <typename T>
__global__ void __launch_bounds__(kBlockSize)
    l2norm_partials_kernel(TensorListMeta<1> meta, const float* scale, const float* found_inf, double* partials) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;  // the step is skipped: no norm needed
  const float s = scale != nullptr ? *scale : 1.0f;
  const ChunkRef c = chunk_ref(meta);
  const T* x = chunk_ptr<T>(meta, 0, c);
  constexpr int N = kVecWidth<T>;
  double sum[1] = {0.0};
  for_each_tile<N>(c.n, aligned16(x), [&](const auto& tile) {
    Lanes<T, N> xl;
    xl.load(x, tile);
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (tile.valid(j)) sum[0] += l2norm_term(xl.x[j], s);
  });
  block_sum<kBlockSize>(sum);
  if (threadIdx.x == 0) partials[meta.first_chunk + blockIdx.x] = sum[0];
}

}  // namespace
}  // namespace fz

extern "C" int fz_cuda_l2norm_partials(void* const* x, const int64_t* numel, int n, int dtype, const float* scale,
                                       const float* found_inf, double* partials, int64_t partials_len,
                                       void* stream) {
  using namespace fz;
  constexpr const char* fn = "fz_cuda_l2norm_partials";
  return guarded(fn, [&]() -> int {
    if (n < 0) return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": negative tensor count");
    if (int rc = check_list(fn, "tensors", x, numel, n, dtype)) return rc;
    int64_t chunks = 0;
    for (int i = 0; i < n; ++i) chunks += num_chunks(numel[i]);
    if (chunks == 0) return FZ_OK;
    if (partials == nullptr || partials_len < chunks)
      return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": the partials buffer holds " +
                                                    std::to_string(partials_len) + " values, " +
                                                    std::to_string(chunks) + " needed");
    void* const* const lists[1] = {x};
    const auto s = static_cast<cudaStream_t>(stream);
    (void)cudaGetLastError();  // forget a failure of an earlier call on this thread
    int rc = -1;
    const bool known = visit_dtype<false>(dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      rc = multi_tensor_apply<1>(lists, numel, n, [&](const TensorListMeta<1>& meta, int blocks) {
        l2norm_partials_kernel<T><<<blocks, kBlockSize, 0, s>>>(meta, scale, found_inf, partials);
        return check_launch("l2norm_partials_kernel");
      });
    });
    if (!known)
      return set_error(FZ_ERR_INVALID_ARGUMENT, std::string(fn) + ": unsupported dtype " + dtype_name(dtype));
    return rc;
  });
}
