// The weight arena (core/weight_arena.h): thread-local scopes, slabs from the device API, bump allocation.
#include "core/weight_arena.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "core/checked.h"
#include "exl2/options.h"
#include "core/device_api.h"

namespace exl2 {

namespace {

std::atomic<int64_t> g_slabs{0}, g_slab_bytes{0}, g_used{0}, g_live{0}, g_allocs{0}, g_overflow{0};

// One raw allocation. Tensors hold it through their Storage's keepalive; the last one frees it.
struct Slab {
  Device device;
  char* base = nullptr;
  size_t cap = 0;
  std::mutex mu;   // top: deleters may run on any thread
  size_t top = 0;  // bump offset

  Slab(Device d, size_t bytes) : device(d), cap(bytes) {
    if (d.is_cpu()) {
      check_host_fits(bytes, "a weight arena slab");
      base = static_cast<char*>(host_alloc(bytes, 4096));
      if (!base) EXL2_FAIL(OutOfMemory, "out of host memory allocating a weight arena slab of ", bytes, " bytes");
    } else {
      base = static_cast<char*>(device::cuda_malloc(bytes, d.index));  // OutOfMemory with the numbers
    }
    g_slabs += 1;
    g_slab_bytes += static_cast<int64_t>(bytes);
  }
  ~Slab() {
    if (device.is_cpu()) host_free(base, cap);
    else device::cuda_free(base, device.index);
    g_slabs -= 1;
    g_slab_bytes -= static_cast<int64_t>(cap);
    g_used -= static_cast<int64_t>(top);
  }
  // The aligned block at the top, or nullptr when it does not fit.
  char* take(size_t a) {
    std::lock_guard<std::mutex> lock(mu);
    if (cap - top < a) return nullptr;
    char* p = base + top;
    top += a;
    g_used += static_cast<int64_t>(a);
    return p;
  }
  void give(char* p, size_t a) {
    std::lock_guard<std::mutex> lock(mu);
    if (p + a == base + top) {  // the last allocation: pop it
      top -= a;
      g_used -= static_cast<int64_t>(a);
    }
  }
};

size_t granule(Device d) { return d.is_cpu() ? size_t(4096) : size_t(2) << 20; }
size_t round_up(size_t n, size_t g) { return (n + g - 1) / g * g; }

thread_local std::vector<WeightArenaState*> t_scopes;
thread_local int t_bypass = 0;

}  // namespace

struct WeightArenaState {
  Device device;
  size_t reserve = 0;       // the loader's estimate (0: none)
  size_t reserved = 0;      // slab bytes taken against it so far
  std::vector<std::shared_ptr<Slab>> slabs;  // open slabs, first fit in creation order

  void* alloc(size_t nbytes, std::function<void(void*)>* deleter, std::shared_ptr<void>* keepalive) {
    const size_t a = weight_arena_aligned(nbytes);
    std::shared_ptr<Slab> slab;
    char* p = nullptr;
    for (const auto& s : slabs)
      if ((p = s->take(a)) != nullptr) {
        slab = s;
        break;
      }
    if (!p) {
      size_t want;
      if (reserve == 0) {
        want = std::max(a, kWeightArenaSlab);
      } else if (reserved < reserve && reserve - reserved >= a) {
        want = reserve - reserved;
      } else {
        want = a;  // the estimate is spent: a slab of this allocation's size (its granule tail serves later ones)
        g_overflow += 1;
      }
      slab = std::make_shared<Slab>(device, round_up(want, granule(device)));
      reserved += slab->cap;
      slabs.push_back(slab);
      p = slab->take(a);
    }
    g_live += static_cast<int64_t>(a);
    g_allocs += 1;
    Slab* raw = slab.get();
    *deleter = [raw, a](void* q) {
      raw->give(static_cast<char*>(q), a);
      g_live -= static_cast<int64_t>(a);
      g_allocs -= 1;
    };
    *keepalive = std::move(slab);  // destroyed after the deleter ran (Storage's member order)
    return p;
  }
};

bool weight_arena_enabled() { return runtime_options().weight_arena; }

WeightArenaScope::WeightArenaScope(Device device, size_t reserve_bytes) {
  if (!weight_arena_enabled()) return;
  state_ = std::make_unique<WeightArenaState>();
  state_->device = device;
  state_->reserve = reserve_bytes;
  t_scopes.push_back(state_.get());
}

WeightArenaScope::~WeightArenaScope() {
  if (!state_) return;
  for (size_t i = t_scopes.size(); i-- > 0;)
    if (t_scopes[i] == state_.get()) {
      t_scopes.erase(t_scopes.begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
}  // the open slabs are released here: each lives on in its tensors, or is freed now when empty

WeightArenaBypass::WeightArenaBypass() { ++t_bypass; }
WeightArenaBypass::~WeightArenaBypass() { --t_bypass; }

WeightArenaStats weight_arena_stats() {
  WeightArenaStats s;
  s.slabs = g_slabs;
  s.slab_bytes = g_slab_bytes;
  s.used_bytes = g_used;
  s.live_bytes = g_live;
  s.live_allocs = g_allocs;
  s.overflow_slabs = g_overflow;
  return s;
}

void* weight_arena_alloc(Device device, size_t nbytes, std::function<void(void*)>* deleter,
                         std::shared_ptr<void>* keepalive) {
  if (t_bypass > 0) return nullptr;
  for (size_t i = t_scopes.size(); i-- > 0;)
    if (t_scopes[i]->device == device) return t_scopes[i]->alloc(nbytes, deleter, keepalive);
  return nullptr;
}

}  // namespace exl2
