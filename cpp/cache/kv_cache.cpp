// The page allocator and the per-layer K/V page pools (see exl2/kv_cache.h).
#include "exl2/kv_cache.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <numeric>

#include "cache/kv_quant.h"
#include "core/checked.h"
#include "exl2/options.h"

namespace exl2 {

const char* cache_type_name(CacheType type) {
  switch (type) {
    case CacheType::F16:
      return "fp16";
    case CacheType::F32:
      return "fp32";
    case CacheType::Q8:
      return "q8";
    case CacheType::Q6:
      return "q6";
    default:
      return "q4";
  }
}

int cache_type_bits(CacheType type) {
  switch (type) {
    case CacheType::F16:
      return 16;
    case CacheType::F32:
      return 32;
    case CacheType::Q8:
      return 8;
    case CacheType::Q6:
      return 6;
    default:
      return 4;
  }
}

CacheType parse_cache_type(const std::string& name, Device device) {
  std::string s;
  for (char c : name) s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s.empty() || s == "auto") return device.is_cpu() ? CacheType::F32 : CacheType::F16;
  if (s == "fp16" || s == "f16" || s == "float16") return CacheType::F16;
  if (s == "fp32" || s == "f32" || s == "float32") return CacheType::F32;
  if (s == "q8") return CacheType::Q8;
  if (s == "q6") return CacheType::Q6;
  if (s == "q4") return CacheType::Q4;
  EXL2_FAIL(InvalidArgument, "cache_type must be one of \"auto\", \"fp16\", \"fp32\", \"q8\", \"q6\", \"q4\", got \"",
            name, "\"");
}

size_t cache_sink_bytes_per_page(const ModelConfig& c, CacheType type) {
  if (cache_type_bits(type) >= 16) return 0;
  return static_cast<size_t>(checked_mul(ErrorKind::OutOfMemory, {2, c.num_hidden_layers, c.num_key_value_heads,
                                                                  c.head_dim, 2}, "a KV cache page's sink rows"));
}

size_t cache_bytes_per_token(const ModelConfig& c, CacheType type) {
  const int bits = cache_type_bits(type);
  const int64_t row = bits >= 16 ? c.head_dim * bits / 8
                                 : kv_row_bytes(c.head_dim, bits) + kv_n_scales(c.head_dim, bits) * 2;  // codes + f16 scales
  return static_cast<size_t>(
      checked_mul(ErrorKind::OutOfMemory, {2, c.num_hidden_layers, c.num_key_value_heads, row}, "a KV cache token"));
}

int64_t CacheLayout::n_slots() const {
  if (group_window.empty()) return 0;
  return static_cast<int64_t>(group_of_layer.size()) / n_groups();
}

bool CacheLayout::windowed() const {
  for (int64_t w : group_window)
    if (w > 0) return true;
  return false;
}

CacheLayout cache_layout(const std::vector<int64_t>& layer_windows) {
  CacheLayout out;
  const int64_t n = static_cast<int64_t>(layer_windows.size());
  std::vector<int64_t> values;  // window values, first appearance first
  std::vector<int64_t> counts;
  for (int64_t w : layer_windows) {
    EXL2_CHECK(w >= 0, "cache_layout: a layer's window must be >= 0, got ", w);
    auto it = std::find(values.begin(), values.end(), w);
    if (it == values.end()) {
      values.push_back(w);
      counts.push_back(1);
    } else {
      counts[it - values.begin()]++;
    }
  }
  int64_t slots = 0;
  for (int64_t c : counts) slots = std::gcd(slots, c);
  out.group_of_layer.resize(n);
  out.slot_of_layer.resize(n);
  std::vector<int64_t> seen(values.size(), 0), first_group(values.size(), 0);
  for (size_t v = 0; v < values.size(); ++v) {
    first_group[v] = out.n_groups();
    for (int64_t g = 0; g < counts[v] / slots; ++g) out.group_window.push_back(values[v]);
  }
  for (int64_t l = 0; l < n; ++l) {
    const size_t v = std::find(values.begin(), values.end(), layer_windows[l]) - values.begin();
    const int64_t i = seen[v]++;
    out.group_of_layer[l] = static_cast<int32_t>(first_group[v] + i / slots);
    out.slot_of_layer[l] = static_cast<int32_t>(i % slots);
  }
  return out;
}

namespace {
int64_t checked_pages(int64_t n_pages) {  // before the pool's vectors are made
  EXL2_CHECK(n_pages >= 0 && n_pages < kMaxCachePages, "KV cache: n_pages must be in [0, 2^31 - 2], got ", n_pages);
  return n_pages;
}
}  // namespace

PagePool::PagePool(int64_t n_pages) : refcount_(checked_pages(n_pages), 0) {
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

namespace {

// The layout a cache of `c` keeps: `layout`, or one group of every layer (window 0) when it is empty.
CacheLayout checked_layout(const ModelConfig& c, const CacheLayout& layout, const std::vector<Device>& layer_devices) {
  if (layout.group_window.empty()) return cache_layout(std::vector<int64_t>(c.num_hidden_layers, 0));
  EXL2_CHECK(static_cast<int64_t>(layout.group_of_layer.size()) == c.num_hidden_layers &&
                 layout.slot_of_layer.size() == layout.group_of_layer.size(),
             "KV cache: the layer layout covers ", layout.group_of_layer.size(), " layers but the model has ",
             c.num_hidden_layers);
  EXL2_CHECK(layout.n_groups() == 1 || layer_devices.empty(),
             "KV cache: a cache of layer groups keeps every layer on one device (no layer_devices)");
  return layout;
}

// Layer i's device: layer_devices[i], or `device` for all layers when the list is empty.
Device layer_dev(const ModelConfig& c, Device device, const std::vector<Device>& layer_devices, int64_t i) {
  if (layer_devices.empty()) return device;
  EXL2_CHECK(static_cast<int64_t>(layer_devices.size()) == c.num_hidden_layers, "KV cache: layer_devices has ",
             layer_devices.size(), " entries but the model has ", c.num_hidden_layers, " layers");
  return layer_devices[i];
}

// The K centre's kind of quantized caches from option kv_k_centre (exl2/kv_cache.h): true = RoPE-aware.
bool k_centre_rope_from_env() { return runtime_options().kv_k_centre == "rope"; }

// Whether quantized caches keep sink rows, from option kv_sink (exl2/kv_cache.h).
bool sink_from_env() { return runtime_options().kv_sink; }

}  // namespace

KVCache::KVCache(const ModelConfig& c, Device device, int64_t n_pages, int page_size, DType dtype,
                 const std::vector<Device>& layer_devices, const CacheLayout& layout)
    : page_size_(page_size),
      dtype_(dtype),
      type_(dtype == DType::F32 ? CacheType::F32 : CacheType::F16),
      bits_(dtype == DType::F32 ? 32 : 16),
      device_(device),
      layout_(checked_layout(c, layout, layer_devices)),
      slot_(layout_.slot_of_layer),
      pool_(n_pages) {
  EXL2_CHECK(page_size > 0 && n_pages > 0 && n_pages < kMaxCachePages,
             "KV cache needs page_size > 0 and n_pages in [1, 2^31 - 2], got ", page_size, ", ", n_pages);
  EXL2_CHECK(dtype == DType::F32 || dtype == DType::F16, "KV cache dtype must be f32 or f16, got ", dtype_name(dtype));
  // n_pages + 1: the last page is scratch_page(), kept outside the views.
  const Shape shape = {n_pages + 1, page_size, c.num_key_value_heads, c.head_dim};
  for (int64_t i = 0; i < layout_.n_slots(); ++i) {  // one group: slot i is layer i
    const Device d = layer_dev(c, device, layer_devices, i);
    k_.push_back(Tensor::zeros(shape, dtype, d).slice(0, n_pages));
    v_.push_back(Tensor::zeros(shape, dtype, d).slice(0, n_pages));
  }
}

KVCache::KVCache(const ModelConfig& c, Device device, int64_t n_pages, int page_size, CacheType type,
                 const std::vector<Device>& layer_devices, const CacheLayout& layout)
    : page_size_(page_size),
      dtype_(DType::U8),
      type_(type),
      bits_(cache_type_bits(type)),
      device_(device),
      layout_(checked_layout(c, layout, layer_devices)),
      slot_(layout_.slot_of_layer),
      pool_(n_pages) {
  EXL2_CHECK(page_size > 0 && n_pages > 0 && n_pages < kMaxCachePages,
             "KV cache needs page_size > 0 and n_pages in [1, 2^31 - 2], got ", page_size, ", ", n_pages);
  if (!quantized()) {
    *this = KVCache(c, device, n_pages, page_size, type == CacheType::F32 ? DType::F32 : DType::F16, layer_devices,
                    layout);
    return;
  }
  EXL2_CHECK_KIND(Unsupported, c.head_dim % kKvQuantBlock == 0, "KV cache type ", cache_type_name(type),
                  " needs head_dim to be a multiple of ", kKvQuantBlock, ", this model has head_dim ", c.head_dim,
                  "; use cache_type \"fp16\"");
  bool on_cuda = device.is_cuda();
  for (const Device& d : layer_devices) on_cuda = on_cuda || d.is_cuda();
  // the CUDA quantized-cache attention kernels are instantiated for these head sizes (cuda/kv_quant.cu): refuse
  // others here, at cache creation, rather than failing every job at its first step
  EXL2_CHECK_KIND(Unsupported, !on_cuda || c.head_dim == 64 || c.head_dim == 96 || c.head_dim == 128 ||
                                   c.head_dim == 256,
                  "KV cache type ", cache_type_name(type), " on CUDA needs head_dim 64, 96, 128 or 256, this model has ",
                  "head_dim ", c.head_dim, "; use cache_type \"fp16\"");
  // n_pages + 1: the last page is scratch_page(), kept outside the views (as for float caches).
  const Shape codes = {n_pages + 1, page_size, c.num_key_value_heads, kv_row_bytes(c.head_dim, bits_)};
  const Shape scales = {n_pages + 1, page_size, c.num_key_value_heads, kv_n_scales(c.head_dim, bits_)};
  const Shape sinks = {n_pages + 1, c.num_key_value_heads, c.head_dim};
  const bool sink = sink_from_env();
  for (int64_t i = 0; i < layout_.n_slots(); ++i) {  // one group: slot i is layer i
    const Device d = layer_dev(c, device, layer_devices, i);
    k_.push_back(Tensor::zeros(codes, DType::U8, d).slice(0, n_pages));
    v_.push_back(Tensor::zeros(codes, DType::U8, d).slice(0, n_pages));
    k_s_.push_back(Tensor::zeros(scales, DType::F16, d).slice(0, n_pages));
    v_s_.push_back(Tensor::zeros(scales, DType::F16, d).slice(0, n_pages));
    if (sink) {
      k_sink_.push_back(Tensor::zeros(sinks, DType::F16, d).slice(0, n_pages));
      v_sink_.push_back(Tensor::zeros(sinks, DType::F16, d).slice(0, n_pages));
    }
  }
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)  // the K centre is per layer, whatever its slot
    k_mean_.push_back(Tensor::zeros({c.num_key_value_heads, c.head_dim}, DType::F32, layer_dev(c, device, layer_devices, i)));
  k_mean_ready_.assign(c.num_hidden_layers, 0);
  k_centre_rope_ = k_centre_rope_from_env();
}

KVCache::KVCache(const ModelConfig& c, const std::vector<Device>& tp_devices, int64_t n_pages, int page_size,
                 CacheType type, const CacheLayout& layout)
    : pool_(n_pages) {
  const int64_t T = static_cast<int64_t>(tp_devices.size());
  EXL2_CHECK(T > 0, "KV cache: tensor parallel needs at least one device");
  EXL2_CHECK(c.num_key_value_heads % T == 0, "KV cache: tensor parallel over ", T,
             " devices needs num_key_value_heads (", c.num_key_value_heads, ") divisible by ", T);
  ModelConfig sub = c;
  sub.num_key_value_heads = c.num_key_value_heads / T;
  std::vector<KVCache> parts;
  parts.reserve(T);
  for (const Device& d : tp_devices)
    parts.emplace_back(sub, d, n_pages, page_size, type, std::vector<Device>{}, layout);
  page_size_ = parts[0].page_size_;
  tp_ = static_cast<int>(T);
  dtype_ = parts[0].dtype_;
  type_ = parts[0].type_;
  bits_ = parts[0].bits_;
  k_centre_rope_ = parts[0].k_centre_rope_;
  device_ = tp_devices[0];
  layout_ = parts[0].layout_;
  // Storage: slot-major, rank-minor (slot i of rank r at i * T + r); shard(l, r) reads layer l's slot of rank r.
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    for (int64_t r = 0; r < T; ++r) slot_.push_back(static_cast<int32_t>(layout_.slot_of_layer[l] * T + r));
  for (int64_t i = 0; i < layout_.n_slots(); ++i) {
    for (KVCache& p : parts) {
      k_.push_back(p.k_[i]);
      v_.push_back(p.v_[i]);
      if (p.quantized()) {
        k_s_.push_back(p.k_s_[i]);
        v_s_.push_back(p.v_s_[i]);
        if (p.sink()) {
          k_sink_.push_back(p.k_sink_[i]);
          v_sink_.push_back(p.v_sink_[i]);
        }
      }
    }
  }
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {  // the K centre is per layer and rank
    for (KVCache& p : parts) {
      if (p.quantized()) {
        k_mean_.push_back(p.k_mean_[l]);
        k_mean_ready_.push_back(0);
      }
    }
  }
}

size_t KVCache::bytes_per_token() const {
  if (k_.empty()) return 0;
  // codes (or values) + scales + the sink rows (one f16 row per page and KV head), per page, per layer
  size_t per_layer = k_[0].nbytes() + (k_s_.empty() ? 0 : k_s_[0].nbytes()) +
                     (k_sink_.empty() ? 0 : static_cast<size_t>(k_[0].size(0) * k_sink_[0].size(1) *
                                                                  k_sink_[0].size(2)) * 2);
  return 2 * slot_.size() * per_layer / static_cast<size_t>(k_[0].size(0) * k_[0].size(1));
}

}  // namespace exl2
