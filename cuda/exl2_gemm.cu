// cuda/exl2_gemm.h: launchers for the EXL2 kernels of cuda/exl2_decode.cuh (fused dequant+GEMV for few rows,
// dequantize + cuBLAS GEMM for many rows), the load-time repack into the tiled layout, and the per-device
// accumulator the GEMV shares between launches. Layout, decoding and kernels: cuda/exl2_decode.cuh.
#include <algorithm>
#include <mutex>
#include <utility>

#include "cuda/common.cuh"
#include "cuda/exl2_decode.cuh"
#include "cuda/exl2_gemm.h"
#include "cuda/graph_exec.h"

namespace exl2::cuda {

namespace {

using namespace exl2k;

constexpr int kMaxM = 16;                           // rows of x per GEMV launch
constexpr int kBlocksPerSm = 2;                     // GEMV: target blocks per SM over the grid (k split)
constexpr int64_t kMaxDqElems = int64_t(64) << 20;  // dequant path: W chunk at most this many elements
constexpr int kMaxDevices = 64;

// xp[r, k] = x[r, perm_u[k]] (0 where perm_u[k] < 0): the input in unit-padded packed row order.
template <typename T>
__global__ void gather_cols_kernel(const T* __restrict__ x, const int32_t* __restrict__ perm_u, T* __restrict__ xp,
                                   int64_t n, int64_t in, int64_t kp) {
  const int64_t total = n * kp;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / kp, k = e % kp;
    const int32_t f = perm_u[k];
    xp[e] = f >= 0 ? x[r * in + f] : from_f32<T>(0.f);
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
  const GemvPlan p = gemv_plan(w.n_units, w.tiles, w.max_bits, M, sm_count(), kBlocksPerSm);
  static size_t attr_bytes[kMaxDevices] = {};
  int dev = 0;
  EXL2_CUDA_CHECK(cudaGetDevice(&dev));
  if (p.smem > 48 * 1024 && p.smem > attr_bytes[dev]) {
    EXL2_CUDA_CHECK(cudaFuncSetAttribute(exl2_gemv_kernel<M>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(p.smem)));
    attr_bytes[dev] = p.smem;
  }
  EXL2_CHECK_KIND(Cuda, w.tiles <= INT_MAX && p.splits <= 65535, "EXL2 GEMV grid too large: ", w.tiles, " x ",
                  p.splits);
  dim3 grid{static_cast<unsigned>(w.tiles), static_cast<unsigned>(p.splits)};
  exl2_gemv_kernel<M><<<grid, kGemvThreads, p.smem, stream>>>(
      x, w.in, m, w.q_weight.data_as<uint32_t>(), w.tile_words, reinterpret_cast<const uint16_t*>(w.q_scale.data()),
      w.tiles * 32, w.msc.data_as<__half>(), w.perm_u.data_as<int32_t>(), w.units.data_as<int4>(),
      static_cast<int>(w.n_units), p.ups, w.max_bits, w.bias.defined() ? w.bias.data_as<float>() : nullptr, y, w.out,
      st.acc, w.tiles * kTileCols, st.counters);
  EXL2_CUDA_LAUNCH_CHECK("exl2_gemv_kernel");
}

void gemv(const Tensor& x, const Exl2DeviceWeights& w, Tensor& y, int64_t n, cudaStream_t stream) {
  GemvState& st = gemv_state(w.device.index, int64_t(kMaxM) * w.tiles * kTileCols, w.tiles, stream);
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
  const int64_t in = w.in, out = w.out, kp = w.n_units * 32, width_all = w.tiles * kTileCols;
  EXL2_CHECK_KIND(Unsupported, n <= INT_MAX && kp <= INT_MAX && out <= INT_MAX,
                  "EXL2 GEMM: sizes beyond cuBLAS int range (n=", n, ", in=", in, ", out=", out, ")");
  const int64_t chunk = std::min(width_all, std::max<int64_t>(kTileCols, kMaxDqElems / kp / kTileCols * kTileCols));
  const size_t xp_bytes = (size_t(n * kp) * sizeof(T) + 255) / 256 * 256;
  const size_t wp_bytes = size_t(kp * chunk) * sizeof(T);
  char* ws = static_cast<char*>(workspace(xp_bytes + wp_bytes));
  T* xp = reinterpret_cast<T*>(ws);
  T* wp = reinterpret_cast<T*>(ws + xp_bytes);
  const T* xs = x.data_as<T>();
  T* ys = y.data_as<T>();

  gather_cols_kernel<T>
      <<<elementwise_blocks(n * kp, 256), 256, 0, stream>>>(xs, w.perm_u.data_as<int32_t>(), xp, n, in, kp);
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
    const int64_t width = std::min(chunk, width_all - c0);  // multiple of 128
    const int64_t nc = std::min(out, c0 + width) - c0;
    dim3 grid{static_cast<unsigned>(width / kTileCols), static_cast<unsigned>(ceil_div(w.n_units, 4))};
    exl2_dequant_kernel<T><<<grid, 128, 0, stream>>>(
        w.q_weight.data_as<uint32_t>(), w.tile_words, reinterpret_cast<const uint16_t*>(w.q_scale.data()), w.tiles * 32,
        w.msc.data_as<__half>(), w.units.data_as<int4>(), static_cast<int>(w.n_units), c0 / kTileCols, width, wp);
    EXL2_CUDA_LAUNCH_CHECK("exl2_dequant_kernel");
    // Row-major y[n, out] is column-major y^T [out, n]; its rows c0.. = Wp^T (col-major [width, kp]) @ xp^T.
    EXL2_CUBLAS_CHECK(cublasGemmEx(cublas_handle(), CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(nc), static_cast<int>(n),
                                   static_cast<int>(kp), &alpha, wp, t, static_cast<int>(width), xp, t,
                                   static_cast<int>(kp), &beta, ys + c0, t, static_cast<int>(out), CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT));
    if (sync_check_enabled()) EXL2_CUDA_LAUNCH_CHECK("cublasGemmEx (exl2)");
  }
}

}  // namespace

Exl2DeviceWeights exl2_upload(const quant::Exl2Layout& layout, const Tensor& q_weight, const Tensor& q_scale,
                              const std::vector<uint16_t>& msc, const Tensor& bias_f32, Device device) {
  EXL2_CHECK(device.is_cuda(), "exl2_upload: a CUDA device expected, got ", device.str());
  EXL2_CHECK(msc.size() == layout.groups.size(), "exl2_upload: msc has ", msc.size(), " entries for ",
             layout.groups.size(), " groups");
  EXL2_CHECK(layout.out_pad % 32 == 0 && q_weight.dtype() == DType::I32 && q_weight.dim() == 2 &&
                 q_weight.size(1) == layout.out_pad && q_scale.dtype() == DType::I32 &&
                 q_scale.numel() == int64_t(layout.groups.size()) * (layout.out_pad / 8),
             "exl2_upload: q_weight i32 [qrows, out_pad] and q_scale i32 [G, out_pad/8] expected, got ",
             q_weight.describe(), ", ", q_scale.describe());
  std::vector<TileGroup> groups;
  for (const quant::Exl2Group& g : layout.groups) groups.push_back({g.bits, g.qrow_start, g.row_start, g.rows});
  TileTables tt;
  EXL2_CHECK(make_tile_tables(groups, layout.perm.data(), tt), "exl2_upload: layer too large for int32 unit tables");
  Exl2DeviceWeights w;
  w.device = device;
  w.in = layout.in;
  w.out = layout.out;
  w.out_pad = layout.out_pad;
  w.n_groups = static_cast<int64_t>(layout.groups.size());
  w.n_units = tt.n_units;
  w.tile_words = tt.tile_words;
  w.tiles = ceil_div(layout.out_pad, kTileCols);
  for (const quant::Exl2Group& g : layout.groups) w.max_bits = std::max(w.max_bits, g.bits);
  const Tensor qs_host = q_scale.to(Device::cpu());
  const std::vector<uint16_t> ts = make_tile_scales(qs_host.data_as<uint32_t>(), w.n_groups, w.out_pad, w.tiles);
  w.q_scale = Tensor::from_vector(ts, DType::I16).to(device);  // u16 bits
  w.msc = Tensor::from_vector(msc, DType::F16).to(device);
  w.perm_u = Tensor::from_vector(tt.perm_u, DType::I32).to(device);
  w.units = Tensor::from_vector(tt.units, DType::I32).view({w.n_units, 4}).to(device);
  if (bias_f32.defined()) {
    EXL2_CHECK(bias_f32.dtype() == DType::F32 && bias_f32.numel() == layout.out, "exl2_upload: bias must be f32 [",
               layout.out, "], got ", bias_f32.describe());
    w.bias = bias_f32.to(device);
  }
  // Repack on the device: disk words -> tiled layout (the disk copy is dropped afterwards).
  {
    DeviceGuard guard(device.index);
    const Tensor qdisk = q_weight.to(device);
    const Tensor qrow = Tensor::from_vector(tt.qrow, DType::I32).to(device);
    w.q_weight = Tensor::empty({w.tiles * w.tile_words, int64_t(kTileCols)}, DType::I32, device);
    EXL2_CHECK(reinterpret_cast<uintptr_t>(w.q_weight.data()) % 16 == 0, "exl2_upload: q_weight not 16-byte aligned");
    cudaStream_t stream = current_stream();
    if (w.n_units > 0) {
      exl2_repack_kernel<<<dim3{static_cast<unsigned>(w.n_units), static_cast<unsigned>(w.tiles)}, 128, 0, stream>>>(
          qdisk.data_as<uint32_t>(), w.out_pad, w.units.data_as<int4>(), qrow.data_as<int32_t>(), w.tile_words,
          w.q_weight.data_as<uint32_t>());
      EXL2_CUDA_LAUNCH_CHECK("exl2_repack_kernel");
    }
    EXL2_CUDA_CHECK(cudaStreamSynchronize(stream));  // qdisk and qrow are freed on return
  }
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
