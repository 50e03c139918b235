// The memory-bandwidth probe that benchmarks compare kernels against.
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"

namespace fz {

// a += s*b; c += s*b; d += s*b over n fp32 elements, split across threads as
// the Adam kernel splits its work. Returns false if `isa` was not built.
bool stream_update(Isa isa, float* a, const float* b, float* c, float* d, int64_t n, float s,
                   int num_threads);

}  // namespace fz
