// CPU Adam/AdamW kernels (see adam_kernel.inc for the math) and their
// multi-tensor, multi-thread driver.
#include "adam.h"

#include <array>
#include <cmath>
#include <cstring>
#include <immintrin.h>
#include <type_traits>

#include "parallel.h"

// The bf16 stochastic-rounding format pins the update to separately rounded
// operations (adam_kernel.inc: madd<true>), which the compiler must not fuse
// into multiply-adds; the other formats use explicit fused ones.
#if defined(__clang__)
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif

namespace fz {

// Per-call constants, folded once per call so the kernel does one pass of
// multiply-adds. adamw_mode: decay = 1 - lr*wd, l2 = 0; Adam (L2): decay = 1,
// l2 = wd. step_size = lr / bc1, bc2_rsqrt = 1 / sqrt(bc2). Each is computed
// in double, as the reference's Python floats are, then rounded to float
// (1 - beta too, as torch does). The first moment is torch's lerp:
// m <- fma(m_coeff, g - m, m_from_grad ? g : m) (fz_lerp_coeff). sr_stream:
// the key of this step's random bits for bf16 states written with stochastic
// rounding, fmix32(fmix32(seed) ^ step) (fastzero/ops/adam/reference.py).
struct AdamConsts {
  float m_coeff, beta2, one_minus_beta2, eps, step_size, bc2_rsqrt, decay, l2, inv_grad_scale;
  bool m_from_grad;
  uint32_t sr_stream;
};

namespace {

uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  return h ^ (h >> 16);
}

AdamConsts adam_consts(const fz_adam_hyper& h, double step, double inv_grad_scale, uint32_t sr_seed) {
  const fz_adam_derived d = fz_adam_derive(&h, step);
  AdamConsts k;
  const float w = float(d.one_minus_beta1);
  k.m_coeff = fz_lerp_coeff(w);
  k.m_from_grad = !(w < 0.5f);
  k.beta2 = float(h.beta2);
  k.one_minus_beta2 = float(d.one_minus_beta2);
  k.eps = float(h.eps);
  k.step_size = float(d.step_size);
  k.bc2_rsqrt = float(1.0 / d.sqrt_bc2);
  k.decay = float(d.decay);
  k.l2 = float(d.l2);
  k.inv_grad_scale = float(inv_grad_scale);
  k.sr_stream = fmix32(fmix32(sr_seed) ^ uint32_t(uint64_t(step)));
  return k;
}

}  // namespace
}  // namespace fz

// GCC 12 warns, inside avx512fintrin.h, that the self-initialized
// _mm512_undefined_* operands of the intrinsics the int8 kernel inlines
// (the block maxima) are uninitialized: a false positive (as in quant.cpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#define FZ_KERNEL_BODY "adam_kernel.inc"
#include "isa_regions.inc"

namespace fz {

AdamSegmentFn adam_segment_fn(Isa isa, int p, int g, int s, int copy, bool sr_params) {
  return FZ_ISA_PICK(isa, adam_pick(p, g, s, copy, sr_params));
}

AdamInt8Fn adam_int8_fn(Isa isa, int p, int g, int copy, bool sr_params) {
  return FZ_ISA_PICK(isa, adam_int8_pick(p, g, copy, sr_params));
}

void adam_multi_tensor(AdamSegmentFn fn, const std::vector<uintptr_t>& p,
                       const std::vector<uintptr_t>& g, const std::vector<uintptr_t>& m,
                       const std::vector<uintptr_t>& v, const std::vector<uintptr_t>& copy,
                       const std::vector<int64_t>& numel, int p_dtype, int g_dtype,
                       int s_dtype, int c_dtype, const fz_adam_hyper& hyper, double step,
                       double inv_grad_scale, uint32_t sr_seed, int num_threads) {
  const AdamConsts k = adam_consts(hyper, step, inv_grad_scale, sr_seed);
  // Segments start at multiples of kChunkElements in their tensor, so none
  // crosses a multiple of 2^32 (where the SR key changes).
  static_assert((int64_t(1) << 32) % kChunkElements == 0, "chunks never straddle 2^32");
  const int64_t ps = dtype_size(p_dtype), gs = dtype_size(g_dtype), ss = dtype_size(s_dtype),
                cs = dtype_size(c_dtype);
  for_each_segment(numel, num_threads, [&](size_t t, int64_t off, int64_t n) {
    char* c = copy.empty() ? nullptr : reinterpret_cast<char*>(copy[t]) + off * cs;
    fn(reinterpret_cast<char*>(p[t]) + off * ps, reinterpret_cast<const char*>(g[t]) + off * gs,
       reinterpret_cast<char*>(m[t]) + off * ss, reinterpret_cast<char*>(v[t]) + off * ss, c,
       n, off, k);
  });
}

void adam_int8_multi_tensor(AdamInt8Fn fn, const std::vector<uintptr_t>& p, const std::vector<uintptr_t>& g,
                            const std::vector<uintptr_t>& m, const std::vector<uintptr_t>& v,
                            const std::vector<uintptr_t>& copy, const std::vector<uintptr_t>& m_scale,
                            const std::vector<uintptr_t>& v_scale, const std::vector<int64_t>& numel, int p_dtype,
                            int g_dtype, int c_dtype, const fz_adam_hyper& hyper, double step,
                            double inv_grad_scale, int64_t block, uint32_t sr_seed, int num_threads) {
  const AdamConsts k = adam_consts(hyper, step, inv_grad_scale, sr_seed);
  // Segments start at multiples of kChunkElements in their tensor, so at block edges.
  static_assert(kChunkElements % 4096 == 0, "chunks start at block edges");
  const int64_t ps = dtype_size(p_dtype), gs = dtype_size(g_dtype), cs = dtype_size(c_dtype);
  for_each_segment(numel, num_threads, [&](size_t t, int64_t off, int64_t n) {
    char* c = copy.empty() ? nullptr : reinterpret_cast<char*>(copy[t]) + off * cs;
    fn(reinterpret_cast<char*>(p[t]) + off * ps, reinterpret_cast<const char*>(g[t]) + off * gs,
       reinterpret_cast<uint8_t*>(m[t]) + off, reinterpret_cast<uint8_t*>(v[t]) + off, c,
       reinterpret_cast<float*>(m_scale[t]), reinterpret_cast<float*>(v_scale[t]), n, off, k, block);
  });
}

}  // namespace fz
