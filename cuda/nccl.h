// NCCL, loaded at run time: libnccl.so.2 is dlopen'ed on first use (no NCCL headers or link at build time) and
// one communicator per GPU is made in this process with ncclCommInitAll, so one host thread drives all GPUs of a
// tensor-parallel model through group calls. Host-only types, so cpp/model/ includes it without CUDA headers.
//
// Library search, first hit wins: the path given to set_nccl_library (the Python package passes the
// nvidia-nccl-cu13 wheel's nvidia/nccl/lib/libnccl.so.2 when it finds one), $NCCL_LIBRARY, then
// dlopen("libnccl.so.2") through the loader's path (LD_LIBRARY_PATH, ldconfig). A miss raises Unsupported naming
// every place tried and how to fix it. Before the first communicator, NCCL_NVLS_ENABLE=0 is put into the process
// environment unless already set (NVLink multicast stays off; nothing here calls cuMulticastCreate).
#pragma once

#include <cstddef>
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

 private:
  std::vector<int> devices_;
  std::vector<void*> comms_;  // ncclComm_t per rank
};

}  // namespace exl2::cuda
