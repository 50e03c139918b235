// Threads for the CPU kernels: a list of tensors cut into chunks, handed out
// dynamically over an OpenMP team.
//
// OpenMP, because the process already has torch's: torch's wheel ships
// libgomp.so.1 and loads it first, so our kernels run on torch's own pool
// (torch.get_num_threads() threads, passed in by Python). A second pool
// would fight torch's workers, which spin for a while after each torch op.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace fz {

// Below this many elements in a call, one thread: waking others costs more.
constexpr int64_t kMinElementsPerThread = 1 << 15;
// Work is handed out in chunks of this many elements (1 MiB of fp32 data),
// claimed dynamically: a thread slowed by a neighbour just claims fewer.
constexpr int64_t kChunkElements = 1 << 18;

struct Chunk {
  size_t tensor;
  int64_t offset, count;
};

// Every tensor cut into chunks (edges at multiples of kChunkElements within a
// tensor, so no two threads share a cache line), in tensor order.
inline std::vector<Chunk> make_chunks(const std::vector<int64_t>& numel) {
  std::vector<Chunk> chunks;
  for (size_t t = 0; t < numel.size(); ++t)
    for (int64_t off = 0; off < numel[t]; off += kChunkElements)
      chunks.push_back({t, off, std::min(kChunkElements, numel[t] - off)});
  return chunks;
}

// Calls fn(i) for every chunk index i, on up to num_threads threads.
template <class Fn>
void parallel_chunks(const std::vector<Chunk>& chunks, int num_threads, Fn&& fn) {
  int64_t total = 0;
  for (const Chunk& c : chunks) total += c.count;
  const int64_t n = int64_t(chunks.size());
  const int threads = int(std::min<int64_t>(
      {int64_t(std::max(num_threads, 1)), std::max<int64_t>(total / kMinElementsPerThread, 1), n}));
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) fn(i);
}

// Calls fn(tensor, offset, count) for every chunk of every tensor.
template <class Fn>
void for_each_segment(const std::vector<int64_t>& numel, int num_threads, Fn&& fn) {
  const std::vector<Chunk> chunks = make_chunks(numel);
  parallel_chunks(chunks, num_threads, [&](int64_t i) {
    fn(chunks[i].tensor, chunks[i].offset, chunks[i].count);
  });
}

}  // namespace fz
