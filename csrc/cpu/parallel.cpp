#include "parallel.h"

#include <pthread.h>

#include <condition_variable>
#include <mutex>
#include <thread>

namespace fz {
namespace {

class ThreadPool {
 public:
  void run(int n, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> serial(run_mu_);  // one job at a time
    if (n <= 1) { fn(0); return; }
    {
      std::unique_lock<std::mutex> lock(mu_);
      while (int(workers_) < n - 1) {
        std::thread(&ThreadPool::work, this, workers_ + 1).detach();
        ++workers_;
      }
      job_ = &fn;
      job_threads_ = n;
      pending_ = n - 1;
      ++generation_;
    }
    wake_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return pending_ == 0; });
    job_ = nullptr;
  }

 private:
  void work(int index) {
    uint64_t seen = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      seen = generation_ - 1;  // a worker born for a job takes that job
    }
    for (;;) {
      const std::function<void(int)>* job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (index >= job_threads_) continue;
        job = job_;
      }
      (*job)(index);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex run_mu_, mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* job_ = nullptr;
  int workers_ = 0, job_threads_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
};

// Leaked on purpose: workers are detached and may still wait at exit. After
// fork() the child has none of them, so it starts a new pool.
ThreadPool* g_pool = nullptr;
std::once_flag g_atfork;

}  // namespace

void parallel_run(int num_threads, const std::function<void(int)>& fn) {
  std::call_once(g_atfork, [] { pthread_atfork(nullptr, nullptr, [] { g_pool = nullptr; }); });
  if (g_pool == nullptr) g_pool = new ThreadPool();
  g_pool->run(num_threads, fn);
}

}  // namespace fz
