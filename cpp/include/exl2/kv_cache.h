// Paged KV cache: per layer, K and V page pools [n_pages, page_size, n_heads_kv, head_dim], and a page
// allocator with reference counts (pages shared by prefix deduplication are freed when the last user
// lets go). Page ids are int32; page tables live with the jobs (engine), not here.
// Quantized caches (Q8/Q6/Q4, format in cache/kv_quant.h) hold per layer u8 code pages
// [n_pages, page_size, n_heads_kv, head_dim * bits / 8] plus f16 scale pages [.., kv_n_scales(head_dim, bits)]
// (head_dim / 32; Q4: twice that, a scale and an offset per block).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "exl2/config.h"
#include "exl2/tensor.h"

namespace exl2 {

// Page ids are int32 and the scratch page's id is n_pages(): a cache holds fewer pages than this.
constexpr int64_t kMaxCachePages = 2147483647;

// Storage of cached K/V: plain floats, or rotated + block-quantized with 8, 6 or 4 bits per value.
enum class CacheType : uint8_t { F16, F32, Q8, Q6, Q4 };
const char* cache_type_name(CacheType type);  // "fp16", "fp32", "q8", "q6", "q4"
int cache_type_bits(CacheType type);          // 16, 32, 8, 6, 4
// "fp16"/"f16", "fp32"/"f32", "q8", "q6", "q4" (any case); "auto"/"" = fp32 on CPU, fp16 on CUDA.
// Anything else raises InvalidArgument listing the choices.
CacheType parse_cache_type(const std::string& name, Device device);
// Bytes of K and V per token for all layers of `config` (quantized: codes + scales); OutOfMemory past 2^63.
size_t cache_bytes_per_token(const ModelConfig& config, CacheType type);
// Quantized caches: the sink rows' bytes per page (f16 K and V row per layer and KV head), all layers; 0 otherwise.
// Counted as if option kv_sink were on (an upper bound for the memory checks).
size_t cache_sink_bytes_per_page(const ModelConfig& config, CacheType type);

// Layer groups for sliding-window memory: the layers of one group share a window (0: full attention) and a page
// table, so pages behind a windowed group's window can be given back while a full group keeps them. Every group
// has n_slots() layers; slot s of every group stores its K/V in one tensor [n_pages, page_size, ..] and the
// groups draw their pages from the one pool (a page belongs to one group of one sequence at a time), so a pool
// page holds n_slots() layers and a sequence's pages are spread over n_groups() page tables. Groups are made per
// window value in order of first appearance, n_slots() = the gcd of the layer counts of the window values (Gemma 3
// 270M: 3 full + 15 windowed layers -> 6 groups of 3); with one window value (every layer full, say) one group
// holds every layer and slot l is layer l: the single page table of a plain cache.
struct CacheLayout {
  std::vector<int64_t> group_window;    // per group: 0 (full attention) or its window in keys
  std::vector<int32_t> group_of_layer;  // per layer
  std::vector<int32_t> slot_of_layer;   // per layer: its storage among the n_slots
  int64_t n_groups() const { return static_cast<int64_t>(group_window.size()); }
  int64_t n_slots() const;
  bool windowed() const;  // some group has a window
};
// The layout of layers with these windows (0: full); empty or every value equal: one group of every layer.
CacheLayout cache_layout(const std::vector<int64_t>& layer_windows);

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
  // Layer split across GPUs: `layer_devices` (empty, or one per layer) puts layer i's pages on layer_devices[i]
  // (one page table for all layers; device() is then layer 0's device).
  // `layout` (CacheLayout; default: one group of every layer) groups the layers: the pool's n_pages pages then hold
  // n_slots() layers each (grouped caches take no layer_devices: InvalidArgument).
  KVCache(const ModelConfig& config, Device device, int64_t n_pages, int page_size, DType dtype,
          const std::vector<Device>& layer_devices = {}, const CacheLayout& layout = {});
  // Any CacheType; Q8/Q6/Q4 need head_dim % 32 == 0 (Unsupported otherwise).
  KVCache(const ModelConfig& config, Device device, int64_t n_pages, int page_size, CacheType type,
          const std::vector<Device>& layer_devices = {}, const CacheLayout& layout = {});
  // Tensor parallel: every layer's KV heads split evenly over the T = tp_devices.size() ranks (rank r holds heads
  // [r * n_kv / T, (r + 1) * n_kv / T) on tp_devices[r]; n_kv % T == 0, InvalidArgument otherwise), one page table
  // and pool for all. The per-layer accessors below (k, v, k_scales, v_scales, k_mean, k_mean_set, set_k_mean) then
  // take a SHARD index, shard(layer, rank); with tp() == 1 the shard index is the layer. `layout` groups the layers
  // as for one device (every rank holds the same slots of its heads; one pool and one table per group for all).
  KVCache(const ModelConfig& config, const std::vector<Device>& tp_devices, int64_t n_pages, int page_size,
          CacheType type, const CacheLayout& layout = {});
  int tp() const { return tp_; }
  int64_t shard(int64_t layer, int rank) const { return layer * tp_ + rank; }

  int page_size() const { return page_size_; }
  int64_t n_pages() const { return pool_.n_pages(); }
  int64_t n_layers() const { return static_cast<int64_t>(slot_.size()) / tp_; }
  // Layer groups (CacheLayout): a Batch's page_table holds one [n_seqs, pages_per_seq] table per group, group g's
  // at rows [g * n_seqs, (g + 1) * n_seqs); layer l reads group(l)'s. One group unless made with a layout.
  int64_t n_groups() const { return static_cast<int64_t>(layout_.group_window.size()); }
  int64_t group(int64_t layer) const { return layout_.group_of_layer.at(layer); }
  int64_t group_window(int64_t g) const { return layout_.group_window.at(g); }
  const CacheLayout& layout() const { return layout_; }
  DType dtype() const { return dtype_; }  // page dtype: f32/f16, or u8 for quantized caches
  CacheType type() const { return type_; }
  bool quantized() const { return bits_ < 16; }
  int bits() const { return bits_; }  // 32, 16, 8, 6, 4
  Device device() const { return device_; }
  Device layer_device(int64_t layer) const { return k_.at(layer * tp_).device(); }  // rank 0's under TP
  // All layers, K and V (quantized: scales and sink rows included, per page / page_size); a grouped cache's page
  // holds n_slots() layers, so its pool holds n_pages * page_size * n_slots / n_layers tokens of every layer.
  size_t bytes_per_token() const;
  // One more page per layer sits after the n_pages() visible ones (same storage, outside the k/v views and the
  // pool): rows that pad a batch for a CUDA graph write their K/V there. Never read by real rows.
  int32_t scratch_page() const { return static_cast<int32_t>(n_pages()); }
  Tensor& k(int64_t layer) { return k_.at(slot_.at(layer)); }
  Tensor& v(int64_t layer) { return v_.at(slot_.at(layer)); }
  // Quantized caches only (undefined tensors otherwise): f16 [n_pages, page_size, n_heads_kv, kv_n_scales].
  Tensor& k_scales(int64_t layer) { return k_s_.at(slot_.at(layer)); }
  Tensor& v_scales(int64_t layer) { return v_s_.at(slot_.at(layer)); }
  // Quantized caches only: the K centring vector of `layer` (cache/kv_quant.h), f32 [n_heads_kv, head_dim] on the
  // layer's device; zeros until set_k_mean. Its kind, k_centre_rope(), is fixed at construction from the
  // option kv_k_centre (exl2/options.h): "rope" -> RoPE-aware (k_mean is a pre-RoPE vector; kv_write_q and
  // attention_paged_q take it with the model's rope table), "fixed" -> one post-RoPE vector (the older scheme, for
  // A/B; anything else raises InvalidArgument). set_k_mean(layer, k, positions, rope) fixes it, once, from the K
  // rows k [n, n_heads_kv, head_dim] (f32/f16, post-RoPE, any device; the first rows the model writes to the layer)
  // at positions (i32 [n], any device): fixed kind, their per-head mean; RoPE-aware kind, the per-head mean of the
  // rows un-rotated by their positions with the table rope (f32 [max_pos, head_dim], any device; required then,
  // ignored by the fixed kind). Later calls do nothing, so every key of the layer is stored relative to the same
  // vector. Defined in cache/kv_quant.cpp.
  Tensor& k_mean(int64_t layer) { return k_mean_.at(layer); }
  bool k_mean_set(int64_t layer) const { return k_mean_ready_.at(layer) != 0; }
  bool k_centre_rope() const { return k_centre_rope_; }
  void set_k_mean(int64_t layer, const Tensor& k, const Tensor& positions = Tensor(), const Tensor& rope = Tensor());
  // Quantized caches: the sink stores of `layer` (cache/kv_quant.h: position 0's rotated K/V rows kept in f16),
  // f16 [n_pages, n_heads_kv, head_dim] each (plus the scratch page after the view, like the pages), one row per page
  // and KV head (1/page_size of an fp16 cache; counted in bytes_per_token). Kept unless option kv_sink is false (read at
  // construction, for A/B; anything but "on"/"off"/unset raises InvalidArgument); undefined tensors then.
  bool sink() const { return !k_sink_.empty(); }
  Tensor& k_sink(int64_t layer) { return sink() ? k_sink_.at(slot_.at(layer)) : none_; }
  Tensor& v_sink(int64_t layer) { return sink() ? v_sink_.at(slot_.at(layer)) : none_; }
  PagePool& pool() { return pool_; }
  const PagePool& pool() const { return pool_; }

 private:
  int page_size_ = 0;
  int tp_ = 1;
  DType dtype_ = DType::F16;
  CacheType type_ = CacheType::F16;
  int bits_ = 16;
  Device device_;
  CacheLayout layout_;              // one group of every layer unless grouped
  std::vector<int32_t> slot_;      // per shard index: its storage in k_, v_, k_s_, .. (identity unless grouped)
  std::vector<Tensor> k_, v_;      // per slot: [n_pages, page_size, n_heads_kv, head_dim (or row bytes)]
  std::vector<Tensor> k_s_, v_s_;  // per slot, quantized only: f16 scales
  std::vector<Tensor> k_mean_;     // per layer, quantized only: f32 [n_heads_kv, head_dim]
  std::vector<uint8_t> k_mean_ready_;
  bool k_centre_rope_ = true;            // quantized only: the K centre's kind (see k_mean)
  std::vector<Tensor> k_sink_, v_sink_;  // per slot, quantized with sink rows only: f16 [n_pages, n_heads_kv, hd]
  Tensor none_;                          // what k_sink / v_sink return without sink rows
  PagePool pool_;
};

}  // namespace exl2
