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
#include "hyperparams.h"

namespace fz {

// Sum over all tensors of (g * inv_grad_scale)^2, in double: the squared
// global grad norm, for the clip (pass 0, only when hyper.max_grad_norm > 0).
double lamb_grad_sumsq(Isa isa, const std::vector<uintptr_t>& g, const std::vector<int64_t>& numel,
                       int g_dtype, double inv_grad_scale, int num_threads);

// Pass 1: updates m and v from g * inv_grad_scale / clip, where clip =
// max(1, sqrt(grad_sumsq) / max_grad_norm) when max_grad_norm > 0 (else 1,
// and grad_sumsq is ignored), and writes the trust ratio of each tensor:
// clamp(||p|| / ||u||, min_coeff, max_coeff), 1 when a norm is 0 (norms from
// per-chunk partial sums added in chunk order: deterministic). Returns false
// if no kernel is built for the dtypes.
bool lamb_norms(Isa isa, const std::vector<uintptr_t>& p, const std::vector<uintptr_t>& g,
                const std::vector<uintptr_t>& m, const std::vector<uintptr_t>& v,
                const std::vector<int64_t>& numel, int p_dtype, int g_dtype, int s_dtype,
                const fz_lamb_hyper& hyper, double inv_grad_scale, double grad_sumsq, int num_threads,
                std::vector<double>* ratios);

// Pass 2: p -= lr * sqrt(bc2) / bc1 * ratio[t] * u (step t >= 1), and the copy.
bool lamb_apply(Isa isa, const std::vector<uintptr_t>& p, const std::vector<uintptr_t>& m,
                const std::vector<uintptr_t>& v, const std::vector<uintptr_t>& copy,
                const std::vector<int64_t>& numel, int p_dtype, int s_dtype, int c_dtype,
                const fz_lamb_hyper& hyper, double step, const std::vector<double>& ratios,
                int num_threads);

}  // namespace fz
