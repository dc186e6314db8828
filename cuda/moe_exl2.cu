// cuda/moe_exl2.h: the grouped EXL2 v4 expert GEMV (the v4 kernel's staging and chunk loops, cuda/exl2_gemv_v4.cuh,
// driven by the device-side grouping), its slice reduce, and the grouped dense f16 GEMV.
#include <algorithm>
#include <cstring>

#include "cuda/common.cuh"
#include "cuda/exl2_gemm.h"
#include "cuda/exl2_gemv_v4.cuh"
#include "cuda/graph_exec.h"
#include "cuda/moe_exl2.h"
#include "cuda/pdl.cuh"
#include "cuda/stream.h"

namespace exl2::cuda {

namespace {

using namespace exl2k;

constexpr int kMoeSmemBytes = 40 * 1024;  // staged x per block at most (as the v4 GEMV)
constexpr int kMoeTargetChunks = 8;       // chunks per k slice aimed at when slicing for parallelism
constexpr int kDenseWarps = 8, kDenseRows = 8;

// One expert's v4 layer (Exl2DeviceWeights' v4_ tensors), read by the blocks from global memory.
struct MoeV4Expert {
  const uint32_t* qw;
  const uint32_t* msc;
  const int32_t* chunk_woff;
  const int32_t* xsrc;
  const float* bias;
  int64_t tile_stride;
  V4Runs runs;
  int n_chunks;
};

struct MoeGrid {
  int64_t in, out, out_pad, n_pairs;
  int col_blocks, slices, n_experts, gather_k;
};

// Block (cb + col_blocks * slice, active slot, row group): expert e = active[slot], positions p0 .. p0 + cnt of its
// run (cnt <= M), k slice `slice` of ceil(n_chunks / slices) chunks. Blocks past the active experts or their rows
// exit before reading any weight.
template <int M>
__global__ void __launch_bounds__(kV4Threads, M > 8 ? 2 : 3)
    moe_exl2_v4_kernel(const __half* __restrict__ x, const MoeV4Expert* __restrict__ tab,
                       const int32_t* __restrict__ offsets, const int32_t* __restrict__ perm,
                       const int32_t* __restrict__ active, const MoeGrid g, __half* __restrict__ y,
                       float* __restrict__ part, unsigned long long* bytes_read) {
  constexpr int NT = v4_ntiles<M>();
  extern __shared__ float4 smem4[];
  __shared__ V4Runs R;
  __shared__ const __half* xrow[M];
  pdl_wait();  // active / offsets / perm and x come from the kernels before
  const int slot = blockIdx.y;
  if (slot >= active[g.n_experts]) return;
  const int e = active[slot];
  const int p0 = offsets[e] + int(blockIdx.z) * M, cnt = min(M, offsets[e + 1] - p0);
  if (cnt <= 0) return;
  const MoeV4Expert& L = tab[e];
  const int cb = int(blockIdx.x) % g.col_blocks, slice = int(blockIdx.x) / g.col_blocks;
  const int cps = (L.n_chunks + g.slices - 1) / g.slices;
  const int c0 = min(slice * cps, L.n_chunks), c1 = min(c0 + cps, L.n_chunks);
  const uint32_t* __restrict__ qw = L.qw;
  const int64_t tile_stride = L.tile_stride;
  if (threadIdx.x == 0) R = L.runs;
  if (threadIdx.x < M) {
    const int n = threadIdx.x, p = p0 + (n < cnt ? n : 0);
    xrow[n] = x + (g.gather_k > 0 ? int64_t(perm[p] / g.gather_k) : int64_t(p)) * g.in;
  }
  const int nu = (c1 - c0) * 4;
  __half* xs = reinterpret_cast<__half*>(smem4);                 // [nu][M][32]
  uint32_t* ms = reinterpret_cast<uint32_t*>(xs + nu * M * 32);  // [nu]
  const int64_t wtile = int64_t(cb) * kV4Warps + threadIdx.x / 32;
  if (wtile * 16 < g.out_pad && c1 > c0) {  // the warp's slice of its tile: one contiguous range, into L2 now
    const int w0 = __ldg(L.chunk_woff + c0), w1 = __ldg(L.chunk_woff + c1);
    const uint32_t* base = qw + wtile * tile_stride + w0;
    if (threadIdx.x % 32 == 0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base), "r"(min(4 * (w1 - w0), kV4PrefetchBytes))
                   : "memory");
#endif
      if (bytes_read) atomicAdd(bytes_read, static_cast<unsigned long long>(4 * (w1 - w0)));
    }
  }
  __syncthreads();  // xrow, R
  const int32_t* __restrict__ xsrc = L.xsrc;
  for (int i = threadIdx.x; i < nu; i += kV4Threads) ms[i] = __ldg(L.msc + int64_t(c0) * 4 + i);
  for (int i = threadIdx.x; i < nu * M * 4; i += kV4Threads) {
    const int ul = i / (M * 4), n = (i / 4) % M, q = i % 4;
    const int4* src = reinterpret_cast<const int4*>(xsrc + (int64_t(c0) * 4 + ul) * 32 + 8 * q);
    const int4 i0 = __ldg(src), i1 = __ldg(src + 1);
    const int idx[8] = {i0.x, i0.y, i0.z, i0.w, i1.x, i1.y, i1.z, i1.w};
    const __half* xn = xrow[n];
    uint32_t v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const unsigned short lo = (n < cnt && idx[2 * j] >= 0) ? __half_as_ushort(xn[idx[2 * j]]) : 0;
      const unsigned short hi = (n < cnt && idx[2 * j + 1] >= 0) ? __half_as_ushort(xn[idx[2 * j + 1]]) : 0;
      v[j] = uint32_t(lo) | uint32_t(hi) << 16;
    }
    *reinterpret_cast<uint4*>(xs + (ul * M + n) * 32 + 8 * q) = make_uint4(v[0], v[1], v[2], v[3]);
  }
  __syncthreads();

  float a[NT][4] = {};
  if (wtile * 16 < g.out_pad) {
    const int lane = threadIdx.x % 32, gl = lane / 4, t = lane % 4;
    const uint32_t* qt = qw + wtile * tile_stride;
    const __half* xl = xs + (gl % M) * 32 + 8 * t;
    const float* kl = reinterpret_cast<const float*>(ms);  // v4_run's correction sums: unused without KC
    for (int r = 0; r < R.n; ++r) {
      const int rs = R.start[r], cs = max(c0, rs), ce = min(c1, R.start[r + 1]);
      if (cs >= ce) continue;
      const int bits = R.bits[r], rpc = R.rpc[r];
      const uint32_t* p = qt + R.woff[r] + (cs - rs) * v4_chunk_words(bits, rpc);
      const __half* xr = xl + (cs - c0) * 4 * M * 32;
      const uint32_t* mr = ms + (cs - c0) * 4;
      switch (bits) {
        case 2:
          v4_run<2, M, false, false>(rpc, p, ce - cs, lane, xr, kl, mr, true, a);
          break;
        case 3:
          v4_run<3, M, false, false>(rpc, p, ce - cs, lane, xr, kl, mr, true, a);
          break;
        case 4:
          v4_run<4, M, false, false>(rpc, p, ce - cs, lane, xr, kl, mr, true, a);
          break;
        case 5:
          v4_run<5, M, false, false>(rpc, p, ce - cs, lane, xr, kl, mr, true, a);
          break;
        case 6:
          v4_run<6, M, false, false>(rpc, p, ce - cs, lane, xr, kl, mr, true, a);
          break;
        case 8:
          v4_run<8, M, false, false>(rpc, p, ce - cs, lane, xr, kl, mr, true, a);
          break;
        default:
          break;
      }
    }
  }
  // Epilogue (lane layout of the mma: n-tile j, c0/c2 columns gl / gl + 8 of row 8j + 2t, c1/c3 row + 1). One
  // slice: y = f16(sum + bias); else this slice's fp32 partials into part [slices][n_pairs][out_pad] (empty slices
  // write zeros), added in slice order by moe_slice_reduce_kernel.
  // It re-derives its block, expert and lane from the special registers (volatile reads the compiler cannot merge
  // with the prologue's) and the grouping (L1 / L2 hits), so that none stays live across the chunk loops: as in the
  // v4 kernel, the m <= 8 kernels (80 registers) spilled with them live.
  unsigned bx, by, bz, tx;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(bx));
  asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(by));
  asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(bz));
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tx));
  const int ee = active[by], eslice = int(bx) / g.col_blocks;
  const int ep0 = offsets[ee] + int(bz) * M, ecnt = min(M, offsets[ee + 1] - ep0);
  const int64_t etile = int64_t(int(bx) % g.col_blocks) * kV4Warps + tx / 32;
  if (etile * 16 >= g.out_pad) return;
  const float* __restrict__ bias = tab[ee].bias;
  const int gl = (tx % 32) / 4, t = tx % 4;
  const int64_t cg = etile * 16 + gl;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int h = 0; h < (M > 1 ? 2 : 1); ++h) {
      const int r0 = 8 * j + 2 * t + h;
      if (r0 >= ecnt) continue;
      const float s0 = h ? a[j][1] : a[j][0], s1 = h ? a[j][3] : a[j][2];
      const int64_t pr = ep0 + r0;
      if (g.slices == 1) {
        if (cg < g.out) y[pr * g.out + cg] = __float2half_rn(s0 + (bias ? bias[cg] : 0.f));
        if (cg + 8 < g.out) y[pr * g.out + cg + 8] = __float2half_rn(s1 + (bias ? bias[cg + 8] : 0.f));
      } else {
        float* pp = part + (int64_t(eslice) * g.n_pairs + pr) * g.out_pad + cg;
        pp[0] = s0;
        pp[8] = s1;
      }
    }
  }
}

// y[p, c] = f16(sum over slices s in order of part[s][p][c] + bias of p's expert). Positions of no active expert
// (none: every position belongs to one) are not touched. grid (column blocks of 256, positions).
__global__ void __launch_bounds__(256)
    moe_slice_reduce_kernel(const float* __restrict__ part, const MoeV4Expert* __restrict__ tab,
                            const int32_t* __restrict__ offsets, const MoeGrid g, __half* __restrict__ y) {
  pdl_wait();
  const int64_t p = blockIdx.y, c = int64_t(blockIdx.x) * 256 + threadIdx.x;
  if (c >= g.out) return;
  int lo = 0, hi = g.n_experts;  // the expert e with offsets[e] <= p < offsets[e + 1]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (offsets[mid] <= p)
      lo = mid;
    else
      hi = mid;
  }
  float s = 0.f;
  for (int i = 0; i < g.slices; ++i) s += part[(int64_t(i) * g.n_pairs + p) * g.out_pad + c];
  const float* bias = tab[lo].bias;
  y[p * g.out + c] = __float2half_rn(s + (bias ? bias[c] : 0.f));
}

// Dense f16 experts: block (column group of kDenseWarps, active slot, row group of kDenseRows); warp w computes
// column c for the block's rows: lanes stride over `in` (8 halves per load when VEC), fp32, a fixed warp tree.
template <bool VEC>
__global__ void __launch_bounds__(kDenseWarps * 32)
    moe_dense_kernel(const __half* const* __restrict__ w_ptrs, int64_t in, int64_t out, const __half* __restrict__ x,
                     int gather_k, const int32_t* __restrict__ offsets, const int32_t* __restrict__ perm,
                     const int32_t* __restrict__ active, int n_experts, __half* __restrict__ y,
                     unsigned long long* bytes_read) {
  pdl_wait();
  const int slot = blockIdx.y;
  if (slot >= active[n_experts]) return;
  const int e = active[slot];
  const int p0 = offsets[e] + int(blockIdx.z) * kDenseRows, cnt = min(kDenseRows, offsets[e + 1] - p0);
  const int64_t c = int64_t(blockIdx.x) * kDenseWarps + threadIdx.x / 32;
  if (cnt <= 0 || c >= out) return;
  const int lane = threadIdx.x % 32;
  const __half* wr = w_ptrs[e] + c * in;
  const __half* xr[kDenseRows];
#pragma unroll
  for (int n = 0; n < kDenseRows; ++n) {
    const int p = p0 + (n < cnt ? n : 0);
    xr[n] = x + (gather_k > 0 ? int64_t(perm[p] / gather_k) : int64_t(p)) * in;
  }
  float acc[kDenseRows] = {};
  if constexpr (VEC) {
    for (int64_t i = 8 * lane; i < in; i += 256) {
      const uint4 wv = __ldg(reinterpret_cast<const uint4*>(wr + i));
      const __half2* wh = reinterpret_cast<const __half2*>(&wv);
#pragma unroll
      for (int n = 0; n < kDenseRows; ++n) {
        if (n >= cnt) break;
        const uint4 xv = *reinterpret_cast<const uint4*>(xr[n] + i);
        const __half2* xh = reinterpret_cast<const __half2*>(&xv);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 wf = __half22float2(wh[q]), xf = __half22float2(xh[q]);
          acc[n] = fmaf(wf.x, xf.x, acc[n]);
          acc[n] = fmaf(wf.y, xf.y, acc[n]);
        }
      }
    }
  } else {
    for (int64_t i = lane; i < in; i += 32) {
      const float wf = __half2float(wr[i]);
#pragma unroll
      for (int n = 0; n < kDenseRows; ++n)
        if (n < cnt) acc[n] = fmaf(wf, __half2float(xr[n][i]), acc[n]);
    }
  }
#pragma unroll
  for (int n = 0; n < kDenseRows; ++n) {
    const float s = warp_sum(acc[n]);
    if (lane == 0 && n < cnt) y[int64_t(p0 + n) * out + c] = __float2half_rn(s);
  }
  if (bytes_read && lane == 0) atomicAdd(bytes_read, static_cast<unsigned long long>(2 * in));
}

}  // namespace

bool moe_exl2_table(const std::vector<const Exl2DeviceWeights*>& ws, MoeExl2Table& t) {
  if (ws.empty()) return false;
  for (const Exl2DeviceWeights* w : ws)
    if (w == nullptr || w->device != ws[0]->device || w->in != ws[0]->in ||
        w->out != ws[0]->out)
      return false;
  std::vector<MoeV4Expert> host(ws.size());
  MoeExl2Table r;
  r.n_experts = static_cast<int64_t>(ws.size());
  r.in = ws[0]->in;
  r.out = ws[0]->out;
  r.out_pad = ws[0]->out_pad;
  for (size_t i = 0; i < ws.size(); ++i) {
    const Exl2DeviceWeights& w = *ws[i];
    MoeV4Expert& d = host[i];
    d.qw = w.v4_q_weight.data_as<uint32_t>();
    d.msc = w.v4_msc.data_as<uint32_t>();
    d.chunk_woff = w.v4_chunk_woff.data_as<int32_t>();
    d.xsrc = w.v4_xsrc.data_as<int32_t>();
    d.bias = w.bias.defined() ? w.bias.data_as<float>() : nullptr;
    d.tile_stride = w.v4_tile_stride;
    d.runs = v4_runs(w.v4_runs);
    d.n_chunks = static_cast<int>(w.v4_chunks);
    r.max_chunks = std::max(r.max_chunks, d.n_chunks);
    r.weight_bytes.push_back(static_cast<int64_t>(w.v4_q_weight.nbytes()));
  }
  Tensor h = Tensor::empty({static_cast<int64_t>(host.size() * sizeof(MoeV4Expert))}, DType::U8);
  std::memcpy(h.data(), host.data(), host.size() * sizeof(MoeV4Expert));
  r.table = h.to(ws[0]->device);
  t = std::move(r);
  return true;
}

namespace {

template <int M>
void launch_moe_exl2(const MoeExl2Table& t, const void* x, int64_t gather_k, const int32_t* offsets,
                     const int32_t* perm, const int32_t* active, int64_t n_pairs, int64_t max_rows, void* y,
                     Tensor& part, uint64_t* bytes_read) {
  const int unit_bytes = M * 32 * 2 + 4;  // x + the group maximum per unit
  const int max_cps = std::max(1, kMoeSmemBytes / (4 * unit_bytes));
  const int col_blocks = static_cast<int>(ceil_div(t.out_pad, kV4Cols));
  const int64_t slots = std::min<int64_t>(t.n_experts, n_pairs), groups = ceil_div(max_rows, M);
  // Slices: as few as the staged x allows, more while the step's blocks (at most `slots` experts active) fill
  // fewer than one block per SM and slices keep >= kMoeTargetChunks chunks.
  int slices = static_cast<int>(ceil_div(t.max_chunks, max_cps));
  const int64_t fill = ceil_div(sm_count(), int64_t(col_blocks) * slots);
  const int most = std::max(1, static_cast<int>(t.max_chunks / kMoeTargetChunks));
  slices = std::max<int>(slices, static_cast<int>(std::min<int64_t>(fill, most)));
  slices = std::max(1, std::min(slices, std::max(t.max_chunks, 1)));
  const int cps = static_cast<int>(ceil_div(t.max_chunks, slices));
  const MoeGrid g{
      t.in, t.out, t.out_pad, n_pairs, col_blocks, slices, static_cast<int>(t.n_experts), static_cast<int>(gather_k)};
  float* pp = nullptr;
  if (slices > 1) {
    const int64_t need = int64_t(slices) * n_pairs * t.out_pad;
    if (!part.defined() || part.numel() < need || part.device() != t.table.device()) {
      part = Tensor::empty({need}, DType::F32, t.table.device());
      bump_scratch_generation();  // CUDA graphs captured with the old partials get recaptured
    }
    pp = part.data_as<float>();
  }
  const auto* tab = reinterpret_cast<const MoeV4Expert*>(t.table.data());
  const dim3 grid(static_cast<unsigned>(int64_t(col_blocks) * slices), static_cast<unsigned>(slots),
                  static_cast<unsigned>(groups));
  EXL2_CUDA_LAUNCH_PDL("moe_exl2_v4_kernel", moe_exl2_v4_kernel<M>, grid, kV4Threads, size_t(cps) * 4 * unit_bytes,
                       current_stream(), static_cast<const __half*>(x), tab, offsets, perm, active, g,
                       static_cast<__half*>(y), pp, reinterpret_cast<unsigned long long*>(bytes_read));
  if (slices > 1)
    EXL2_CUDA_LAUNCH_PDL("moe_slice_reduce_kernel", moe_slice_reduce_kernel,
                         dim3(static_cast<unsigned>(ceil_div(t.out, 256)), static_cast<unsigned>(n_pairs)), 256, 0,
                         current_stream(), static_cast<const float*>(pp), tab, offsets, g, static_cast<__half*>(y));
}

}  // namespace

void moe_exl2_forward(const MoeExl2Table& t, const void* x, int64_t gather_k, const int32_t* offsets,
                      const int32_t* perm, const int32_t* active, int64_t n_pairs, int64_t max_rows, void* y,
                      Tensor& part, uint64_t* bytes_read) {
  if (n_pairs == 0) return;
  EXL2_CHECK(max_rows >= 1 && max_rows <= kMoeGroupedMaxRows, "moe_exl2_forward: max_rows must be 1..",
             kMoeGroupedMaxRows, ", got ", max_rows);
  EXL2_CHECK_KIND(Unsupported, n_pairs <= 65535, "CUDA moe_exl2_forward: at most 65535 (row, slot) pairs, got ",
                  n_pairs);
  // The kernel for the fewest rows one expert can own (max_rows; row groups of 16 above).
  if (max_rows == 1)
    launch_moe_exl2<1>(t, x, gather_k, offsets, perm, active, n_pairs, max_rows, y, part, bytes_read);
  else if (max_rows == 2)
    launch_moe_exl2<2>(t, x, gather_k, offsets, perm, active, n_pairs, max_rows, y, part, bytes_read);
  else if (max_rows <= 4)
    launch_moe_exl2<4>(t, x, gather_k, offsets, perm, active, n_pairs, max_rows, y, part, bytes_read);
  else if (max_rows <= 8)
    launch_moe_exl2<8>(t, x, gather_k, offsets, perm, active, n_pairs, max_rows, y, part, bytes_read);
  else
    launch_moe_exl2<16>(t, x, gather_k, offsets, perm, active, n_pairs, max_rows, y, part, bytes_read);
}

void moe_dense_forward(const void* const* w_ptrs, int64_t n_experts, int64_t in, int64_t out, const void* x,
                       int64_t gather_k, const int32_t* offsets, const int32_t* perm, const int32_t* active,
                       int64_t n_pairs, int64_t max_rows, void* y, uint64_t* bytes_read) {
  if (n_pairs == 0 || out == 0) return;
  const dim3 grid(static_cast<unsigned>(ceil_div(out, kDenseWarps)),
                  static_cast<unsigned>(std::min<int64_t>(n_experts, n_pairs)),
                  static_cast<unsigned>(ceil_div(max_rows, kDenseRows)));
  const bool vec = in % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;  // weights: whole allocations
  auto* w = reinterpret_cast<const __half* const*>(w_ptrs);
  auto* bytes = reinterpret_cast<unsigned long long*>(bytes_read);
  if (vec)
    EXL2_CUDA_LAUNCH_PDL("moe_dense_kernel", moe_dense_kernel<true>, grid, kDenseWarps * 32, 0, current_stream(), w, in,
                         out, static_cast<const __half*>(x), static_cast<int>(gather_k), offsets, perm, active,
                         static_cast<int>(n_experts), static_cast<__half*>(y), bytes);
  else
    EXL2_CUDA_LAUNCH_PDL("moe_dense_kernel", moe_dense_kernel<false>, grid, kDenseWarps * 32, 0, current_stream(), w,
                         in, out, static_cast<const __half*>(x), static_cast<int>(gather_k), offsets, perm, active,
                         static_cast<int>(n_experts), static_cast<__half*>(y), bytes);
}

}  // namespace exl2::cuda
