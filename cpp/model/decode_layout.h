// The padded decode layout of CUDA-graph steps, shared by the one-device graph (model/graph.cpp) and tensor
// parallel (model/tensor_parallel.cpp): a batch padded to a bucket of B rows (a power of two), row i < n the batch's
// row i as sequence i with its own copy of its sequence's page-table row, padding rows token 0 at position 0 of
// sequence B, whose pages (like every page past a sequence's own) are the cache's scratch page; pages_per_seq
// bucketed to a power of two.
#pragma once

#include <cstdint>

#include "exl2/model.h"

namespace exl2 {

constexpr int64_t kMaxGraphRows = 64;

// B for a batch of at most kMaxGraphRows rows with at most max_rows_per_seq rows of any one sequence and its logit
// rows fitting in B; 0 when the batch does not fit the layout.
int64_t decode_rows_bucket(const Batch& batch, int64_t max_rows_per_seq);

// The pages_per_seq bucket: the smallest power of two covering every row's position.
int64_t decode_pages_bucket(const Batch& batch, int64_t page_size);

// The padded page tables, `groups` of them (kv_cache.h CacheLayout), each [B + 1, pps], group g's from row
// g * (B + 1): out holds groups * (B + 1) * pps entries.
void decode_page_tables(const Batch& batch, int64_t groups, int64_t B, int64_t pps, int32_t scratch_page,
                        int32_t* out);

// The rows' metadata: ids, positions and sequences (rows[0, B), [B, 2B), [2B, 3B)) and the logit row index [B]
// (the batch's logit rows, or every real row; 0 past them).
void decode_row_meta(const Batch& batch, int64_t B, int32_t* rows, int32_t* logit_idx);

}  // namespace exl2
