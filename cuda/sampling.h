// GPU helpers for the sampler: row softmax with temperature, argmax and top-k over logits that stay on the
// device (only the few selected values cross to the host). Raw device pointers, current stream, no sync.
#pragma once

#include <cstdint>

namespace exl2::cuda {

// probs[r, :] = softmax(logits[r, :] / temperature) in fp32 (max-subtracted).  logits, probs: f32 [rows, vocab];
// probs may equal logits. temperature <= 0: a one-hot row at the argmax (greedy). NaN logits count as -inf.
void softmax_rows(const float* logits, float* probs, int64_t rows, int64_t vocab, float temperature);

// out_index[r] = argmax of row r (lowest index among equal maxima).  values: f32 [rows, vocab].
void argmax_rows(const float* values, int64_t rows, int64_t vocab, int32_t* out_index);

// The k largest entries of each row, in descending order (ties: lower index first):
// out_values f32 [rows, k], out_indices i32 [rows, k]. 1 <= k <= vocab; k passes over the row, so meant for
// the sampler's small k (<= a few hundred); pass probabilities to get top-p by a host-side prefix sum.
void topk_rows(const float* values, int64_t rows, int64_t vocab, int k, float* out_values, int32_t* out_indices);

}  // namespace exl2::cuda
