// Threads for the CPU kernels: a small persistent pool, and an even split of
// a list of tensors by element count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

namespace fz {

// Calls fn(0..n-1) on n threads, fn(0) on the caller, and returns when all
// are done. The caller chooses n (Python passes torch.get_num_threads()), so
// the kernels never run more threads than torch's own pool would.
void parallel_run(int num_threads, const std::function<void(int)>& fn);

// Below this many elements in a call, one thread: waking others costs more.
constexpr int64_t kMinElementsPerThread = 1 << 15;

// Calls fn(tensor, offset, count) for every run of elements, after splitting
// the concatenation of all tensors into equal shares, one per thread, whose
// edges are multiples of 64 elements (no two threads share a cache line of
// fp32 data).
template <class Fn>
void for_each_segment(const std::vector<int64_t>& numel, int num_threads, Fn&& fn) {
  std::vector<int64_t> start(numel.size() + 1, 0);
  for (size_t t = 0; t < numel.size(); ++t) start[t + 1] = start[t] + numel[t];
  const int64_t total = start.back();
  if (total == 0) return;
  int threads = int(std::min<int64_t>(std::max(num_threads, 1),
                                      std::max<int64_t>(total / kMinElementsPerThread, 1)));
  auto edge = [&](int k) -> int64_t {
    if (k >= threads) return total;
    const int64_t e = (total / threads) * k + (total % threads) * k / threads;
    return std::min(total, (e + 63) / 64 * 64);
  };
  parallel_run(threads, [&](int k) {
    const int64_t begin = edge(k), end = edge(k + 1);
    if (begin >= end) return;
    // First tensor that ends after `begin`.
    size_t t = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1;
    for (int64_t pos = begin; pos < end; ++t) {
      const int64_t stop = std::min(end, start[t + 1]);
      if (stop > pos) fn(t, pos - start[t], stop - pos);
      pos = std::max(pos, stop);
    }
  });
}

}  // namespace fz
