// Shared pieces of the CPU kernels: dtype codes, scalar conversions, the
// run-time ISA check and the thread pool. No PyTorch header here (DESIGN.md
// rule 2): kernels see raw pointers, element counts and dtype codes.
#pragma once

#include <cstdint>
#include <cstring>

// The Python-facing interface of the extension (bindings.cpp): bumped whenever
// a binding is added or its arguments change, so that a stale prebuilt
// extension is rebuilt instead of failing with a pybind TypeError or a missing
// attribute (fastzero/native/abi.py agrees). 7: mask_pack, mask_unpack,
// stream_narrow.
#define FZ_CPU_ABI_VERSION 7

namespace fz {

// Dtype codes shared with Python (fastzero/native/abi.py: DTYPE_CODES,
// NO_DTYPE; tests/test_native_abi.py checks they agree).
enum DType : int { kNone = -1, kF32 = 0, kF16 = 1, kBF16 = 2 };

// Bytes per element of a dtype code; 0 for kNone (an absent stream).
constexpr int64_t dtype_size(int d) { return d == kF32 ? 4 : (d == kNone ? 0 : 2); }

// Instruction sets, best last. Python passes one of these as an int
// (fastzero/native/abi.py: ISA_NAMES, indexed by code).
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// Best instruction set this CPU and OS support (CPUID plus XGETBV, via libgcc).
Isa best_isa();

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// bf16 <-> fp32, round to nearest even, NaN -> 0x7FC0 (as c10::BFloat16).
inline float bf16_to_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }
inline uint16_t f32_to_bf16(float f) {
  uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// IEEE half <-> fp32 in software, round to nearest even; used where F16C is
// not assumed (the scalar path). Same results as F16C's VCVTPS2PH/VCVTPH2PS
// for every non-NaN input.
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in fp32
    const float f = float(man) * 5.9604644775390625e-08f;
    return bits_f32(f32_bits(f) | sign);
  }
  if (exp == 31) return bits_f32(sign | 0x7f800000u | (man << 13));
  return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}
inline uint16_t f32_to_f16(float f) {
  uint32_t x = f32_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x47800000u)  // |f| >= 65536: inf, or NaN (quieted)
    return sign | (x > 0x7f800000u ? 0x7e00 : 0x7c00);
  if (x < 0x38800000u) {  // below 2^-14: let the FPU round into 2^-24 steps
    const float a = bits_f32(x) + 0.5f;
    return sign | uint16_t(f32_bits(a) - 0x3f000000u);
  }
  // Normal: rebias the exponent, round the 13 dropped bits to nearest even.
  // A carry out of the mantissa rounds 65520..65535 up to inf, as it should.
  x += 0xc8000fffu + ((x >> 13) & 1u);
  return sign | uint16_t(x >> 13);
}

}  // namespace fz
