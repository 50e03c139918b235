// CPU Adam/AdamW: the ISA-independent interface of adam.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"
#include "hyperparams.h"

namespace fz {

// The per-call constants the kernel uses (adam.cpp derives them from
// fz_adam_hyper, the step and the grad scale; the kernels read them).
struct AdamConsts;

// Updates one contiguous run of n elements of one tensor.
using AdamSegmentFn = void (*)(void* p, const void* g, void* m, void* v, void* copy,
                               int64_t n, const AdamConsts& k);

// The kernel for this ISA and dtype combination, or nullptr if not built:
// params fp32 (states fp32, optional fp16/bf16 copy) or fp16/bf16 (states
// fp32 or the param dtype, no copy); grads any of the three.
AdamSegmentFn adam_segment_fn(Isa isa, int p, int g, int s, int copy);

// One pass over a list of tensors with the same dtypes, split evenly across
// num_threads threads by element count. `copy` is empty or one per tensor.
// step: t >= 1; inv_grad_scale: the grads are multiplied by it (fused unscale).
void adam_multi_tensor(AdamSegmentFn fn, const std::vector<uintptr_t>& p,
                       const std::vector<uintptr_t>& g, const std::vector<uintptr_t>& m,
                       const std::vector<uintptr_t>& v, const std::vector<uintptr_t>& copy,
                       const std::vector<int64_t>& numel, int p_dtype, int g_dtype,
                       int s_dtype, int c_dtype, const fz_adam_hyper& hyper, double step,
                       double inv_grad_scale, int num_threads);

}  // namespace fz
