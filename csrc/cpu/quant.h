// Block-wise symmetric quantization (ZeRO++'s qwZ / qgZ): quantize,
// dequantize and the dequantized sum over ranks. The math and the formats
// are fastzero/ops/quant/reference.py: scale = absmax / qmax per block (NaN
// for a block holding NaN or inf), q = rne(clamp(x / scale, -qmax, qmax)) or,
// stochastic, floor(clamp(x / scale + u(seed, i), -qmax, qmax)); int8 codes,
// or int4 two to a byte (even element in the low nibble).
#pragma once

#include <cstdint>

#include "common.h"

namespace fz {

// x: n values (fp32, fp16 or bf16); codes: int8 [n] (bits 8) or uint8
// [ceil(n / 2)] (bits 4, block even); scales: fp32 [ceil(n / block)].
// Returns false for an ISA or dtype without a kernel or a bad format.
bool quant_quantize(Isa isa, const void* x, int x_dtype, void* codes, float* scales, int64_t n, int64_t block,
                    int bits, bool stochastic, uint32_t seed, int num_threads);

// out[i] = q[i] * scale (fp32 math), rounded to out's dtype.
bool quant_dequantize(Isa isa, const void* codes, int bits, const float* scales, void* out, int out_dtype,
                      int64_t n, int64_t block, int num_threads);

// out[i] = sum over r < ranks of q_r[i] * scale_r (an fp32 add per rank, in
// rank order), rounded to out's dtype. Rank r's codes start at codes +
// r * code_stride bytes, its scales at scales + r * ceil(n / block).
bool quant_dequantize_sum(Isa isa, const void* codes, int bits, int64_t code_stride, const float* scales,
                          int64_t ranks, void* out, int out_dtype, int64_t n, int64_t block, int num_threads);

}  // namespace fz
