// CUDA graphs for the model's decode steps, and the few host-visible CUDA helpers a step needs (pinned host
// staging, async copies on the current stream, the one stream sync), behind host-only types so cpp/model/ can
// include this header without CUDA headers. Also the process-wide counters the tests read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace exl2::cuda {

// ---- counters ---------------------------------------------------------------------------------------------
// cudaMalloc calls made by exl2cpp so far (device::cuda_malloc, the scratch workspace, the cuBLAS workspace).
// A decode loop after warm-up must leave it unchanged.
int64_t device_malloc_count();
void note_device_malloc();  // call next to every cudaMalloc
// Bumped whenever a shared device scratch buffer (cuda::workspace, or any other grow-only buffer a captured
// kernel may point at) is reallocated: graphs captured under an older generation are stale and get recaptured.
uint64_t scratch_generation();
void bump_scratch_generation();

struct GraphStats {
  int64_t captures = 0;          // graphs captured and instantiated
  int64_t launches = 0;          // graph replays
  int64_t capture_failures = 0;  // captures that raised (the step then ran eagerly)
};
GraphStats graph_stats();
void note_capture_failure();

// Option cuda_graphs (exl2/options.h): false disables graph capture/replay (steps run eagerly); read on every call.
bool graphs_enabled();

// ---- host staging and copies ---------------------------------------------------------------------------------
// Page-locked host memory (cudaHostAlloc), so async copies to and from it do not stage through the driver.
void* pinned_alloc(size_t bytes, int device);  // OutOfMemory with the numbers
void pinned_free(void* ptr);                   // never throws
// Stream-ordered copies on the current stream of `device`; they return before the copy is done.
void copy_to_device_async(void* dst, const void* src, size_t bytes, int device);
void copy_to_host_async(void* dst, const void* src, size_t bytes, int device);
void synchronize_stream(int device);  // the current stream of `device`

// ---- graphs ----------------------------------------------------------------------------------------------------
// One captured sequence of kernels. capture() records body() on the current stream of `device` (nothing runs:
// kernels are recorded with the pointers and sizes body() passes them, so every buffer they use must stay where
// it is while the graph lives; values in device memory, e.g. batch metadata, may change between launches).
// body() must not allocate or synchronize. If it throws, the capture is ended and discarded, the graph stays
// empty and the error is rethrown.
class Graph {
 public:
  Graph() = default;
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  void capture(int device, const std::function<void()>& body);
  void launch(int device) const;  // on the current stream of `device`; asynchronous
  bool ready() const { return exec_ != nullptr; }

 private:
  void* exec_ = nullptr;  // cudaGraphExec_t
};

}  // namespace exl2::cuda
