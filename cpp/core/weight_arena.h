// The weight arena: while a WeightArenaScope is alive on a thread, Tensor::empty on its device sub-allocates from
// a few large slabs instead of one allocation per tensor (the CUDA driver rounds every large cudaMalloc up to 2 MiB
// pages; one slab per load recovers that rounding, ~6% of a 4-bit 7B model).
//
// Contract:
// - A scope covers one device on the thread that created it; scopes nest (the innermost one of a device wins).
//   Other devices and other threads allocate as before. A WeightArenaBypass on the thread suspends all its scopes
//   (staging tensors that die before the load ends must not take arena space for the model's life).
// - Allocations are bump-allocated with kWeightArenaAlign (256-byte) alignment. Each tensor keeps its slab alive
//   (shared ownership through its Storage); a slab is freed when the scope has ended and its last tensor is gone.
//   Freeing the allocation at a slab's top lowers the top again (a staging tensor freed right away costs nothing).
// - Slab sizes: with reserve_bytes > 0 (the loader's estimate of what it will place on the device), the first slab
//   is that size, rounded up to the allocation granule (CUDA 2 MiB, CPU 4 KiB), and the whole load is one
//   allocation when the estimate holds; what does not fit once it is spent goes to a slab of its own aligned size
//   (rounded to the granule: later small tensors fill that tail), i.e. never worse than per-tensor allocation.
//   With reserve_bytes == 0, slabs of kWeightArenaSlab bytes (or the request, when larger).
// - Out of memory: the slab's allocation raises OutOfMemoryError with the numbers (as a plain allocation does).
// - Option weight_arena false (exl2/options.h, read when a scope is created) makes scopes inert; default on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "exl2/tensor.h"

namespace exl2 {

constexpr size_t kWeightArenaAlign = 256;
constexpr size_t kWeightArenaSlab = size_t(256) << 20;

// n rounded up to kWeightArenaAlign (what an allocation of n bytes takes inside a slab; n == 0 takes one unit).
inline size_t weight_arena_aligned(size_t n) {
  return (n ? (n + kWeightArenaAlign - 1) / kWeightArenaAlign : 1) * kWeightArenaAlign;
}

bool weight_arena_enabled();  // option weight_arena

struct WeightArenaState;

class WeightArenaScope {
 public:
  explicit WeightArenaScope(Device device, size_t reserve_bytes = 0);
  ~WeightArenaScope();
  WeightArenaScope(const WeightArenaScope&) = delete;
  WeightArenaScope& operator=(const WeightArenaScope&) = delete;

 private:
  std::unique_ptr<WeightArenaState> state_;  // null when the arena is off
};

class WeightArenaBypass {
 public:
  WeightArenaBypass();
  ~WeightArenaBypass();
  WeightArenaBypass(const WeightArenaBypass&) = delete;
  WeightArenaBypass& operator=(const WeightArenaBypass&) = delete;
};

// Process-wide counters (all devices): live slabs and their bytes, the bump-allocated bytes inside them (used) and
// the bytes / count of the allocations still alive (used - live: space freed below a slab's top, lost until the slab
// goes); overflow_slabs counts, since the process started, the slabs made past a scope's reserve (estimate short).
struct WeightArenaStats {
  int64_t slabs = 0, slab_bytes = 0, used_bytes = 0, live_bytes = 0, live_allocs = 0, overflow_slabs = 0;
};
WeightArenaStats weight_arena_stats();

// Tensor::empty's hook: when a scope of `device` is active on this thread (and no bypass), sub-allocates nbytes and
// returns the pointer with the Storage's deleter and keepalive; else returns nullptr.
void* weight_arena_alloc(Device device, size_t nbytes, std::function<void(void*)>* deleter,
                         std::shared_ptr<void>* keepalive);

}  // namespace exl2
