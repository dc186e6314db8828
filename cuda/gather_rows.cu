// cuda::gather_rows: out[i] = x[idx[i]], one block per output row, 16-byte copies when rows allow; idx is read
// on the device (clamped to [0, rows)), so the gather can sit inside a CUDA graph with idx changing per replay.
#include "backend/kernels.h"
#include "cuda/common.cuh"
#include "cuda/pdl.cuh"

namespace exl2::cuda {

namespace {

template <typename T>
__global__ void gather_rows_kernel(const T* __restrict__ x, const int32_t* __restrict__ idx, int64_t rows,
                                   int64_t row_elems, T* __restrict__ out) {
  pdl_wait();  // cuda/pdl.cuh
  const int64_t i = blockIdx.x;
  int64_t r = idx[i];
  r = r < 0 ? 0 : (r >= rows ? rows - 1 : r);
  const T* src = x + r * row_elems;
  T* dst = out + i * row_elems;
  for (int64_t e = threadIdx.x; e < row_elems; e += blockDim.x) dst[e] = src[e];
}

template <typename T>
void launch(const void* x, const int32_t* idx, int64_t m, int64_t rows, int64_t row_bytes, void* out) {
  const int64_t elems = row_bytes / static_cast<int64_t>(sizeof(T));
  const int threads = elems >= 256 ? 256 : 64;
  EXL2_CUDA_LAUNCH_PDL("gather_rows_kernel", gather_rows_kernel<T>, static_cast<unsigned>(m), threads, 0,
                       current_stream(), static_cast<const T*>(x), idx, rows, elems, static_cast<T*>(out));
}

}  // namespace

void gather_rows(const void* x, const int32_t* idx, int64_t m, int64_t rows, int64_t row_bytes, void* out) {
  if (m == 0 || row_bytes == 0) return;
  EXL2_CHECK_KIND(Unsupported, m <= 0x7fffffff, "CUDA gather_rows: at most 2^31-1 rows, got ", m);
  const uintptr_t bits =
      reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(out) | static_cast<uintptr_t>(row_bytes);
  if (bits % 16 == 0)
    launch<uint4>(x, idx, m, rows, row_bytes, out);
  else if (bits % 4 == 0)
    launch<uint32_t>(x, idx, m, rows, row_bytes, out);
  else
    launch<uint16_t>(x, idx, m, rows, row_bytes, out);
}

}  // namespace exl2::cuda
