// Device memory and copies behind Tensor: CPU via aligned malloc, CUDA via the CUDA backend
// (cuda/device.cu) when compiled, else stubs that raise UnsupportedError (cpp/core/device_stub.cpp).
#pragma once

#include <cstddef>
#include <string>

#include "exl2/tensor.h"

namespace exl2::device {

bool cuda_compiled();              // the library was built with the CUDA backend
std::string cuda_missing_reason();  // why not (recorded at configure time); "" when it was
// Unsupported naming `what`, why this build has no CUDA backend and how to rebuild; returns on a CUDA build.
void require_cuda_backend(const std::string& what);
int cuda_device_count();           // 0 when not compiled or no driver/GPU
std::string cuda_device_name(int index);
void cuda_mem_info(int index, size_t* free_bytes, size_t* total_bytes);
void* cuda_malloc(size_t nbytes, int index);  // OutOfMemory with the numbers on failure
void cuda_free(void* ptr, int index);
void cuda_synchronize(int index);
// Any direction between host and device(s); synchronous with respect to the host.
void copy(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes);
void memset_zero(void* dst, Device device, size_t nbytes);

}  // namespace exl2::device
