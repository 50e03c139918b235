// CPU Adam/AdamW: the ISA-independent interface of adam.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"

namespace fz {

// Per-call constants, folded on the host so the kernel does one pass of
// multiply-adds. adamw_mode: decay = 1 - lr*wd, l2 = 0; Adam (L2): decay = 1,
// l2 = wd. step_size = lr / bc1, bc2_rsqrt = 1 / sqrt(bc2). 1 - beta is
// rounded from double, as torch does.
struct AdamHyper {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, bc2_rsqrt, decay, l2,
      inv_grad_scale;
};

// Updates one contiguous run of n elements of one tensor.
using AdamSegmentFn = void (*)(void* p, const void* g, void* m, void* v, void* copy,
                               int64_t n, const AdamHyper& h);

// The kernel for this ISA and dtype combination, or nullptr if not built:
// params fp32 (states fp32, optional fp16/bf16 copy) or fp16/bf16 (states
// fp32 or the param dtype, no copy); grads any of the three.
AdamSegmentFn adam_segment_fn(Isa isa, int p, int g, int s, int copy);

// One pass over a list of tensors with the same dtypes, split evenly across
// num_threads threads by element count. `copy` is empty or one per tensor.
void adam_multi_tensor(AdamSegmentFn fn, const std::vector<uintptr_t>& p,
                       const std::vector<uintptr_t>& g, const std::vector<uintptr_t>& m,
                       const std::vector<uintptr_t>& v, const std::vector<uintptr_t>& copy,
                       const std::vector<int64_t>& numel, int p_dtype, int g_dtype,
                       int s_dtype, int c_dtype, const AdamHyper& h, int num_threads);

}  // namespace fz
