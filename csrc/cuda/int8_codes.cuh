// The 8-bit codes of Adam's int8 states (state_format="int8"), to the bit of
// fastzero/ops/adam/int8_codes.py: per block of B elements one fp32 scale
// (the block's largest magnitude) and one byte per element, a small float of
// y = |x| / scale in [0, 1] (exp_avg: sign bit, 4 exponent and 3 mantissa
// bits; exp_avg_sq: 5 and 3, and a value above 0 never gets code 0).
//
// The optimizer step's codes are rounded stochastically, with 16 random bits
// per element (the bf16 format's: the kernel draws them); rounding to
// nearest is only for whole-state conversions, which Python does.
//
// __host__ __device__, so that a host program can check these very functions
// against the Python rule without a GPU (tests/ops/adam/test_int8_states_cuda.py):
// on the device each operation is an _rn intrinsic (never contracted into an
// FMA); on the host a plain IEEE operation (that test builds with
// -ffp-contract=off). No PyTorch here (DESIGN.md rule 2).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#define FZ_HD __host__ __device__ __forceinline__

namespace fz {
namespace int8 {

FZ_HD uint32_t bits_of(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
#endif
}

FZ_HD float f32_of(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
#endif
}

FZ_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

FZ_HD float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;
constexpr uint32_t kMinNormalBits = 0x00800000u;  // 2^-126
constexpr uint32_t kNaNBits = 0x7fc00000u;        // the rule's NaN scale

// One of the two codes. `Bias` = 2^exp_bits - 1 (15, 31): the code of 1.0 is
// Bias << 3, the smallest normal value 2^emin with emin = 1 - Bias, the
// subnormal step 2^(emin - 3) = 2^(-2 - Bias). All constants as fp32 bits.
template <int Bias, bool Signed>
struct Int8Code {
  static constexpr uint32_t kRebias = uint32_t(127 - Bias) << 23;        // fp32's exponent bias less the code's
  static constexpr uint32_t kMinNormal = uint32_t(128 - Bias) << 23;     // 2^emin
  static constexpr uint32_t kStep = uint32_t(125 - Bias) << 23;          // 2^(emin - 3)
  static constexpr uint32_t kSubScale = uint32_t(149 + Bias) << 23;      // 2^(23 - emin): steps * 2^20
  static constexpr uint32_t kMagnitude = Signed ? 0x7fu : 0xffu;

  // x from code c (sign in bit 7 if Signed) and the block's scale s:
  // value(c) * s, one rounding; the value itself is exact (a small integer
  // times a power of two, or the code's bits moved into place).
  static FZ_HD float decode(uint32_t c, float s) {
    const uint32_t mag = c & kMagnitude;
    const float value = mag < 8 ? mul_rn(float(mag), f32_of(kStep)) : f32_of((mag << 20) + kRebias);
    const float x = mul_rn(value, s);
    return Signed ? f32_of(bits_of(x) ^ ((c & 0x80u) << 24)) : x;  // the reference's -x: the sign bit flipped
  }

  // The code of x, given k = 1 / scale of a block that encodes (a normal,
  // finite scale, so y below is finite), rounded stochastically with the
  // 16-bit integer r (< 2^16). Exact, as the rule states it:
  //  - y = min(|x| * k, 1): one rounded multiply, as the reference's.
  //  - t, y as the code with 20 more fraction bits: y >= 2^emin, y's bits
  //    less the exponent rebias (integer arithmetic); y < 2^emin, y * 2^(23 -
  //    emin), exact (a power of two; y may be an fp32 subnormal) and below
  //    2^23, truncated.
  //  - (t + 16 r) >> 20: the code above with probability t's fraction of a
  //    step (to 2^-16), so the mean is y; a carry moves into the exponent,
  //    and y = 1 stays the top code (16 r < 2^20).
  static FZ_HD uint32_t encode(float x, float k, uint32_t r) {
    const uint32_t xb = bits_of(x);
    const float p = mul_rn(f32_of(xb & kAbsMask), k);
    const uint32_t yb = bits_of(p) < 0x3f800000u ? bits_of(p) : 0x3f800000u;  // min(y, 1): both >= 0
    const uint32_t t = yb < kMinNormal ? uint32_t(mul_rn(f32_of(yb), f32_of(kSubScale))) : yb - kRebias;
    const uint32_t c = (t + (r << 4)) >> 20;
    if (Signed) return c | ((xb >> 24) & 0x80u);
    return c == 0 && yb != 0 ? 1u : c;  // a value above 0 never reads as a zero square
  }
};
using ExpAvgCode = Int8Code<15, true>;
using ExpAvgSqCode = Int8Code<31, false>;

// A block's scale from its largest |x| bit pattern (an unsigned max of the
// bits ranks NaN and inf above every finite value): NaN and codes 0 for a
// block with a non-finite value, 0 and codes 0 below 2^-126, else the max
// itself and its IEEE reciprocal.
struct Scale {
  float scale, inv;
  bool encodes;
};
FZ_HD Scale scale_of(uint32_t absmax_bits) {
  if (absmax_bits >= kInfBits) return {f32_of(kNaNBits), 0.0f, false};
  if (absmax_bits < kMinNormalBits) return {0.0f, 0.0f, false};
  const float s = f32_of(absmax_bits);
  return {s, div_rn(1.0f, s), true};
}

template <class Code>
FZ_HD uint32_t encode(float x, const Scale& s, uint32_t r) {
  return s.encodes ? Code::encode(x, s.inv, r) : 0u;
}

}  // namespace int8
}  // namespace fz

#undef FZ_HD
