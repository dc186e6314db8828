// Paged KV cache: per layer, K and V page pools [n_pages, page_size, n_heads_kv, head_dim], and a page
// allocator with reference counts (pages shared by prefix deduplication are freed when the last user
// lets go). Page ids are int32; page tables live with the jobs (engine), not here.
#pragma once

#include <cstdint>
#include <vector>

#include "exl2/config.h"
#include "exl2/tensor.h"

namespace exl2 {

class PagePool {
 public:
  explicit PagePool(int64_t n_pages = 0);
  int64_t n_pages() const { return static_cast<int64_t>(refcount_.size()); }
  int64_t n_free() const { return static_cast<int64_t>(free_.size()); }
  int64_t n_used() const { return n_pages() - n_free(); }
  // Take `n` pages (refcount 1 each). Throws OutOfMemory naming the numbers when fewer are free.
  std::vector<int32_t> alloc(int64_t n);
  void retain(int32_t page);   // refcount + 1
  void release(int32_t page);  // refcount - 1; back to the free list at 0
  int32_t refcount(int32_t page) const;

 private:
  std::vector<int32_t> refcount_;
  std::vector<int32_t> free_;  // LIFO
};

class KVCache {
 public:
  // n_pages * page_size tokens of K and V for every layer of `config`, in `dtype` (f32 or f16) on `device`.
  KVCache(const ModelConfig& config, Device device, int64_t n_pages, int page_size, DType dtype);

  int page_size() const { return page_size_; }
  int64_t n_pages() const { return pool_.n_pages(); }
  int64_t n_layers() const { return static_cast<int64_t>(k_.size()); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  size_t bytes_per_token() const;  // all layers, K and V
  // One more page per layer sits after the n_pages() visible ones (same storage, outside the k/v views and the
  // pool): rows that pad a batch for a CUDA graph write their K/V there. Never read by real rows.
  int32_t scratch_page() const { return static_cast<int32_t>(n_pages()); }
  Tensor& k(int64_t layer) { return k_.at(layer); }
  Tensor& v(int64_t layer) { return v_.at(layer); }
  PagePool& pool() { return pool_; }
  const PagePool& pool() const { return pool_; }

 private:
  int page_size_;
  DType dtype_;
  Device device_;
  std::vector<Tensor> k_, v_;  // per layer: [n_pages, page_size, n_heads_kv, head_dim]
  PagePool pool_;
};

}  // namespace exl2
