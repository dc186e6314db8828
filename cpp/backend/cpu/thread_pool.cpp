// The CPU backend's persistent thread pool (contract in thread_pool.h).
#include "backend/cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace exl2::cpu {
namespace {

thread_local bool t_inside_task = false;

int threads_from_env() {
  if (const char* s = std::getenv("EXL2CPP_NUM_THREADS")) {
    const int v = std::atoi(s);
    if (v >= 1) return std::min(v, 1024);
  }
  const unsigned hc = std::thread::hardware_concurrency();
  return hc ? static_cast<int>(hc) : 1;
}

class Pool {
 public:
  explicit Pool(int n_threads) : n_threads_(n_threads) {
    for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this] { worker_loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return n_threads_; }

  // Returns false (and does nothing) when the pool is busy; the caller then runs inline.
  bool try_run(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn) {
    std::unique_lock<std::mutex> owner(owner_mu_, std::try_to_lock);
    if (!owner.owns_lock()) return false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      n_ = n;
      chunk_ = chunk;
      next_.store(0);
      active_ = static_cast<int>(workers_.size());
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(mu_);
    done_.wait(lk, [this] { return active_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
    return true;
  }

 private:
  void work() {
    t_inside_task = true;
    for (;;) {
      const int64_t b = next_.fetch_add(chunk_);
      if (b >= n_) break;
      try {
        (*fn_)(b, std::min(n_, b + chunk_));
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu_);
        if (!error_) error_ = std::current_exception();
      }
    }
    t_inside_task = false;
  }

  void worker_loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        wake_.wait(lk, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      work();
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (--active_ == 0) done_.notify_one();
      }
    }
  }

  const int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex owner_mu_;  // held by the host thread whose job is running
  std::mutex mu_;
  std::condition_variable wake_, done_;
  bool stop_ = false;
  uint64_t generation_ = 0;
  int active_ = 0;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, chunk_ = 1;
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_;
};

Pool& pool() {
  static Pool p(threads_from_env());
  return p;
}

}  // namespace

int num_threads() { return pool().size(); }

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  if (t_inside_task || n <= grain) {
    fn(0, n);
    return;
  }
  Pool& p = pool();
  if (p.size() <= 1) {
    fn(0, n);
    return;
  }
  // A few chunks per thread balance uneven work without much scheduling overhead.
  const int64_t chunk = std::max(grain, (n + 4 * p.size() - 1) / (4 * p.size()));
  if (!p.try_run(n, chunk, fn)) fn(0, n);
}

void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) { parallel_for(n, 1, fn); }

}  // namespace exl2::cpu
