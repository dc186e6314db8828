// The padded decode layout of CUDA-graph steps (model/decode_layout.h).
#include "model/decode_layout.h"

#include <algorithm>
#include <vector>

namespace exl2 {

int64_t decode_rows_bucket(const Batch& b, int64_t max_rows_per_seq) {
  const int64_t n = static_cast<int64_t>(b.tokens.size());
  if (n > kMaxGraphRows) return 0;
  int64_t bucket = 1;
  while (bucket < n) bucket *= 2;
  const int64_t m = b.logit_rows.empty() ? n : static_cast<int64_t>(b.logit_rows.size());
  if (m > bucket) return 0;
  std::vector<int32_t> seqs = b.seq_of_token;
  std::sort(seqs.begin(), seqs.end());
  for (size_t i = 0; i < seqs.size();) {
    size_t j = i;
    while (j < seqs.size() && seqs[j] == seqs[i]) ++j;
    if (static_cast<int64_t>(j - i) > max_rows_per_seq) return 0;
    i = j;
  }
  return bucket;
}

int64_t decode_pages_bucket(const Batch& b, int64_t page_size) {
  int64_t need = 1;
  for (int32_t p : b.positions) need = std::max<int64_t>(need, p / page_size + 1);
  int64_t pps = 1;
  while (pps < need) pps *= 2;
  return pps;
}

void decode_page_tables(const Batch& b, int64_t groups, int64_t B, int64_t pps, int32_t scratch, int32_t* out) {
  const int64_t n = static_cast<int64_t>(b.tokens.size());
  const int64_t copy = std::min<int64_t>(pps, b.pages_per_seq);
  const int64_t n_seqs = static_cast<int64_t>(b.page_table.size()) / b.pages_per_seq / groups;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t i = 0; i <= B; ++i) {
      int32_t* row = out + (g * (B + 1) + i) * pps;
      int64_t j = 0;
      if (i < n) {
        const int32_t* src = b.page_table.data() + (g * n_seqs + int64_t(b.seq_of_token[i])) * b.pages_per_seq;
        for (; j < copy; ++j) row[j] = src[j];
      }
      for (; j < pps; ++j) row[j] = scratch;
    }
  }
}

void decode_row_meta(const Batch& b, int64_t B, int32_t* rows, int32_t* logit_idx) {
  const int64_t n = static_cast<int64_t>(b.tokens.size());
  const int64_t m = b.logit_rows.empty() ? n : static_cast<int64_t>(b.logit_rows.size());
  for (int64_t i = 0; i < B; ++i) {
    const bool real = i < n;
    rows[i] = real ? b.tokens[i] : 0;
    rows[B + i] = real ? b.positions[i] : 0;
    rows[2 * B + i] = static_cast<int32_t>(real ? i : B);
    logit_idx[i] = i < m ? (b.logit_rows.empty() ? static_cast<int32_t>(i) : b.logit_rows[i]) : 0;
  }
}

}  // namespace exl2
