// NCCL, loaded at run time: libnccl.so.2 is dlopen'ed on first use (no NCCL headers or link at build time) and
// one communicator per GPU is made in this process with ncclCommInitAll, so one host thread drives all GPUs of a
// tensor-parallel model through group calls (or one thread per GPU, all_gather_rank; abort() for a failed rank).
// Host-only types, so cpp/model/ includes it without CUDA headers.
//
// Library search, first hit wins: the path given to set_nccl_library (the Python package passes the
// nvidia-nccl-cu13 wheel's nvidia/nccl/lib/libnccl.so.2 when it finds one), $NCCL_LIBRARY, then
// dlopen("libnccl.so.2") through the loader's path (LD_LIBRARY_PATH, ldconfig). A miss raises Unsupported naming
// every place tried and how to fix it. Before the first communicator, NCCL_NVLS_ENABLE=0 is put into the process
// environment unless already set (NVLink multicast stays off; nothing here calls cuMulticastCreate).
#pragma once

#include <atomic>
#include <cstddef>
#include <shared_mutex>
#include <string>
#include <vector>

#include "exl2/tensor.h"

namespace exl2::cuda {

// Where to look first for libnccl.so.2 (empty: no preference). Takes effect only before the first load.
void set_nccl_library(const std::string& path);
// Loads the library if needed; the loaded file's path and NCCL's version as "2.32.3 (/path/libnccl.so.2)".
// Unsupported when no library can be loaded.
std::string nccl_describe();

// One NCCL communicator per GPU of `devices` (distinct CUDA indices, rank r = devices[r]), all in this process.
class NcclGroup {
 public:
  explicit NcclGroup(const std::vector<int>& devices);
  ~NcclGroup();
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int size() const { return static_cast<int>(devices_.size()); }
  // One all-gather over every rank, in one NCCL group: rank r's `count` elements at send[r] land at
  // recv[j] + r * count on every rank j (recv[j] holds size() * count elements). Enqueued on each rank's current
  // stream (cuda/stream.h); the host does not wait. dtype: F16, BF16, F32 or I32. send[r] may be
  // recv[r] + r * count (in place).
  void all_gather(const std::vector<const void*>& send, const std::vector<void*>& recv, size_t count, DType dtype);
  // Rank `rank`'s part of an all-gather (the same contract), called from that rank's own host thread (NCCL's
  // thread-per-GPU model; no group): every rank must make the matching call, on its own thread.
  void all_gather_rank(int rank, const void* send, void* recv, size_t count, DType dtype);
  // One sum all-reduce over every rank, in one NCCL group (recv[r] may be send[r]).
  void all_reduce_sum(const std::vector<const void*>& send, const std::vector<void*>& recv, size_t count, DType dtype);

  // After a failure on one rank's thread: ncclCommAbort on every communicator, which makes NCCL kernels still
  // waiting on the device for a rank that will never call give up, so streams drain and host syncs return.
  // Callable from any thread, also while other threads make NCCL calls (those in flight finish first, at most a
  // few seconds; later calls raise Internal "another rank failed"). Idempotent; never throws.
  void abort() noexcept;
  bool aborted() const { return aborted_.load(); }
  // After abort(): wait for every device, then make new communicators (ncclCommInitAll). One thread, no NCCL
  // call in flight. No-op when not aborted.
  void reinit();

 private:
  void check_not_aborted() const;  // Internal "another rank failed" after abort()
  std::vector<int> devices_;
  std::vector<void*> comms_;  // ncclComm_t per rank; nullptr once aborted
  std::atomic<bool> aborted_{false};
  std::shared_timed_mutex calls_;  // shared: an NCCL call in flight; exclusive: abort()
};

}  // namespace exl2::cuda
