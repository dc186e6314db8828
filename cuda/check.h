// Error checks for the CUDA backend: every CUDA runtime / cuBLAS call and every kernel launch goes through these
// macros, which throw exl2::Error(Cuda, "file:line: ...") instead of aborting.
// Option sync_check (exl2/options.h) makes every launch check synchronize the current stream, pinning async faults
// to an op.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "exl2/errors.h"

namespace exl2::cuda {

[[noreturn]] void fail_cuda(cudaError_t err, const char* file, int line, const char* what);
[[noreturn]] void fail_cublas(cublasStatus_t st, const char* file, int line, const char* what);
// cudaGetLastError after a launch; with option sync_check also synchronizes the current stream (skipped
// while the stream is being captured into a graph) and checks again.
void after_launch(const char* file, int line, const char* kernel);
bool sync_check_enabled();  // option sync_check
bool ref_kernels_enabled(); // option cuda_reference: the simple reference kernels (bisecting fast paths)

}  // namespace exl2::cuda

#define EXL2_CUDA_CHECK(call)                                                                    \
  do {                                                                                           \
    cudaError_t exl2_err_ = (call);                                                              \
    if (exl2_err_ != cudaSuccess) ::exl2::cuda::fail_cuda(exl2_err_, __FILE__, __LINE__, #call); \
  } while (0)

#define EXL2_CUBLAS_CHECK(call)                                                                                \
  do {                                                                                                         \
    cublasStatus_t exl2_st_ = (call);                                                                          \
    if (exl2_st_ != CUBLAS_STATUS_SUCCESS) ::exl2::cuda::fail_cublas(exl2_st_, __FILE__, __LINE__, #call); \
  } while (0)

// After every <<<...>>>: EXL2_CUDA_LAUNCH_CHECK("rms_norm_kernel");
#define EXL2_CUDA_LAUNCH_CHECK(name) ::exl2::cuda::after_launch(__FILE__, __LINE__, name)
