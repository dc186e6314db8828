// cuda/exl2_gemm.h: the tiled device layout (tables and repack), the launch of the tensor-core GEMV
// (cuda/exl2_gemv_tc.cuh) for few rows, the dequantize kernel and cuBLAS GEMM for many rows, and the per-device
// accumulator the GEMV shares between launches. Decoding is in cuda/exl2_decode.cuh.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include "core/env.h"
#include "core/weight_arena.h"
#include "cuda/common.cuh"
#include "cuda/exl2_decode.cuh"
#include "cuda/exl2_gemm.h"
#include "cuda/exl2_gemv_kernel.cuh"
#include "cuda/exl2_gemv_tc.cuh"
#include "cuda/exl2_gemv_v4.cuh"
#include "cuda/graph_exec.h"
#include "cuda/pdl.cuh"

namespace exl2::cuda {

namespace {

using namespace exl2k;

constexpr int kThreads = 128;                       // dequantize kernel: threads per block, one column each
constexpr int kV0Cols = kGemvThreads * 4;         // CUDA-core GEMV: 4 columns per thread
constexpr int kV0SmemBytes = 32 * 1024;             // CUDA-core GEMV: staged x slice per block at most
constexpr int kV0BlocksPerSm = 8;                   // CUDA-core GEMV: at most this many blocks per SM (k split)
constexpr int kV0MaxM = 2;                          // rows up to which the CUDA-core GEMV is used (measured faster)
constexpr int kMaxM = 32;                           // rows of x per GEMV launch at most (accumulator rows)
constexpr int kMainMaxM = 16;                       // the main layout's kernels and v4k: rows per launch
constexpr int kSmemBytes = 40 * 1024;               // GEMV: staged x per block (+ 4 KiB static: under 48 KiB)
constexpr int64_t kMaxDqElems = int64_t(64) << 20;  // dequant path: W chunk at most this many elements
constexpr int kMaxDevices = 64;

// ---- dequantize + cuBLAS ---------------------------------------------------------------------------------------

// Stores one column of a unit into wp (W in packed row order, [in, width]).
template <typename TW>
struct ColStore {
  TW* dst;  // wp + row * width + lc
  int64_t ld;
  int nvals;
  __device__ void operator()(int a, int b, uint32_t bits) {
    const __half2 h = as_half2(bits);
    if (a < nvals) dst[a * ld] = from_f32<TW>(__low2float(h));
    if (b < nvals) dst[b * ld] = from_f32<TW>(__high2float(h));
  }
};

// grid (column blocks of the chunk, slots). wp [in, width]: W in PACKED row order, columns c0 .. c0+width.
template <typename TW>
__global__ void __launch_bounds__(kThreads)
    exl2_dequant_kernel(const uint32_t* __restrict__ q_weight, int64_t tile_stride, const uint32_t* __restrict__ q_scale,
                        const __half* __restrict__ msc, const int4* __restrict__ slots, int64_t out_pad, int64_t c0,
                        int64_t width, TW* __restrict__ wp) {
  const int64_t lc = int64_t(blockIdx.x) * kThreads + threadIdx.x;  // column inside the chunk
  if (lc >= width) return;
  const UnitInfo U = unit_info(slots, blockIdx.y);
  if (U.nvals == 0) return;
  const int64_t col = c0 + lc;
  const uint32_t* p = q_weight + (col / 8) * tile_stride + U.woff + (col % 8) * U.bits;
  uint32_t w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = i < U.bits ? __ldg(p + i) : 0u;
  const __half2 s2 = col_scale(__ldg(q_scale + int64_t(U.group) * (out_pad / 8) + col / 8), int(col % 8), msc[U.group]);
  ColStore<TW> st{wp + int64_t(U.row) * width + lc, width, U.nvals};
  decode_col_any(U.bits, w, s2, st);
}

// Tiled layout from ExLlamaV2's: one thread per q_weight word (qmap: row -> {woff + word index, bits}).
__global__ void exl2_repack_kernel(const uint32_t* __restrict__ src, int64_t qrows, int64_t out_pad,
                                   const int2* __restrict__ qmap, int64_t tile_stride, uint32_t* __restrict__ dst) {
  const int64_t total = qrows * out_pad;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / out_pad, col = e % out_pad;
    const int2 m = qmap[r];
    dst[(col / 8) * tile_stride + m.x + (col % 8) * m.y] = src[e];
  }
}

// The v4 layout (cuda/exl2_gemv_v4.cuh) from ExLlamaV2's: one thread per destination word.
__global__ void exl2_v4_repack_kernel(V4Src src, int64_t tile_stride, uint32_t* __restrict__ dst) {
  const int64_t total = (src.out_pad / 16) * tile_stride;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x)
    dst[e] = v4_layout_word(src, e / tile_stride, e % tile_stride);
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

// Per device (see cuda/stream.cu: a rank thread growing its accumulator must not block the other ranks' threads).
std::mutex g_state_mutex[kMaxDevices];
GemvState g_state[kMaxDevices];

GemvState& gemv_state(int device, int64_t acc_floats, int64_t n_counters, cudaStream_t stream) {
  EXL2_CHECK_KIND(Cuda, device >= 0 && device < kMaxDevices, "CUDA device index ", device, " out of range");
  std::lock_guard<std::mutex> lock(g_state_mutex[device]);
  GemvState& s = g_state[device];
  if (acc_floats > s.acc_floats || n_counters > s.n_counters) {
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    EXL2_CUDA_CHECK(cudaStreamIsCapturing(stream, &cap));
    EXL2_CHECK_KIND(Cuda, cap == cudaStreamCaptureStatusNone, "EXL2 GEMV on cuda:", device,
                    " needs a larger accumulator (", acc_floats,
                    " floats) while the stream is being captured into a CUDA graph; run one warm-up step with the "
                    "largest layer before capturing");
    const int64_t na = std::max(acc_floats, s.acc_floats), nc = std::max(n_counters, s.n_counters);
    free_device(s.acc, device);  // deferred on tensor-parallel rank threads (cuda/stream.h)
    free_device(s.counters, device);
    s.acc = nullptr;
    s.counters = nullptr;
    s.acc_floats = s.n_counters = 0;
    if (cudaMalloc(&s.acc, size_t(na) * sizeof(float)) != cudaSuccess ||
        cudaMalloc(&s.counters, size_t(nc) * sizeof(unsigned)) != cudaSuccess) {
      cudaGetLastError();
      free_device(s.acc, device);
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

// The CUDA-core kernel for 1-2 rows (cuda/exl2_gemv_kernel.cuh): k split into slices of `ups` units so that the
// grid is one wave of resident blocks.
template <int M>
void launch_gemv_v0(const __half* x, int m, const Exl2DeviceWeights& w, __half* y, GemvState& st, cudaStream_t stream) {
  const int64_t col_tiles = ceil_div(w.out_pad, kV0Cols);
  const int n_units = static_cast<int>(w.n_units);
  const int max_ups = std::max(1, kV0SmemBytes / (32 * M * int(sizeof(float))));
  // Resident blocks per SM as registers allow (cached per device), at most kV0BlocksPerSm: one wave.
  static int resident_v0[kMaxDevices] = {};
  int dev = 0;
  EXL2_CUDA_CHECK(cudaGetDevice(&dev));
  if (resident_v0[dev] == 0) {
    int b = 0;
    EXL2_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, exl2_gemv_kernel<M>, kGemvThreads, kV0SmemBytes / 4));
    resident_v0[dev] = std::max(1, std::min(b, kV0BlocksPerSm));
  }
  const int64_t target = int64_t(sm_count()) * resident_v0[dev];
  int64_t slices = std::min<int64_t>(std::max<int64_t>(1, ceil_div(target, col_tiles)), n_units);
  int ups = static_cast<int>(ceil_div(n_units, slices));
  ups = std::min(ups, max_ups);
  slices = ceil_div(n_units, ups);
  EXL2_CHECK_KIND(Cuda, col_tiles <= INT_MAX && slices <= 65535, "EXL2 GEMV grid too large: ", col_tiles, " x ",
                  slices);
  const size_t smem = size_t(ups) * 32 * M * sizeof(float);
  dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(slices));
  EXL2_CUDA_LAUNCH_PDL("exl2_gemv_kernel", exl2_gemv_kernel<M>, grid, kGemvThreads, smem, stream, x, w.in, m,
                       w.q_weight.data_as<uint32_t>(), w.tile_stride, w.q_scale.data_as<uint32_t>(),
                       w.msc.data_as<__half>(), w.q_perm.data_as<int32_t>(), w.units.data_as<int4>(), n_units, ups,
                       w.bias.defined() ? w.bias.data_as<float>() : nullptr, y, w.out, w.out_pad, st.acc,
                       st.counters);
}

template <int MAXW, bool M16>
void launch_gemv(const __half* x, int m, const Exl2DeviceWeights& w, __half* y, GemvState& st, cudaStream_t stream) {
  const int64_t col_blocks = ceil_div(w.out_pad, kTcCols);
  const int n_quads = static_cast<int>(w.n_quads);
  // k slices: at least what the staged x needs (m rows of qpb * 64 + 8 words in kSmemBytes); otherwise as many
  // as fill the GPU's resident blocks in ONE wave (a second, partial wave would double the time).
  static int resident[kMaxDevices] = {};
  int dev = 0;
  EXL2_CUDA_CHECK(cudaGetDevice(&dev));
  if (resident[dev] == 0) {
    int b = 0;
    EXL2_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, exl2_gemv_tc_kernel<MAXW, M16>, kTcThreads,
                                                                  kSmemBytes));
    resident[dev] = std::max(1, b);
  }
  const int max_qpb = std::max(1, (kSmemBytes / (4 * m) - 8) / 64);
  const int64_t wave = int64_t(sm_count()) * resident[dev];
  int64_t slices = std::max<int64_t>(ceil_div(n_quads, max_qpb), std::max<int64_t>(1, wave / col_blocks));
  slices = std::max<int64_t>(1, std::min<int64_t>(slices, n_quads));
  const int qpb = static_cast<int>(ceil_div(n_quads, slices));
  slices = ceil_div(n_quads, qpb);
  EXL2_CHECK_KIND(Cuda, col_blocks <= INT_MAX && slices <= 65535, "EXL2 GEMV grid too large: ", col_blocks, " x ",
                  slices);
  const size_t smem = size_t(m) * (size_t(qpb) * 64 + 8) * sizeof(uint32_t);
  dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(slices));
  EXL2_CUDA_LAUNCH_PDL("exl2_gemv_tc_kernel", exl2_gemv_tc_kernel<MAXW, M16>, grid, kTcThreads, smem, stream, x,
                       w.in, m, w.q_weight.data_as<uint32_t>(), w.tile_stride, w.q_scale.data_as<uint32_t>(),
                       w.msc.data_as<__half>(), w.slots.data_as<int4>(), w.xsrc.data_as<int32_t>(), n_quads, qpb,
                       w.bias.defined() ? w.bias.data_as<float>() : nullptr, y, w.out, w.out_pad, st.acc,
                       st.counters);
}

// Blocks per SM the v4 GEMV aims at (one wave): env EXL2CPP_GEMV_BLOCKS_PER_SM (1..32), else what registers and
// the largest staging allow.
int v4_blocks_per_sm(int occupancy) {
  static const int from_env = [] {
    const char* v = std::getenv("EXL2CPP_GEMV_BLOCKS_PER_SM");
    if (!v || !*v) return 0;
    char* end = nullptr;
    const long b = std::strtol(v, &end, 10);
    EXL2_CHECK(end && *end == '\0' && b >= 1 && b <= 32, "EXL2CPP_GEMV_BLOCKS_PER_SM must be 1..32, got '", v, "'");
    return static_cast<int>(b);
  }();
  return from_env > 0 ? std::min(from_env, std::max(1, occupancy)) : std::max(1, occupancy);
}

constexpr int kV4SmemBytes = 40 * 1024;  // v4 GEMV: staged x + corrections per block at most

// Chunks per k slice the v4 GEMV aims at: env EXL2CPP_GEMV_CHUNKS (1..1024), else 8.
int v4_chunks_per_slice() {
  static const int from_env = [] {
    const char* v = std::getenv("EXL2CPP_GEMV_CHUNKS");
    if (!v || !*v) return 8;
    char* end = nullptr;
    const long c = std::strtol(v, &end, 10);
    EXL2_CHECK(end && *end == '\0' && c >= 1 && c <= 1024, "EXL2CPP_GEMV_CHUNKS must be 1..1024, got '", v, "'");
    return static_cast<int>(c);
  }();
  return from_env;
}

// An env knob of the v4 GEMV: integer in [lo, hi] or `dflt` when unset (read once).
int v4_env_int(const char* name, int lo, int hi, int dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  const long c = std::strtol(v, &end, 10);
  EXL2_CHECK(end && *end == '\0' && c >= lo && c <= hi, name, " must be ", lo, "..", hi, ", got '", v, "'");
  return static_cast<int>(c);
}

// Launch knobs (dev/kernels/exl2_gemv_notes.md, session 5 hypotheses): EXL2CPP_GEMV_PREFETCH (bytes of the L2 bulk
// prefetch per warp at the start, 0..65536, default 8192), EXL2CPP_GEMV_AHEAD (1: the loop keeps 8 KB prefetched
// ahead, the default; 0: no prefetch in the loop), EXL2CPP_GEMV_PDL (1: launched as a programmatic dependent
// launch on sm_90+, so its weight prefetch overlaps the previous kernel's tail; default 1: +4% end to end; only where
// cuda/pdl.h pdl_enabled(), so EXL2CPP_PDL=0 turns it off too), EXL2CPP_GEMV_L1 (1: the
// L1 prefetch pipeline variant of the kernel, v4 only, not v4k; default 0), EXL2CPP_GEMV_SLICES (k slices per column block, 0 = automatic: 1 gives every
// warp all of k and the direct epilogue: no atomics, no counter, no last-block pass).
V4Knobs v4_knobs() {
  static const V4Knobs k = [] {
    V4Knobs r;
    r.prefetch_bytes = v4_env_int("EXL2CPP_GEMV_PREFETCH", 0, 65536, kV4PrefetchBytes);
    r.ahead = v4_env_int("EXL2CPP_GEMV_AHEAD", 0, 1, 1);
    r.pdl = v4_env_int("EXL2CPP_GEMV_PDL", 0, 1, 1);
    r.l1 = v4_env_int("EXL2CPP_GEMV_L1", 0, 1, 0);
    return r;
  }();
  return k;
}
int v4_forced_slices() {
  static const int s = v4_env_int("EXL2CPP_GEMV_SLICES", 0, 65535, 0);
  return s;
}
// EXL2CPP_GEMV_M32: 1 runs 17..32 rows of x through one v4 launch of the four-n-tile kernel (M = 32), 0 (default)
// through two 16-row launches, each streaming the weights again. v4 only (v4k stays at 16 rows per launch). Read at
// every call (tests switch it; in CUDA graphs: at capture). Flip point of the 32-row kernel.
bool v4_m32_enabled() { return env_switch("EXL2CPP_GEMV_M32", "1", "0", false); }
// Rows of x one v4 launch takes for layers of this kind (kc: v4k).
int v4_rows_per_launch(bool kc) { return !kc && v4_m32_enabled() ? 32 : 16; }
// EXL2CPP_GEMV_CLUSTER: 1 reduces the k slices of a column block through a thread-block cluster (v4_plan_cluster;
// sm_90 and newer), 0 (default) through the accumulator, atomics and the last block. Read at every launch, so that
// tests can switch it (in CUDA graphs: at capture).
bool v4_cluster_requested() { return env_switch("EXL2CPP_GEMV_CLUSTER", "1", "0", false); }
constexpr int kV4MaxCluster = 8;  // the portable cluster size limit
std::atomic<int64_t> g_cluster_launches{0};
std::atomic<int64_t> g_m32_launches{0};

// One layer's part of a v4 launch (cps, slices, block0: v4_plan), its split-k regions acc / counters.
V4Layer v4_layer(const Exl2DeviceWeights& w, __half* y, float* acc, unsigned* counters) {
  V4Layer L;
  L.qw = w.v4_q_weight.data_as<uint32_t>();
  L.msc = w.v4_msc.data_as<uint32_t>();
  L.chunk_woff = w.v4_chunk_woff.data_as<int32_t>();
  L.xsrc = w.v4_xsrc.data_as<int32_t>();
  L.kcoef = w.v4_correct ? w.v4_kcoef.data_as<float>() : nullptr;
  L.bias = w.bias.defined() ? w.bias.data_as<float>() : nullptr;
  L.y = y;
  L.acc = acc;
  L.counters = counters;
  L.tile_stride = w.v4_tile_stride;
  L.out = w.out;
  L.out_pad = w.out_pad;
  L.runs = v4_runs(w.v4_runs);
  L.n_chunks = static_cast<int>(w.v4_chunks);
  L.col_blocks = static_cast<int>(ceil_div(w.out_pad, kV4Cols));
  return L;
}

// The v4 kernel (cuda/exl2_gemv_v4.cuh) for m <= M rows of x [m, in] and the layers of g (1..kV4MaxGroup, their
// y / acc / counters set): k split by v4_plan, one wave.
template <int M, bool KC, bool L1P = false, bool FUSE = false>
void launch_gemv_v4(const __half* x, int m, int64_t in, V4Group& g, cudaStream_t stream, const V4Fuse& fz = {}) {
  const int unit_bytes = M * 32 * 2 + (KC ? M * 4 : 0) + 4;  // x + corrections + group maximum per unit
  const int max_cps = std::max(1, kV4SmemBytes / (4 * unit_bytes));
  static int occ[kMaxDevices] = {};  // per instantiation
  int dev = 0;
  EXL2_CUDA_CHECK(cudaGetDevice(&dev));
  if (occ[dev] == 0) {
    int b = 0;
    EXL2_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, exl2_gemv_v4_kernel<M, KC, L1P, FUSE>,
                                                                  kV4Threads, kV4SmemBytes));
    occ[dev] = std::max(1, b);
  }
  // Bytes in flight do not need more blocks than one wave: each warp asks L2 for its slice at the start.
  const int64_t wave = int64_t(sm_count()) * v4_blocks_per_sm(occ[dev]);
  const bool fits = v4_plan(g, sm_count(), wave, v4_chunks_per_slice(), max_cps, v4_forced_slices());
  EXL2_CHECK_KIND(Cuda, fits && g.blocks > 0, "EXL2 v4 GEMV grid too large: ", g.blocks, " blocks");
  g.cluster = 0;
  if (v4_cluster_requested() && compute_capability() >= 90) v4_plan_cluster(g, kV4MaxCluster, max_cps);
  int cps = 1;
  for (int i = 0; i < g.n; ++i) cps = std::max(cps, g.l[i].cps);
  size_t smem = size_t(cps) * 4 * unit_bytes;
  if (g.cluster > 1) {
    smem = std::max<size_t>(smem, v4_cluster_smem(M));
    g_cluster_launches.fetch_add(1, std::memory_order_relaxed);
  }
  if (M == 32) g_m32_launches.fetch_add(1, std::memory_order_relaxed);
  V4Knobs knobs = v4_knobs();
  knobs.pdl = knobs.pdl && pdl_enabled();  // EXL2CPP_GEMV_PDL and the global switch (cuda/pdl.h, EXL2CPP_PDL)
  const V4Group& gc = g;
  launch_kernel_cluster_pdl_if(knobs.pdl, static_cast<unsigned>(std::max(g.cluster, 1)), __FILE__, __LINE__,
                               FUSE ? "exl2_gemv_v4_kernel<fuse>" : "exl2_gemv_v4_kernel",
                               exl2_gemv_v4_kernel<M, KC, L1P, FUSE>, dim3(static_cast<unsigned>(g.blocks)),
                               dim3(kV4Threads), smem, stream, x, in, m, gc, knobs, fz);
}

template <bool KC, bool L1P = false, bool FUSE = false>
void launch_gemv_v4_m(const __half* x, int m, int64_t in, V4Group& g, cudaStream_t stream, const V4Fuse& fz = {}) {
  if (m == 1)
    launch_gemv_v4<1, KC, L1P, FUSE>(x, m, in, g, stream, fz);
  else if (m == 2)
    launch_gemv_v4<2, KC, L1P, FUSE>(x, m, in, g, stream, fz);
  else if (m <= 4)
    launch_gemv_v4<4, KC, L1P, FUSE>(x, m, in, g, stream, fz);
  else if (m <= 8)
    launch_gemv_v4<8, KC, L1P, FUSE>(x, m, in, g, stream, fz);
  else if (m <= 16) {
    if constexpr (!(KC && FUSE))  // exl2_gemm_fused leaves v4k at 9..16 rows to the composition (it spills)
      launch_gemv_v4<16, KC, false, FUSE>(x, m, in, g, stream, fz);  // no L1P variant for two n-tiles (it spills)
  } else {  // 17..32 rows: v4 only (v4_rows_per_launch keeps v4k at 16)
    EXL2_CHECK_KIND(Cuda, !KC && m <= 32, "EXL2 v4 GEMV: ", m, " rows in one launch (v4k: at most 16, v4: 32)");
    if constexpr (!KC) launch_gemv_v4<32, false, false, FUSE>(x, m, in, g, stream, fz);
  }
}

// The variant the layers were loaded for (v4k: KC) and EXL2CPP_GEMV_L1 asks for.
void launch_gemv_v4_any(const __half* x, int m, int64_t in, bool kc, V4Group& g, cudaStream_t stream) {
  if (kc)
    launch_gemv_v4_m<true>(x, m, in, g, stream);
  else if (v4_knobs().l1)
    launch_gemv_v4_m<false, true>(x, m, in, g, stream);
  else
    launch_gemv_v4_m<false>(x, m, in, g, stream);
}

void gemv(const Tensor& x, const Exl2DeviceWeights& w, Tensor& y, int64_t n, cudaStream_t stream) {
  GemvState& st = gemv_state(w.device.index, int64_t(kMaxM) * w.out_pad,
                             std::max(ceil_div(w.out_pad, kTcCols), ceil_div(w.out_pad, kV4Cols)), stream);
  const __half* xp = x.data_as<__half>();
  __half* yp = y.data_as<__half>();
  const bool wide = w.max_bits > 4;
  const int64_t per_launch = w.gemv != 0 ? v4_rows_per_launch(w.v4_correct) : kMainMaxM;
  for (int64_t r0 = 0; r0 < n; r0 += per_launch) {
    const int m = static_cast<int>(std::min<int64_t>(per_launch, n - r0));
    const __half* xr = xp + r0 * w.in;
    __half* yr = yp + r0 * w.out;
    if (w.gemv != 0) {
      V4Group g;
      g.n = 1;
      g.l[0] = v4_layer(w, yr, st.acc, st.counters);
      launch_gemv_v4_any(xr, m, w.in, w.v4_correct, g, stream);
    } else if (m == 1 && kV0MaxM >= 1)
      launch_gemv_v0<1>(xr, m, w, yr, st, stream);
    else if (m == 2 && kV0MaxM >= 2)
      launch_gemv_v0<2>(xr, m, w, yr, st, stream);
    else if (m <= 8)
      wide ? launch_gemv<8, false>(xr, m, w, yr, st, stream) : launch_gemv<4, false>(xr, m, w, yr, st, stream);
    else
      wide ? launch_gemv<8, true>(xr, m, w, yr, st, stream) : launch_gemv<4, true>(xr, m, w, yr, st, stream);
  }
}

template <typename T>
void dequant_gemm(const Tensor& x, const Exl2DeviceWeights& w, Tensor& y, int64_t n, cudaStream_t stream) {
  const int64_t in = w.in, out = w.out, out_pad = w.out_pad;
  EXL2_CHECK_KIND(Unsupported, n <= INT_MAX && in <= INT_MAX && out <= INT_MAX,
                  "EXL2 GEMM: sizes beyond cuBLAS int range (n=", n, ", in=", in, ", out=", out, ")");
  const int64_t chunk = std::min(out_pad, std::max<int64_t>(32, kMaxDqElems / in / 32 * 32));
  const size_t xp_bytes = w.gemv != 0 ? 0 : (size_t(n * in) * sizeof(T) + 255) / 256 * 256;
  const size_t wp_bytes = size_t(in * chunk) * sizeof(T);
  char* ws = static_cast<char*>(workspace(xp_bytes + wp_bytes));
  T* xp = reinterpret_cast<T*>(ws);
  T* wp = reinterpret_cast<T*>(ws + xp_bytes);
  const T* xs = x.data_as<T>();
  T* ys = y.data_as<T>();
  const bool v4 = w.gemv != 0;  // v4 layout: W in the original input order, x as is

  if (!v4) {
    gather_cols_kernel<T>
        <<<elementwise_blocks(n * in, 256), 256, 0, stream>>>(xs, w.q_perm.data_as<int32_t>(), xp, n, in);
    EXL2_CUDA_LAUNCH_CHECK("gather_cols_kernel");
  }
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
    if (v4) {
      dim3 grid(static_cast<unsigned>(ceil_div(width, 128)), static_cast<unsigned>(w.v4_chunks));
      exl2_v4_dequant_kernel<T><<<grid, 128, 0, stream>>>(w.v4_q_weight.data_as<uint32_t>(), w.v4_tile_stride,
                                                          w.v4_chunk_woff.data_as<int32_t>(),
                                                          w.v4_xsrc.data_as<int32_t>(), w.v4_msc.data_as<uint32_t>(),
                                                          v4_runs(w.v4_runs), c0, width, wp);
      EXL2_CUDA_LAUNCH_CHECK("exl2_v4_dequant_kernel");
    } else {
      dim3 grid(static_cast<unsigned>(ceil_div(width, kThreads)), static_cast<unsigned>(w.n_quads * 4));
      exl2_dequant_kernel<T><<<grid, kThreads, 0, stream>>>(w.q_weight.data_as<uint32_t>(), w.tile_stride,
                                                            w.q_scale.data_as<uint32_t>(), w.msc.data_as<__half>(),
                                                            w.slots.data_as<int4>(), out_pad, c0, width, wp);
      EXL2_CUDA_LAUNCH_CHECK("exl2_dequant_kernel");
    }
    // Row-major y[n, out] is column-major y^T [out, n]; its rows c0.. = Wp^T (col-major [width, in]) @ xp^T.
    EXL2_CUBLAS_CHECK(cublasGemmEx(cublas_handle(), CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(nc), static_cast<int>(n),
                                   static_cast<int>(in), &alpha, wp, t, static_cast<int>(width), v4 ? xs : xp, t,
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

namespace {
// Bit widths of a unit table (exl2_unit_table) in order of first appearance.
std::vector<int> unit_widths(const std::vector<int32_t>& units) {
  std::vector<int> widths;
  for (size_t u = 0; u + 3 < units.size(); u += 4) {
    const int b = units[u + 3] & 0xff;
    if (std::find(widths.begin(), widths.end(), b) == widths.end()) widths.push_back(b);
  }
  return widths;
}
}  // namespace

Exl2TcTables exl2_tc_tables(const quant::Exl2Layout& layout) {
  const std::vector<int32_t> units = exl2_unit_table(layout);
  const int64_t n_units = static_cast<int64_t>(units.size() / 4);
  const std::vector<int> widths = unit_widths(units);
  Exl2TcTables t;
  int64_t qrows = 0;
  for (const quant::Exl2Group& gr : layout.groups) qrows = std::max<int64_t>(qrows, gr.qrow_start + gr.qrows);
  t.qmap.assign(size_t(2 * qrows), 0);
  int64_t woff = 0;
  for (int b : widths) {
    t.max_bits = std::max(t.max_bits, b);
    int64_t n = 0;
    for (int64_t u = 0; u < n_units; ++u) {
      const int32_t* e = &units[size_t(4 * u)];
      if ((e[3] & 0xff) != b) continue;
      const int nvals = (e[3] >> 8) & 0xff, nwords = e[3] >> 16;
      EXL2_CHECK(woff + 8 * b <= INT_MAX, "EXL2 tiled layout: tile of ", woff + 8 * b, " words exceeds int range");
      t.slots.insert(t.slots.end(), {static_cast<int32_t>(woff), e[1], e[2], b | (nvals << 8)});
      for (int i = 0; i < nwords; ++i) {
        t.qmap[size_t(2 * (e[0] + i))] = static_cast<int32_t>(woff + i);
        t.qmap[size_t(2 * (e[0] + i) + 1)] = b;
      }
      woff += 8 * b;
      ++n;
    }
    for (; n % 4 != 0; ++n) t.slots.insert(t.slots.end(), {0, 0, 0, b});  // empty slots of this width
  }
  t.tile_stride = woff;
  // The CUDA-core kernel's table: the units in file order, qrow replaced by woff.
  t.units = units;
  for (int64_t u = 0; u < n_units; ++u) t.units[size_t(4 * u)] = t.qmap[size_t(2 * units[size_t(4 * u)])];
  t.n_quads = static_cast<int64_t>(t.slots.size() / 16);
  t.xsrc.assign(size_t(t.n_quads * 128), -1);
  for (int64_t q = 0; q < t.n_quads; ++q) {
    for (int j = 0; j < 4; ++j) {
      const int32_t* e = &t.slots[size_t(4 * (4 * q + j))];
      const int bits = e[3] & 0xff, nvals = (e[3] >> 8) & 0xff;
      for (int P = 0; P < 16; ++P) {
        int ra = 0, rb = 0;
        exl2k::pair_rows(bits, P, ra, rb);
        const int64_t base = q * 128 + (P / 2) * 16 + j * 4 + (P % 2) * 2;
        if (ra < nvals) t.xsrc[size_t(base)] = layout.perm[size_t(e[1] + ra)];
        if (rb < nvals) t.xsrc[size_t(base + 1)] = layout.perm[size_t(e[1] + rb)];
      }
    }
  }
  return t;
}

namespace {
std::vector<int32_t> v4_flat_runs(const Exl2V4Tables& t) {
  std::vector<int32_t> f = t.run_start;
  for (const auto* v : {&t.run_bits, &t.run_woff, &t.run_rpc, &t.run_srow}) f.insert(f.end(), v->begin(), v->end());
  return f;
}
V4Runs v4_runs_of(const Exl2V4Tables& t) { return v4_runs(v4_flat_runs(t)); }
}  // namespace

Exl2V4Tables exl2_v4_tables(const quant::Exl2Layout& layout) {
  const std::vector<int32_t> units = exl2_unit_table(layout);
  const int64_t n_units = static_cast<int64_t>(units.size() / 4);
  const std::vector<int> widths = unit_widths(units);
  Exl2V4Tables t;
  for (int b : widths) {
    t.run_start.push_back(static_cast<int32_t>(t.ugroup.size() / 4));
    t.run_bits.push_back(b);
    int64_t n = 0;
    for (int64_t u = 0; u < n_units; ++u) {
      const int32_t* e = &units[size_t(4 * u)];
      if ((e[3] & 0xff) != b) continue;
      const int nvals = (e[3] >> 8) & 0xff;
      t.slot_info.insert(t.slot_info.end(), {e[0], nvals});
      t.ugroup.push_back(e[2]);
      for (int r = 0; r < 32; ++r) t.xsrc.push_back(r < nvals ? layout.perm[size_t(e[1] + r)] : -1);
      ++n;
    }
    for (; n % 4 != 0; ++n) {
      t.slot_info.insert(t.slot_info.end(), {0, 0});
      t.ugroup.push_back(-1);
      t.xsrc.insert(t.xsrc.end(), 32, -1);
    }
  }
  t.n_chunks = static_cast<int64_t>(t.ugroup.size() / 4);
  t.run_start.push_back(static_cast<int32_t>(t.n_chunks));
  // Scale rows: the fewest per chunk (1, 2 or 4) such that, in every chunk of the run, the units of each row
  // [4j / rpc, 4(j + 1) / rpc) are of one group (empty slots, only at a width's end, match any); row j's group is
  // its first unit's. Their 4-bit codes follow each chunk's weights in the tile (v4_code_words, v4_code_pos).
  int64_t woff = 0;
  for (size_t r = 0; r + 1 < t.run_start.size(); ++r) {
    auto rows_share = [&](int rpc) {
      const int per = 4 / rpc;
      for (int32_t c = t.run_start[r]; c < t.run_start[r + 1]; ++c)
        for (int u = 0; u < 4; ++u) {
          const int32_t gu = t.ugroup[size_t(4 * c + u)], g0 = t.ugroup[size_t(4 * c + u / per * per)];
          if (gu >= 0 && gu != g0) return false;
        }
      return true;
    };
    const int rpc = rows_share(1) ? 1 : rows_share(2) ? 2 : 4;
    t.run_rpc.push_back(rpc);
    t.run_srow.push_back(static_cast<int32_t>(t.srow_group.size()));
    for (int32_t c = t.run_start[r]; c < t.run_start[r + 1]; ++c)
      for (int j = 0; j < rpc; ++j) t.srow_group.push_back(t.ugroup[size_t(4 * c + 4 * j / rpc)]);
    EXL2_CHECK(woff <= INT_MAX, "EXL2 v4 layout: tile of ", woff, " words exceeds int range");
    t.run_woff.push_back(static_cast<int32_t>(woff));
    woff += int64_t(t.run_start[r + 1] - t.run_start[r]) * exl2k::v4_chunk_words(t.run_bits[r], rpc);
  }
  EXL2_CHECK(woff <= INT_MAX, "EXL2 v4 layout: tile of ", woff, " words exceeds int range");
  t.tile_stride = woff;
  const V4Runs runs = v4_runs_of(t);
  for (int32_t c = 0; c <= t.n_chunks; ++c) t.chunk_srow.push_back(exl2k::v4_srow(runs, c));
  for (size_t r = 0; r < t.run_bits.size(); ++r)
    for (int32_t c = t.run_start[r]; c < t.run_start[r + 1]; ++c)
      t.chunk_woff.push_back(t.run_woff[r] + (c - t.run_start[r]) * exl2k::v4_chunk_words(t.run_bits[r], t.run_rpc[r]));
  t.chunk_woff.push_back(static_cast<int32_t>(t.tile_stride));
  // Correction coefficients 2^(10-o) + z per row: the raw decode of zero words gives 2^(10-o) per output.
  t.kcoef.assign(t.xsrc.size(), 0.f);
  for (size_t r = 0; r < t.run_bits.size(); ++r) {
    const int b = t.run_bits[r];
    uint32_t zero[8] = {};
    uint32_t h[16];
    exl2k::v4_decode_any(b, zero, h, false);
    for (int32_t s = 4 * t.run_start[r]; s < 4 * t.run_start[r + 1]; ++s)
      for (int row = 0; row < 32; ++row) {
        if (t.xsrc[size_t(s * 32 + row)] < 0) continue;
        const int q = 4 * (s % 4) + (row % 8) / 2;
        const __half2 v = exl2k::as_half2(h[q]);
        t.kcoef[size_t(s * 32 + row)] = __half2float(row % 2 ? __high2half(v) : __low2half(v)) + float(1 << (b - 1));
      }
  }
  EXL2_CHECK(t.chunk_srow.back() == int32_t(t.srow_group.size()), "EXL2 v4 layout: scale rows do not add up");
  return t;
}

namespace {
// v4_bitmap of every width, [9][256] (index = bits), each checked to be a bijection of the B * 32 layout bits.
std::vector<int32_t> v4_maps() {
  std::vector<int32_t> maps(9 * 256, -1);
  for (int b : {2, 3, 4, 5, 6, 8}) {
    exl2k::v4_bitmap(b, maps.data() + b * 256);
    std::vector<int> seen(4 * 8 * 8, 0);
    for (int i = 0; i < b * 32; ++i) {
      const int32_t e = maps[size_t(b * 256 + i)];
      EXL2_CHECK(e >= 0 && (e & 15) < b, "EXL2 v4 layout: decoder of ", b, " bits reads bit ", i, " badly");
      ++seen[size_t(((e >> 8) * 8 + ((e >> 4) & 15)) * 8 + (e & 15))];
    }
    for (int u = 0; u < 4; ++u)
      for (int v = 0; v < 8; ++v)
        for (int k = 0; k < b; ++k)
          EXL2_CHECK(seen[size_t((u * 8 + v) * 8 + k)] == 1, "EXL2 v4 layout: decoder of ", b, " bits is not a bijection");
  }
  return maps;
}

}  // namespace

std::vector<int32_t> exl2_v4_unit_msc(const Exl2V4Tables& t, const std::vector<uint16_t>& msc) {
  std::vector<int32_t> tab(t.ugroup.size(), 0);
  for (size_t s = 0; s < t.ugroup.size(); ++s) {
    const int32_t g = t.ugroup[s];
    if (g < 0) continue;
    EXL2_CHECK(size_t(g) < msc.size(), "EXL2 v4 layout: unit of group ", g, " but only ", msc.size(), " maxima");
    tab[s] = static_cast<int32_t>(uint32_t(msc[size_t(g)]) * 0x10001u);
  }
  return tab;
}

std::vector<uint32_t> exl2_v4_repack_host(const Exl2V4Tables& t, const uint32_t* q_weight, int64_t qrows,
                                          int64_t out_pad, const uint32_t* q_scale) {
  (void)qrows;
  const std::vector<int32_t> maps = v4_maps();
  exl2k::V4Src src{q_weight, q_scale, reinterpret_cast<const int2*>(t.slot_info.data()), maps.data(),
                   t.srow_group.data(), t.chunk_srow.data(), out_pad, v4_runs_of(t)};
  std::vector<uint32_t> dst(size_t(out_pad / 16 * t.tile_stride), 0u);
  for (int64_t tile = 0; tile < out_pad / 16; ++tile)
    for (int64_t off = 0; off < t.tile_stride; ++off) dst[size_t(tile * t.tile_stride + off)] = exl2k::v4_layout_word(src, tile, off);
  return dst;
}

int exl2_gemv_v4_requested() {
  // Default: v4 (session 5 on the H200: its GPU tests pass on both layouts and Llama-2-7B 4.0 bpw decodes at
  // 323 tok/s with PDL against main's 285, dev/kernels/gemv_ab.sh). EXL2CPP_GEMV=main keeps the older layout.
  const char* v = std::getenv("EXL2CPP_GEMV");
  if (!v || !*v || std::string(v) == "v4") return 1;
  if (std::string(v) == "main") return 0;
  EXL2_CHECK(std::string(v) == "v4k", "EXL2CPP_GEMV must be 'main', 'v4' or 'v4k', got '", v, "'");
  return 2;
}

std::vector<uint32_t> exl2_tc_repack_host(const Exl2TcTables& t, const uint32_t* q_weight, int64_t qrows,
                                          int64_t out_pad) {
  EXL2_CHECK(out_pad % 8 == 0 && int64_t(t.qmap.size()) == 2 * qrows, "exl2_tc_repack_host: tables do not match");
  std::vector<uint32_t> dst(size_t(out_pad / 8 * t.tile_stride), 0u);
  for (int64_t r = 0; r < qrows; ++r)
    for (int64_t col = 0; col < out_pad; ++col)
      dst[size_t((col / 8) * t.tile_stride + t.qmap[size_t(2 * r)] + (col % 8) * t.qmap[size_t(2 * r + 1)])] =
          q_weight[size_t(r * out_pad + col)];
  return dst;
}

Exl2DeviceWeights exl2_upload(const quant::Exl2Layout& layout, const Tensor& q_weight, const Tensor& q_scale,
                              const std::vector<uint16_t>& msc, const Tensor& bias_f32, Device device) {
  EXL2_CHECK(device.is_cuda(), "exl2_upload: a CUDA device expected, got ", device.str());
  EXL2_CHECK(msc.size() == layout.groups.size(), "exl2_upload: msc has ", msc.size(), " entries for ",
             layout.groups.size(), " groups");
  EXL2_CHECK(layout.out_pad % 32 == 0 && q_weight.dim() == 2 && q_weight.size(1) == layout.out_pad,
             "exl2_upload: q_weight must be [qrows, out_pad] with out_pad % 32 == 0, got ", q_weight.describe());
  Exl2DeviceWeights w;
  w.device = device;
  w.gemv = exl2_gemv_v4_requested();
  w.in = layout.in;
  w.out = layout.out;
  w.out_pad = layout.out_pad;
  w.n_groups = static_cast<int64_t>(layout.groups.size());
  const int64_t qrows = q_weight.size(0);
  if (w.gemv == 0) {
    const Exl2TcTables t = exl2_tc_tables(layout);
    w.n_quads = t.n_quads;
    w.tile_stride = t.tile_stride;
    w.max_bits = t.max_bits;
    EXL2_CHECK(int64_t(t.qmap.size()) == 2 * qrows, "exl2_upload: q_weight has ", qrows, " rows, the groups ",
               t.qmap.size() / 2);
    {
      DeviceGuard guard(device.index);
      cudaStream_t stream = current_stream();
      Tensor src, qmap;
      {
        WeightArenaBypass staging;  // freed on return: never in a weight arena
        src = q_weight.to(device);
        qmap = Tensor::from_vector(t.qmap, DType::I32).to(device);
      }
      w.q_weight = Tensor::empty({w.out_pad / 8, std::max<int64_t>(1, t.tile_stride)}, DType::I32, device);
      EXL2_CUDA_CHECK(cudaMemsetAsync(w.q_weight.data(), 0, w.q_weight.nbytes(), stream));
      if (qrows > 0) {
        exl2_repack_kernel<<<elementwise_blocks(qrows * w.out_pad, 256), 256, 0, stream>>>(
            src.data_as<uint32_t>(), qrows, w.out_pad, qmap.data_as<int2>(), t.tile_stride,
            w.q_weight.data_as<uint32_t>());
        EXL2_CUDA_LAUNCH_CHECK("exl2_repack_kernel");
      }
      EXL2_CUDA_CHECK(cudaStreamSynchronize(stream));  // src and qmap are freed on return
    }
    w.q_scale = q_scale.to(device);
    w.msc = Tensor::from_vector(msc, DType::F16).to(device);
    w.q_perm = Tensor::from_vector(layout.perm, DType::I32).to(device);
    w.slots = Tensor::from_vector(t.slots, DType::I32).view({t.n_quads * 4, 4}).to(device);
    w.n_units = static_cast<int64_t>(t.units.size() / 4);
    w.units = Tensor::from_vector(t.units, DType::I32).view({w.n_units, 4}).to(device);
    w.xsrc = Tensor::from_vector(t.xsrc, DType::I32).to(device);
    EXL2_CHECK(reinterpret_cast<uintptr_t>(w.q_weight.data()) % 16 == 0, "exl2_upload: q_weight must be 16-byte aligned");
  } else {
    // The v4 layout only: q_scale and the file's q_weight are needed for the repack alone (the 4-bit scale codes
    // live in the layout after each chunk's weights, the group maxima in v4_msc, the permutation in v4_xsrc).
    const Exl2V4Tables v = exl2_v4_tables(layout);
    for (int b : v.run_bits) w.max_bits = std::max(w.max_bits, b);
    w.v4_correct = w.gemv == 2;
    if (w.v4_correct) w.v4_kcoef = Tensor::from_vector(v.kcoef, DType::F32).to(device);
    w.v4_chunks = v.n_chunks;
    w.v4_tile_stride = v.tile_stride;
    w.v4_runs = v4_flat_runs(v);
    DeviceGuard guard(device.index);
    cudaStream_t stream = current_stream();
    Tensor src, qs, maps, info, srow_group, chunk_srow;
    {
      WeightArenaBypass staging;  // the repack's inputs are freed on return: never in a weight arena
      src = q_weight.to(device);
      qs = q_scale.to(device);
      maps = Tensor::from_vector(v4_maps(), DType::I32).to(device);
      info = Tensor::from_vector(v.slot_info, DType::I32).to(device);
      srow_group = Tensor::from_vector(v.srow_group, DType::I32).to(device);
      chunk_srow = Tensor::from_vector(v.chunk_srow, DType::I32).to(device);
    }
    w.v4_msc = Tensor::from_vector(exl2_v4_unit_msc(v, msc), DType::I32).to(device);
    w.v4_chunk_woff = Tensor::from_vector(v.chunk_woff, DType::I32).to(device);
    w.v4_xsrc = Tensor::from_vector(v.xsrc, DType::I32).to(device);
    w.v4_q_weight = Tensor::empty({w.out_pad / 16, std::max<int64_t>(1, v.tile_stride)}, DType::I32, device);
    const int64_t total = (w.out_pad / 16) * v.tile_stride;
    if (total > 0) {
      const V4Src vs{src.data_as<uint32_t>(), qs.data_as<uint32_t>(), info.data_as<int2>(), maps.data_as<int32_t>(),
                     srow_group.data_as<int32_t>(), chunk_srow.data_as<int32_t>(), w.out_pad, v4_runs_of(v)};
      exl2_v4_repack_kernel<<<elementwise_blocks(total, 256), 256, 0, stream>>>(vs, v.tile_stride,
                                                                                 w.v4_q_weight.data_as<uint32_t>());
      EXL2_CUDA_LAUNCH_CHECK("exl2_v4_repack_kernel");
    }
    EXL2_CUDA_CHECK(cudaStreamSynchronize(stream));  // the repack's inputs are freed on return
    EXL2_CHECK(reinterpret_cast<uintptr_t>(w.v4_q_weight.data()) % 16 == 0,
               "exl2_upload: the v4 q_weight must be 16-byte aligned");
  }
  if (bias_f32.defined()) {
    EXL2_CHECK(bias_f32.dtype() == DType::F32 && bias_f32.numel() == layout.out, "exl2_upload: bias must be f32 [",
               layout.out, "], got ", bias_f32.describe());
    w.bias = bias_f32.to(device);
  }
  return w;
}

int64_t exl2_upload_bytes(const quant::Exl2Layout& layout) {
  auto a = [](size_t n) { return static_cast<int64_t>(weight_arena_aligned(n)); };
  const size_t G = layout.groups.size();
  const size_t out_pad = static_cast<size_t>(layout.out_pad);
  int64_t n = layout.has_bias ? a(static_cast<size_t>(layout.out) * 4) : 0;
  const int gemv = exl2_gemv_v4_requested();
  if (gemv == 0) {  // exl2_upload's main branch: q_weight, q_scale, msc, q_perm, slots, units, xsrc
    const Exl2TcTables t = exl2_tc_tables(layout);
    n += a(out_pad / 8 * static_cast<size_t>(std::max<int64_t>(1, t.tile_stride)) * 4);
    n += a(G * (out_pad / 8) * 4) + a(G * 2) + a(layout.perm.size() * 4);
    n += a(t.slots.size() * 4) + a(t.units.size() * 4) + a(t.xsrc.size() * 4);
  } else {  // the v4 branch: kcoef (v4k), msc (one word per unit slot), chunk_woff, xsrc, q_weight
    const Exl2V4Tables v = exl2_v4_tables(layout);
    if (gemv == 2) n += a(v.kcoef.size() * 4);
    n += a(v.ugroup.size() * 4) + a(v.chunk_woff.size() * 4) + a(v.xsrc.size() * 4);
    n += a(out_pad / 16 * static_cast<size_t>(std::max<int64_t>(1, v.tile_stride)) * 4);
  }
  return n;
}

int64_t exl2_device_bytes(const Exl2DeviceWeights& w) {
  int64_t n = 0;
  for (const Tensor* t : {&w.q_weight, &w.q_scale, &w.msc, &w.q_perm, &w.slots, &w.xsrc, &w.units, &w.bias,
                          &w.v4_q_weight, &w.v4_chunk_woff, &w.v4_xsrc, &w.v4_kcoef, &w.v4_msc})
    if (t->defined()) n += static_cast<int64_t>(t->nbytes());
  return n;
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

namespace {
// Whether the bytes of a and b intersect.
bool overlaps(const Tensor& a, const Tensor& b) {
  const char* pa = static_cast<const char*>(a.data());
  const char* pb = static_cast<const char*>(b.data());
  return !(pa + a.nbytes() <= pb || pb + b.nbytes() <= pa);
}

// exl2_gemm's checks of x, y against the layer (InvalidArgument naming what differs).
void check_gemm_args(const Tensor& x, const Exl2DeviceWeights& w, const Tensor& y) {
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
  EXL2_CHECK(!overlaps(y, x), "exl2_gemm: y must not overlap x");
}
}  // namespace

void exl2_gemm(const Tensor& x, const Exl2DeviceWeights& w, Tensor& y) {
  check_gemm_args(x, w, y);
  const int64_t n = x.numel() / w.in;
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

int64_t exl2_gemv_cluster_launches() { return g_cluster_launches.load(std::memory_order_relaxed); }
int64_t exl2_gemv_m32_launches() { return g_m32_launches.load(std::memory_order_relaxed); }

bool exl2_gemm_group_enabled() { return env_switch("EXL2CPP_GEMV_GROUP", "1", "0"); }

namespace {
// The V4Group of layers ws (one device) writing ys, each layer its own region of the device's split-k accumulator and
// counters (all zero between launches; a layer's last blocks clear theirs again, as in the single-layer launch). The
// state is sized for all of them and never below what the single-layer path asks for, so that the paths never shrink
// each other's state.
V4Group v4_group_of(const std::vector<const Exl2DeviceWeights*>& ws, const std::vector<Tensor*>& ys,
                    cudaStream_t stream) {
  const Exl2DeviceWeights& w0 = *ws[0];
  int64_t acc_floats = 0, n_counters = 0;
  for (const Exl2DeviceWeights* w : ws) {
    acc_floats += int64_t(kMaxM) * w->out_pad;
    n_counters += ceil_div(w->out_pad, kV4Cols);
  }
  acc_floats = std::max(acc_floats, int64_t(kMaxM) * w0.out_pad);
  n_counters = std::max(n_counters, std::max(ceil_div(w0.out_pad, kTcCols), ceil_div(w0.out_pad, kV4Cols)));
  GemvState& st = gemv_state(w0.device.index, acc_floats, n_counters, stream);
  V4Group g;
  g.n = static_cast<int>(ws.size());
  float* acc = st.acc;
  unsigned* counters = st.counters;
  for (size_t i = 0; i < ws.size(); ++i) {
    g.l[i] = v4_layer(*ws[i], ys[i]->data_as<__half>(), acc, counters);
    acc += int64_t(kMaxM) * ws[i]->out_pad;
    counters += g.l[i].col_blocks;
  }
  return g;
}
}  // namespace

bool exl2_gemm_group(const Tensor& x, const std::vector<const Exl2DeviceWeights*>& ws, const std::vector<Tensor*>& ys) {
  EXL2_CHECK(ws.size() == ys.size(), "exl2_gemm_group: ", ws.size(), " layers but ", ys.size(), " outputs");
  if (ws.size() < 2 || ws.size() > size_t(kV4MaxGroup) || !exl2_gemm_group_enabled()) return false;
  const Exl2DeviceWeights& w0 = *ws[0];
  for (const Exl2DeviceWeights* w : ws)
    if (w->gemv == 0 || w->device != w0.device || w->in != w0.in || w->v4_correct != w0.v4_correct) return false;
  if (!x.defined() || x.dtype() != DType::F16 || x.device() != w0.device || ref_kernels_enabled()) return false;
  for (size_t i = 0; i < ws.size(); ++i) {
    EXL2_CHECK(ys[i] != nullptr, "exl2_gemm_group: output ", i, " is null");
    check_gemm_args(x, *ws[i], *ys[i]);
  }
  const int64_t n = x.numel() / w0.in;
  if (n < 1 || n > v4_rows_per_launch(w0.v4_correct) || n > exl2_gemm_threshold()) return false;
  for (size_t i = 0; i < ys.size(); ++i)
    for (size_t j = i + 1; j < ys.size(); ++j)
      EXL2_CHECK(!overlaps(*ys[i], *ys[j]), "exl2_gemm_group: outputs ", i, " and ", j, " overlap");
  DeviceGuard guard(w0.device.index);
  cudaStream_t stream = current_stream();
  V4Group g = v4_group_of(ws, ys, stream);
  launch_gemv_v4_any(x.data_as<__half>(), static_cast<int>(n), w0.in, w0.v4_correct, g, stream);
  return true;
}

bool exl2_gemm_fused(const Tensor& src, const std::vector<const Exl2DeviceWeights*>& ws, const std::vector<Tensor*>& ys,
                     int prologue, const Tensor& norm_w, float eps, const Tensor& up, bool add_into) {
  EXL2_CHECK(ws.size() == ys.size(), "exl2_gemm_fused: ", ws.size(), " layers but ", ys.size(), " outputs");
  EXL2_CHECK(prologue >= 0 && prologue <= 2, "exl2_gemm_fused: prologue must be 0, 1 or 2, got ", prologue);
  if (ws.empty() || ws.size() > size_t(kV4MaxGroup) || (ws.size() >= 2 && !exl2_gemm_group_enabled())) return false;
  if (add_into && ws.size() != 1) return false;
  const Exl2DeviceWeights& w0 = *ws[0];
  for (const Exl2DeviceWeights* w : ws)
    if (w->gemv == 0 || w->device != w0.device || w->in != w0.in || w->v4_correct != w0.v4_correct) return false;
  if (!src.defined() || src.dtype() != DType::F16 || src.device() != w0.device || ref_kernels_enabled()) return false;
  for (size_t i = 0; i < ws.size(); ++i) {
    EXL2_CHECK(ys[i] != nullptr, "exl2_gemm_fused: output ", i, " is null");
    check_gemm_args(src, *ws[i], *ys[i]);
  }
  const int64_t n = src.numel() / w0.in;
  if (n < 1 || n > v4_rows_per_launch(w0.v4_correct) || n > exl2_gemm_threshold()) return false;
  if (w0.v4_correct && n > 8) return false;  // the fused v4k kernel for two n-tiles spills in its loops: not built
  V4Fuse fz;
  fz.prologue = prologue;
  fz.add = add_into ? 1 : 0;
  if (prologue == 1) {
    if (!norm_w.defined() || norm_w.device() != w0.device || norm_w.numel() != w0.in ||
        !(norm_w.dtype() == DType::F32 || norm_w.dtype() == DType::F16 || norm_w.dtype() == DType::BF16))
      return false;
    fz.norm_w = norm_w.data();
    fz.w_type = norm_w.dtype() == DType::F32 ? 0 : norm_w.dtype() == DType::F16 ? 1 : 2;
    fz.eps = eps;
    fz.vec = (w0.in % 8 == 0 && reinterpret_cast<uintptr_t>(src.data()) % 16 == 0) ? 1 : 0;
  } else if (prologue == 2) {
    if (!up.defined() || up.dtype() != DType::F16 || up.device() != w0.device || up.numel() != src.numel())
      return false;
    fz.up = up.data_as<__half>();
  }
  for (size_t i = 0; i < ys.size(); ++i) {
    if ((prologue == 1 && overlaps(*ys[i], norm_w)) || (prologue == 2 && overlaps(*ys[i], up))) return false;
    for (size_t j = i + 1; j < ys.size(); ++j)
      EXL2_CHECK(!overlaps(*ys[i], *ys[j]), "exl2_gemm_fused: outputs ", i, " and ", j, " overlap");
  }
  DeviceGuard guard(w0.device.index);
  cudaStream_t stream = current_stream();
  V4Group g = v4_group_of(ws, ys, stream);
  const __half* xp = src.data_as<__half>();
  const int mi = static_cast<int>(n);
  if (w0.v4_correct)
    launch_gemv_v4_m<true, false, true>(xp, mi, w0.in, g, stream, fz);
  else
    launch_gemv_v4_m<false, false, true>(xp, mi, w0.in, g, stream, fz);
  return true;
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
