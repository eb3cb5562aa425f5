// ThreadPool: the one place strata's CPU kernels get their parallelism from.
//
// Design decisions:
// - Static, contiguous partitioning. ParallelFor(n) hands thread i the i-th of num_threads equal
//   slices of [0, n), so which thread computes which element depends only on (n, num_threads).
//   Together with per-slice partial sums combined in slice order this makes every reduction
//   bitwise reproducible for a given thread count.
// - The calling thread is one of the workers (thread 0), so a pool of 1 thread runs everything
//   inline with no synchronisation at all.
// - BLAS runs single-threaded inside slices (see kernels/cpu/gemm.h), so the pool is the only
//   source of threads and the machine is never oversubscribed.
// - Workers spin briefly before sleeping: kernels are launched back to back, and a condition
//   variable wake-up costs more than most elementwise kernels.
//
// Thread-safety: ParallelFor, ParallelForSlices and Run share one job slot, so one thread at a
// time may call them on a pool (its owner; a thread that works beside it, such as a background
// optimizer, needs a pool of its own). A call from inside a task of any pool
// (InTask()) runs inline on the calling thread, single-threaded, so a kernel called from a pool
// task is legal and uses no other thread. `fn` is borrowed for the call: every slice has returned
// when the call returns, and nothing of it is kept. num_threads, PartsFor and SliceBegin may be
// called from any thread. Destroy the pool only when no call is in flight; the destructor joins
// its workers.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace strata {

class ThreadPool {
 public:
  // num_threads >= 1 counts the calling thread; num_threads - 1 workers are started.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Runs fn(begin, end) on contiguous slices covering [0, n). At most num_threads slices, and no
  // slice shorter than min_chunk (except the last), so tiny loops stay on one thread.
  template <typename F>
  void ParallelFor(int64_t n, int64_t min_chunk, F&& fn) {
    if (n <= 0) return;
    int parts = PartsFor(n, min_chunk);
    if (parts == 1) {
      fn(int64_t{0}, n);
      return;
    }
    auto body = [&](int tid, int nparts) {
      int64_t begin = SliceBegin(n, nparts, tid);
      int64_t end = SliceBegin(n, nparts, tid + 1);
      if (begin < end) fn(begin, end);
    };
    RunParts(parts, body);
  }

  // Like ParallelFor, but fn(part, begin, end) also gets the slice's index in
  // [0, PartsFor(n, min_chunk)), for per-slice partial results combined in slice order.
  template <typename F>
  void ParallelForSlices(int64_t n, int64_t min_chunk, F&& fn) {
    if (n <= 0) return;
    int parts = PartsFor(n, min_chunk);
    auto body = [&](int tid, int nparts) {
      int64_t begin = SliceBegin(n, nparts, tid);
      int64_t end = SliceBegin(n, nparts, tid + 1);
      if (begin < end) fn(tid, begin, end);
    };
    RunParts(parts, body);
  }

  // Runs fn(tid, num_threads) once on every thread of the pool (tid 0 is the caller).
  template <typename F>
  void Run(F&& fn) {
    RunParts(num_threads_, fn);
  }

  // True on a thread that is running a task of some pool: a ParallelFor from here runs inline.
  static bool InTask() { return in_task(); }

  // The number of slices ParallelFor(n, min_chunk) uses (1 for a nested call); callers that keep
  // per-slice partial results size them with this.
  int PartsFor(int64_t n, int64_t min_chunk) const;
  // Start of slice `part` of `parts` equal slices of [0, n).
  static int64_t SliceBegin(int64_t n, int parts, int part) { return n * part / parts; }

 private:
  template <typename F>
  void RunParts(int parts, F& fn) {
    if (parts == 1 || in_task()) {
      for (int i = 0; i < parts; ++i) fn(i, parts);
      return;
    }
    Dispatch(parts, &Trampoline<F>, &fn);
  }
  template <typename F>
  static void Trampoline(void* f, int tid, int parts) {
    (*static_cast<F*>(f))(tid, parts);
  }
  using TaskFn = void (*)(void*, int, int);

  void Dispatch(int parts, TaskFn fn, void* arg);
  void WorkerLoop(int tid);
  static bool& in_task();

  const int num_threads_;
  std::vector<std::thread> workers_;

  // Current job, published by bumping epoch_.
  TaskFn task_fn_ = nullptr;
  void* task_arg_ = nullptr;
  int task_parts_ = 0;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
};

}  // namespace strata
