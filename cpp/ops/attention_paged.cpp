// ops::attention_paged: checks (q, out act [n, n_heads, head_dim], n_heads a multiple of the cache's n_heads_kv,
// out not aliasing q; paged cache and indices per check.h) and dispatch; the host-side planning of a step's
// decode and prefill rows (attention_spans) and the per-span calls.
#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void attention_paged(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages, const Tensor& positions,
                     const Tensor& seq_of_token, const Tensor& page_table, float scale, Tensor& out, int64_t n_decode,
                     int64_t window, float softcap) {
  const char* op = "attention_paged";
  detail::check_window(op, window, softcap);
  detail::check_defined_same_device(op, {{"q", &q},
                                         {"k_pages", &k_pages},
                                         {"v_pages", &v_pages},
                                         {"positions", &positions},
                                         {"seq_of_token", &seq_of_token},
                                         {"page_table", &page_table},
                                         {"out", &out}});
  detail::check_act(op, "q", q);
  detail::check_rank(op, "q", q, 3);
  detail::check_rank(op, "k_pages", k_pages, 4);
  const int64_t n = q.size(0), n_heads = q.size(1), head_dim = q.size(2), n_heads_kv = k_pages.size(2);
  EXL2_CHECK(n_heads_kv >= 1 && n_heads % n_heads_kv == 0, op, ": q's n_heads (", n_heads,
             ") must be a multiple of k_pages's n_heads_kv (dim 2), got ", k_pages.describe());
  detail::check_paged_cache(op, k_pages, v_pages, positions, seq_of_token, page_table, n, n_heads_kv, head_dim, true,
                            window);
  detail::check_same_dtype(op, "out", out, "q", q);
  detail::check_shape(op, "out", out, q.shape());
  detail::check_no_overlap(op, "out", out, "q", q);
  if (q.numel() == 0) return;
  EXL2_OPS_DISPATCH(q.device(), attention_paged, q.data(), k_pages.data(), v_pages.data(), k_pages.dtype(),
                    positions.data_as<int32_t>(), seq_of_token.data_as<int32_t>(), page_table.data_as<int32_t>(),
                    page_table.size(1), n, n_heads, n_heads_kv, head_dim, k_pages.size(1), scale, out.data(), q.dtype(),
                    n_decode, window, softcap);
}

std::vector<AttentionSpan> attention_spans(const int32_t* seq_of_token, int64_t n) {
  std::vector<AttentionSpan> spans;
  bool in_prefill = false;  // the current span has prefill runs already
  for (int64_t b = 0; b < n;) {
    int64_t e = b + 1;
    while (e < n && seq_of_token[e] == seq_of_token[b]) ++e;
    const bool decode = e - b <= kAttentionDecodeRun;
    if (spans.empty() || (decode && in_prefill)) {  // a decode run after prefill runs opens a new span
      spans.push_back({b, b, 0});
      in_prefill = false;
    }
    AttentionSpan& s = spans.back();
    s.end = e;
    if (decode)
      s.n_decode = e - s.begin;  // the span's decode rows so far (no prefill run yet)
    else
      in_prefill = true;
    b = e;
  }
  return spans;
}

void attention_paged_spans(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages, const Tensor& positions,
                           const Tensor& seq_of_token, const Tensor& page_table, float scale, Tensor& out,
                           const std::vector<AttentionSpan>& spans, int64_t window, float softcap) {
  if (spans.size() == 1 && spans[0].begin == 0 && spans[0].end == q.size(0)) {  // the usual case: no slices
    attention_paged(q, k_pages, v_pages, positions, seq_of_token, page_table, scale, out, spans[0].n_decode, window,
                    softcap);
    return;
  }
  if (spans.empty()) {
    attention_paged(q, k_pages, v_pages, positions, seq_of_token, page_table, scale, out, -1, window, softcap);
    return;
  }
  for (const AttentionSpan& s : spans) {
    EXL2_CHECK(0 <= s.begin && s.begin < s.end && s.end <= q.size(0), "attention_paged_spans: span [", s.begin, ", ",
               s.end, ") is not inside q's ", q.size(0), " rows; plan the spans with attention_spans");
    Tensor qs = q.slice(s.begin, s.end), os = out.slice(s.begin, s.end);
    attention_paged(qs, k_pages, v_pages, positions.slice(s.begin, s.end), seq_of_token.slice(s.begin, s.end),
                    page_table, scale, os, s.n_decode, window, softcap);
  }
}

}  // namespace exl2::ops
