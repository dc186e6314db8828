// cuda::attention_paged: causal attention over the paged KV cache. Dispatch between
//   - the tensor-core kernels of cuda/attention_kernels.cuh (f16 activations and cache, head_dim 64/128/256):
//     flash-decoding with GQA head packing and a fused split merge for decode rows (one launch block per row and
//     KV head, however many rows), and FlashAttention-2 style tiles for prefill rows (runs of consecutive rows of
//     one sequence; a tile spanning several sequences takes one pass per sequence, so it suits few long runs).
//     The caller says which rows are which (n_decode: rows [0, n_decode) decode, the rest prefill; ops::
//     attention_paged_spans plans it from the batch layout); without a hint, n <= kDecodeMaxRows rows decode;
//     Prefill tiles give each warp two 16-row m-tiles of Q (RM = 2: 128-row blocks, every K / V fragment read
//     from shared memory feeds two mma) for head_dim 64 and 128; 256 keeps one (RM = 1);
//   - attention_ref_kernel: one block per (row, head), one key at a time; used for f32/bf16 activations, f32 or
//     bf16 caches, other head dims, soft-capped scores (Gemma 2), and everything when option cuda_reference is on.
// A sliding window (window > 0) runs in both: the tensor-core kernels skip the key tiles below it.
// Rows may mix sequences and positions: every row reads its own sequence's pages up to its own position.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "backend/kernels.h"
#include "cuda/attention_kernels.cuh"
#include "cuda/common.cuh"
#include "cuda/pdl.cuh"

namespace exl2::cuda {

namespace {

constexpr int64_t kDecodeMaxRows = 16;  // no n_decode hint: rows <= this all decode, more all prefill

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
                                     int64_t page_size, float scale, TA* __restrict__ out, int64_t window,
                                     float softcap) {
  __shared__ float scratch[32];
  pdl_wait();  // cuda/pdl.cuh
  const int64_t t = blockIdx.x, h = blockIdx.y;
  const int64_t hk = h / (n_heads / n_heads_kv);
  const int d = threadIdx.x;
  const bool own = d < head_dim;
  const float qd = own ? to_f32(q[(t * n_heads + h) * head_dim + d]) : 0.f;
  const int64_t pos = positions[t];
  const int32_t* seq_pages = page_table + int64_t(seq_of_token[t]) * pages_per_seq;
  float m = -INFINITY, l = 0.f, acc = 0.f;
  for (int64_t j = window > 0 ? max(int64_t(0), pos - window + 1) : 0; j <= pos; ++j) {
    const int64_t off = kv_offset(seq_pages, j, page_size, n_heads_kv, hk, head_dim);
    float s = block_sum(own ? qd * to_f32(k_pages[off + d]) : 0.f, scratch) * scale;
    if (softcap > 0.f) s = softcap * tanhf(s / softcap);
    const float m_new = fmaxf(m, s);
    const float corr = expf(m - m_new), p = expf(s - m_new);
    l = l * corr + p;
    acc = acc * corr + (own ? p * to_f32(v_pages[off + d]) : 0.f);
    m = m_new;
  }
  pdl_launch_dependents();
  if (own) out[(t * n_heads + h) * head_dim + d] = from_f32<TA>(acc / l);
}

template <typename TA, typename TC>
void launch_ref(const void* q, const void* k_pages, const void* v_pages, const int32_t* positions,
                const int32_t* seq_of_token, const int32_t* page_table, int64_t pages_per_seq, int64_t n,
                int64_t n_heads, int64_t n_heads_kv, int64_t head_dim, int64_t page_size, float scale, void* out,
                int64_t window, float softcap) {
  EXL2_CHECK_KIND(Unsupported, head_dim <= 1024, "CUDA attention: head_dim <= 1024 expected, got ", head_dim);
  const int threads = static_cast<int>(ceil_div(head_dim, 32) * 32);
  EXL2_CUDA_LAUNCH_PDL("attention_ref_kernel", attention_ref_kernel<TA, TC>,
                       dim3(static_cast<unsigned>(n), static_cast<unsigned>(n_heads)), threads, 0, current_stream(),
                       static_cast<const TA*>(q), static_cast<const TC*>(k_pages), static_cast<const TC*>(v_pages),
                       positions, seq_of_token, page_table, pages_per_seq, n_heads, n_heads_kv, head_dim, page_size,
                       scale, static_cast<TA*>(out), window, softcap);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void attention_paged(const void* q, const void* k_pages, const void* v_pages, DType cache_dtype,
                     const int32_t* positions, const int32_t* seq_of_token, const int32_t* page_table,
                     int64_t pages_per_seq, int64_t n, int64_t n_heads, int64_t n_heads_kv, int64_t head_dim,
                     int64_t page_size, float scale, void* out, DType act, int64_t n_decode, int64_t window,
                     float softcap) {
  if (n == 0 || n_heads == 0) return;
  EXL2_CHECK(n_heads_kv > 0 && n_heads % n_heads_kv == 0, "CUDA attention: n_heads (", n_heads,
             ") must be a multiple of n_heads_kv (", n_heads_kv, ")");
  const bool fast = !ref_kernels_enabled() && softcap == 0.f && compute_capability() >= 80 && act == DType::F16 && cache_dtype == DType::F16 &&
                    (head_dim == 64 || head_dim == 128 || head_dim == 256) && aligned16(q) && aligned16(k_pages) &&
                    aligned16(v_pages) && aligned16(out) && n <= (int64_t(65535) << 6) && n_heads <= 65535 &&
                    pages_per_seq * page_size <= 0x7fffffff;
  if (fast) {
    const auto* qh = static_cast<const __half*>(q);
    const auto* kh = static_cast<const __half*>(k_pages);
    const auto* vh = static_cast<const __half*>(v_pages);
    auto* oh = static_cast<__half*>(out);
    // Tile configurations (dev/kernels/attention_bench.sh times the alternatives): prefill <D, warps, keys per
    // tile, stages, Q in registers>, decode <D, keys per tile (= 16 x warps), stages, Q in registers>.
    const int64_t nd = n_decode < 0 ? (n <= kDecodeMaxRows ? n : 0) : std::min(n_decode, n);
    if (nd > 0) {
      switch (head_dim) {
        case 64: attn::launch_decode_mma<64, 64, 2, true>(qh, kh, vh, positions, seq_of_token, page_table, pages_per_seq, nd, n_heads, n_heads_kv, page_size, scale, oh, 0, window); break;
        case 128: attn::launch_decode_mma<128, 64, 2, true>(qh, kh, vh, positions, seq_of_token, page_table, pages_per_seq, nd, n_heads, n_heads_kv, page_size, scale, oh, 0, window); break;
        default: attn::launch_decode_mma<256, 32, 2, false>(qh, kh, vh, positions, seq_of_token, page_table, pages_per_seq, nd, n_heads, n_heads_kv, page_size, scale, oh, 0, window); break;
      }
    }
    if (nd < n) {  // the prefill rows: the same arrays from row nd on (16-byte aligned: n_heads * D halves a row)
      const int64_t np = n - nd, off = nd * n_heads * head_dim;
      qh += off;
      oh += off;
      positions += nd;
      seq_of_token += nd;
      // rm2 for head_dim 64 / 128: on the H200 211 against rm1's 153 TFLOP/s (2048 x 32 heads, D128), 273 against
      // 178 at 8192, 163 against 156 at D64 (dev/kernels/attention_prefill_notes.md); head_dim 256 keeps rm1.
      int rm = head_dim == 256 ? 1 : 2;
      // Sliding windows: the kernel variant without spills at sm_90 (ptxas: the windowed rm2 D128 kernel spills 64
      // bytes, the windowed rm1 D64 one 8; the others none).
      if (window > 0 && head_dim == 128) rm = 1;
      if (window > 0 && head_dim == 64) rm = 2;
      switch (head_dim) {
        case 64:
          if (rm == 2) attn::launch_prefill_mma<64, 4, 64, 2, true, 2>(qh, kh, vh, positions, seq_of_token, page_table, pages_per_seq, np, n_heads, n_heads_kv, page_size, scale, oh, window);
          else attn::launch_prefill_mma<64, 4, 64, 2, true>(qh, kh, vh, positions, seq_of_token, page_table, pages_per_seq, np, n_heads, n_heads_kv, page_size, scale, oh, window);
          break;
        case 128:
          if (rm == 2) {  // 102 KiB with 64-key tiles: above the 99 KiB of consumer cards, 32-key tiles there
            if (attn::smem_fits(attn::attention_prefill_mma_kernel<128, 4, 64, 2, false, 2>, attn::prefill_smem_bytes<128, 4, 64, 2, 2>()))
              attn::launch_prefill_mma<128, 4, 64, 2, false, 2>(qh, kh, vh, positions, seq_of_token, page_table, pages_per_seq, np, n_heads, n_heads_kv, page_size, scale, oh, window);
            else
              attn::launch_prefill_mma<128, 4, 32, 2, false, 2>(qh, kh, vh, positions, seq_of_token, page_table, pages_per_seq, np, n_heads, n_heads_kv, page_size, scale, oh, window);
          } else {
            attn::launch_prefill_mma<128, 4, 64, 2, true>(qh, kh, vh, positions, seq_of_token, page_table, pages_per_seq, np, n_heads, n_heads_kv, page_size, scale, oh, window);
          }
          break;
        default:  // 99 KiB per block on consumer cards: 16-key tiles there
          if (attn::smem_fits(attn::attention_prefill_mma_kernel<256, 4, 32, 2, false>, attn::prefill_smem_bytes<256, 4, 32, 2>()))
            attn::launch_prefill_mma<256, 4, 32, 2, false>(qh, kh, vh, positions, seq_of_token, page_table, pages_per_seq, np, n_heads, n_heads_kv, page_size, scale, oh, window);
          else
            attn::launch_prefill_mma<256, 4, 16, 2, false>(qh, kh, vh, positions, seq_of_token, page_table, pages_per_seq, np, n_heads, n_heads_kv, page_size, scale, oh, window);
          break;
      }
    }
    return;
  }
  EXL2_DISPATCH_ACT(act, "attention_paged", [&](auto ta) {
    using TA = decltype(ta);
    EXL2_DISPATCH_FLOAT(cache_dtype, "attention_paged cache", [&](auto tc) {
      using TC = decltype(tc);
      launch_ref<TA, TC>(q, k_pages, v_pages, positions, seq_of_token, page_table, pages_per_seq, n, n_heads,
                         n_heads_kv, head_dim, page_size, scale, out, window, softcap);
    });
  });
}

}  // namespace exl2::cuda
