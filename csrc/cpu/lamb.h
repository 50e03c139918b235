// CPU LAMB: the ISA-independent interface of lamb.cpp. Three passes, each
// multi-tensor and multi-thread: (0) the sum of squares of the grads, for
// the global-norm clip; (1) update m and v, and per tensor the sums of
// squares of p and of the update direction u; (2) recompute u from the new
// m and v and apply p -= step_size * trust_ratio * u. No temporary the size
// of the parameters.
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"

namespace fz {

// grad_mult = 1 / (grad_scale * clip). eps_inside_sqrt: d = sqrt(v + eps),
// else d = sqrt(v) + eps. u = m / d + weight_decay * p.
struct LambHyper {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, grad_mult;
  bool eps_inside_sqrt;
};

// Sum over all tensors of (g * grad_mult)^2, in double.
double lamb_grad_sumsq(Isa isa, const std::vector<uintptr_t>& g, const std::vector<int64_t>& numel,
                       int g_dtype, float grad_mult, int num_threads);

// Pass 1. Returns false if no kernel is built for the dtypes. Writes, per
// tensor, sums[2t] = sum p^2 and sums[2t+1] = sum u^2 (deterministic:
// per-chunk partials added in chunk order).
bool lamb_norms(Isa isa, const std::vector<uintptr_t>& p, const std::vector<uintptr_t>& g,
                const std::vector<uintptr_t>& m, const std::vector<uintptr_t>& v,
                const std::vector<int64_t>& numel, int p_dtype, int g_dtype, int s_dtype,
                const LambHyper& h, int num_threads, std::vector<double>* sums);

// Pass 2: p += scale[t] * u (scale = -step_size * trust ratio), and the copy.
bool lamb_apply(Isa isa, const std::vector<uintptr_t>& p, const std::vector<uintptr_t>& m,
                const std::vector<uintptr_t>& v, const std::vector<uintptr_t>& copy,
                const std::vector<int64_t>& numel, int p_dtype, int s_dtype, int c_dtype,
                const LambHyper& h, const std::vector<float>& scale, int num_threads);

}  // namespace fz
