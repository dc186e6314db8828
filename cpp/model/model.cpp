// Model: loading (config -> registry -> graph), batch validation, caches and the info report.
#include "exl2/model.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <new>
#include <stdexcept>

#include "core/checked.h"
#include "core/device_api.h"
#include "exl2/safetensors.h"
#include "model/graph.h"
#include "model/load_checks.h"
#include "model/tensor_parallel.h"

namespace exl2 {

void Batch::validate(const KVCache& cache, int64_t vocab_size, int64_t max_seq_len) const {
  const size_t n = tokens.size();
  EXL2_CHECK(n > 0, "batch has no tokens");
  EXL2_CHECK(positions.size() == n && seq_of_token.size() == n, "batch: tokens, positions and seq_of_token must ",
             "have the same length, got ", n, ", ", positions.size(), ", ", seq_of_token.size());
  const int64_t groups = cache.n_groups();  // one table per layer group (kv_cache.h CacheLayout)
  EXL2_CHECK(pages_per_seq > 0 && !page_table.empty() && page_table.size() % (pages_per_seq * groups) == 0,
             "batch: page_table size ", page_table.size(), " is not a positive multiple of pages_per_seq ",
             pages_per_seq, groups > 1 ? str_cat(" times the cache's ", groups, " layer groups") : std::string());
  const int64_t n_seqs = static_cast<int64_t>(page_table.size()) / pages_per_seq / groups;
  for (size_t i = 0; i < n; ++i) {
    EXL2_CHECK(tokens[i] >= 0 && tokens[i] < vocab_size, "token id ", tokens[i], " at row ", i,
               " is outside the vocabulary [0, ", vocab_size, ")");
    EXL2_CHECK(positions[i] >= 0 && positions[i] < max_seq_len, "position ", positions[i], " at row ", i,
               " is outside [0, max_seq_len=", max_seq_len, "); load the model with a larger max_seq_len");
    EXL2_CHECK(seq_of_token[i] >= 0 && seq_of_token[i] < n_seqs, "seq_of_token ", seq_of_token[i], " at row ", i,
               " is outside [0, ", n_seqs, ")");
    EXL2_CHECK(positions[i] / cache.page_size() < pages_per_seq, "position ", positions[i], " at row ", i,
               " needs page ", positions[i] / cache.page_size(), " but sequences have ", pages_per_seq, " pages");
    for (int64_t g = 0; g < groups; ++g) {
      const int32_t page =
          page_table[(g * n_seqs + seq_of_token[i]) * pages_per_seq + positions[i] / cache.page_size()];
      EXL2_CHECK(page >= 0 && page < cache.n_pages(), "page id ", page, " for row ", i,
                 groups > 1 ? str_cat(" (layer group ", g, ")") : std::string(), " is outside [0, ", cache.n_pages(),
                 ")");
    }
  }
  for (int32_t r : logit_rows)
    EXL2_CHECK(r >= 0 && static_cast<size_t>(r) < n, "logit row ", r, " outside [0, ", n, ")");
}

// Tensor parallel: validate the devices and the shard plan, check each GPU's memory (its share of every layer, the
// replicated embedding; rank 0 also the head), then build the graph.
std::unique_ptr<Model> Model::load_tensor_parallel(const std::string& model_dir, const ModelConfig& config,
                                                   const TensorMap& tensors, const LoadOptions& options,
                                                   int64_t max_seq_len, const DecoderSpec& spec) {
  const std::vector<Device>& devs = options.tp_devices;
  EXL2_CHECK(options.layer_devices.empty() && options.head_device < 0,
             "tensor parallel and a layer split (layer_devices / gpu_split) cannot be combined; pick one");
  const int64_t T = static_cast<int64_t>(devs.size());
  plan_tensor_parallel(config, T);  // InvalidArgument for configs that do not split
  WeightSizes sizes;  // CUDA: sized once here, the OOM check's numbers are the ranks' arena reserves
  if (devs[0].is_cuda()) {
    const int count = device::cuda_device_count();
    for (size_t i = 0; i < devs.size(); ++i) {
      EXL2_CHECK(devs[i].is_cuda(), "tensor parallel: devices must be all CUDA or all CPU, got ", devs[i].str(),
                 " after ", devs[0].str());
      EXL2_CHECK(devs[i].index >= 0 && devs[i].index < count, "tensor parallel: ", devs[i].str(),
                 " is not a visible CUDA device (", count, " visible)");
      for (size_t j = 0; j < i; ++j)
        EXL2_CHECK(devs[i] != devs[j], "tensor parallel: ", devs[i].str(), " is listed twice");
    }
    sizes.per_device = tp_weight_bytes(config, tensors, T, max_seq_len, &sizes.head);
    for (int64_t r = 0; r < T; ++r) {
      const size_t need = sizes.per_device[r] + (r == 0 ? sizes.head : 0);
      size_t free_b = 0, total_b = 0;
      device::cuda_mem_info(devs[r].index, &free_b, &total_b);
      EXL2_CHECK_KIND(OutOfMemory, need < free_b, "tensor parallel: ", devs[r].str(), " needs about ", need / (1 << 20),
                      " MiB for its shard of the weights but only ", free_b / (1 << 20), " MiB of ",
                      total_b / (1 << 20), " MiB are free there; free the GPU, use more GPUs or a smaller quant");
    }
  } else {
    for (const Device& d : devs)
      EXL2_CHECK(d.is_cpu(), "tensor parallel: devices must be all CUDA or all CPU, got ", d.str(), " after cpu");
  }
  LoadOptions opt = options;
  opt.device = devs[0];
  std::unique_ptr<Model> m(new Model());
  m->max_seq_len_ = max_seq_len;
  m->graph_ = std::make_unique<ModelGraph>(config, tensors, opt, spec, max_seq_len, sizes);
  return m;
}

std::unique_ptr<Model> Model::load(const std::string& model_dir, const LoadOptions& options) {
  // Whatever a size computed from the files or options still makes the host run out of (a vector of a checked but
  // large count), or a file system error not caught at its call: an exl2::Error naming the folder, never a
  // std::bad_alloc or filesystem_error the caller cannot tell from a bug.
  try {
    return load_checked(model_dir, options);
  } catch (const std::bad_alloc&) {
    EXL2_FAIL(OutOfMemory, "out of host memory loading ", model_dir);
  } catch (const std::length_error& e) {
    EXL2_FAIL(OutOfMemory, "loading ", model_dir, ": a size from its files is too large (", e.what(), ")");
  } catch (const std::filesystem::filesystem_error& e) {
    EXL2_FAIL(Io, "loading ", model_dir, ": ", e.what());
  }
}

std::unique_ptr<Model> Model::load_checked(const std::string& model_dir, const LoadOptions& options) {
  const ModelConfig config = ModelConfig::load(model_dir);
  const std::string source = (std::filesystem::path(model_dir) / "config.json").string();
  EXL2_CHECK_KIND(Unsupported, config.head_dim % 2 == 0, "config.json: head_dim must be even, got ", config.head_dim);
  TensorMap tensors = TensorMap::open(model_dir);
  const DecoderSpec spec = decoder_spec(config);  // the architecture's composition; Unsupported for what it lacks
  check_layers(config, tensors, source, false, spec.names.layers);

  EXL2_CHECK(options.max_seq_len >= 0, "max_seq_len must be positive (0: the config's max_position_embeddings), got ",
             options.max_seq_len);
  const int64_t max_seq_len = options.max_seq_len > 0 ? options.max_seq_len : config.max_position_embeddings;
  check_max_seq_len(config, max_seq_len, options.max_seq_len == 0, source);
  check_rope(config, max_seq_len, source);
  // The CPU backend computes from what it loads: copies, so that the model does not depend on its files.
  const Device target = options.tp_devices.empty() ? options.device : options.tp_devices[0];
  if (target.is_cuda()) device::require_cuda_backend("device " + target.str());
  tensors.set_copy(target.is_cpu());

  if (!options.tp_devices.empty()) return load_tensor_parallel(model_dir, config, tensors, options, max_seq_len, spec);
  const bool split = !options.layer_devices.empty() || options.head_device >= 0;
  if (split) {
    EXL2_CHECK(options.device.is_cuda(), "layer split (layer_devices / gpu_split) needs device=\"cuda\", got \"",
               options.device.str(), "\"");
    EXL2_CHECK(options.layer_devices.empty() ||
                   static_cast<int64_t>(options.layer_devices.size()) == config.num_hidden_layers,
               "layer_devices has ", options.layer_devices.size(), " entries but the model has ",
               config.num_hidden_layers, " layers (give one CUDA index per layer)");
    const int count = device::cuda_device_count();
    for (size_t i = 0; i < options.layer_devices.size(); ++i)
      EXL2_CHECK(options.layer_devices[i] >= 0 && options.layer_devices[i] < count, "layer_devices[", i, "] = ",
                 options.layer_devices[i], " is not a visible CUDA device (", count, " visible)");
    EXL2_CHECK(options.head_device >= -1 && options.head_device < count, "head_device ", options.head_device,
               " is not a visible CUDA device (", count, " visible; -1: the last layer's)");
  }

  WeightSizes sizes;  // CUDA: sized once here, the OOM check's numbers are the graph's arena reserves
  if (options.device.is_cuda() && split) {
    // Fail before anything is half-loaded: each GPU must hold what is placed on it (graph.h weight_bytes_per_device:
    // the aligned sizes the weight arena reserves).
    const int count = device::cuda_device_count();
    EXL2_CHECK(options.device.index < count, "device ", options.device.str(), " requested but ", count,
               " CUDA device(s) are visible");
    sizes.per_device = weight_bytes_per_device(config, tensors, options, max_seq_len);
    const std::vector<size_t>& need = sizes.per_device;
    for (int d = 0; d < int(need.size()); ++d) {
      if (need[d] == 0) continue;
      size_t free_b = 0, total_b = 0;
      device::cuda_mem_info(d, &free_b, &total_b);
      EXL2_CHECK_KIND(OutOfMemory, need[d] < free_b, "the layers placed on cuda:", d, " need about ",
                      need[d] / (1 << 20), " MiB but only ", free_b / (1 << 20), " MiB of ", total_b / (1 << 20),
                      " MiB are free there; lower that GPU's share in gpu_split or use gpu_split=\"auto\"");
    }
  } else if (options.device.is_cuda()) {
    // Fail before anything is half-loaded: the weights' aligned sizes (graph.h weight_bytes_per_device) must fit.
    const int count = device::cuda_device_count();
    EXL2_CHECK(options.device.index < count, "device ", options.device.str(), " requested but ", count,
               " CUDA device(s) are visible");
    size_t free_b = 0, total_b = 0;
    device::cuda_mem_info(options.device.index, &free_b, &total_b);
    sizes.per_device = weight_bytes_per_device(config, tensors, options, max_seq_len);
    const size_t need = sizes.per_device[options.device.index];
    EXL2_CHECK_KIND(OutOfMemory, need < free_b, "model weights need about ", need / (1 << 20), " MiB on ",
                    options.device.str(), " but only ", free_b / (1 << 20), " MiB of ", total_b / (1 << 20),
                    " MiB are free; use a smaller quant, free the GPU, or split across GPUs");
  }

  std::unique_ptr<Model> m(new Model());
  m->max_seq_len_ = max_seq_len;
  m->graph_ = std::make_unique<ModelGraph>(config, tensors, options, spec, max_seq_len, sizes);
  return m;
}

Model::~Model() = default;

const ModelConfig& Model::config() const { return graph_->config(); }
Device Model::device() const { return graph_->device(); }
std::vector<Device> Model::layer_devices() const { return graph_->layer_devices(); }
Device Model::head_device() const { return graph_->head_device(); }
bool Model::split() const { return graph_->split(); }
std::vector<Device> Model::tp_devices() const {
  return graph_->tp_devices();
}
int64_t Model::max_seq_len() const { return max_seq_len_; }
DType Model::activation_dtype() const { return graph_->act_dtype(); }
ModelGraph& Model::graph() { return *graph_; }

std::unique_ptr<KVCache> Model::make_cache(int64_t n_tokens, int page_size) const {
  return make_cache(n_tokens, page_size, device().is_cpu() ? CacheType::F32 : CacheType::F16);
}

CacheLayout Model::window_layout() const {
  std::vector<int64_t> windows;
  const bool plain = split();  // a layer split's cache keeps one page table (make_cache)
  for (const LayerSpec& l : graph_->spec().layers) windows.push_back(plain ? 0 : l.window);
  return cache_layout(windows);
}

int64_t Model::kv_window() const {
  int64_t w = 0;
  for (const LayerSpec& l : graph_->spec().layers) {
    if (l.window <= 0) return 0;
    w = std::max(w, l.window);
  }
  return w;
}

std::unique_ptr<KVCache> Model::make_cache(int64_t n_tokens, int page_size, CacheType type) const {
  return make_cache(n_tokens, page_size, type, false);
}

std::unique_ptr<KVCache> Model::make_cache(int64_t n_tokens, int page_size, CacheType type, bool windowed) const {
  EXL2_CHECK(n_tokens > 0 && page_size > 0, "make_cache: n_tokens and page_size must be positive, got ", n_tokens,
             ", ", page_size);
  const int64_t n_pages = n_tokens / page_size + (n_tokens % page_size != 0);  // no n_tokens + page_size overflow
  // Bytes of the whole cache (or of a share of it): per token of every page, plus the sink rows of every page and
  // the scratch page. Saturating: a count past 2^64 still compares as too large.
  const size_t tokens = saturating_bytes(static_cast<size_t>(n_pages), static_cast<size_t>(page_size));
  auto bytes_of = [&](size_t per_token, size_t sink_per_page) {
    return saturating_bytes(per_token, tokens, saturating_bytes(sink_per_page, static_cast<size_t>(n_pages) + 1));
  };
  auto what = [&](const std::string& where) {
    return str_cat("KV cache of cache_tokens=", n_tokens, " (", n_pages, " pages of ", page_size, ", ",
                   cache_type_name(type), ") needs ", where);
  };
  const std::string fix = "; ask for fewer cache tokens or a quantized cache_type";
  const size_t per_token = cache_bytes_per_token(config(), type), sink = cache_sink_bytes_per_page(config(), type);
  auto check_fits = [&](size_t need, Device d, const std::string& share) {
    size_t free_b = 0, total_b = 0;
    if (d.is_cpu()) {
      free_b = host_available_bytes();
      EXL2_CHECK_KIND(OutOfMemory, need <= free_b, what(bytes_str(need)), share, " but only ", bytes_str(free_b),
                      " of host memory are available", fix);
      return;
    }
    device::cuda_mem_info(d.index, &free_b, &total_b);
    EXL2_CHECK_KIND(OutOfMemory, need < free_b, what(bytes_str(need)), share, " on ", d.str(), " but only ",
                    free_b / (1 << 20), " MiB of ", total_b / (1 << 20), " MiB are free there", fix);
  };
  auto check_pages = [&] {  // page ids are int32, and the scratch page's id is n_pages
    EXL2_CHECK(n_pages < kMaxCachePages, "KV cache of cache_tokens=", n_tokens, " needs ", n_pages, " pages of ",
               page_size, " tokens but page ids are 32-bit (at most ", kMaxCachePages - 1,
               " pages); use a larger page_size or fewer cache tokens");
  };
  const CacheLayout layout = windowed ? window_layout() : CacheLayout();
  // A cache of layer groups: the same memory in pages of n_slots layers, n_groups times as many.
  auto group_pages = [&] {
    const int64_t pool = checked_mul(ErrorKind::InvalidArgument, {n_pages, layout.n_groups()}, "KV cache pages");
    EXL2_CHECK(pool < kMaxCachePages, "KV cache of cache_tokens=", n_tokens, " needs ", pool, " pages of ", page_size,
               " tokens (", layout.n_groups(), " layer groups) but page ids are 32-bit (at most ", kMaxCachePages - 1,
               " pages); use a larger page_size or fewer cache tokens");
    return pool;
  };
  if (const std::vector<Device> tp = tp_devices(); !tp.empty()) {  // each rank's KV heads on its device
    const size_t need = bytes_of(per_token / tp.size(), sink / tp.size());
    if (tp[0].is_cpu()) check_fits(saturating_bytes(need, tp.size()), tp[0], " (all ranks)");
    for (const Device& d : tp)
      if (d.is_cuda()) check_fits(need, d, " (its share of the KV heads)");
    check_pages();
    if (layout.windowed()) return std::make_unique<KVCache>(config(), tp, group_pages(), page_size, type, layout);
    return std::make_unique<KVCache>(config(), tp, n_pages, page_size, type);
  }
  if (split() && config().num_hidden_layers > 0) {  // each layer's pages on its GPU: check every GPU's share
    const std::vector<Device> devs = layer_devices();
    const size_t per_layer = bytes_of(per_token, sink) / devs.size();
    std::vector<std::pair<Device, size_t>> need;
    for (const Device& d : devs) {
      auto it = std::find_if(need.begin(), need.end(), [&](const auto& p) { return p.first == d; });
      if (it == need.end()) need.emplace_back(d, 0), it = need.end() - 1;
      it->second = saturating_bytes(1, it->second, per_layer);
    }
    for (const auto& [d, bytes] : need) check_fits(bytes, d, " (its layers)");
    check_pages();
    return std::make_unique<KVCache>(config(), device(), n_pages, page_size, type, devs);
  }
  check_fits(bytes_of(per_token, sink), device(), "");
  check_pages();
  if (layout.windowed())
    return std::make_unique<KVCache>(config(), device(), group_pages(), page_size, type, std::vector<Device>{}, layout);
  return std::make_unique<KVCache>(config(), device(), n_pages, page_size, type);
}

Tensor Model::forward(const Batch& batch, KVCache& cache) { return graph_->forward(batch, cache); }

Tensor Model::forward(const Batch& batch, KVCache& cache, DeviceArgmax* argmax) {
  return graph_->forward(batch, cache, argmax);
}

std::string Model::info_json() const {
  Json layers = Json::make_array();
  for (const auto& kv : graph_->linears()) {
    Json o = Json::make_object();
    o.set("name", Json::make_string(kv.first));
    o.set("kind", Json::make_string(kv.second->kind()));
    o.set("in_features", Json::make_int(kv.second->in_features()));
    o.set("out_features", Json::make_int(kv.second->out_features()));
    o.set("bytes", Json::make_int(static_cast<int64_t>(kv.second->nbytes())));
    o.set("bits_per_weight", Json::make_number(kv.second->bits_per_weight()));
    o.set("bits", Json::make_string(kv.second->bits_desc()));
    layers.push_back(o);
  }
  Json root = Json::make_object();
  root.set("architecture", Json::make_string(config().architecture));
  root.set("device", Json::make_string(device().str()));
  Json devs = Json::make_array();
  for (const Device& d : layer_devices()) devs.push_back(Json::make_string(d.str()));
  root.set("layer_devices", devs);
  root.set("head_device", Json::make_string(head_device().str()));
  Json tp = Json::make_array();
  for (const Device& d : tp_devices()) tp.push_back(Json::make_string(d.str()));
  root.set("tp_devices", tp);
  root.set("activation_dtype", Json::make_string(dtype_name(activation_dtype())));
  root.set("max_seq_len", Json::make_int(max_seq_len_));
  root.set("weight_bytes", Json::make_int(static_cast<int64_t>(graph_->weight_bytes())));
  root.set("linears", layers);
  return root.dump();
}

}  // namespace exl2
