// The CUDA implementation of core/device_api.h: device queries, allocation (OutOfMemory with the numbers),
// copies in any direction (stream-ordered on the current stream, then synchronized) and memset.
#include <cstring>

#include "core/device_api.h"
#include "cuda/check.h"
#include "cuda/graph_exec.h"
#include "cuda/stream.h"

namespace exl2::device {

namespace {

void check_index(int index) {
  int n = cuda_device_count();
  EXL2_CHECK(index >= 0 && index < n, "CUDA device index in [0, ", n, ") expected, got ", index,
             n == 0 ? " (no CUDA device visible: check the driver and CUDA_VISIBLE_DEVICES)" : "");
}

}  // namespace

bool cuda_compiled() { return true; }
std::string cuda_missing_reason() { return {}; }
void require_cuda_backend(const std::string&) {}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver / no GPU: report zero devices, not an error
    return 0;
  }
  return n;
}

std::string cuda_device_name(int index) {
  check_index(index);
  cudaDeviceProp prop{};
  EXL2_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  return prop.name;
}

void cuda_mem_info(int index, size_t* free_bytes, size_t* total_bytes) {
  check_index(index);
  cuda::DeviceGuard guard(index);
  EXL2_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
}

void* cuda_malloc(size_t nbytes, int index) {
  check_index(index);
  if (nbytes == 0) return nullptr;
  cuda::DeviceGuard guard(index);
  void* p = nullptr;
  cuda::note_device_malloc();
  cudaError_t err = cudaMalloc(&p, nbytes);
  if (err != cudaSuccess) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    if (err == cudaErrorMemoryAllocation) {
      EXL2_FAIL(OutOfMemory, "CUDA out of memory on cuda:", index, ": requested ", nbytes, " bytes (",
                nbytes / double(1 << 20), " MiB), free ", free_b, " bytes (", free_b / double(1 << 20),
                " MiB) of ", total_b, " bytes total; use a smaller model, fewer bits, a shorter cache or a "
                "smaller batch");
    }
    cuda::fail_cuda(err, __FILE__, __LINE__, "cudaMalloc");
  }
  return p;
}

void cuda_free(void* ptr, int index) {
  // Called from deleters: never throws. cudaFree synchronizes the device, so pending kernels finish first; on a
  // tensor-parallel rank thread the free is deferred (cuda/stream.h DeferFrees).
  cuda::free_device(ptr, index);
}

void cuda_synchronize(int index) {
  check_index(index);
  cuda::DeviceGuard guard(index);
  EXL2_CUDA_CHECK(cudaStreamSynchronize(cuda::current_stream(index)));
  EXL2_CUDA_CHECK(cudaDeviceSynchronize());
}

void copy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes) {
  if (nbytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, nbytes);
    return;
  }
  // Our kernels run on a non-blocking stream, so the copy must be ordered on that stream (a plain cudaMemcpy
  // on the legacy stream would not wait for them). The device whose stream orders the copy: the CUDA side
  // (the source for device-to-device, so the data is complete before it moves).
  int dev = src_device.is_cuda() ? src_device.index : dst_device.index;
  cuda::DeviceGuard guard(dev);
  cudaStream_t s = cuda::current_stream(dev);
  if (dst_device.is_cuda() && src_device.is_cuda() && dst_device.index != src_device.index) {
    // Also wait for the destination device's pending work on that memory.
    EXL2_CUDA_CHECK(cudaStreamSynchronize(cuda::current_stream(dst_device.index)));
    EXL2_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_device.index, src, src_device.index, nbytes, s));
  } else {
    EXL2_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, s));
  }
  EXL2_CUDA_CHECK(cudaStreamSynchronize(s));
}

void memset_zero(void* dst, Device device, size_t nbytes) {
  if (nbytes == 0) return;
  if (device.is_cpu()) {
    std::memset(dst, 0, nbytes);
    return;
  }
  cuda::DeviceGuard guard(device.index);
  EXL2_CUDA_CHECK(cudaMemsetAsync(dst, 0, nbytes, cuda::current_stream(device.index)));
}

}  // namespace exl2::device
