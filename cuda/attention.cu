// cuda::attention_paged: causal attention over the paged KV cache. Three kernels:
//   - attention_decode_kernel + attention_combine_kernel (few rows): flash-decoding, each block takes the q heads
//     sharing one KV head (GQA) over strided chunks of the sequence; partial softmax states are merged after;
//   - attention_prefill_kernel (many rows): flash-style tiles of 32 query rows x 32 keys, K/V tiles staged in
//     shared memory from the pages, online softmax, fp32 SIMT math (tensor cores: not yet);
//   - attention_ref_kernel: one block per (row, head), one key at a time; used for f32 activations, non-f16
//     caches, head dims other than 64/128/256, and everything when EXL2CPP_CUDA_REF=1.
// Rows may mix sequences and positions: every row reads its own sequence's pages up to its own position.
#include <algorithm>
#include <cmath>

#include "backend/kernels.h"
#include "cuda/common.cuh"

namespace exl2::cuda {

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int64_t kDecodeMaxRows = 16;  // rows <= this: decode kernel; more: prefill kernel

// Element offset of key/value row j of KV head hk in the pages: [n_pages, page_size, n_heads_kv, head_dim].
__device__ __forceinline__ int64_t kv_offset(const int32_t* __restrict__ seq_pages, int64_t j, int64_t page_size,
                                             int64_t n_heads_kv, int64_t hk, int64_t head_dim) {
  const int64_t page = seq_pages[j / page_size];
  return ((page * page_size + j % page_size) * n_heads_kv + hk) * head_dim;
}

// ---- reference ---------------------------------------------------------------------------------------------

// grid (n, n_heads), block: head_dim rounded up to a warp; thread d owns output dim d.
template <typename TA, typename TC>
__global__ void attention_ref_kernel(const TA* __restrict__ q, const TC* __restrict__ k_pages,
                                     const TC* __restrict__ v_pages, const int32_t* __restrict__ positions,
                                     const int32_t* __restrict__ seq_of_token, const int32_t* __restrict__ page_table,
                                     int64_t pages_per_seq, int64_t n_heads, int64_t n_heads_kv, int64_t head_dim,
                                     int64_t page_size, float scale, TA* __restrict__ out) {
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x, h = blockIdx.y;
  const int64_t hk = h / (n_heads / n_heads_kv);
  const int d = threadIdx.x;
  const bool own = d < head_dim;
  const float qd = own ? to_f32(q[(t * n_heads + h) * head_dim + d]) : 0.f;
  const int64_t pos = positions[t];
  const int32_t* seq_pages = page_table + int64_t(seq_of_token[t]) * pages_per_seq;
  float m = -INFINITY, l = 0.f, acc = 0.f;
  for (int64_t j = 0; j <= pos; ++j) {
    const int64_t off = kv_offset(seq_pages, j, page_size, n_heads_kv, hk, head_dim);
    const float s = block_sum(own ? qd * to_f32(k_pages[off + d]) : 0.f, scratch) * scale;
    const float m_new = fmaxf(m, s);
    const float corr = expf(m - m_new), p = expf(s - m_new);
    l = l * corr + p;
    acc = acc * corr + (own ? p * to_f32(v_pages[off + d]) : 0.f);
    m = m_new;
  }
  if (own) out[(t * n_heads + h) * head_dim + d] = from_f32<TA>(acc / l);
}

// ---- decode (flash-decoding, GQA) --------------------------------------------------------------------------

constexpr int kDecodeWarps = 4;
constexpr int kDecodeUnroll = 2;  // keys loaded per warp before use (memory-level parallelism)

// E consecutive f16 -> f32, one vector load (E = 2, 4, 8: 4, 8, 16 bytes; caller guarantees alignment).
template <int E>
__device__ __forceinline__ void load_f16x(const __half* __restrict__ p, float (&f)[E]) {
  if constexpr (E == 8) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = __half22float2(h[i]);
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  } else if constexpr (E == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float2 x = __half22float2(h[i]);
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  } else {
    static_assert(E == 2, "E must be 2, 4 or 8");
    const float2 x = __half22float2(*reinterpret_cast<const __half2*>(p));
    f[0] = x.x;
    f[1] = x.y;
  }
}

// grid (n, n_heads_kv * n_groups, n_splits); block kDecodeWarps warps. Block (t, kv head hk, group grp, split z)
// handles q heads hk*G + grp*GB + [0, gcount) over key chunks z, z + n_splits, ... of row t's sequence.
// Lane owns dims [lane*E, lane*E + E). Scores live in the log2 domain (q pre-scaled by scale*log2(e)).
// Output: the final row when one split covers the row, else partial (acc, m, l) per split for the combine.
template <int D, int GB>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    attention_decode_kernel(const __half* __restrict__ q, const __half* __restrict__ k_pages,
                            const __half* __restrict__ v_pages, const int32_t* __restrict__ positions,
                            const int32_t* __restrict__ seq_of_token, const int32_t* __restrict__ page_table,
                            int64_t pages_per_seq, int n_heads, int n_heads_kv, int n_groups, int64_t page_size,
                            int64_t chunk, float scale_log2, __half* __restrict__ out, float* __restrict__ part_acc,
                            float* __restrict__ part_ml) {
  constexpr int E = D / 32;
  constexpr int NW = kDecodeWarps, U = kDecodeUnroll;
  __shared__ float sm_acc[NW][GB][D];
  __shared__ float sm_m[NW][GB], sm_l[NW][GB];

  const int64_t t = blockIdx.x;
  const int hk = blockIdx.y / n_groups, grp = blockIdx.y % n_groups;
  const int z = blockIdx.z, n_splits = gridDim.z;
  const int G = n_heads / n_heads_kv;
  const int h0 = hk * G + grp * GB;
  const int gcount = min(GB, G - grp * GB);
  const int64_t len = int64_t(positions[t]) + 1;
  if (int64_t(z) * chunk >= len) return;  // block-uniform: this split has no keys for this row
  const int64_t n_valid = min(int64_t(n_splits), (len + chunk - 1) / chunk);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int32_t* seq_pages = page_table + int64_t(seq_of_token[t]) * pages_per_seq;

  float qf[GB][E];
#pragma unroll
  for (int g = 0; g < GB; ++g) {
    if (g < gcount) {
      load_f16x<E>(q + (t * n_heads + h0 + g) * D + lane * E, qf[g]);
#pragma unroll
      for (int e = 0; e < E; ++e) qf[g][e] *= scale_log2;
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) qf[g][e] = 0.f;
    }
  }
  float m[GB], l[GB], acc[GB][E];
#pragma unroll
  for (int g = 0; g < GB; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
  }

  for (int64_t cb = int64_t(z) * chunk; cb < len; cb += int64_t(n_splits) * chunk) {
    const int64_t ce = min(cb + chunk, len);
    for (int64_t j0 = cb + int64_t(warp) * U; j0 < ce; j0 += int64_t(NW) * U) {
      float kf[U][E], vf[U][E];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (j0 + u < ce) {
          const int64_t off = kv_offset(seq_pages, j0 + u, page_size, n_heads_kv, hk, D) + lane * E;
          load_f16x<E>(k_pages + off, kf[u]);
          load_f16x<E>(v_pages + off, vf[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (j0 + u < ce) {  // warp-uniform
#pragma unroll
          for (int g = 0; g < GB; ++g) {
            if (g < gcount) {  // warp-uniform
              float s = 0.f;
#pragma unroll
              for (int e = 0; e < E; ++e) s = fmaf(qf[g][e], kf[u][e], s);
              s = warp_sum(s);
              const float m_new = fmaxf(m[g], s);
              const float corr = exp2f(m[g] - m_new), p = exp2f(s - m_new);
              l[g] = l[g] * corr + p;
#pragma unroll
              for (int e = 0; e < E; ++e) acc[g][e] = fmaf(acc[g][e], corr, p * vf[u][e]);
              m[g] = m_new;
            }
          }
        }
      }
    }
  }

  // Merge the warps' states.
#pragma unroll
  for (int g = 0; g < GB; ++g) {
#pragma unroll
    for (int e = 0; e < E; ++e) sm_acc[warp][g][lane * E + e] = acc[g][e];
    if (lane == 0) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < gcount * D; idx += blockDim.x) {
    const int g = idx / D, d = idx % D;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) mm = fmaxf(mm, sm_m[w][g]);
    float ll = 0.f, a = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float c = sm_m[w][g] == -INFINITY ? 0.f : exp2f(sm_m[w][g] - mm);
      ll = fmaf(sm_l[w][g], c, ll);
      a = fmaf(sm_acc[w][g][d], c, a);
    }
    const int64_t row = t * n_heads + h0 + g;  // [n, n_heads] row of q / out
    if (n_valid == 1) {
      out[row * D + d] = __float2half_rn(a / ll);
    } else {
      const int64_t p = row * n_splits + z;
      part_acc[p * D + d] = a;
      if (d == 0) {
        part_ml[2 * p] = mm;
        part_ml[2 * p + 1] = ll;
      }
    }
  }
}

// grid (n, n_heads), block D threads (or fewer with a loop): merge the valid splits of row (t, h).
template <int D>
__global__ void attention_combine_kernel(const int32_t* __restrict__ positions, int n_heads, int n_splits,
                                         int64_t chunk, const float* __restrict__ part_acc,
                                         const float* __restrict__ part_ml, __half* __restrict__ out) {
  const int64_t t = blockIdx.x, h = blockIdx.y;
  const int64_t len = int64_t(positions[t]) + 1;
  const int64_t n_valid = min(int64_t(n_splits), (len + chunk - 1) / chunk);
  if (n_valid <= 1) return;  // the decode kernel wrote this row
  const int64_t row = t * n_heads + h;
  const float* ml = part_ml + 2 * row * n_splits;
  float mm = -INFINITY;
  for (int s = 0; s < n_valid; ++s) mm = fmaxf(mm, ml[2 * s]);
  float ll = 0.f;
  for (int s = 0; s < n_valid; ++s) ll = fmaf(ml[2 * s + 1], exp2f(ml[2 * s] - mm), ll);
  const float inv = 1.f / ll;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float a = 0.f;
    for (int s = 0; s < n_valid; ++s) a = fmaf(part_acc[(row * n_splits + s) * D + d], exp2f(ml[2 * s] - mm), a);
    out[row * D + d] = __float2half_rn(a * inv);
  }
}

// ---- prefill (tiled, SIMT) ---------------------------------------------------------------------------------

constexpr int kPrefillRows = 32;  // query rows per block (one head)
constexpr int kPrefillKeys = 32;  // keys per tile (= lanes: lane j scores key j of the tile)
constexpr int kPrefillWarps = 4;
constexpr int kRowsPerWarp = kPrefillRows / kPrefillWarps;

template <int D>
constexpr size_t prefill_smem_bytes() {
  return size_t(kPrefillRows) * D * sizeof(float) + size_t(kPrefillKeys) * (D + 2) * sizeof(__half) +
         size_t(kPrefillKeys) * D * sizeof(__half);
}

// grid (ceil(n / 32), n_heads). Shared: qs f32 [32][D] (pre-scaled), ks f16 [32][D + 2] (padded: lanes read
// different rows), vs f16 [32][D]. Warp w owns query rows w*8 .. w*8+7; lane owns dims 2*lane + 64*c + {0, 1}.
// The distinct sequences among the block's rows are processed one after another (usually just one); each
// pass streams that sequence's keys 0 .. max position of its rows, masking per row.
template <int D>
__global__ void __launch_bounds__(kPrefillWarps * 32)
    attention_prefill_kernel(const __half* __restrict__ q, const __half* __restrict__ k_pages,
                             const __half* __restrict__ v_pages, const int32_t* __restrict__ positions,
                             const int32_t* __restrict__ seq_of_token, const int32_t* __restrict__ page_table,
                             int64_t pages_per_seq, int64_t n, int n_heads, int n_heads_kv, int64_t page_size,
                             float scale_log2, __half* __restrict__ out) {
  constexpr int P = D / 2;    // half2 pairs per row
  constexpr int C = D / 64;   // pairs per lane
  constexpr int KS = P + 1;   // padded ks row stride in half2
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* qs = reinterpret_cast<float*>(smem_raw);
  __half2* ks = reinterpret_cast<__half2*>(qs + kPrefillRows * D);
  __half2* vs = ks + kPrefillKeys * KS;
  __shared__ int s_seq[kPrefillRows], s_pos[kPrefillRows], s_first[kPrefillRows], s_len[kPrefillRows];

  const int64_t t0 = int64_t(blockIdx.x) * kPrefillRows;
  const int h = blockIdx.y;
  const int hk = h / (n_heads / n_heads_kv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  if (threadIdx.x < kPrefillRows) {
    const int64_t t = t0 + threadIdx.x;
    s_seq[threadIdx.x] = t < n ? seq_of_token[t] : -1;
    s_pos[threadIdx.x] = t < n ? positions[t] : -1;
  }
  for (int idx = threadIdx.x; idx < kPrefillRows * P; idx += blockDim.x) {
    const int r = idx / P, p = idx % P;
    const int64_t t = t0 + r;
    float2 f = make_float2(0.f, 0.f);
    if (t < n) f = __half22float2(reinterpret_cast<const __half2*>(q + (t * n_heads + h) * D)[p]);
    qs[r * D + 2 * p] = f.x * scale_log2;
    qs[r * D + 2 * p + 1] = f.y * scale_log2;
  }
  __syncthreads();
  if (threadIdx.x < kPrefillRows) {
    const int r = threadIdx.x, s = s_seq[r];
    int first = s >= 0, mx = -1;
    for (int r2 = 0; r2 < kPrefillRows; ++r2) {
      if (s_seq[r2] == s) {
        if (r2 < r) first = 0;
        mx = max(mx, s_pos[r2]);
      }
    }
    s_first[r] = first;
    s_len[r] = mx + 1;
  }
  __syncthreads();

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][2 * C];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int c = 0; c < 2 * C; ++c) acc[i][c] = 0.f;
  }

  for (int r = 0; r < kPrefillRows; ++r) {
    if (!s_first[r]) continue;  // block-uniform
    const int seq = s_seq[r];
    const int64_t kv_len = s_len[r];
    const int32_t* seq_pages = page_table + int64_t(seq) * pages_per_seq;
    int row_pos[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int row = warp * kRowsPerWarp + i;
      row_pos[i] = s_seq[row] == seq ? s_pos[row] : -1;  // -1: masks every key
    }
    for (int64_t kb = 0; kb < kv_len; kb += kPrefillKeys) {
      __syncthreads();  // the previous tile is consumed
      for (int idx = threadIdx.x; idx < kPrefillKeys * P; idx += blockDim.x) {
        const int key = idx / P, p = idx % P;
        const int64_t j = kb + key;
        __half2 k2 = __floats2half2_rn(0.f, 0.f), v2 = k2;
        if (j < kv_len) {
          const int64_t off = kv_offset(seq_pages, j, page_size, n_heads_kv, hk, D);
          k2 = reinterpret_cast<const __half2*>(k_pages + off)[p];
          v2 = reinterpret_cast<const __half2*>(v_pages + off)[p];
        }
        ks[key * KS + p] = k2;
        vs[key * P + p] = v2;
      }
      __syncthreads();

      // Scores: lane scores key kb + lane against the warp's rows.
      float sc[kRowsPerWarp];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) sc[i] = 0.f;
      const float2* q2 = reinterpret_cast<const float2*>(qs) + warp * kRowsPerWarp * P;
#pragma unroll 4
      for (int p = 0; p < P; ++p) {
        const float2 kf = __half22float2(ks[lane * KS + p]);
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          const float2 qf = q2[i * P + p];
          sc[i] = fmaf(qf.x, kf.x, fmaf(qf.y, kf.y, sc[i]));
        }
      }
      const int64_t j = kb + lane;
      float pr[kRowsPerWarp];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const float s = j <= row_pos[i] ? sc[i] : -INFINITY;
        const float m_new = fmaxf(m[i], warp_max(s));
        float corr = 1.f, p = 0.f;
        if (m_new != -INFINITY) {
          corr = exp2f(m[i] - m_new);  // m[i] = -inf gives 0
          p = exp2f(s - m_new);        // masked: 0
        }
        l[i] = l[i] * corr + warp_sum(p);
#pragma unroll
        for (int c = 0; c < 2 * C; ++c) acc[i][c] *= corr;
        m[i] = m_new;
        pr[i] = p;
      }
      // acc[row] += sum_key p[row][key] * v[key]
#pragma unroll 4
      for (int key = 0; key < kPrefillKeys; ++key) {
        float2 vf[C];
#pragma unroll
        for (int c = 0; c < C; ++c) vf[c] = __half22float2(vs[key * P + lane + 32 * c]);
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          const float pk = __shfl_sync(0xffffffffu, pr[i], key);
#pragma unroll
          for (int c = 0; c < C; ++c) {
            acc[i][2 * c] = fmaf(pk, vf[c].x, acc[i][2 * c]);
            acc[i][2 * c + 1] = fmaf(pk, vf[c].y, acc[i][2 * c + 1]);
          }
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t t = t0 + warp * kRowsPerWarp + i;
    if (t >= n) continue;
    const float inv = 1.f / l[i];
    __half2* o = reinterpret_cast<__half2*>(out + (t * n_heads + h) * D);
#pragma unroll
    for (int c = 0; c < C; ++c) o[lane + 32 * c] = __floats2half2_rn(acc[i][2 * c] * inv, acc[i][2 * c + 1] * inv);
  }
}

// ---- launchers ---------------------------------------------------------------------------------------------

template <int D, int GB>
void launch_decode(const __half* q, const __half* k_pages, const __half* v_pages, const int32_t* positions,
                   const int32_t* seq_of_token, const int32_t* page_table, int64_t pages_per_seq, int64_t n,
                   int64_t n_heads, int64_t n_heads_kv, int64_t page_size, float scale, __half* out) {
  const int64_t G = n_heads / n_heads_kv;
  const int64_t n_groups = ceil_div(G, GB);
  const int64_t base = n * n_heads_kv * n_groups;  // blocks per split
  // Splits: enough blocks for ~4 waves at full length; chunks are strided over the splits, so short rows
  // still spread over many blocks and long rows loop.
  constexpr int64_t kChunk = 64;  // keys per chunk
  const int64_t max_len = pages_per_seq * page_size;
  const int64_t want = std::max<int64_t>(1, ceil_div(int64_t(4) * sm_count(), base));
  const int64_t n_splits = std::min<int64_t>({want, ceil_div(max_len, kChunk), 65535});
  float* part_acc = nullptr;
  float* part_ml = nullptr;
  if (n_splits > 1) {
    const int64_t parts = n * n_heads * n_splits;
    float* ws = static_cast<float*>(workspace(size_t(parts) * (D + 2) * sizeof(float)));
    part_acc = ws;
    part_ml = ws + parts * D;
  }
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(n_heads_kv * n_groups),
                  static_cast<unsigned>(n_splits));
  attention_decode_kernel<D, GB><<<grid, kDecodeWarps * 32, 0, current_stream()>>>(
      q, k_pages, v_pages, positions, seq_of_token, page_table, pages_per_seq, static_cast<int>(n_heads),
      static_cast<int>(n_heads_kv), static_cast<int>(n_groups), page_size, kChunk, scale * kLog2e, out, part_acc,
      part_ml);
  EXL2_CUDA_LAUNCH_CHECK("attention_decode_kernel");
  if (n_splits > 1) {
    attention_combine_kernel<D><<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(n_heads)),
                                  std::min(D, 128), 0, current_stream()>>>(
        positions, static_cast<int>(n_heads), static_cast<int>(n_splits), kChunk, part_acc, part_ml, out);
    EXL2_CUDA_LAUNCH_CHECK("attention_combine_kernel");
  }
}

template <int D>
void launch_decode_d(int64_t G, const __half* q, const __half* k_pages, const __half* v_pages,
                     const int32_t* positions, const int32_t* seq_of_token, const int32_t* page_table,
                     int64_t pages_per_seq, int64_t n, int64_t n_heads, int64_t n_heads_kv, int64_t page_size,
                     float scale, __half* out) {
  if (G <= 1) launch_decode<D, 1>(q, k_pages, v_pages, positions, seq_of_token, page_table, pages_per_seq, n, n_heads, n_heads_kv, page_size, scale, out);
  else if (G <= 2) launch_decode<D, 2>(q, k_pages, v_pages, positions, seq_of_token, page_table, pages_per_seq, n, n_heads, n_heads_kv, page_size, scale, out);
  else if (G <= 4) launch_decode<D, 4>(q, k_pages, v_pages, positions, seq_of_token, page_table, pages_per_seq, n, n_heads, n_heads_kv, page_size, scale, out);
  else launch_decode<D, 8>(q, k_pages, v_pages, positions, seq_of_token, page_table, pages_per_seq, n, n_heads, n_heads_kv, page_size, scale, out);
}

template <int D>
void launch_prefill(const __half* q, const __half* k_pages, const __half* v_pages, const int32_t* positions,
                    const int32_t* seq_of_token, const int32_t* page_table, int64_t pages_per_seq, int64_t n,
                    int64_t n_heads, int64_t n_heads_kv, int64_t page_size, float scale, __half* out) {
  constexpr size_t smem = prefill_smem_bytes<D>();
  if (smem > 48 * 1024) {
    EXL2_CHECK_KIND(Unsupported, smem <= max_smem_per_block_optin(), "CUDA attention prefill: head_dim ", D,
                    " needs ", smem, " bytes of shared memory per block, this GPU allows ",
                    max_smem_per_block_optin());
    static int raised_for_device = -1;  // set once per process (first device); cheap to repeat otherwise
    int dev = 0;
    EXL2_CUDA_CHECK(cudaGetDevice(&dev));
    if (raised_for_device != dev) {
      EXL2_CUDA_CHECK(cudaFuncSetAttribute(attention_prefill_kernel<D>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
      raised_for_device = dev;
    }
  }
  const dim3 grid(static_cast<unsigned>(ceil_div(n, kPrefillRows)), static_cast<unsigned>(n_heads));
  attention_prefill_kernel<D><<<grid, kPrefillWarps * 32, smem, current_stream()>>>(
      q, k_pages, v_pages, positions, seq_of_token, page_table, pages_per_seq, n, static_cast<int>(n_heads),
      static_cast<int>(n_heads_kv), page_size, scale * kLog2e, out);
  EXL2_CUDA_LAUNCH_CHECK("attention_prefill_kernel");
}

template <typename TA, typename TC>
void launch_ref(const void* q, const void* k_pages, const void* v_pages, const int32_t* positions,
                const int32_t* seq_of_token, const int32_t* page_table, int64_t pages_per_seq, int64_t n,
                int64_t n_heads, int64_t n_heads_kv, int64_t head_dim, int64_t page_size, float scale, void* out) {
  EXL2_CHECK_KIND(Unsupported, head_dim <= 1024, "CUDA attention: head_dim <= 1024 expected, got ", head_dim);
  const int threads = static_cast<int>(ceil_div(head_dim, 32) * 32);
  attention_ref_kernel<TA, TC><<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(n_heads)), threads, 0,
                                 current_stream()>>>(
      static_cast<const TA*>(q), static_cast<const TC*>(k_pages), static_cast<const TC*>(v_pages), positions,
      seq_of_token, page_table, pages_per_seq, n_heads, n_heads_kv, head_dim, page_size, scale, static_cast<TA*>(out));
  EXL2_CUDA_LAUNCH_CHECK("attention_ref_kernel");
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void attention_paged(const void* q, const void* k_pages, const void* v_pages, DType cache_dtype,
                     const int32_t* positions, const int32_t* seq_of_token, const int32_t* page_table,
                     int64_t pages_per_seq, int64_t n, int64_t n_heads, int64_t n_heads_kv, int64_t head_dim,
                     int64_t page_size, float scale, void* out, DType act) {
  if (n == 0 || n_heads == 0) return;
  EXL2_CHECK(n_heads_kv > 0 && n_heads % n_heads_kv == 0, "CUDA attention: n_heads (", n_heads,
             ") must be a multiple of n_heads_kv (", n_heads_kv, ")");
  const bool fast = !ref_kernels_enabled() && act == DType::F16 && cache_dtype == DType::F16 &&
                    (head_dim == 64 || head_dim == 128 || head_dim == 256) && aligned16(q) && aligned16(k_pages) &&
                    aligned16(v_pages) && aligned16(out) && n <= 0x7fffffff && n_heads <= 65535;
  if (fast) {
    const auto* qh = static_cast<const __half*>(q);
    const auto* kh = static_cast<const __half*>(k_pages);
    const auto* vh = static_cast<const __half*>(v_pages);
    auto* oh = static_cast<__half*>(out);
    const int64_t G = n_heads / n_heads_kv;
    if (n <= kDecodeMaxRows) {
      switch (head_dim) {
        case 64: launch_decode_d<64>(G, qh, kh, vh, positions, seq_of_token, page_table, pages_per_seq, n, n_heads, n_heads_kv, page_size, scale, oh); break;
        case 128: launch_decode_d<128>(G, qh, kh, vh, positions, seq_of_token, page_table, pages_per_seq, n, n_heads, n_heads_kv, page_size, scale, oh); break;
        default: launch_decode_d<256>(G, qh, kh, vh, positions, seq_of_token, page_table, pages_per_seq, n, n_heads, n_heads_kv, page_size, scale, oh); break;
      }
    } else {
      switch (head_dim) {
        case 64: launch_prefill<64>(qh, kh, vh, positions, seq_of_token, page_table, pages_per_seq, n, n_heads, n_heads_kv, page_size, scale, oh); break;
        case 128: launch_prefill<128>(qh, kh, vh, positions, seq_of_token, page_table, pages_per_seq, n, n_heads, n_heads_kv, page_size, scale, oh); break;
        default: launch_prefill<256>(qh, kh, vh, positions, seq_of_token, page_table, pages_per_seq, n, n_heads, n_heads_kv, page_size, scale, oh); break;
      }
    }
    return;
  }
  EXL2_DISPATCH_ACT(act, "attention_paged", [&](auto ta) {
    using TA = decltype(ta);
    EXL2_DISPATCH_FLOAT(cache_dtype, "attention_paged cache", [&](auto tc) {
      using TC = decltype(tc);
      launch_ref<TA, TC>(q, k_pages, v_pages, positions, seq_of_token, page_table, pages_per_seq, n, n_heads,
                         n_heads_kv, head_dim, page_size, scale, out);
    });
  });
}

}  // namespace exl2::cuda
