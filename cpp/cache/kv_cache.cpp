// The page allocator and the per-layer K/V page pools (see exl2/kv_cache.h).
#include "exl2/kv_cache.h"

namespace exl2 {

PagePool::PagePool(int64_t n_pages) : refcount_(n_pages, 0) {
  free_.reserve(n_pages);
  for (int64_t i = n_pages - 1; i >= 0; --i) free_.push_back(static_cast<int32_t>(i));
}

std::vector<int32_t> PagePool::alloc(int64_t n) {
  EXL2_CHECK_KIND(OutOfMemory, n <= n_free(), "KV cache is full: need ", n, " pages, ", n_free(), " of ", n_pages(),
                  " free; give the cache more tokens (cache_tokens / max_seq_len) or run fewer jobs at once");
  std::vector<int32_t> pages(n);
  for (int64_t i = 0; i < n; ++i) {
    pages[i] = free_.back();
    free_.pop_back();
    refcount_[pages[i]] = 1;
  }
  return pages;
}

void PagePool::retain(int32_t page) {
  EXL2_CHECK_KIND(Internal, page >= 0 && page < n_pages() && refcount_[page] > 0, "retain of free page ", page);
  ++refcount_[page];
}

void PagePool::release(int32_t page) {
  EXL2_CHECK_KIND(Internal, page >= 0 && page < n_pages() && refcount_[page] > 0, "release of free page ", page);
  if (--refcount_[page] == 0) free_.push_back(page);
}

int32_t PagePool::refcount(int32_t page) const {
  EXL2_CHECK(page >= 0 && page < n_pages(), "page id ", page, " out of range [0, ", n_pages(), ")");
  return refcount_[page];
}

KVCache::KVCache(const ModelConfig& c, Device device, int64_t n_pages, int page_size, DType dtype)
    : page_size_(page_size), dtype_(dtype), device_(device), pool_(n_pages) {
  EXL2_CHECK(page_size > 0 && n_pages > 0, "KV cache needs page_size > 0 and n_pages > 0, got ", page_size, ", ",
             n_pages);
  EXL2_CHECK(dtype == DType::F32 || dtype == DType::F16, "KV cache dtype must be f32 or f16, got ", dtype_name(dtype));
  // n_pages + 1: the last page is scratch_page(), kept outside the views.
  const Shape shape = {n_pages + 1, page_size, c.num_key_value_heads, c.head_dim};
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    k_.push_back(Tensor::zeros(shape, dtype, device).slice(0, n_pages));
    v_.push_back(Tensor::zeros(shape, dtype, device).slice(0, n_pages));
  }
}

size_t KVCache::bytes_per_token() const {
  if (k_.empty()) return 0;
  return 2 * k_.size() * k_[0].nbytes() / static_cast<size_t>(k_[0].size(0) * k_[0].size(1));
}

}  // namespace exl2
