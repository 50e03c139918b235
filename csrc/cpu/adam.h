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

// Updates one contiguous run of n elements of one tensor, the first of
// which is element `first` of the tensor (the index stochastic rounding keys on).
using AdamSegmentFn = void (*)(void* p, const void* g, void* m, void* v, void* copy,
                               int64_t n, int64_t first, const AdamConsts& k);

// The kernel for this ISA and dtype combination, or nullptr if not built:
// params fp32 (states fp32, optional fp16/bf16 copy) or fp16/bf16 (states
// fp32 or the param dtype, no copy); grads any of the three. State code
// kBF16SR (3, dtype_dispatch.inc): bf16 states written with stochastic
// rounding, for params of any dtype (copies as with fp32 states).
// sr_params: bf16 params written with stochastic rounding (bf16_stochastic_round;
// p must be bf16, else nullptr).
AdamSegmentFn adam_segment_fn(Isa isa, int p, int g, int s, int copy, bool sr_params);

// The int8-state kernel (adam_int8_kernel.inc) for this ISA and dtype
// combination, or nullptr: params fp32 (copy none, fp16 or bf16) or fp16/bf16
// (no copy), grads any of the three. Updates elements [first, first + n) of
// one tensor, `first` a multiple of `block`; m, v: its uint8 codes, ms, vs:
// its fp32 block scales (all of them: index = element / block).
using AdamInt8Fn = void (*)(void* p, const void* g, uint8_t* m, uint8_t* v, void* copy, float* ms, float* vs,
                            int64_t n, int64_t first, const AdamConsts& k, int64_t block);
AdamInt8Fn adam_int8_fn(Isa isa, int p, int g, int copy, bool sr_params);

// The state code of bf16 states written with stochastic rounding (the
// dtype_dispatch.inc constant, outside the ISA namespaces).
constexpr int kAdamStatesBF16SR = 3;

// One pass over a list of tensors with the same dtypes, split evenly across
// num_threads threads by element count. `copy` is empty or one per tensor.
// step: t >= 1; inv_grad_scale: the grads are multiplied by it (fused unscale);
// sr_seed: the seed of stochastic rounding (kBF16SR states, bf16 params written
// with stochastic rounding).
void adam_multi_tensor(AdamSegmentFn fn, const std::vector<uintptr_t>& p,
                       const std::vector<uintptr_t>& g, const std::vector<uintptr_t>& m,
                       const std::vector<uintptr_t>& v, const std::vector<uintptr_t>& copy,
                       const std::vector<int64_t>& numel, int p_dtype, int g_dtype,
                       int s_dtype, int c_dtype, const fz_adam_hyper& hyper, double step,
                       double inv_grad_scale, uint32_t sr_seed, int num_threads);

// One pass over a list of tensors with int8 states (state_format="int8"):
// block a power of two in [64, 4096], scales one fp32 per block per tensor.
void adam_int8_multi_tensor(AdamInt8Fn fn, const std::vector<uintptr_t>& p, const std::vector<uintptr_t>& g,
                            const std::vector<uintptr_t>& m, const std::vector<uintptr_t>& v,
                            const std::vector<uintptr_t>& copy, const std::vector<uintptr_t>& m_scale,
                            const std::vector<uintptr_t>& v_scale, const std::vector<int64_t>& numel, int p_dtype,
                            int g_dtype, int c_dtype, const fz_adam_hyper& hyper, double step,
                            double inv_grad_scale, int64_t block, uint32_t sr_seed, int num_threads);

}  // namespace fz
