// Op contracts. Each op validates its Tensor arguments (device, dtype, shape, aliasing) and dispatches to
// the backend of the tensors' device: cpu::<op> (reference, fp32 accumulation) or cuda::<op>.
// Shapes are outermost first. "act" = activation dtype: f32 on CPU, f16 on CUDA (both accepted by both
// backends where noted). Every op writes all of `out`. Out may alias an input only where stated.
#pragma once

#include <cstdint>
#include <vector>

#include "exl2/tensor.h"

namespace exl2::ops {

// out[n, H] = table[ids[n], :] converted to out's dtype.  ids: i32 [n]; table: f32/f16/bf16 [V, H].
// ids outside [0, V) raise InvalidArgument (checked on the host for CPU, clamped+flagged on CUDA).
void embedding(const Tensor& ids, const Tensor& table, Tensor& out);

// out = x / rms(x) * w, over the last dim.  x, out: act [rows, H]; w: f32/f16/bf16 [H]. out may alias x.
void rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out);

// out = (x - mean(x)) / sqrt(var(x) + eps) * w over the last dim (LayerNorm without bias; mean, variance and the
// product in fp32).  x, out: act [rows, H]; w: f32/f16/bf16 [H], or [G, H] with rows % G == 0: row r takes w's row
// r % G (a weight per head: x [n * heads, head_dim], w [heads, head_dim], Cohere's q/k norm). out may alias x.
void layer_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out);

// h = h + r (rounded as add), then out = rms_norm(h): the residual add and the next norm in one pass (one kernel
// on CUDA for f16). h, r, out: act [rows, H]; out may alias r, not h.
void add_rms_norm(Tensor& h, const Tensor& r, const Tensor& w, float eps, Tensor& out);

// In-place rotary embedding, HF "rotate_half" (NeoX) convention, on x: act [n, n_heads, head_dim].
// positions: i32 [n]; cos_sin: f32 [max_pos, head_dim] holding cos in [:, :head_dim/2] and sin in
// [:, head_dim/2:] (the scaled table from model/rope.h). Positions >= max_pos raise InvalidArgument.
void rope(Tensor& x, const Tensor& positions, const Tensor& cos_sin);

// rope of q [n, nq_heads, head_dim] and k [n, nk_heads, head_dim] (same positions) in one pass.
void rope_qk(Tensor& q, Tensor& k, const Tensor& positions, const Tensor& cos_sin);

// y[n, out] = x[n, in] @ w[out, in]^T (+ bias[out]).  x, y: act; w: f32/f16/bf16; bias: f32/f16 or undefined.
// fp32 accumulation. y must not alias x.
void matmul_nt(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y);

// out = silu(gate) * up, elementwise.  all act [n, I]. out may alias gate or up.
void silu_mul(const Tensor& gate, const Tensor& up, Tensor& out);

// out = gelu_tanh(gate) * up, elementwise, gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) (HF
// gelu_pytorch_tanh), fp32.  all act [n, I]. out may alias gate or up.
void gelu_tanh_mul(const Tensor& gate, const Tensor& up, Tensor& out);

// out = x * s; then, when cap > 0, out = cap * tanh(out / cap) (logit soft-capping), in fp32. x, out: act, same
// shape; f32 x on a CUDA device too (the logits). out may alias x.
void scale(const Tensor& x, float s, float cap, Tensor& out);

// out = a + b, elementwise, same shape and dtype. out may alias a or b.
void add(const Tensor& a, const Tensor& b, Tensor& out);

// Write the keys/values of a batch into the paged cache.
//   k, v: act [n, n_heads_kv, head_dim]; k_pages, v_pages: cache dtype [n_pages, page_size, n_heads_kv, head_dim]
//   positions: i32 [n]; seq_of_token: i32 [n]; page_table: i32 [n_seqs, pages_per_seq].
// Token t goes to page page_table[seq_of_token[t], positions[t] / page_size], slot positions[t] % page_size.
void kv_write(const Tensor& k, const Tensor& v, Tensor& k_pages, Tensor& v_pages, const Tensor& positions,
              const Tensor& seq_of_token, const Tensor& page_table);

// rope_qk(q, k, ...) then kv_write(k, v, ...) as one op (one pass over q, k and v on CUDA): q and k are rotated
// in place, the rotated k and v written into the pages. Same arguments and checks as the two; same results.
void rope_qk_kv_write(Tensor& q, Tensor& k, const Tensor& v, const Tensor& positions, const Tensor& cos_sin,
                      Tensor& k_pages, Tensor& v_pages, const Tensor& seq_of_token, const Tensor& page_table);

// Causal attention over the paged cache (the batch's own K/V must already be written by kv_write).
//   q: act [n, n_heads, head_dim]; out: act [n, n_heads, head_dim] (must not alias q).
// Token t of sequence s = seq_of_token[t] attends to cache positions 0..positions[t] of s; with window > 0 only
// to the last `window` of them, positions[t] - window + 1 .. positions[t] (a sliding window, the row's own key
// included: HF's kv_idx > q_idx - sliding_window). Head h reads KV head h / (n_heads / n_heads_kv) (GQA).
// page_table entries of pages wholly before a row's window are never read (any id; the engine's windowed layer
// groups give those pages back and pass the scratch page there).
// Scores scaled by `scale`, then with softcap > 0 capped: softcap * tanh(score / softcap) (Gemma 2); fp32 softmax.
// n_decode (a speed hint; results do not depend on it beyond rounding, and not at all on CPU): rows
// [0, n_decode) are decode rows (each one of few rows of its sequence: flash-decoding on CUDA, one block per
// row), rows [n_decode, n) prefill rows (runs of consecutive rows of one sequence: tiles of 64 rows on CUDA).
// < 0: unknown, CUDA takes n <= 16 rows as decode rows and more as prefill rows. Values > n mean n.
void attention_paged(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages, const Tensor& positions,
                     const Tensor& seq_of_token, const Tensor& page_table, float scale, Tensor& out,
                     int64_t n_decode = -1, int64_t window = 0, float softcap = 0.f);

// A step's attention calls planned from its row layout (a host copy of seq_of_token): rows cut into maximal runs
// of consecutive rows of one sequence; runs of at most kAttentionDecodeRun rows are decode rows, longer runs
// prefill rows; consecutive runs join one span while the span is decode runs then prefill runs (a decode run
// after prefill runs opens the next span). The engine's steps (decode rows first, then prefill chunks) give one
// span unless a short prefill chunk follows a long one; a decode-only step gives one span of decode rows.
// Spans cover [0, n) in order; n == 0 gives none.
constexpr int64_t kAttentionDecodeRun = 16;
struct AttentionSpan {
  int64_t begin = 0, end = 0;  // rows [begin, end)
  int64_t n_decode = 0;        // rows [begin, begin + n_decode) are decode rows
};
std::vector<AttentionSpan> attention_spans(const int32_t* seq_of_token, int64_t n);
// attention_paged over each span's rows (row slices of q, out, positions, seq_of_token). An empty `spans`: one
// call over all rows without a hint.
void attention_paged_spans(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages, const Tensor& positions,
                           const Tensor& seq_of_token, const Tensor& page_table, float scale, Tensor& out,
                           const std::vector<AttentionSpan>& spans, int64_t window = 0, float softcap = 0.f);

// out[i, :] = x[idx[i], :] (a row gather; picks the rows whose logits are wanted).  x, out: act [*, H], same
// dtype; idx: i32 [m]; out: [m, H], must not alias x. idx values outside [0, x.size(0)) raise InvalidArgument
// (checked on the host for CPU; clamped on CUDA, where idx may live in device memory and change between
// CUDA-graph replays).
void gather_rows(const Tensor& x, const Tensor& idx, Tensor& out);

// The greedy token of each row and its log-probability, so that a greedy row's result crosses to the host as two
// numbers instead of the row (the engine's device argmax).  logits: f32 [rows, vocab], rows contiguous; index:
// i32 [rows]; logprob: f32 [rows]; one device. index[r] = argmax of row r, the lowest column among equal maxima;
// logprob[r] = log_softmax(row r)[index[r]]. CPU: the host sampler's numbers bit for bit (engine/sampler.h,
// temperature 0: the same scan and cpu::sum_exp). CUDA: the same index; logprob from an f32 exp-sum (a few ulp of
// the CPU's). A row holding NaN or +inf: index[r] = -2 - i with i its lowest such column, logprob[r] = that value
// (the sampler's error names it); a row of -inf only: index -1, logprob -inf.
void argmax_logprob(const Tensor& logits, Tensor& index, Tensor& logprob);

// argmax_logprob generalized to the sampled rows of the engine's device sampling: each row's token under its own
// SampleParams (exl2/sample_params.h) and that token's log-probability, so that a plain sampled row also crosses
// to the host as two numbers.  params: u8 [rows, sizeof(SampleParams)] (SampleParams per row, same device; its
// ranges are checked on the host for CPU, trusted on CUDA). temperature 0: argmax_logprob's result. Else the host
// sampler's steps 3-6 and 8 on the row as processed logits l (engine/sampler.h): z = (l - max l) / T, top-k
// (boundary ties kept), top-p (by probability desc, ties to the lower id, the shortest prefix reaching top_p),
// min-p, then the first id in id order whose running sum of weights exceeds u * total; logprob[r] =
// log_softmax(l)[index[r]] (before temperature). Error codes as argmax_logprob. CPU: Sampler::sample's token and
// logprob bit for bit for the same u (the same code, backend/cpu/sample_filter.h). CUDA (cuda/sampling.cu): the
// same weights fast_exp(z) in f32 and f64 sums in another order, so a token can differ only where u * total or
// top_p * total falls within rounding (~1e-15 relative) of a cumulative boundary, or where a weight rounds
// differently by an ulp (FMA contraction) at a top-p / min-p boundary; the token is always one the CPU path could
// give (inside its support up to such a boundary element); logprob from an f32 exp-sum as argmax_logprob.
void sample_logprob(const Tensor& logits, const Tensor& params, Tensor& index, Tensor& logprob);

// The KL divergence of a distribution change given as a change of the logits, per row (the converter's KL
// sensitivity pass: z the clean model's logits, d = head @ (x' - x) the change the quantized states x' make).
// z, d: f32 [rows, vocab], one device; out: f32 [rows]. out[r] = KL(p || q) with p = softmax(z_r) and
// q = softmax(z_r + d_r), taken as log1p(E_p[expm1(d)]) - E_p[d]: accurate for small changes (d is never added
// to z), exactly 0 for d = 0. The weights exp(z - max z) in f32; expm1 (whose f32 rounding, ~1e-7 of |d|, would be
// ~1e-3 of a small change's KL), the sums and the result in fp64 on both backends (CUDA: one block per row). Non-finite z or d give an undefined result.
void logit_kl(const Tensor& z, const Tensor& d, Tensor& out);

// Copy/convert between float dtypes on one device (f32 <-> f16 <-> bf16). Same shape.
void convert(const Tensor& src, Tensor& dst);

// ---- Mixture of experts (MoE): router, grouping by expert, weighted combine (cpp/ops/moe.cpp) -----------------------
// A MoE layer at `rows` tokens, n_experts experts, k experts per token, P = rows * k (row, slot) pairs, flat index
// i = row * k + slot. The expert MLPs themselves run through linear/moe_linear.h (MoeExperts) on the grouping.

// The top-k router of HF transformers (MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock, Qwen3MoeSparseMoeBlock), in
// fp32.  logits: act [rows, n_experts] (f32 or f16, the router linear's output); ids: i32 [rows, k]; weights: f32
// [rows, k]; 1 <= k <= n_experts <= kMoeMaxExperts. Per row: p = softmax(logits) (max subtracted, fp32 exp and sum);
// ids[r, :] = the k experts of largest logit, descending, ties to the lower id (the order of p: softmax is monotone;
// NaN counts as below -inf, so ids are always distinct and in [0, n_experts)); weights[r, j] = p[ids[r, j]], or with
// renormalize (Mixtral always; Qwen-MoE `norm_topk_prob`) p[ids[r, j]] / sum_j p[ids[r, j]]. On CUDA one kernel (one
// warp per row), no host sync; ids identical to the CPU's, weights within a few fp32 ulp (expf vs std::exp).
constexpr int64_t kMoeMaxExperts = 1024;
void moe_route(const Tensor& logits, int64_t k, bool renormalize, Tensor& ids, Tensor& weights);

// Groups the (row, slot) pairs by expert, so that each expert's tokens are one contiguous run.  ids: i32 [rows, k]
// (values in [0, n_experts): checked on the host for CPU, clamped on CUDA); offsets: i32 [n_experts + 1]; perm, inv:
// i32 [P]; active: i32 [n_experts + 1]. All on ids' device, computed there (CUDA: one kernel, no host sync, so a CUDA
// graph can replay it with new ids).
//   offsets[e] = number of pairs of experts < e (offsets[n_experts] = P): expert e owns positions
//     [offsets[e], offsets[e + 1]);
//   perm[p] = the flat index i of the pair at position p, sorted by (expert, i): stable, so an expert's rows are in
//     token order;  inv[i] = p where perm[p] = i (inv[perm[p]] = p);
//   active[0 .. n) = the n experts with at least one pair, ascending; active[n .. n_experts) = -1;
//     active[n_experts] = n.
void moe_group(const Tensor& ids, int64_t n_experts, Tensor& offsets, Tensor& perm, Tensor& inv, Tensor& active);

// The weighted sum of the experts' outputs back into token order (and Qwen2-MoE's gated shared expert):
//   out[r] = (add ? out[r] : 0) + sum_{j < k, ascending} weights[r, j] * expert_out[inv[r * k + j]]
//            + (shared defined ? sigmoid(shared_gate[r]) * shared[r] : 0)
// in fp32, rounded once into out's dtype.  expert_out: act [P, H] (position order, as moe_group's perm); weights: f32
// [rows, k]; inv: i32 [P] (values in [0, P): checked on CPU, clamped on CUDA); shared: act [rows, H], out's dtype, or
// undefined; shared_gate: f32 or act [rows, 1] (the gate linear's logit), defined exactly when shared is; out: act
// [rows, H], must not overlap the inputs. One thread per output element on CUDA, a fixed order: deterministic, and
// the CPU's result within fp16 rounding (fp32 sums in the same order; expf).
void moe_combine(const Tensor& expert_out, const Tensor& weights, const Tensor& inv, const Tensor& shared,
                 const Tensor& shared_gate, bool add, Tensor& out);

}  // namespace exl2::ops
