// CUDA graph capture/replay, pinned staging, async copies and the counters declared in cuda/graph_exec.h.
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "cuda/check.h"
#include "cuda/graph_exec.h"
#include "cuda/stream.h"
#include "exl2/options.h"

namespace exl2::cuda {

namespace {

std::atomic<int64_t> g_mallocs{0};
std::atomic<uint64_t> g_generation{1};
std::atomic<int64_t> g_captures{0}, g_launches{0}, g_capture_failures{0};

}  // namespace

int64_t device_malloc_count() {
  return g_mallocs.load();
}
void note_device_malloc() {
  g_mallocs.fetch_add(1);
}
uint64_t scratch_generation() {
  return g_generation.load();
}
void bump_scratch_generation() {
  g_generation.fetch_add(1);
}

GraphStats graph_stats() {
  GraphStats s;
  s.captures = g_captures.load();
  s.launches = g_launches.load();
  s.capture_failures = g_capture_failures.load();
  return s;
}

void note_capture_failure() {
  g_capture_failures.fetch_add(1);
}

bool graphs_enabled() { return runtime_options().cuda_graphs; }

void* pinned_alloc(size_t bytes, int device) {
  DeviceGuard guard(device);
  void* p = nullptr;
  cudaError_t err = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault);
  if (err != cudaSuccess) {
    cudaGetLastError();
    EXL2_FAIL(OutOfMemory, "could not allocate ", bytes, " bytes of page-locked host memory for cuda:", device, " (",
              cudaGetErrorString(err), "); free host memory or use a smaller batch");
  }
  return p;
}

void pinned_free(void* ptr) {
  if (!ptr) return;
  cudaFreeHost(ptr);
  cudaGetLastError();
}

void copy_to_device_async(void* dst, const void* src, size_t bytes, int device) {
  if (bytes == 0) return;
  DeviceGuard guard(device);
  EXL2_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, current_stream(device)));
}

void copy_to_host_async(void* dst, const void* src, size_t bytes, int device) {
  if (bytes == 0) return;
  DeviceGuard guard(device);
  EXL2_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, current_stream(device)));
}

void synchronize_stream(int device) {
  DeviceGuard guard(device);
  EXL2_CUDA_CHECK(cudaStreamSynchronize(current_stream(device)));
}

Graph::~Graph() {
  if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
}

void Graph::capture(int device, const std::function<void()>& body) {
  DeviceGuard guard(device);
  if (exec_) {
    cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
    exec_ = nullptr;
  }
  cudaStream_t stream = current_stream(device);
  // Thread-local mode: unsafe calls (cudaMalloc, syncs) from this thread fail the capture; other threads are
  // not affected.
  EXL2_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    body();
  } catch (...) {
    cudaGraph_t broken = nullptr;
    cudaStreamEndCapture(stream, &broken);  // ends (and discards) the capture whatever its state
    if (broken) cudaGraphDestroy(broken);
    cudaGetLastError();
    throw;
  }
  cudaGraph_t graph = nullptr;
  EXL2_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (err != cudaSuccess) fail_cuda(err, __FILE__, __LINE__, "cudaGraphInstantiate");
  exec_ = exec;
  g_captures.fetch_add(1);
}

void Graph::launch(int device) const {
  EXL2_CHECK_KIND(Internal, exec_ != nullptr, "launch of an empty CUDA graph");
  DeviceGuard guard(device);
  EXL2_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), current_stream(device)));
  g_launches.fetch_add(1);
}

}  // namespace exl2::cuda
