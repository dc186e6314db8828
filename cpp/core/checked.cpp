// Host memory (see checked.h): what is available to this process (/proc/meminfo and the cgroup v2 limit), and
// the host buffers' allocation.
#include "core/checked.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace exl2 {

namespace {

// The value of `key` (kB) in /proc/meminfo, in bytes; false when absent.
bool meminfo_bytes(const char* key, size_t* out) {
  FILE* f = std::fopen("/proc/meminfo", "r");
  if (!f) return false;
  char line[256];
  bool found = false;
  const size_t n = std::strlen(key);
  while (std::fgets(line, sizeof line, f)) {
    unsigned long long kb = 0;
    if (std::strncmp(line, key, n) == 0 && line[n] == ':' && std::sscanf(line + n + 1, "%llu", &kb) == 1) {
      *out = static_cast<size_t>(kb) * 1024;
      found = true;
      break;
    }
  }
  std::fclose(f);
  return found;
}

// One unsigned number from a file ("max" and unreadable files: false).
bool file_number(const char* path, size_t* out) {
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  unsigned long long v = 0;
  const bool ok = std::fscanf(f, "%llu", &v) == 1;
  std::fclose(f);
  if (ok) *out = static_cast<size_t>(v);
  return ok;
}

}  // namespace

std::string bytes_str(size_t bytes) {
  if (bytes == SIZE_MAX) return "over 2^64 bytes";
  char buf[64];
  std::snprintf(buf, sizeof buf, " bytes (%.1f MiB)", static_cast<double>(bytes) / (1 << 20));
  return std::to_string(bytes) + buf;
}

size_t host_available_bytes() {
  size_t avail = SIZE_MAX, mem = 0, swap = 0;
  if (meminfo_bytes("MemAvailable", &mem)) avail = mem + (meminfo_bytes("SwapFree", &swap) ? swap : 0);
  size_t limit = 0, used = 0;
  if (file_number("/sys/fs/cgroup/memory.max", &limit) && file_number("/sys/fs/cgroup/memory.current", &used))
    avail = std::min(avail, limit > used ? limit - used : size_t(0));
  return avail;
}

void* host_alloc(size_t bytes, size_t align) {
  if (bytes >= kHostMapBytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }
  return std::aligned_alloc(align, (bytes + align - 1) / align * align);
}

void host_free(void* p, size_t bytes) {
  if (!p) return;
  if (bytes >= kHostMapBytes) ::munmap(p, bytes);
  else std::free(p);
}

void check_host_fits(size_t bytes, const std::string& what, const std::string& fix) {
  if (bytes < kHostCheckBytes) return;
  const size_t avail = host_available_bytes();
  if (bytes > avail)
    EXL2_FAIL(OutOfMemory, what, " needs ", bytes_str(bytes), " but only ", bytes_str(avail),
              " of host memory are available", fix);
}

}  // namespace exl2
