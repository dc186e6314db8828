// cuda/exl2_gemm.h: the v4 device layout (tables and repack), the launches of the v4 GEMV (cuda/exl2_gemv_v4.cuh)
// and of dequantize + cuBLAS as the op's plan says, and the per-device accumulator the GEMV shares between launches.
// Decoding is in cuda/exl2_decode.cuh.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include "core/weight_arena.h"
#include "cuda/common.cuh"
#include "cuda/exl2_decode.cuh"
#include "cuda/exl2_gemm.h"
#include "cuda/exl2_gemv_v4.cuh"
#include "cuda/graph_exec.h"
#include "cuda/pdl.cuh"

namespace exl2::cuda {

namespace {

using namespace exl2k;

constexpr int kMaxM = 32;                           // rows of x per GEMV launch at most (accumulator rows)
constexpr int64_t kMaxDqElems = int64_t(64) << 20;  // dequant path: W chunk at most this many elements
constexpr int kMaxDevices = 64;

// ---- dequantize + cuBLAS ---------------------------------------------------------------------------------------

// The v4 layout (cuda/exl2_gemv_v4.cuh) from ExLlamaV2's: one thread per destination word.
__global__ void exl2_v4_repack_kernel(V4Src src, int64_t tile_stride, uint32_t* __restrict__ dst) {
  const int64_t total = (src.out_pad / 16) * tile_stride;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x)
    dst[e] = v4_layout_word(src, e / tile_stride, e % tile_stride);
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

// ---- launchers ---------------------------------------------------------------------------------------------------

constexpr int kV4SmemBytes = 40 * 1024;  // v4 GEMV: staged x + group maxima per block at most

std::atomic<int64_t> g_m32_launches{0};

// The launch knobs the plan's tuning asks for (cuda/exl2_gemv_v4.cuh V4Knobs); PDL also needs cuda/pdl.h's switch.
V4Knobs v4_knobs(const ops::Exl2MatmulTuning& t) {
  V4Knobs k;
  k.prefetch_bytes = t.prefetch_bytes;
  k.ahead = t.prefetch_ahead ? 1 : 0;
  k.pdl = pdl_enabled() ? 1 : 0;
  k.l1 = 0;
  return k;
}

// One layer's part of a v4 launch (cps, slices, block0: v4_plan), its split-k regions acc / counters.
V4Layer v4_layer(const Exl2DeviceWeights& w, __half* y, float* acc, unsigned* counters) {
  V4Layer L;
  L.qw = w.v4_q_weight.data_as<uint32_t>();
  L.msc = w.v4_msc.data_as<uint32_t>();
  L.chunk_woff = w.v4_chunk_woff.data_as<int32_t>();
  L.xsrc = w.v4_xsrc.data_as<int32_t>();
  L.kcoef = nullptr;
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
// y / acc / counters set): k split by v4_plan under the plan's tuning, one wave.
template <int M, bool FUSE = false>
void launch_gemv_v4(const __half* x, int m, int64_t in, V4Group& g, const ops::Exl2MatmulTuning& t,
                    cudaStream_t stream, const V4Fuse& fz = {}) {
  const int unit_bytes = M * 32 * 2 + 4;  // x + group maximum per unit
  const int max_cps = std::max(1, kV4SmemBytes / (4 * unit_bytes));
  static int occ[kMaxDevices] = {};  // per instantiation
  int dev = 0;
  EXL2_CUDA_CHECK(cudaGetDevice(&dev));
  if (occ[dev] == 0) {
    int b = 0;
    EXL2_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, exl2_gemv_v4_kernel<M, false, false, FUSE>,
                                                                  kV4Threads, kV4SmemBytes));
    occ[dev] = std::max(1, b);
  }
  // Bytes in flight do not need more blocks than one wave: each warp asks L2 for its slice at the start.
  const int blocks_per_sm = t.blocks_per_sm > 0 ? std::min(t.blocks_per_sm, occ[dev]) : occ[dev];
  const int64_t wave = int64_t(sm_count()) * blocks_per_sm;
  const bool fits = v4_plan(g, sm_count(), wave, t.chunks_per_slice, max_cps, t.slices);
  EXL2_CHECK_KIND(Cuda, fits && g.blocks > 0, "EXL2 v4 GEMV grid too large: ", g.blocks, " blocks");
  g.cluster = 0;
  int cps = 1;
  for (int i = 0; i < g.n; ++i) cps = std::max(cps, g.l[i].cps);
  const size_t smem = size_t(cps) * 4 * unit_bytes;
  if (M == 32) g_m32_launches.fetch_add(1, std::memory_order_relaxed);
  const V4Knobs knobs = v4_knobs(t);
  const V4Group& gc = g;
  launch_kernel_cluster_pdl_if(knobs.pdl, 1u, __FILE__, __LINE__,
                               FUSE ? "exl2_gemv_v4_kernel<fuse>" : "exl2_gemv_v4_kernel",
                               exl2_gemv_v4_kernel<M, false, false, FUSE>, dim3(static_cast<unsigned>(g.blocks)),
                               dim3(kV4Threads), smem, stream, x, in, m, gc, knobs, fz);
}

// The instantiation for m rows (the plan's m_tile).
template <bool FUSE = false>
void launch_gemv_v4_m(const __half* x, int m, int m_tile, int64_t in, V4Group& g, const ops::Exl2MatmulTuning& t,
                      cudaStream_t stream, const V4Fuse& fz = {}) {
  EXL2_CHECK_KIND(Internal, m >= 1 && m <= m_tile, "EXL2 v4 GEMV: ", m, " rows for a ", m_tile, "-row launch");
  switch (m_tile) {
    case 1: return launch_gemv_v4<1, FUSE>(x, m, in, g, t, stream, fz);
    case 2: return launch_gemv_v4<2, FUSE>(x, m, in, g, t, stream, fz);
    case 4: return launch_gemv_v4<4, FUSE>(x, m, in, g, t, stream, fz);
    case 8: return launch_gemv_v4<8, FUSE>(x, m, in, g, t, stream, fz);
    case 16: return launch_gemv_v4<16, FUSE>(x, m, in, g, t, stream, fz);
    case 32: return launch_gemv_v4<32, FUSE>(x, m, in, g, t, stream, fz);
    default: EXL2_FAIL(Internal, "EXL2 v4 GEMV: no kernel for ", m_tile, " rows");
  }
}

int64_t n_counters_of(const Exl2DeviceWeights& w) { return ceil_div(w.out_pad, kV4Cols); }

template <typename T>
void dequant_gemm(const T* xs, const Exl2DeviceWeights& w, T* ys, int64_t n, cudaStream_t stream) {
  const int64_t in = w.in, out = w.out, out_pad = w.out_pad;
  EXL2_CHECK_KIND(Unsupported, n <= INT_MAX && in <= INT_MAX && out <= INT_MAX,
                  "EXL2 GEMM: sizes beyond cuBLAS int range (n=", n, ", in=", in, ", out=", out, ")");
  const int64_t chunk = std::min(out_pad, std::max<int64_t>(32, kMaxDqElems / in / 32 * 32));
  T* wp = static_cast<T*>(workspace(size_t(in * chunk) * sizeof(T)));
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
    // W in the original input order (through v4_xsrc), so x is used as is.
    dim3 grid(static_cast<unsigned>(ceil_div(width, 128)), static_cast<unsigned>(w.v4_chunks));
    exl2_v4_dequant_kernel<T><<<grid, 128, 0, stream>>>(w.v4_q_weight.data_as<uint32_t>(), w.v4_tile_stride,
                                                        w.v4_chunk_woff.data_as<int32_t>(),
                                                        w.v4_xsrc.data_as<int32_t>(), w.v4_msc.data_as<uint32_t>(),
                                                        v4_runs(w.v4_runs), c0, width, wp);
    EXL2_CUDA_LAUNCH_CHECK("exl2_v4_dequant_kernel");
    // Row-major y[n, out] is column-major y^T [out, n]; its rows c0.. = Wp^T (col-major [width, in]) @ x^T.
    EXL2_CUBLAS_CHECK(cublasGemmEx(cublas_handle(), CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(nc), static_cast<int>(n),
                                   static_cast<int>(in), &alpha, wp, t, static_cast<int>(width), xs, t,
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

Exl2DeviceWeights exl2_upload(const quant::Exl2Layout& layout, const Tensor& q_weight, const Tensor& q_scale,
                              const std::vector<uint16_t>& msc, const Tensor& bias_f32, Device device) {
  EXL2_CHECK(device.is_cuda(), "exl2_upload: a CUDA device expected, got ", device.str());
  EXL2_CHECK(msc.size() == layout.groups.size(), "exl2_upload: msc has ", msc.size(), " entries for ",
             layout.groups.size(), " groups");
  EXL2_CHECK(layout.out_pad % 32 == 0 && q_weight.dim() == 2 && q_weight.size(1) == layout.out_pad,
             "exl2_upload: q_weight must be [qrows, out_pad] with out_pad % 32 == 0, got ", q_weight.describe());
  Exl2DeviceWeights w;
  w.device = device;
  w.in = layout.in;
  w.out = layout.out;
  w.out_pad = layout.out_pad;
  w.n_groups = static_cast<int64_t>(layout.groups.size());
  // q_scale and the file's q_weight are needed for the repack alone (the 4-bit scale codes live in the layout after
  // each chunk's weights, the group maxima in v4_msc, the permutation in v4_xsrc).
  const Exl2V4Tables v = exl2_v4_tables(layout);
  for (int b : v.run_bits) w.max_bits = std::max(w.max_bits, b);
  w.v4_chunks = v.n_chunks;
  w.v4_tile_stride = v.tile_stride;
  w.v4_runs = v4_flat_runs(v);
  {
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
  const size_t out_pad = static_cast<size_t>(layout.out_pad);
  int64_t n = layout.has_bias ? a(static_cast<size_t>(layout.out) * 4) : 0;
  // exl2_upload's tensors: msc (one word per unit slot), chunk_woff, xsrc, q_weight
  const Exl2V4Tables v = exl2_v4_tables(layout);
  n += a(v.ugroup.size() * 4) + a(v.chunk_woff.size() * 4) + a(v.xsrc.size() * 4);
  n += a(out_pad / 16 * static_cast<size_t>(std::max<int64_t>(1, v.tile_stride)) * 4);
  return n;
}

int64_t exl2_device_bytes(const Exl2DeviceWeights& w) {
  int64_t n = 0;
  for (const Tensor* t : {&w.bias, &w.v4_q_weight, &w.v4_chunk_woff, &w.v4_xsrc, &w.v4_msc})
    if (t->defined()) n += static_cast<int64_t>(t->nbytes());
  return n;
}

ops::Exl2GpuInfo exl2_gpu_info(int device) {
  static std::mutex mutex;
  static ops::Exl2GpuInfo cache[kMaxDevices];
  EXL2_CHECK_KIND(Cuda, device >= 0 && device < kMaxDevices, "CUDA device index ", device, " out of range");
  std::lock_guard<std::mutex> lock(mutex);
  ops::Exl2GpuInfo& g = cache[device];
  if (g.cc == 0) {
    cudaDeviceProp p{};
    EXL2_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
    g.name = p.name;
    g.cc = p.major * 10 + p.minor;
    g.sm_count = p.multiProcessorCount;
  }
  return g;
}

void exl2_gemm(const void* x, DType act, int64_t n, const Exl2DeviceWeights& w, void* y,
               const ops::Exl2MatmulPlan& plan) {
  if (n == 0) return;
  DeviceGuard guard(w.device.index);
  cudaStream_t stream = current_stream();
  if (plan.kernel == ops::Exl2Kernel::dequant_cublas) {
    if (act == DType::F16)
      dequant_gemm<__half>(static_cast<const __half*>(x), w, static_cast<__half*>(y), n, stream);
    else
      dequant_gemm<float>(static_cast<const float*>(x), w, static_cast<float*>(y), n, stream);
    return;
  }
  EXL2_CHECK_KIND(Internal, plan.kernel == ops::Exl2Kernel::gemv_v4 && act == DType::F16,
                  "exl2_gemm: a plan of kernel ", ops::exl2_kernel_name(plan.kernel), " for ", dtype_name(act), " x");
  GemvState& st = gemv_state(w.device.index, int64_t(kMaxM) * w.out_pad, n_counters_of(w), stream);
  const __half* xp = static_cast<const __half*>(x);
  __half* yp = static_cast<__half*>(y);
  for (const ops::Exl2Launch& l : plan.launches) {
    V4Group g;
    g.n = 1;
    g.l[0] = v4_layer(w, yp + l.row0 * w.out, st.acc, st.counters);
    launch_gemv_v4_m(xp + l.row0 * w.in, static_cast<int>(l.rows), l.m_tile, w.in, g, plan.tuning, stream);
  }
}

int64_t exl2_gemv_m32_launches() { return g_m32_launches.load(std::memory_order_relaxed); }

namespace {
// The V4Group of layers ws (one device) writing ys, each layer its own region of the device's split-k accumulator and
// counters (all zero between launches; a layer's last blocks clear theirs again, as in the single-layer launch). The
// state is sized for all of them and never below what the single-layer path asks for, so that the paths never shrink
// each other's state.
V4Group v4_group_of(const std::vector<const Exl2DeviceWeights*>& ws, const std::vector<void*>& ys,
                    cudaStream_t stream) {
  const Exl2DeviceWeights& w0 = *ws[0];
  int64_t acc_floats = 0, n_counters = 0;
  for (const Exl2DeviceWeights* w : ws) {
    acc_floats += int64_t(kMaxM) * w->out_pad;
    n_counters += n_counters_of(*w);
  }
  acc_floats = std::max(acc_floats, int64_t(kMaxM) * w0.out_pad);
  n_counters = std::max(n_counters, n_counters_of(w0));
  GemvState& st = gemv_state(w0.device.index, acc_floats, n_counters, stream);
  V4Group g;
  g.n = static_cast<int>(ws.size());
  float* acc = st.acc;
  unsigned* counters = st.counters;
  for (size_t i = 0; i < ws.size(); ++i) {
    g.l[i] = v4_layer(*ws[i], static_cast<__half*>(ys[i]), acc, counters);
    acc += int64_t(kMaxM) * ws[i]->out_pad;
    counters += g.l[i].col_blocks;
  }
  return g;
}

void check_one_launch(const char* who, const ops::Exl2MatmulPlan& plan, size_t n_layers) {
  EXL2_CHECK_KIND(Internal,
                  plan.kernel == ops::Exl2Kernel::gemv_v4 && plan.launches.size() == 1 && n_layers >= 1 &&
                      n_layers <= size_t(kV4MaxGroup),
                  who, ": a plan of one gemv_v4 launch for 1..", kV4MaxGroup, " layers expected");
}
}  // namespace

void exl2_gemm_group(const void* x, int64_t n, const std::vector<const Exl2DeviceWeights*>& ws,
                     const std::vector<void*>& ys, const ops::Exl2MatmulPlan& plan) {
  check_one_launch("exl2_gemm_group", plan, ws.size());
  const Exl2DeviceWeights& w0 = *ws[0];
  DeviceGuard guard(w0.device.index);
  cudaStream_t stream = current_stream();
  V4Group g = v4_group_of(ws, ys, stream);
  const ops::Exl2Launch& l = plan.launches[0];
  launch_gemv_v4_m(static_cast<const __half*>(x), static_cast<int>(n), l.m_tile, w0.in, g, plan.tuning, stream);
}

void exl2_gemm_fused(const void* src, int64_t n, const std::vector<const Exl2DeviceWeights*>& ws,
                     const std::vector<void*>& ys, const ops::Exl2MatmulPlan& plan, const Exl2Prologue& pro) {
  check_one_launch("exl2_gemm_fused", plan, ws.size());
  const Exl2DeviceWeights& w0 = *ws[0];
  V4Fuse fz;
  fz.prologue = pro.kind;
  fz.add = pro.add_into ? 1 : 0;
  if (pro.kind == 1) {
    fz.norm_w = pro.norm_w;
    fz.w_type = pro.norm_dtype == DType::F32 ? 0 : pro.norm_dtype == DType::F16 ? 1 : 2;
    fz.eps = pro.eps;
    fz.vec = pro.vec ? 1 : 0;
  } else if (pro.kind == 2) {
    fz.up = static_cast<const __half*>(pro.up);
  }
  DeviceGuard guard(w0.device.index);
  cudaStream_t stream = current_stream();
  V4Group g = v4_group_of(ws, ys, stream);
  const ops::Exl2Launch& l = plan.launches[0];
  launch_gemv_v4_m<true>(static_cast<const __half*>(src), static_cast<int>(n), l.m_tile, w0.in, g, plan.tuning,
                         stream, fz);
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
