// The CPU backend's thread pool: one persistent set of workers shared by every CPU kernel.
//
// parallel_for(n, fn) runs fn(begin, end) over disjoint ranges covering [0, n) and returns when all are done.
// - Size: env EXL2CPP_NUM_THREADS (>= 1) if set, else std::thread::hardware_concurrency(); read once, at the
//   first call. The calling thread works too, so the pool holds size-1 workers.
// - Reentrancy: a call made from inside a running task (nested), or while another host thread holds the pool,
//   runs inline on the calling thread (no deadlock, no oversubscription). Exceptions thrown by fn are caught
//   and the first one is rethrown to the caller after all ranges finish.
// - grain: the smallest range worth handing to another thread; n <= grain runs inline.
#pragma once

#include <cstdint>
#include <functional>

namespace exl2::cpu {

void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn);
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// Threads a parallel_for may use (workers + caller).
int num_threads();

}  // namespace exl2::cpu
