// cuda/exl2_gemm.h: the fused EXL2 dequantize+GEMV kernel (few rows), the dequantize kernel and cuBLAS GEMM for
// many rows, the unit table, and the per-device accumulator the GEMV shares between launches.
//
// Thread layout (both kernels): a block has 128 threads; thread t of column tile b owns the 4 adjacent columns
// col = 4*(128*b + t) .. col+3 and reads their words of one q_weight row with one 16-byte load (a warp reads 512
// contiguous bytes of the row). Work along k is cut into units (32 packed rows of one group); decoding is in
// cuda/exl2_decode.cuh.
#include <algorithm>
#include <mutex>
#include <utility>

#include "cuda/common.cuh"
#include "cuda/exl2_decode.cuh"
#include "cuda/exl2_gemm.h"
#include "cuda/exl2_gemv_kernel.cuh"
#include "cuda/graph_exec.h"

namespace exl2::cuda {

namespace {

using namespace exl2k;

constexpr int kThreads = kGemvThreads;              // threads per block (both kernels)
constexpr int kColsPerBlock = kThreads * 4;         // 4 columns per thread
constexpr int kMaxM = 16;                           // rows of x per GEMV launch
constexpr int kSmemBytes = 32 * 1024;               // GEMV: staged x slice per block at most
constexpr int kBlocksPerSm = 8;                     // GEMV: at most this many blocks per SM (k split)
constexpr int64_t kMaxDqElems = int64_t(64) << 20;  // dequant path: W chunk at most this many elements
constexpr int kMaxDevices = 64;

// ---- dequantize + cuBLAS ---------------------------------------------------------------------------------------

// grid (column tiles of the chunk, units). wp [in, ldw]: W in PACKED row order, columns c0 .. c0+width.
template <typename TW>
__global__ void __launch_bounds__(kThreads)
    exl2_dequant_kernel(const uint32_t* __restrict__ q_weight, const uint32_t* __restrict__ q_scale,
                        const __half* __restrict__ msc, const int4* __restrict__ units, int64_t out_pad, int64_t c0,
                        int64_t width, TW* __restrict__ wp) {
  const int64_t lc = (int64_t(blockIdx.x) * kThreads + threadIdx.x) * 4;  // column inside the chunk
  if (lc >= width) return;
  const int64_t col = c0 + lc;
  const UnitInfo U = unit_info(units, blockIdx.y);
  UnitData D;
  load_unit(U, q_weight, q_scale, msc, out_pad, col, D);
  DequantStore<TW> st{wp + int64_t(U.row) * width + lc, width, U.nvals};
  decode_unit_any(U.bits, D, st);
}

// xp[r, k] = x[r, perm[k]]: the input in packed row order.
template <typename T>
__global__ void gather_cols_kernel(const T* __restrict__ x, const int32_t* __restrict__ perm, T* __restrict__ xp,
                                   int64_t n, int64_t in) {
  const int64_t total = n * in;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / in, k = e % in;
    xp[e] = x[r * in + perm[k]];
  }
}

template <typename T>
__global__ void fill_bias_rows_kernel(const float* __restrict__ bias, T* __restrict__ y, int64_t n, int64_t out) {
  const int64_t total = n * out;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x)
    y[e] = from_f32<T>(bias[e % out]);
}

// ---- per-device GEMV accumulator ------------------------------------------------------------------------------

struct GemvState {
  float* acc = nullptr;  // [kMaxM, cap_out_pad] fp32, all zero between launches
  int64_t acc_floats = 0;
  unsigned* counters = nullptr;  // [cap_tiles], all zero between launches
  int64_t n_counters = 0;
};

std::mutex g_state_mutex;
GemvState g_state[kMaxDevices];

GemvState& gemv_state(int device, int64_t acc_floats, int64_t n_counters, cudaStream_t stream) {
  EXL2_CHECK_KIND(Cuda, device >= 0 && device < kMaxDevices, "CUDA device index ", device, " out of range");
  std::lock_guard<std::mutex> lock(g_state_mutex);
  GemvState& s = g_state[device];
  if (acc_floats > s.acc_floats || n_counters > s.n_counters) {
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    EXL2_CUDA_CHECK(cudaStreamIsCapturing(stream, &cap));
    EXL2_CHECK_KIND(Cuda, cap == cudaStreamCaptureStatusNone, "EXL2 GEMV on cuda:", device,
                    " needs a larger accumulator (", acc_floats,
                    " floats) while the stream is being captured into a CUDA graph; run one warm-up step with the "
                    "largest layer before capturing");
    const int64_t na = std::max(acc_floats, s.acc_floats), nc = std::max(n_counters, s.n_counters);
    if (s.acc) EXL2_CUDA_CHECK(cudaFree(s.acc));
    if (s.counters) EXL2_CUDA_CHECK(cudaFree(s.counters));
    s.acc = nullptr;
    s.counters = nullptr;
    s.acc_floats = s.n_counters = 0;
    if (cudaMalloc(&s.acc, size_t(na) * sizeof(float)) != cudaSuccess ||
        cudaMalloc(&s.counters, size_t(nc) * sizeof(unsigned)) != cudaSuccess) {
      cudaGetLastError();
      if (s.acc) cudaFree(s.acc);
      s.acc = nullptr;
      s.counters = nullptr;
      EXL2_FAIL(OutOfMemory, "EXL2 GEMV accumulator of ", na * 4 + nc * 4,
                " bytes could not be allocated on cuda:", device);
    }
    EXL2_CUDA_CHECK(cudaMemsetAsync(s.acc, 0, size_t(na) * sizeof(float), stream));
    EXL2_CUDA_CHECK(cudaMemsetAsync(s.counters, 0, size_t(nc) * sizeof(unsigned), stream));
    EXL2_CUDA_CHECK(cudaStreamSynchronize(stream));
    s.acc_floats = na;
    s.n_counters = nc;
    note_device_malloc();
    note_device_malloc();
    bump_scratch_generation();  // CUDA graphs captured with the old accumulator get recaptured
  }
  return s;
}

int g_threshold_override = -1;

// ---- launchers ---------------------------------------------------------------------------------------------------

template <int M>
void launch_gemv(const __half* x, int m, const Exl2DeviceWeights& w, __half* y, GemvState& st, cudaStream_t stream) {
  const int64_t col_tiles = ceil_div(w.out_pad, kColsPerBlock);
  const int n_units = static_cast<int>(w.n_units);
  const int max_ups = std::max(1, kSmemBytes / (32 * M * int(sizeof(float))));
  // Resident blocks per SM as registers allow (cached per device), at most kBlocksPerSm: one wave.
  static int resident[kMaxDevices] = {};
  int dev = 0;
  EXL2_CUDA_CHECK(cudaGetDevice(&dev));
  if (resident[dev] == 0) {
    int b = 0;
    EXL2_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, exl2_gemv_kernel<M>, kThreads, kSmemBytes / 4));
    resident[dev] = std::max(1, std::min(b, kBlocksPerSm));
  }
  const int64_t target = int64_t(sm_count()) * resident[dev];
  int64_t slices = std::min<int64_t>(std::max<int64_t>(1, ceil_div(target, col_tiles)), n_units);
  int ups = static_cast<int>(ceil_div(n_units, slices));
  ups = std::min(ups, max_ups);
  slices = ceil_div(n_units, ups);
  EXL2_CHECK_KIND(Cuda, col_tiles <= INT_MAX && slices <= 65535, "EXL2 GEMV grid too large: ", col_tiles, " x ",
                  slices);
  const size_t smem = size_t(ups) * 32 * M * sizeof(float);
  dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(slices));
  exl2_gemv_kernel<M><<<grid, kThreads, smem, stream>>>(
      x, w.in, m, w.q_weight.data_as<uint32_t>(), w.q_scale.data_as<uint32_t>(), w.msc.data_as<__half>(),
      w.q_perm.data_as<int32_t>(), w.units.data_as<int4>(), n_units, ups,
      w.bias.defined() ? w.bias.data_as<float>() : nullptr, y, w.out, w.out_pad, st.acc, st.counters);
  EXL2_CUDA_LAUNCH_CHECK("exl2_gemv_kernel");
}

void gemv(const Tensor& x, const Exl2DeviceWeights& w, Tensor& y, int64_t n, cudaStream_t stream) {
  GemvState& st = gemv_state(w.device.index, int64_t(kMaxM) * w.out_pad, ceil_div(w.out_pad, kColsPerBlock), stream);
  const __half* xp = x.data_as<__half>();
  __half* yp = y.data_as<__half>();
  for (int64_t r0 = 0; r0 < n; r0 += kMaxM) {
    const int m = static_cast<int>(std::min<int64_t>(kMaxM, n - r0));
    const __half* xr = xp + r0 * w.in;
    __half* yr = yp + r0 * w.out;
    if (m == 1)
      launch_gemv<1>(xr, m, w, yr, st, stream);
    else if (m == 2)
      launch_gemv<2>(xr, m, w, yr, st, stream);
    else if (m <= 4)
      launch_gemv<4>(xr, m, w, yr, st, stream);
    else if (m <= 8)
      launch_gemv<8>(xr, m, w, yr, st, stream);
    else
      launch_gemv<16>(xr, m, w, yr, st, stream);
  }
}

template <typename T>
void dequant_gemm(const Tensor& x, const Exl2DeviceWeights& w, Tensor& y, int64_t n, cudaStream_t stream) {
  const int64_t in = w.in, out = w.out, out_pad = w.out_pad;
  EXL2_CHECK_KIND(Unsupported, n <= INT_MAX && in <= INT_MAX && out <= INT_MAX,
                  "EXL2 GEMM: sizes beyond cuBLAS int range (n=", n, ", in=", in, ", out=", out, ")");
  const int64_t chunk = std::min(out_pad, std::max<int64_t>(32, kMaxDqElems / in / 32 * 32));
  const size_t xp_bytes = (size_t(n * in) * sizeof(T) + 255) / 256 * 256;
  const size_t wp_bytes = size_t(in * chunk) * sizeof(T);
  char* ws = static_cast<char*>(workspace(xp_bytes + wp_bytes));
  T* xp = reinterpret_cast<T*>(ws);
  T* wp = reinterpret_cast<T*>(ws + xp_bytes);
  const T* xs = x.data_as<T>();
  T* ys = y.data_as<T>();

  gather_cols_kernel<T>
      <<<elementwise_blocks(n * in, 256), 256, 0, stream>>>(xs, w.q_perm.data_as<int32_t>(), xp, n, in);
  EXL2_CUDA_LAUNCH_CHECK("gather_cols_kernel");
  float beta = 0.f;
  if (w.bias.defined()) {
    fill_bias_rows_kernel<T><<<elementwise_blocks(n * out, 256), 256, 0, stream>>>(w.bias.data_as<float>(), ys, n, out);
    EXL2_CUDA_LAUNCH_CHECK("fill_bias_rows_kernel");
    beta = 1.f;
  }
  const float alpha = 1.f;
  const cudaDataType_t t = std::is_same<T, __half>::value ? CUDA_R_16F : CUDA_R_32F;
  for (int64_t c0 = 0; c0 < out; c0 += chunk) {
    const int64_t width = std::min(chunk, out_pad - c0);  // multiple of 32
    const int64_t nc = std::min(out, c0 + width) - c0;
    dim3 grid(static_cast<unsigned>(ceil_div(width, kColsPerBlock)), static_cast<unsigned>(w.n_units));
    exl2_dequant_kernel<T><<<grid, kThreads, 0, stream>>>(w.q_weight.data_as<uint32_t>(), w.q_scale.data_as<uint32_t>(),
                                                          w.msc.data_as<__half>(), w.units.data_as<int4>(), out_pad, c0,
                                                          width, wp);
    EXL2_CUDA_LAUNCH_CHECK("exl2_dequant_kernel");
    // Row-major y[n, out] is column-major y^T [out, n]; its rows c0.. = Wp^T (col-major [width, in]) @ xp^T.
    EXL2_CUBLAS_CHECK(cublasGemmEx(cublas_handle(), CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(nc), static_cast<int>(n),
                                   static_cast<int>(in), &alpha, wp, t, static_cast<int>(width), xp, t,
                                   static_cast<int>(in), &beta, ys + c0, t, static_cast<int>(out), CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT));
    if (sync_check_enabled()) EXL2_CUDA_LAUNCH_CHECK("cublasGemmEx (exl2)");
  }
}

}  // namespace

std::vector<int32_t> exl2_unit_table(const quant::Exl2Layout& layout) {
  std::vector<int32_t> t;
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    const quant::Exl2Group& gr = layout.groups[g];
    for (int64_t r = 0; r < gr.rows; r += 32) {
      const int64_t nvals = std::min<int64_t>(32, gr.rows - r);
      const int64_t nwords = (nvals * gr.bits + 31) / 32;
      const int64_t qrow = gr.qrow_start + (r / 32) * gr.bits;
      EXL2_CHECK(qrow + nwords <= gr.qrow_start + gr.qrows && gr.row_start + r <= INT_MAX && qrow <= INT_MAX,
                 "EXL2 unit table: group ", g, " rows ", r, ".. do not fit its q_weight rows");
      t.push_back(static_cast<int32_t>(qrow));
      t.push_back(static_cast<int32_t>(gr.row_start + r));
      t.push_back(static_cast<int32_t>(g));
      t.push_back(static_cast<int32_t>(gr.bits | (nvals << 8) | (nwords << 16)));
    }
  }
  return t;
}

Exl2DeviceWeights exl2_upload(const quant::Exl2Layout& layout, const Tensor& q_weight, const Tensor& q_scale,
                              const std::vector<uint16_t>& msc, const Tensor& bias_f32, Device device) {
  EXL2_CHECK(device.is_cuda(), "exl2_upload: a CUDA device expected, got ", device.str());
  EXL2_CHECK(msc.size() == layout.groups.size(), "exl2_upload: msc has ", msc.size(), " entries for ",
             layout.groups.size(), " groups");
  Exl2DeviceWeights w;
  w.device = device;
  w.in = layout.in;
  w.out = layout.out;
  w.out_pad = layout.out_pad;
  w.n_groups = static_cast<int64_t>(layout.groups.size());
  w.q_weight = q_weight.to(device);
  w.q_scale = q_scale.to(device);
  w.msc = Tensor::from_vector(msc, DType::F16).to(device);
  w.q_perm = Tensor::from_vector(layout.perm, DType::I32).to(device);
  const std::vector<int32_t> units = exl2_unit_table(layout);
  w.n_units = static_cast<int64_t>(units.size() / 4);
  w.units = Tensor::from_vector(units, DType::I32).view({w.n_units, 4}).to(device);
  if (bias_f32.defined()) {
    EXL2_CHECK(bias_f32.dtype() == DType::F32 && bias_f32.numel() == layout.out, "exl2_upload: bias must be f32 [",
               layout.out, "], got ", bias_f32.describe());
    w.bias = bias_f32.to(device);
  }
  EXL2_CHECK(reinterpret_cast<uintptr_t>(w.q_weight.data()) % 16 == 0 && w.out_pad % 32 == 0,
             "exl2_upload: q_weight must be 16-byte aligned with out_pad % 32 == 0");
  return w;
}

int exl2_gemm_threshold() {
  if (g_threshold_override >= 0) return g_threshold_override;
  static const int from_env = [] {
    const char* v = std::getenv("EXL2CPP_EXL2_GEMM_THRESHOLD");
    if (!v || !*v) return 32;
    char* end = nullptr;
    const long t = std::strtol(v, &end, 10);
    EXL2_CHECK(end && *end == '\0' && t >= 0 && t <= INT_MAX,
               "EXL2CPP_EXL2_GEMM_THRESHOLD must be a row count >= 0, got '", v, "'");
    return static_cast<int>(t);
  }();
  return from_env;
}

void set_exl2_gemm_threshold(int rows) {
  g_threshold_override = rows < 0 ? -1 : rows;
}

void exl2_gemm(const Tensor& x, const Exl2DeviceWeights& w, Tensor& y) {
  EXL2_CHECK(x.defined() && y.defined(), "exl2_gemm: x and y must be defined");
  EXL2_CHECK(x.device() == w.device && y.device() == w.device, "exl2_gemm: x (", x.describe(), ") and y (",
             y.describe(), ") must be on the layer's device ", w.device.str());
  EXL2_CHECK(x.dtype() == DType::F16 || x.dtype() == DType::F32, "exl2_gemm: x must be f16 or f32, got ", x.describe());
  EXL2_CHECK(y.dtype() == x.dtype(), "exl2_gemm: y must have x's dtype, got x ", x.describe(), ", y ", y.describe());
  EXL2_CHECK(x.dim() >= 1 && x.size(-1) == w.in, "exl2_gemm: x's last dim must be in_features = ", w.in, ", got ",
             x.describe());
  const int64_t n = x.numel() / w.in;
  EXL2_CHECK(y.dim() == x.dim() && y.size(-1) == w.out && y.numel() == n * w.out, "exl2_gemm: y must be [..., ", w.out,
             "] with x's leading dims, got x ", x.describe(), ", y ", y.describe());
  {
    const char* xb = static_cast<const char*>(x.data());
    const char* yb = static_cast<const char*>(y.data());
    EXL2_CHECK(yb + y.nbytes() <= xb || xb + x.nbytes() <= yb, "exl2_gemm: y must not overlap x");
  }
  if (n == 0) return;
  DeviceGuard guard(w.device.index);
  cudaStream_t stream = current_stream();
  if (x.dtype() == DType::F16 && n <= exl2_gemm_threshold() && !ref_kernels_enabled()) {
    gemv(x, w, y, n, stream);
  } else if (x.dtype() == DType::F16) {
    dequant_gemm<__half>(x, w, y, n, stream);
  } else {
    dequant_gemm<float>(x, w, y, n, stream);
  }
}

double time_on_stream_seconds(Device device, const std::function<void()>& f, int iters) {
  EXL2_CHECK(device.is_cuda() && iters > 0, "time_on_stream_seconds: a CUDA device and iters > 0 expected");
  DeviceGuard guard(device.index);
  cudaStream_t s = current_stream();
  for (int i = 0; i < 3; ++i) f();
  cudaEvent_t a, b;
  EXL2_CUDA_CHECK(cudaEventCreate(&a));
  EXL2_CUDA_CHECK(cudaEventCreate(&b));
  EXL2_CUDA_CHECK(cudaEventRecord(a, s));
  for (int i = 0; i < iters; ++i) f();
  EXL2_CUDA_CHECK(cudaEventRecord(b, s));
  EXL2_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0.f;
  EXL2_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return double(ms) * 1e-3 / iters;
}

}  // namespace exl2::cuda
