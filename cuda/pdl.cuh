// Programmatic dependent launch (PDL) for the kernels of a model step: the device-side griddepcontrol helpers and
// the host launch helper that marks a launch as a programmatic dependent of the previous kernel in its stream.
//
// What PDL is (sm_90+): a kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization may be scheduled
// before the kernel ahead of it in the stream has finished, so that its launch latency and prologue overlap the
// predecessor's tail (between the small kernels of a decode step that is most of their cost). Two PTX instructions:
//   griddepcontrol.wait              (pdl_wait) blocks until every prerequisite grid has COMPLETED and its memory
//                                    operations are flushed and visible; a no-op when not launched as a dependent.
//   griddepcontrol.launch_dependents (pdl_launch_dependents) lets the next dependent grid be scheduled once every
//                                    block of this grid has executed it (or exited); only a scheduling hint: the
//                                    dependent still waits for this grid's completion in its own pdl_wait.
// Below sm_90 both compile to nothing and the host never sets the attribute (cuda/pdl.h pdl_enabled()).
//
// CONTRACT of every kernel launched through EXL2_CUDA_LAUNCH_PDL (the rule that keeps PDL correct):
//   1. Every block executes pdl_wait() before it reads or writes any memory that an earlier operation of the stream
//      writes or reads (activations, KV cache, metadata, accumulators, counters, workspace), and before it exits,
//      including every early-return path. Only loads of data that no kernel of the step writes (weights, constant
//      tables) may come before it. Simplest: pdl_wait() as the kernel's first statement.
//      Why before exiting too: a grid that completes without waiting could complete before its predecessor, and
//      the next dependent's pdl_wait (which waits only for its immediate predecessor) would no longer imply that
//      everything earlier has finished; with the wait in every block, completion is transitive down the stream.
//   2. pdl_launch_dependents() is optional; where used it sits after the kernel's main loop, outside conditionals
//      (every thread of the block reaches it or exits), never before pdl_wait().
//   3. Kernels launched normally (<<<>>>, cuBLAS, NCCL) and memset/memcpy in between are fine: a normal launch waits
//      for full completion of what precedes it, and a dependent's pdl_wait waits for whatever precedes it.
// Results do not change with PDL (same kernels, same order, same arithmetic), which tests/test_cuda_graphs.py
// checks bit for bit. Capturable into CUDA graphs (programmatic edges, CUDA 12.3+).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuda/check.h"
#include "cuda/pdl.h"

namespace exl2::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...) through cudaLaunchKernelEx, as a programmatic dependent when `pdl`
// (the caller's pdl_enabled() and any switch of its own); launch errors and option sync_check as
// EXL2_CUDA_LAUNCH_CHECK. Arguments convert to the kernel's parameter types as with <<<>>>, but default arguments of
// the kernel do not apply: pass them all.
// cluster_x > 1 also launches the grid as thread-block clusters of cluster_x blocks along x (sm_90; grid.x must be
// a multiple of it).
template <typename... KArgs, typename... Args>
void launch_kernel_cluster_pdl_if(bool pdl, unsigned cluster_x, const char* file, int line, const char* name,
                                  void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                  Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_x > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster_x;
    attr[n].val.clusterDim.y = 1;
    attr[n++].val.clusterDim.z = 1;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) fail_cuda(err, file, line, name);
  after_launch(file, line, name);
}

template <typename... KArgs, typename... Args>
void launch_kernel_pdl_if(bool pdl, const char* file, int line, const char* name, void (*kernel)(KArgs...),
                          dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  launch_kernel_cluster_pdl_if(pdl, 1u, file, line, name, kernel, grid, block, smem, stream,
                               std::forward<Args>(args)...);
}

// launch_kernel_pdl_if(pdl_enabled(), ...): what EXL2_CUDA_LAUNCH_PDL calls.
template <typename... KArgs, typename... Args>
void launch_kernel(const char* file, int line, const char* name, void (*kernel)(KArgs...), dim3 grid, dim3 block,
                   size_t smem, cudaStream_t stream, Args&&... args) {
  launch_kernel_pdl_if(pdl_enabled(), file, line, name, kernel, grid, block, smem, stream,
                       std::forward<Args>(args)...);
}

}  // namespace exl2::cuda

// EXL2_CUDA_LAUNCH_PDL("add_kernel", add_kernel<TA>, grid, block, smem, stream, args...): the kernel must follow
// the contract above (pdl_wait() in every block before touching stream data or exiting).
#define EXL2_CUDA_LAUNCH_PDL(name, ...) ::exl2::cuda::launch_kernel(__FILE__, __LINE__, name, __VA_ARGS__)
