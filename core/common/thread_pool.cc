#include "core/common/thread_pool.h"

#include <algorithm>

#include "core/common/logging.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define STRATA_CPU_RELAX() _mm_pause()
#else
#define STRATA_CPU_RELAX() std::this_thread::yield()
#endif

namespace strata {
namespace {
// How many polls a thread makes before blocking on a condition variable (~20-50 us).
constexpr int kSpinIterations = 4000;
}  // namespace

bool& ThreadPool::in_task() {
  thread_local bool flag = false;
  return flag;
}

ThreadPool::ThreadPool(int num_threads) : num_threads_(std::max(1, num_threads)) {
  workers_.reserve(num_threads_ - 1);
  for (int tid = 1; tid < num_threads_; ++tid) {
    workers_.emplace_back([this, tid] { WorkerLoop(tid); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
    epoch_.fetch_add(1);
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

int ThreadPool::PartsFor(int64_t n, int64_t min_chunk) const {
  if (in_task()) return 1;  // nested calls run inline: one slice
  if (min_chunk < 1) min_chunk = 1;
  int64_t by_size = (n + min_chunk - 1) / min_chunk;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads_, by_size)));
}

void ThreadPool::Dispatch(int parts, TaskFn fn, void* arg) {
  CHECK_LE(parts, num_threads_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    task_fn_ = fn;
    task_arg_ = arg;
    task_parts_ = parts;
    pending_.store(num_threads_ - 1, std::memory_order_relaxed);
    epoch_.fetch_add(1, std::memory_order_release);
  }
  work_cv_.notify_all();

  in_task() = true;
  fn(arg, 0, parts);
  in_task() = false;

  for (int i = 0; i < kSpinIterations; ++i) {
    if (pending_.load(std::memory_order_acquire) == 0) return;
    STRATA_CPU_RELAX();
  }
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
}

void ThreadPool::WorkerLoop(int tid) {
  // The epoch at construction, not a fresh load: a job dispatched before this thread got to run
  // must still be seen as new.
  uint64_t seen = 0;
  in_task() = true;
  while (true) {
    bool ready = false;
    for (int i = 0; i < kSpinIterations; ++i) {
      if (epoch_.load(std::memory_order_acquire) != seen) {
        ready = true;
        break;
      }
      STRATA_CPU_RELAX();
    }
    if (!ready) {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
    }
    if (stop_.load()) return;
    TaskFn fn;
    void* arg;
    int parts;
    {
      std::lock_guard<std::mutex> lock(mu_);
      seen = epoch_.load(std::memory_order_acquire);
      fn = task_fn_;
      arg = task_arg_;
      parts = task_parts_;
    }
    if (tid < parts) fn(arg, tid, parts);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mu_);
      done_cv_.notify_one();
    }
  }
}

}  // namespace strata
