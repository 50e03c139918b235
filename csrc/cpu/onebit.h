// 1-bit compression with error feedback (1-bit Adam's): pack and unpack.
// The math is fastzero/ops/reference/onebit.py; sign bits are packed eight to
// a byte, element i of a chunk in bit i % 8 of byte i / 8.
#pragma once

#include <cstdint>

#include "common.h"

namespace fz {

// Over `chunks` chunks of numel / chunks elements (a multiple of 8):
// y = x + error; scales[c] = ||y_c||_2 / sqrt(len); bits = (y >= 0);
// error = y - scales[c] * (bit ? 1 : -1). x is fp32, fp16 or bf16; error and
// scales fp32. Returns false if `isa` or `x_dtype` has no kernel.
bool onebit_pack(Isa isa, const void* x, int x_dtype, float* error, uint8_t* bits, float* scales,
                 int64_t numel, int64_t chunks, int num_threads);

// `rows` rows of row_bytes bytes of bits, one scale each. average == false:
// out[r * 8 * row_bytes + i] = scales[r] * sign; true: out[i] = the mean over
// rows of scales[r] * sign (8 * row_bytes elements).
bool onebit_unpack(Isa isa, const uint8_t* bits, const float* scales, float* out, int64_t rows,
                   int64_t row_bytes, bool average, int num_threads);

// A 0/1 mask (fp32, fp16 or bf16) as bits: bit i % 8 of byte i / 8 is
// (x[i] != 0), ceil(numel / 8) bytes; and back, 1 or 0 in out's dtype.
// Return false if `isa` or the dtype has no kernel.
bool mask_pack(Isa isa, const void* x, int x_dtype, uint8_t* bits, int64_t numel, int num_threads);
bool mask_unpack(Isa isa, const uint8_t* bits, void* out, int out_dtype, int64_t numel, int num_threads);

}  // namespace fz
