// Overflow-checked size arithmetic for sizes computed from file or request values (shapes, token counts, page
// counts), and the host-memory check that large host allocations pass before they are made.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "exl2/errors.h"

namespace exl2 {

// The product of non-negative factors, or false when a factor is negative or the product passes INT64_MAX.
inline bool mul_fits(std::initializer_list<int64_t> factors, int64_t* out) {
  int64_t p = 1;
  for (int64_t f : factors)
    if (f < 0 || __builtin_mul_overflow(p, f, &p)) return false;
  *out = p;
  return true;
}

// The product of non-negative factors; throws `kind` with the message pieces and " (over 2^63 - 1)" otherwise.
template <typename... Msg>
int64_t checked_mul(ErrorKind kind, std::initializer_list<int64_t> factors, const Msg&... msg) {
  int64_t p = 0;
  if (!mul_fits(factors, &p)) throw_error(kind, msg..., " (the product passes 2^63 - 1)");
  return p;
}

// Bytes a * b (+ c) as a saturating count: SIZE_MAX when the exact value does not fit, so that a comparison with
// a memory size still refuses it. Messages print it with bytes_str.
inline size_t saturating_bytes(size_t a, size_t b, size_t c = 0) {
  size_t p = 0;
  if (__builtin_mul_overflow(a, b, &p) || __builtin_add_overflow(p, c, &p)) return SIZE_MAX;
  return p;
}

// "123456789 bytes (117.7 MiB)", or "over 2^64 bytes" for SIZE_MAX.
std::string bytes_str(size_t bytes);

// Bytes a host allocation can take now without swapping the process into the OOM killer: MemAvailable + SwapFree
// (/proc/meminfo), capped by the cgroup's limit less its usage when one is set (cgroup v2 memory.max). SIZE_MAX
// when none of these can be read.
size_t host_available_bytes();

// Allocations below this skip the host-memory check (one /proc read per large allocation only).
constexpr size_t kHostCheckBytes = size_t(64) << 20;

// Throws OutOfMemory "<what> needs <bytes> but only <available> of host memory are available<fix>" when `bytes`
// (>= kHostCheckBytes) is more than host_available_bytes().
void check_host_fits(size_t bytes, const std::string& what, const std::string& fix = "");

// Host buffers, `align` (a power of two <= 4096) aligned; nullptr when the system refuses. Buffers of
// kHostMapBytes or more are their own anonymous mappings, unmapped by host_free: freed memory goes back to the
// system at once, whatever malloc's trimming and mmap threshold do (a failed load under a memory cap must leave
// room to restore the old model). host_free takes the size given to host_alloc.
constexpr size_t kHostMapBytes = size_t(1) << 20;
void* host_alloc(size_t bytes, size_t align);
void host_free(void* p, size_t bytes);

}  // namespace exl2
