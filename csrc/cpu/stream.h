// The memory-bandwidth probe that benchmarks compare kernels against.
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"

namespace fz {

// a += s*b; c += s*b; d += s*b over lists of fp32 tensors, split across
// threads as the Adam kernel splits its work (so a probe over the same
// tensors as an Adam step sees the same memory layout). Returns false if
// `isa` was not built.
bool stream_update(Isa isa, const std::vector<uintptr_t>& a, const std::vector<uintptr_t>& b,
                   const std::vector<uintptr_t>& c, const std::vector<uintptr_t>& d,
                   const std::vector<int64_t>& numel, float s, int num_threads);

// a[:] = s over lists of fp32 tensors, with cache-bypassing stores when
// `nt`: the write-bandwidth probe. Returns false if `isa` was not built.
bool stream_fill(Isa isa, const std::vector<uintptr_t>& a, const std::vector<int64_t>& numel, float s, bool nt,
                 int num_threads);

// out = codes of x over lists of fp32 tensors (bits 8: a byte per value; 4:
// a nibble), cache-bypassing stores when `nt`: the probe of quantize's
// traffic (stream_kernel.inc's narrow_segment). Returns false if `isa` was
// not built.
bool stream_narrow(Isa isa, const std::vector<uintptr_t>& x, const std::vector<uintptr_t>& out,
                   const std::vector<int64_t>& numel, int bits, bool nt, int num_threads);

}  // namespace fz
