// cuda::kv_write_q / cuda::attention_paged_q: the quantized KV cache of cache/kv_quant.h on the GPU.
//   - kv_write_q_kernel: one warp per (token, KV head) row: K centring (fixed, or RoPE-aware from the rope table
//     row of the token's position), signs, block Hadamard butterflies in shared memory (position 0: the rotated
//     row also goes to the sink store as f16)
//     (the CPU's order, so codes match the CPU bit for bit), absmax per 32 (Q4: min/max and the
//     clip search and least-squares refits) by warp reductions, pack, store;
//   - attention_q_kernel: one block per (row, KV head, group of q heads), 4 warps striding over the keys; each lane
//     dequantizes dims lane + 32 e (e < D/32) of a key/value row straight from the packed bytes (coalesced), q is
//     rotated in shared memory first and the V sum is un-rotated once at the end; online softmax in the log2
//     domain as in attention.cu; with the RoPE-aware K centre each score gains ab . rope[j] (ab: the per-head
//     a/b vector of kv_quant.h, in shared memory aliased with the merge buffer); key/value 0 come from the sink
//     rows (staged in shared memory) when the cache keeps them. Head dims 64, 96, 128, 256.
#include <cstdint>

#include "cache/kv_quant.h"
#include "cuda/common.cuh"
#include "cuda/pdl.cuh"

namespace exl2::cuda {

namespace {

constexpr float kLog2e = 1.4426950408889634f;

// Normalized block Hadamard on x[0..D) in shared memory, `lanes` threads starting at thread `tid`; the caller
// synchronizes between calls (sync() runs between the stages).
template <typename Sync>
__device__ __forceinline__ void hadamard_shared(float* x, int D, int tid, int lanes, Sync sync) {
  const int B = D & -D;
  for (int h = 1; h < B; h <<= 1) {
    for (int p = tid; p < D / 2; p += lanes) {
      const int j = (p / h) * 2 * h + (p % h);
      const float a = x[j], b = x[j + h];
      x[j] = a + b;
      x[j + h] = a - b;
    }
    sync();
  }
  const float norm = static_cast<float>(1.0 / sqrt(static_cast<double>(B)));
  for (int i = tid; i < D; i += lanes) x[i] *= norm;
  sync();
}

__device__ __forceinline__ float load_act(const void* p, int64_t i, bool f16) {
  return f16 ? __half2float(static_cast<const __half*>(p)[i]) : static_cast<const float*>(p)[i];
}

__device__ __forceinline__ void store_act(void* p, int64_t i, float v, bool f16) {
  if (f16)
    static_cast<__half*>(p)[i] = __float2half_rn(v);
  else
    static_cast<float*>(p)[i] = v;
}

// ---- write -------------------------------------------------------------------------------------------------

constexpr int kWriteWarps = 4;

// One lane's value of a Q4 block under (d16, z16): its code q (round, clamp to 0..15) and the block's squared error
// summed over the warp (warp-uniform), in the CPU's q4_block order of operations.
__device__ __forceinline__ float q4_lane(float val, __half d16, __half z16, int& q) {
  const float d = __half2float(d16), z = __half2float(z16);
  q = 0;
  if (d != 0.f) q = min(max(__float2int_rn(__fdiv_rn(__fsub_rn(val, z), d)), 0), 15);
  const float e = __fsub_rn(__fmaf_rn(float(q), d, z), val);
  float err = __fmul_rn(e, e);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) err = __fadd_rn(err, __shfl_xor_sync(0xffffffffu, err, o));
  return err;
}

// grid: ceil(n * n_heads_kv * 2 / kWriteWarps) blocks of kWriteWarps warps; warp w of the grid takes row w / 2 of
// K (w even) or V (w odd). Shared: per warp D floats + D code bytes.
__global__ void __launch_bounds__(kWriteWarps * 32)
    kv_write_q_kernel(const void* __restrict__ k, const void* __restrict__ v, uint8_t* __restrict__ k_q,
                      uint16_t* __restrict__ k_s, uint8_t* __restrict__ v_q, uint16_t* __restrict__ v_s,
                      const float* __restrict__ k_mean, const float* __restrict__ rope, int bits,
                      const int32_t* __restrict__ positions, const int32_t* __restrict__ seq_of_token,
                      const int32_t* __restrict__ page_table, int64_t pages_per_seq, int64_t n, int64_t page_size,
                      int n_heads_kv, int D, bool act_f16, uint16_t* __restrict__ k_sink,
                      uint16_t* __restrict__ v_sink) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  pdl_wait();  // cuda/pdl.cuh: before the early return below too
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* x = reinterpret_cast<float*>(smem_raw) + warp * D;
  uint8_t* codes = reinterpret_cast<uint8_t*>(reinterpret_cast<float*>(smem_raw) + kWriteWarps * D) + warp * D;
  const int64_t w = int64_t(blockIdx.x) * kWriteWarps + warp;
  if (w >= n * n_heads_kv * 2) return;  // warp-uniform; no block-wide sync below
  const bool is_v = w & 1;
  const int64_t r = w >> 1, t = r / n_heads_kv, h = r % n_heads_kv;
  const int64_t pos = positions[t];
  const int64_t page = page_table[int64_t(seq_of_token[t]) * pages_per_seq + pos / page_size];
  const int64_t slot = (page * page_size + pos % page_size) * n_heads_kv + h;
  const void* src = is_v ? v : k;
  const float* mu = (!is_v && k_mean) ? k_mean + h * D : nullptr;  // K centring: fp32 subtract, as the CPU
  const float* cs = (mu && rope) ? rope + pos * D : nullptr;       // RoPE-aware centre: RoPE(mu, pos)
  const int half = D / 2;
  for (int i = lane; i < D; i += 32) {
    float a = load_act(src, r * D + i, act_f16);
    if (cs) {
      const int i1 = i < half ? i : i - half;
      float c1, c2;
      kv_rope_centre(mu[i1], mu[i1 + half], cs[i1], cs[i1 + half], &c1, &c2);
      a = __fsub_rn(a, i < half ? c1 : c2);
    } else if (mu) {
      a = __fsub_rn(a, mu[i]);
    }
    x[i] = a * kv_rot_sign(uint32_t(i));
  }
  __syncwarp();
  hadamard_shared(x, D, lane, 32, [] { __syncwarp(); });
  uint16_t* sink = is_v ? v_sink : k_sink;
  if (sink && pos == 0) {  // sink rows (kv_quant.h): the rotated row of position 0, f16
    uint16_t* dst = sink + (page * n_heads_kv + h) * D;
    for (int i = lane; i < D; i += 32) dst[i] = __half_as_ushort(__float2half_rn(x[i]));
  }

  const int qn = 1 << (bits - 1);
  const int ns = kv_n_scales(D, bits);
  uint16_t* scales = (is_v ? v_s : k_s) + slot * ns;
  for (int b = 0; b < D / kKvQuantBlock; ++b) {
    const float val = x[b * 32 + lane];
    if (bits == 4) {  // asymmetric grid, clip picked by least squared error (same ops and sum order as the CPU)
      float mn = val, mx = val;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      }
      float best_err = INFINITY;
      __half best_d = __float2half_rn(0.f), best_z = best_d;
      int best_q = 0;
      for (int j = 0; j < kKvQ4Clips; ++j) {
        const float c = kv_q4_clip(j), lo = __fmul_rn(mn, c), hi = __fmul_rn(mx, c);
        const __half d16 = __float2half_rn(__fdiv_rn(__fsub_rn(hi, lo), 15.f)), z16 = __float2half_rn(lo);
        int q = 0;
        const float err = q4_lane(val, d16, z16, q);
        if (err < best_err || j == 0) {  // warp-uniform: every lane holds the same sum
          best_err = err;
          best_d = d16;
          best_z = z16;
          best_q = q;
        }
      }
      for (int it = 0; it < kKvQ4Refits; ++it) {  // least-squares refits of (d, z) (kv_quant.h; the CPU's ops)
        const float qf = float(best_q);
        float sq = qf, sqq = __fmul_rn(qf, qf), sy = val, sqy = __fmul_rn(qf, val);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          sq = __fadd_rn(sq, __shfl_xor_sync(0xffffffffu, sq, o));
          sqq = __fadd_rn(sqq, __shfl_xor_sync(0xffffffffu, sqq, o));
          sy = __fadd_rn(sy, __shfl_xor_sync(0xffffffffu, sy, o));
          sqy = __fadd_rn(sqy, __shfl_xor_sync(0xffffffffu, sqy, o));
        }
        const float nb = float(kKvQuantBlock);
        const float det = __fsub_rn(__fmul_rn(nb, sqq), __fmul_rn(sq, sq));
        if (!(det > 0.f)) break;  // warp-uniform
        const float df = __fdiv_rn(__fsub_rn(__fmul_rn(nb, sqy), __fmul_rn(sq, sy)), det);
        const float zf = __fdiv_rn(__fsub_rn(sy, __fmul_rn(df, sq)), nb);
        const __half d16 = __float2half_rn(df), z16 = __float2half_rn(zf);
        int q = 0;
        const float err = q4_lane(val, d16, z16, q);
        if (!(err < best_err)) break;
        best_err = err;
        best_d = d16;
        best_z = z16;
        best_q = q;
      }
      codes[b * 32 + lane] = uint8_t(best_q);
      if (lane == 0) {
        scales[2 * b] = __half_as_ushort(best_d);
        scales[2 * b + 1] = __half_as_ushort(best_z);
      }
      continue;
    }
    // First index of the largest |value| (the CPU keeps the first on ties).
    float best = fabsf(val);
    int idx = lane;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
      if (ob > best || (ob == best && oi < idx)) {
        best = ob;
        idx = oi;
      }
    }
    const float m = x[b * 32 + idx];
    const __half d16 = __float2half_rn(__fdiv_rn(m, float(-qn)));
    const float d = __half2float(d16);
    int q = 0;
    if (d != 0.f) q = min(max(__float2int_rn(__fdiv_rn(val, d)), -qn), qn - 1);
    codes[b * 32 + lane] = uint8_t(q + qn);
    if (lane == 0) scales[b] = __half_as_ushort(d16);
  }
  __syncwarp();
  const int rb = D * bits / 8;
  uint8_t* dst = (is_v ? v_q : k_q) + slot * rb;
  for (int ib = lane; ib < rb; ib += 32) {
    uint32_t byte;
    if (bits == 8) {
      byte = codes[ib];
    } else if (bits == 4) {
      byte = codes[2 * ib] | (uint32_t(codes[2 * ib + 1]) << 4);
    } else {  // 6: 4 codes in 3 bytes
      const int g = ib / 3;
      const uint32_t wd = codes[4 * g] | (uint32_t(codes[4 * g + 1]) << 6) | (uint32_t(codes[4 * g + 2]) << 12) |
                          (uint32_t(codes[4 * g + 3]) << 18);
      byte = (wd >> (8 * (ib % 3))) & 0xffu;
    }
    dst[ib] = uint8_t(byte);
  }
}

// ---- attention ---------------------------------------------------------------------------------------------

constexpr int kAttnWarps = 4;

// Code of value i (0..31) of block e in a packed row (BITS-bit little-endian stream): a signed level (code - qn)
// for Q8/Q6, the unsigned code for Q4 (asymmetric: value = fma(code, d, z)).
template <int BITS>
__device__ __forceinline__ int load_level(const uint8_t* __restrict__ row, int e, int i) {
  constexpr int qn = 1 << (BITS - 1);
  if constexpr (BITS == 8) {
    return int(row[e * 32 + i]) - qn;
  } else if constexpr (BITS == 4) {
    const uint32_t b = row[e * 16 + (i >> 1)];
    return int((b >> ((i & 1) * 4)) & 15u);
  } else {
    const int bit = 6 * i, off = e * 24 + (bit >> 3), sh = bit & 7;
    uint32_t w = row[off];
    if (sh > 2) w |= uint32_t(row[off + 1]) << 8;
    return int((w >> sh) & 63u) - qn;
  }
}

// grid (n, n_heads_kv * n_groups); block kAttnWarps warps. Block (t, hk, grp) handles q heads hk*G + grp*GB +
// [0, gcount). Shared: qs [GB][D] (rotated, pre-scaled q; later the merged, un-rotated output), per-warp states.
// OPT: a sliding window (keys from len - window) and / or soft-capped scores (instantiated apart, so the plain
// kernels compile as before).
template <int E, int GB, int BITS, bool OPT = false>
__global__ void __launch_bounds__(kAttnWarps * 32)
    attention_q_kernel(const void* __restrict__ q, const uint8_t* __restrict__ k_q, const uint16_t* __restrict__ k_s,
                       const uint8_t* __restrict__ v_q, const uint16_t* __restrict__ v_s,
                       const int32_t* __restrict__ positions, const int32_t* __restrict__ seq_of_token,
                       const int32_t* __restrict__ page_table, int64_t pages_per_seq, int n_heads, int n_heads_kv,
                       int n_groups, int64_t page_size, float scale_log2, void* __restrict__ out, bool act_f16,
                       const float* __restrict__ k_mean, const float* __restrict__ rope,
                       const uint16_t* __restrict__ k_sink, const uint16_t* __restrict__ v_sink, int64_t window,
                       float softcap_log2) {
  constexpr int D = 32 * E;
  if constexpr (!OPT) {  // no sliding window, no soft-cap: that code folds away
    window = 0;
    softcap_log2 = 0.f;
  }
  constexpr int RB = D * BITS / 8;
  constexpr int NW = kAttnWarps;
  __shared__ float qs[GB][D];
  __shared__ float sm_acc[NW][GB][D];
  __shared__ float sm_m[NW][GB], sm_l[NW][GB];
  __shared__ float sm_sink[2][D];  // the sequence's sink rows (K, V), when the cache keeps them
  pdl_wait();  // cuda/pdl.cuh: q and the cache belong to earlier kernels

  const int64_t t = blockIdx.x;
  const int hk = blockIdx.y / n_groups, grp = blockIdx.y % n_groups;
  const int G = n_heads / n_heads_kv;
  const int h0 = hk * G + grp * GB;
  const int gcount = min(GB, G - grp * GB);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t len = int64_t(positions[t]) + 1;
  const int64_t first = window > 0 ? max(int64_t(0), len - window) : 0;  // the row's sliding window
  const int32_t* seq_pages = page_table + int64_t(seq_of_token[t]) * pages_per_seq;
  // Sink rows (kv_quant.h): key and value 0 of the sequence, read once into shared memory (visible after the
  // __syncthreads below).
  const bool sink = k_sink != nullptr;  // block-uniform
  if (sink) {
    const int64_t srow = (int64_t(seq_pages[0]) * n_heads_kv + hk) * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      sm_sink[0][i] = __half2float(__ushort_as_half(k_sink[srow + i]));
      sm_sink[1][i] = __half2float(__ushort_as_half(v_sink[srow + i]));
    }
  }
  // RoPE-aware K centre (kv_quant.h): ab [GB][D] = (a, b) of each head, pre-scaled like q; it lives in sm_acc,
  // which is free until the merge.
  const bool centre = k_mean != nullptr && rope != nullptr;  // block-uniform
  float(*ab)[D] = reinterpret_cast<float(*)[D]>(&sm_acc[0][0][0]);

  // Rotate q (R q) for the block's heads (and form ab from the unrotated q).
  for (int idx = threadIdx.x; idx < GB * D; idx += blockDim.x) {
    const int g = idx / D, d = idx % D;
    qs[g][d] = g < gcount ? load_act(q, (t * n_heads + h0 + g) * D + d, act_f16) * kv_rot_sign(uint32_t(d)) : 0.f;
    if (centre) {
      float a = 0.f;
      if (g < gcount) {
        constexpr int H = D / 2;
        const int i = d < H ? d : d - H;
        const int64_t row = (t * n_heads + h0 + g) * D;
        const float q1 = load_act(q, row + i, act_f16), q2 = load_act(q, row + H + i, act_f16);
        const float m1 = k_mean[int64_t(hk) * D + i], m2 = k_mean[int64_t(hk) * D + H + i];
        a = d < H ? q1 * m1 + q2 * m2 : q2 * m1 - q1 * m2;
      }
      ab[g][d] = a * scale_log2;
    }
  }
  __syncthreads();
  for (int g = 0; g < gcount; ++g) hadamard_shared(qs[g], D, threadIdx.x, blockDim.x, [] { __syncthreads(); });

  float qf[GB][E], m[GB], l[GB], acc[GB][E];
#pragma unroll
  for (int g = 0; g < GB; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      qf[g][e] = qs[g][lane + 32 * e] * scale_log2;
      acc[g][e] = 0.f;
    }
  }

  for (int64_t j = first + warp; j < len; j += NW) {
    const int64_t slot = (int64_t(seq_pages[j / page_size]) * page_size + j % page_size) * n_heads_kv + hk;
    const uint8_t* kr = k_q + slot * RB;
    const uint8_t* vr = v_q + slot * RB;
    float kf[E], vf[E], rv[E];
#pragma unroll
    for (int e = 0; e < E; ++e) rv[e] = centre ? __ldg(rope + j * D + lane + 32 * e) : 0.f;  // key j at position j
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if constexpr (BITS == 4) {
        const __half2 ks = *reinterpret_cast<const __half2*>(k_s + slot * 2 * E + 2 * e);
        const __half2 vs = *reinterpret_cast<const __half2*>(v_s + slot * 2 * E + 2 * e);
        kf[e] = fmaf(float(load_level<4>(kr, e, lane)), __low2float(ks), __high2float(ks));
        vf[e] = fmaf(float(load_level<4>(vr, e, lane)), __low2float(vs), __high2float(vs));
      } else {
        const float ks = __half2float(__ushort_as_half(k_s[slot * E + e]));
        const float vs = __half2float(__ushort_as_half(v_s[slot * E + e]));
        kf[e] = float(load_level<BITS>(kr, e, lane)) * ks;
        vf[e] = float(load_level<BITS>(vr, e, lane)) * vs;
      }
    }
    if (sink && j == 0) {  // warp-uniform: key/value 0 from the sink rows instead
#pragma unroll
      for (int e = 0; e < E; ++e) {
        kf[e] = sm_sink[0][lane + 32 * e];
        vf[e] = sm_sink[1][lane + 32 * e];
      }
    }
#pragma unroll
    for (int g = 0; g < GB; ++g) {
      if (g < gcount) {  // block-uniform
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) s = fmaf(qf[g][e], kf[e], s);
        if (centre) {
#pragma unroll
          for (int e = 0; e < E; ++e) s = fmaf(ab[g][lane + 32 * e], rv[e], s);
        }
        s = warp_sum(s);
        // Soft-cap in the log2 domain: log2e * cap * tanh(s_nat / cap) with s = log2e * s_nat.
        if (softcap_log2 > 0.f) s = softcap_log2 * tanhf(s / softcap_log2);
        const float m_new = fmaxf(m[g], s);
        const float corr = exp2f(m[g] - m_new), p = exp2f(s - m_new);
        l[g] = l[g] * corr + p;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = fmaf(acc[g][e], corr, p * vf[e]);
        m[g] = m_new;
      }
    }
  }

  pdl_launch_dependents();  // e.g. the o projection's GEMV starts prefetching its weights
  // Merge the warps' states into qs (reused as the output rows), then un-rotate and store.
  __syncthreads();  // every warp is done with ab (aliased with sm_acc)
#pragma unroll
  for (int g = 0; g < GB; ++g) {
#pragma unroll
    for (int e = 0; e < E; ++e) sm_acc[warp][g][lane + 32 * e] = acc[g][e];
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
    qs[g][d] = a / ll;
  }
  __syncthreads();
  for (int g = 0; g < gcount; ++g) hadamard_shared(qs[g], D, threadIdx.x, blockDim.x, [] { __syncthreads(); });
  for (int idx = threadIdx.x; idx < gcount * D; idx += blockDim.x) {
    const int g = idx / D, d = idx % D;
    store_act(out, (t * n_heads + h0 + g) * D + d, qs[g][d] * kv_rot_sign(uint32_t(d)), act_f16);
  }
}

template <int E, int GB>
void launch_attention_q(int bits, const void* q, const uint8_t* k_q, const uint16_t* k_s, const uint8_t* v_q,
                        const uint16_t* v_s, const int32_t* positions, const int32_t* seq_of_token,
                        const int32_t* page_table, int64_t pages_per_seq, int64_t n, int64_t n_heads,
                        int64_t n_heads_kv, int64_t page_size, float scale, void* out, bool act_f16,
                        const float* k_mean, const float* rope, const uint16_t* k_sink, const uint16_t* v_sink,
                        int64_t window, float softcap) {
  const int64_t G = n_heads / n_heads_kv;
  const int64_t n_groups = ceil_div(G, GB);
  EXL2_CHECK_KIND(Unsupported, n <= 0x7fffffff && n_heads_kv * n_groups <= 65535,
                  "CUDA attention_paged_q: grid too large (n ", n, ", n_heads ", n_heads, ")");
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(n_heads_kv * n_groups));
  auto go = [&](auto kernel) {
    EXL2_CUDA_LAUNCH_PDL("attention_q_kernel", kernel, grid, kAttnWarps * 32, 0, current_stream(), q, k_q, k_s, v_q,
                         v_s, positions, seq_of_token, page_table, pages_per_seq, static_cast<int>(n_heads),
                         static_cast<int>(n_heads_kv), static_cast<int>(n_groups), page_size, scale * kLog2e, out,
                         act_f16, k_mean, rope, k_sink, v_sink, window, softcap * kLog2e);
  };
  const bool opt = window > 0 || softcap > 0.f;  // the kernels with a sliding window / soft-cap
  switch (bits) {
    case 8:
      opt ? go(attention_q_kernel<E, GB, 8, true>) : go(attention_q_kernel<E, GB, 8>);
      break;
    case 6:
      opt ? go(attention_q_kernel<E, GB, 6, true>) : go(attention_q_kernel<E, GB, 6>);
      break;
    default:
      opt ? go(attention_q_kernel<E, GB, 4, true>) : go(attention_q_kernel<E, GB, 4>);
      break;
  }
}

template <int E>
void launch_attention_q_e(int bits, const void* q, const uint8_t* k_q, const uint16_t* k_s, const uint8_t* v_q,
                          const uint16_t* v_s, const int32_t* positions, const int32_t* seq_of_token,
                          const int32_t* page_table, int64_t pages_per_seq, int64_t n, int64_t n_heads,
                          int64_t n_heads_kv, int64_t page_size, float scale, void* out, bool act_f16,
                          const float* k_mean, const float* rope, const uint16_t* k_sink, const uint16_t* v_sink,
                          int64_t window, float softcap) {
  if (n_heads / n_heads_kv <= 2)
    launch_attention_q<E, 2>(bits, q, k_q, k_s, v_q, v_s, positions, seq_of_token, page_table, pages_per_seq, n,
                             n_heads, n_heads_kv, page_size, scale, out, act_f16, k_mean, rope, k_sink, v_sink, window,
                             softcap);
  else
    launch_attention_q<E, 8>(bits, q, k_q, k_s, v_q, v_s, positions, seq_of_token, page_table, pages_per_seq, n,
                             n_heads, n_heads_kv, page_size, scale, out, act_f16, k_mean, rope, k_sink, v_sink, window,
                             softcap);
}

}  // namespace

void kv_write_q(const void* k, const void* v, uint8_t* k_q, uint16_t* k_s, uint8_t* v_q, uint16_t* v_s,
                const float* k_mean, const float* rope, int bits, const int32_t* positions, const int32_t* seq_of_token,
                const int32_t* page_table, int64_t pages_per_seq, int64_t n, int64_t page_size, int64_t n_heads_kv,
                int64_t head_dim, DType act, uint16_t* k_sink, uint16_t* v_sink) {
  if (n * n_heads_kv == 0) return;
  EXL2_CHECK_KIND(Unsupported, act == DType::F32 || act == DType::F16, "CUDA kv_write_q: activations f32/f16");
  EXL2_CHECK_KIND(Unsupported, head_dim <= 2048, "CUDA kv_write_q: head_dim <= 2048 expected, got ", head_dim);
  const int64_t warps = n * n_heads_kv * 2;
  const size_t smem = size_t(kWriteWarps) * head_dim * (sizeof(float) + 1);
  EXL2_CUDA_LAUNCH_PDL("kv_write_q_kernel", kv_write_q_kernel, static_cast<unsigned>(ceil_div(warps, kWriteWarps)),
                       kWriteWarps * 32, smem, current_stream(), k, v, k_q, k_s, v_q, v_s, k_mean, rope, bits,
                       positions, seq_of_token, page_table, pages_per_seq, n, page_size, static_cast<int>(n_heads_kv),
                       static_cast<int>(head_dim), act == DType::F16, k_sink, v_sink);
}

void attention_paged_q(const void* q, const uint8_t* k_q, const uint16_t* k_s, const uint8_t* v_q, const uint16_t* v_s,
                       int bits, const int32_t* positions, const int32_t* seq_of_token, const int32_t* page_table,
                       int64_t pages_per_seq, int64_t n, int64_t n_heads, int64_t n_heads_kv, int64_t head_dim,
                       int64_t page_size, float scale, void* out, DType act, const float* k_mean, const float* rope,
                       const uint16_t* k_sink, const uint16_t* v_sink, int64_t window, float softcap) {
  if (n == 0 || n_heads == 0) return;
  EXL2_CHECK_KIND(Unsupported, act == DType::F32 || act == DType::F16, "CUDA attention_paged_q: activations f32/f16");
  const bool f16 = act == DType::F16;
  switch (head_dim) {
    case 64:
      launch_attention_q_e<2>(bits, q, k_q, k_s, v_q, v_s, positions, seq_of_token, page_table, pages_per_seq, n,
                              n_heads, n_heads_kv, page_size, scale, out, f16, k_mean, rope, k_sink, v_sink, window,
                              softcap);
      break;
    case 96:
      launch_attention_q_e<3>(bits, q, k_q, k_s, v_q, v_s, positions, seq_of_token, page_table, pages_per_seq, n,
                              n_heads, n_heads_kv, page_size, scale, out, f16, k_mean, rope, k_sink, v_sink, window,
                              softcap);
      break;
    case 128:
      launch_attention_q_e<4>(bits, q, k_q, k_s, v_q, v_s, positions, seq_of_token, page_table, pages_per_seq, n,
                              n_heads, n_heads_kv, page_size, scale, out, f16, k_mean, rope, k_sink, v_sink, window,
                              softcap);
      break;
    case 256:
      launch_attention_q_e<8>(bits, q, k_q, k_s, v_q, v_s, positions, seq_of_token, page_table, pages_per_seq, n,
                              n_heads, n_heads_kv, page_size, scale, out, f16, k_mean, rope, k_sink, v_sink, window,
                              softcap);
      break;
    default:
      EXL2_FAIL(Unsupported, "CUDA attention_paged_q: head_dim 64, 96, 128 or 256 expected for a quantized cache, got ",
                head_dim, "; use cache_type \"fp16\"");
  }
}

}  // namespace exl2::cuda
