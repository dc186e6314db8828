// Loading and running the model graph (see graph.h): buffers from the Workspace, the layers through DecoderBody,
// decode steps as CUDA graphs (cuda/graph_exec.h). Calls ops:: and the linears only.
#include "model/graph.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>

#include "cache/kv_quant.h"
#include "core/checked.h"
#include "exl2/options.h"
#include "core/device_api.h"
#include "core/weight_arena.h"
#include "linear/exl2_linear.h"
#include "model/decode_layout.h"
#include "model/rope.h"
#include "model/tensor_parallel.h"
#include "model/workspace.h"
#include "ops/ops.h"

#ifdef EXL2_WITH_CUDA
#include "cuda/graph_exec.h"
#include "cuda/multi_device.h"
#endif

namespace exl2 {

// The step's metadata views on one device.
struct StepMeta {
  Tensor ids, pos, seq, pages, logit_idx;
};

struct StepIO {
  int64_t n = 0, m = 0;         // rows; logit rows
  Tensor ids, pos, seq, pages;  // i32 [n], [n], [n], [n_seqs, pages_per_seq] (device)
  Tensor logit_idx;             // i32 [m] rows of h to take; undefined: all n rows (m == n)
  Tensor logits;                // act [m, vocab] (unused when act is f32)
  Tensor logits32;              // f32 [m, vocab]: the step's result (on the head's device)
  // Attention's decode and prefill rows (ops.h attention_spans); empty: no hint (CPU).
  std::vector<ops::AttentionSpan> spans;
  std::vector<StepMeta> on;     // split models: the same metadata on each device in use, by CUDA index
};

struct StepActs {
  Tensor h, x, q, k, v, attn, gate, up;
  MoeBuffers moe{};
};

// The body's view of one device for a step (T = 1: the gathered inputs are the buffers themselves).
RankRun run_on(const StepActs& a, std::vector<DecoderLayer>& layers, const std::vector<Tensor>& ropes,
               const Tensor& pos, const Tensor& seq, const Tensor& pages) {
  RankRun R;
  R.layers = &layers;
  R.ropes = &ropes;
  R.b = StepBufs{a.h, a.x, a.q, a.k, a.v, a.attn, a.gate, a.up, a.attn, a.gate, a.x};
  attach_moe(R.b, a.moe);
  R.pos = pos;
  R.seq = seq;
  R.pages = pages;
  return R;
}

struct DecodeGraphs {
#ifdef EXL2_WITH_CUDA
  struct Entry {
    bool warm = false;    // ran eagerly once for this cache: scratch buffers have their size for this shape
    bool failed = false;  // capture raised: this shape stays eager (for this cache)
    std::unique_ptr<cuda::Graph> graph;
    uint64_t ws_generation = 0, scratch_generation = 0;
    std::vector<const void*> cache_ptrs;  // the cache's K/V buffers the graph was captured with
    int page_size = 0;
  };
  std::map<std::pair<int64_t, int64_t>, Entry> entries;  // (rows bucket, pages_per_seq bucket)
#endif
};

namespace {

StepActs acts_of(const Workspace& ws, int64_t n) {
  return StepActs{ws.h(n), ws.x(n), ws.q(n), ws.k(n), ws.v(n), ws.attn(n), ws.gate(n), ws.up(n), ws.moe(n)};
}

}  // namespace

size_t device_weight_bytes(const TensorMap& tensors, const std::string& name) {
  auto ends_with = [&](const char* suf) {
    const size_t n = std::strlen(suf);
    return name.size() >= n && name.compare(name.size() - n, n, suf) == 0;
  };
  auto exl2_part = [&](const char* suf) {  // <prefix><suf> of an EXL2 linear
    return ends_with(suf) && tensors.contains(name.substr(0, name.size() - std::strlen(suf)) + ".q_weight");
  };
  const TensorInfo& ti = tensors.info(name);
  const size_t file = ti.end - ti.begin;
  if (exl2_part(".q_weight")) {  // the whole layer: exact where the CUDA EXL2 kernels are built
    const std::string prefix = name.substr(0, name.size() - 9);
    const int64_t exact = exl2_linear_cuda_bytes(tensors, prefix);
    if (exact >= 0) return static_cast<size_t>(exact);
    size_t n = weight_arena_aligned(file) + weight_arena_aligned(tensors.info(prefix + ".q_scale").end -
                                                                 tensors.info(prefix + ".q_scale").begin);
    if (tensors.contains(prefix + ".bias"))
      n += weight_arena_aligned(static_cast<size_t>(shape_numel(tensors.info(prefix + ".bias").shape)) * 4);
    return n;
  }
  if (exl2_part(".q_scale") || exl2_part(".q_perm") || exl2_part(".q_invperm") || exl2_part(".q_groups") ||
      exl2_part(".q_scale_max") || exl2_part(".bias"))
    return 0;  // counted with its q_weight
  if (!dtype_is_float(ti.dtype)) return weight_arena_aligned(file);
  const size_t numel = static_cast<size_t>(shape_numel(ti.shape));
  const bool f32 = ends_with("norm.weight") || ends_with(".bias");
  return weight_arena_aligned(numel * (f32 ? 4 : 2));
}

namespace {

std::atomic<int64_t> g_sizing_walks{0};

// One walk over the file's tensors, each sized by device_weight_bytes and put in the bucket the two loaders place
// it by: a decoder layer's, the head's or the embedding's side.
struct WeightBuckets {
  std::vector<size_t> layer;  // [num_hidden_layers]: <layers><i>.*
  size_t stray = 0;  // <layers><i>.* with i outside the config's layers (a layer split places them on the
                     // model's device, tensor parallel counts them with the layers)
  size_t head = 0;   // the final norm and <head>.*, or instead of <head>.* the tied head's f16 copy
  size_t other = 0;  // the rest (the embedding)
  size_t rope = 0;   // the RoPE tables, f32 [max_seq_len, head_dim] each
};

WeightBuckets weight_buckets(const ModelConfig& c, const TensorMap& tensors, int64_t max_seq_len) {
  g_sizing_walks.fetch_add(1, std::memory_order_relaxed);
  const DecoderSpec spec = decoder_spec(c);
  const std::string& lp = spec.names.layers;
  const std::string head = spec.names.head + ".";
  const int64_t n_layers = c.num_hidden_layers;
  WeightBuckets b;
  b.layer.assign(static_cast<size_t>(std::max<int64_t>(n_layers, 0)), 0);
  bool own_head = false;
  for (const std::string& name : tensors.names()) {
    const size_t bytes = device_weight_bytes(tensors, name);
    if (name.rfind(lp, 0) == 0) {
      const int64_t li = std::atoll(name.c_str() + lp.size());
      (li >= 0 && li < n_layers ? b.layer[static_cast<size_t>(li)] : b.stray) += bytes;
    } else if (name.rfind(head, 0) == 0 || name == spec.names.final_norm) {
      b.head += bytes;
      own_head = own_head || name.rfind(head, 0) == 0;
    } else {
      b.other += bytes;
    }
  }
  if (!own_head) b.head += weight_arena_aligned(static_cast<size_t>(c.vocab_size * c.hidden_size) * 2);
  b.rope = spec.ropes.size() * weight_arena_aligned(static_cast<size_t>(
      checked_mul(ErrorKind::InvalidArgument, {max_seq_len, c.head_dim, 4}, "the RoPE table's bytes")));
  return b;
}

}  // namespace

int64_t weight_sizing_walks() { return g_sizing_walks.load(std::memory_order_relaxed); }

std::vector<size_t> weight_bytes_per_device(const ModelConfig& c, const TensorMap& tensors, const LoadOptions& opt,
                                            int64_t max_seq_len) {
  const int64_t n_layers = c.num_hidden_layers;
  auto layer_dev = [&](int64_t i) { return opt.layer_devices.empty() ? opt.device.index : opt.layer_devices[i]; };
  const int head = opt.head_device >= 0 ? opt.head_device : (n_layers > 0 ? layer_dev(n_layers - 1) : opt.device.index);
  int max_index = std::max(opt.device.index, head);
  for (int d : opt.layer_devices) max_index = std::max(max_index, d);
  std::vector<size_t> need(static_cast<size_t>(max_index) + 1, 0);
  const WeightBuckets b = weight_buckets(c, tensors, max_seq_len);
  for (int64_t i = 0; i < n_layers; ++i) need[layer_dev(i)] += b.layer[static_cast<size_t>(i)];
  need[head] += b.head;
  need[opt.device.index] += b.other + b.stray + b.rope;
  for (size_t d = 0; d < need.size(); ++d)
    if (need[d] > 0 && static_cast<int>(d) != opt.device.index) need[d] += b.rope;  // split: a table per device
  return need;
}

std::vector<size_t> tp_weight_bytes(const ModelConfig& c, const TensorMap& tensors, int64_t T, int64_t max_seq_len,
                                    size_t* head) {
  const WeightBuckets b = weight_buckets(c, tensors, max_seq_len);
  size_t layers = b.stray;
  for (size_t bytes : b.layer) layers += bytes;
  *head = b.head;
  return std::vector<size_t>(static_cast<size_t>(T), layers / static_cast<size_t>(T) + b.other + b.rope);
}

ModelGraph::ModelGraph(const ModelConfig& c, const TensorMap& tm, const LoadOptions& opt, const DecoderSpec& spec,
                       int64_t max_seq_len, const WeightSizes& sizes)
    : config_(c),
      spec_(spec),
      device_(opt.device),
      act_(opt.device.is_cpu() ? DType::F32 : DType::F16),
      max_seq_len_(max_seq_len) {
  // Diagnostics: option cpu_activations "f16" runs the CPU backend with f16 activations, as the GPU does, to tell the
  // GPU's numerics from GPU bugs (the CPU kernels take f16 activations; fp32 accumulation either way).
  if (device_.is_cpu() && runtime_options().cpu_activations == "f16") act_ = DType::F16;
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t nq = c.num_attention_heads * hd, nkv = c.num_key_value_heads * hd;
  check_tensors_read(spec_, c, tm);  // before any weight is placed

  if (!opt.tp_devices.empty()) {  // tensor parallel: the whole graph lives in TensorParallel
    device_ = opt.tp_devices[0];
    act_ = device_.is_cpu() ? DType::F32 : DType::F16;
    layer_dev_.assign(c.num_hidden_layers, device_);
    head_dev_ = device_;
    for (const Device& d : opt.tp_devices)
      if (std::find(used_devs_.begin(), used_devs_.end(), d) == used_devs_.end()) used_devs_.push_back(d);
    split_ = used_devs_.size() > 1;
    tp_ = std::make_unique<TensorParallel>(c, tm, opt.tp_devices, spec_, max_seq_len, act_, sizes);
    if (opt.progress) opt.progress(c.num_hidden_layers + 2, c.num_hidden_layers + 2);
    return;
  }
  // Placement (Model::load validated the indices): every layer on device_ unless opt.layer_devices splits them.
  layer_dev_.assign(c.num_hidden_layers, device_);
  if (!opt.layer_devices.empty())
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) layer_dev_[i] = Device::cuda(opt.layer_devices[i]);
  head_dev_ = opt.head_device >= 0 ? Device::cuda(opt.head_device) : (layer_dev_.empty() ? device_ : layer_dev_.back());
  used_devs_ = {device_};
  for (const Device& d : layer_dev_)
    if (std::find(used_devs_.begin(), used_devs_.end(), d) == used_devs_.end()) used_devs_.push_back(d);
  if (std::find(used_devs_.begin(), used_devs_.end(), head_dev_) == used_devs_.end()) used_devs_.push_back(head_dev_);
  split_ = used_devs_.size() > 1;
  EXL2_CHECK(!split_ || device_.is_cuda(), "layer split needs CUDA devices, the model is on ", device_.str());
#ifdef EXL2_WITH_CUDA
  if (split_) {
    std::vector<int> idx;
    for (const Device& d : used_devs_) idx.push_back(d.index);
    cuda::enable_peer_access(idx);
  }
#endif

  // The weights come from one weight arena per device (core/weight_arena.h), reserved at the loader's estimate
  // (sizes: Model::load's, made once for its OOM check); the scopes end before the workspaces (those are not weights,
  // and grow).
  std::vector<std::unique_ptr<WeightArenaScope>> arenas;
  if (device_.is_cpu()) {
    arenas.push_back(std::make_unique<WeightArenaScope>(device_));  // no reserve: dense CPU weights stay mapped
  } else {
    const std::vector<size_t>& need = sizes.per_device;
    for (const Device& d : used_devs_)
      arenas.push_back(std::make_unique<WeightArenaScope>(d, d.index < int(need.size()) ? need[d.index] : 0));
  }
  const TensorNames& names = spec_.names;
  Tensor emb = tm.get_checked(names.embed, {c.vocab_size, H}, {DType::F16, DType::BF16, DType::F32});
  embed_ = device_.is_cpu() ? emb : emb.to_dtype(DType::F16).to(device_);
  final_norm_ = load_norm(spec_, tm, names.final_norm, H, head_dev_);
  const std::vector<Tensor> ropes_host = rope_tables(spec_, c, max_seq_len);
  for (const Tensor& t : ropes_host) ropes_.push_back(device_.is_cpu() ? t : t.to(device_));
  if (split_) {
    int max_index = 0;
    for (const Device& d : used_devs_) max_index = std::max(max_index, d.index);
    ropes_on_.resize(max_index + 1);
    ws_on_.resize(max_index + 1);
    for (const Device& d : used_devs_)
      for (size_t r = 0; r < ropes_host.size(); ++r) ropes_on_[d.index].push_back(d == device_ ? ropes_[r] : ropes_host[r].to(d));
  }

  const int64_t modules = c.num_hidden_layers + 2;  // LoadOptions::progress: embedding, layers, head
  if (opt.progress) opt.progress(1, modules);
  layers_.reserve(c.num_hidden_layers);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    layers_.push_back(load_layer(spec_, c, tm, i, layer_dev_[i]));
    if (opt.progress) opt.progress(i + 2, modules);
  }
  // lm_head: its own tensors when present (EXL2 writes a quantized lm_head even for tied models), else tied.
  if (tm.contains(names.head + ".weight") || tm.contains(names.head + ".q_weight")) {
    lm_head_ = load_linear(tm, names.head, H, c.vocab_size, false, head_dev_);
  } else {
    EXL2_CHECK_KIND(ModelFormat, c.tie_word_embeddings,
                    "missing tensor lm_head.weight (and tie_word_embeddings "
                    "is false in config.json)");
    lm_head_ = make_dense_linear(emb, Tensor(), head_dev_);
  }
  if (opt.progress) opt.progress(modules, modules);
  arenas.clear();
  WorkspaceDims dims;
  dims.hidden = H;
  dims.q_width = nq;
  dims.kv_width = nkv;
  dims.intermediate = I;
  dims.vocab = c.vocab_size;
  dims.moe = moe_dims(spec_, c, 1);
  ws_ = std::make_unique<Workspace>(device_, act_, dims);
  for (const Device& d : used_devs_)
    if (d != device_) ws_on_[d.index] = std::make_unique<Workspace>(d, act_, dims);
  graphs_ = std::make_unique<DecodeGraphs>();
}

Workspace& ModelGraph::ws_on(Device d) {
  if (d == device_) return *ws_;
  EXL2_CHECK_KIND(Internal, d.index >= 0 && static_cast<size_t>(d.index) < ws_on_.size() && ws_on_[d.index],
                  "no workspace on ", d.str());
  return *ws_on_[d.index];
}

std::vector<Device> ModelGraph::tp_devices() const {
  return tp_ ? tp_->devices() : std::vector<Device>{};
}

std::vector<std::pair<std::string, const Linear*>> ModelGraph::linears() const {
  if (tp_) return tp_->linears();
  std::vector<std::pair<std::string, const Linear*>> out;
  for (size_t i = 0; i < layers_.size(); ++i) layer_linears(spec_, config_, static_cast<int64_t>(i), layers_[i], "", out);
  out.emplace_back(spec_.names.head, lm_head_.get());
  return out;
}

size_t ModelGraph::weight_bytes() const {
  if (tp_) return tp_->weight_bytes();
  size_t total = embed_.nbytes() + final_norm_.nbytes();  // all devices together
  for (const auto& kv : linears()) total += kv.second->nbytes();
  for (const DecoderLayer& L : layers_) total += layer_norm_bytes(L);
  return total;
}

// ---- forward ------------------------------------------------------------------------------------------------

ModelGraph::~ModelGraph() = default;

Tensor ModelGraph::forward(const Batch& batch, KVCache& cache, DeviceArgmax* argmax) {
  std::lock_guard<std::mutex> lock(mutex_);
  batch.validate(cache, config_.vocab_size, max_seq_len_);
  EXL2_CHECK(cache.n_layers() == config_.num_hidden_layers, "forward: cache has ", cache.n_layers(),
             " layers, the model ", config_.num_hidden_layers);
  if (tp_) return tp_->forward(batch, cache, argmax);  // checks the cache's shards itself
  EXL2_CHECK(cache.tp() == 1, "forward: the cache is split over ", cache.tp(), " tensor-parallel ranks but the model ",
             "is not tensor-parallel; make the cache with this model's make_cache");
  if (!split_) {
    EXL2_CHECK(cache.device() == device_, "forward: cache is on ", cache.device().str(), ", model on ", device_.str());
  } else {
    for (size_t l = 0; l < layers_.size(); ++l)
      EXL2_CHECK(cache.layer_device(l) == layer_dev_[l], "forward: the cache's layer ", l, " is on ",
                 cache.layer_device(l).str(), " but the model's layer ", l, " is on ", layer_dev_[l].str(),
                 "; make the cache with this model's make_cache");
  }
#ifdef EXL2_WITH_CUDA
  if (device_.is_cuda()) {
    cuda::ScopedDevice scope(device_.index);  // kernels launch on the current device (cuda:N models)
    if (split_) return forward_eager(batch, cache, argmax);  // split models: eager, no CUDA graphs (graph.h)
    // Decode-shaped batches as graphs: at most ops::kAttentionDecodeRun rows of one sequence (a speculative job's
    // verify rows, a short prefill chunk: what the eager step runs as decode rows too, ops::attention_spans; the
    // padded layout gives each row its own copy of its sequence's page table).
    const int64_t bucket = decode_rows_bucket(batch, ops::kAttentionDecodeRun);
    if (bucket > 0) return forward_decode(batch, cache, bucket, argmax);
    return forward_eager(batch, cache, argmax);
  }
#endif
  return forward_eager(batch, cache, argmax);
}

Tensor ModelGraph::forward_eager(const Batch& batch, KVCache& cache, DeviceArgmax* argmax) {
  const int64_t n = static_cast<int64_t>(batch.tokens.size());
  const bool pick = !batch.logit_rows.empty();
  const int64_t m = pick ? static_cast<int64_t>(batch.logit_rows.size()) : n;
  const int64_t pt = static_cast<int64_t>(batch.page_table.size());
  const int64_t o_pages = 3 * n, o_idx = o_pages + pt, total = o_idx + (pick ? m : 0);
  Workspace& ws = *ws_;
  ws.begin_step();
  ws.reserve(std::max(n, m), total);
  int32_t* st = ws.staging();
  std::memcpy(st, batch.tokens.data(), n * sizeof(int32_t));
  std::memcpy(st + n, batch.positions.data(), n * sizeof(int32_t));
  std::memcpy(st + 2 * n, batch.seq_of_token.data(), n * sizeof(int32_t));
  std::memcpy(st + o_pages, batch.page_table.data(), pt * sizeof(int32_t));
  if (pick) std::memcpy(st + o_idx, batch.logit_rows.data(), m * sizeof(int32_t));
  ws.upload(total);

  StepIO io;
  io.n = n;
  io.m = m;
  io.ids = ws.meta(0, n);
  io.pos = ws.meta(n, n);
  io.seq = ws.meta(2 * n, n);
  io.pages = ws.meta(o_pages, pt).view({pt / batch.pages_per_seq, static_cast<int64_t>(batch.pages_per_seq)});
  if (pick) io.logit_idx = ws.meta(o_idx, m);
  if (device_.is_cpu()) {  // one attention path on CPU: no spans
    io.logits32 = Tensor::empty({m, config_.vocab_size}, DType::F32, device_);
    if (act_ != DType::F32) io.logits = Tensor::empty({m, config_.vocab_size}, act_, device_);
    run_step(io, cache);
    return logits_to_host(io.logits32, m, argmax);
  }
  io.spans = ops::attention_spans(batch.seq_of_token.data(), n);
  if (split_) {  // the same metadata on every other device in use (one more async upload each)
    io.on.resize(ws_on_.size());
    for (const Device& d : used_devs_) {
      Workspace& w = ws_on(d);
      if (&w != &ws) {
        w.begin_step();
        w.reserve(std::max(n, m), total);
        std::memcpy(w.staging(), st, total * sizeof(int32_t));
        w.upload(total);
      }
      StepMeta& md = io.on[d.index];
      md.ids = w.meta(0, n);
      md.pos = w.meta(n, n);
      md.seq = w.meta(2 * n, n);
      md.pages = w.meta(o_pages, pt).view({pt / batch.pages_per_seq, static_cast<int64_t>(batch.pages_per_seq)});
      if (pick) md.logit_idx = w.meta(o_idx, m);
    }
  }
  Workspace& hw = ws_on(head_dev_);  // the logits come from the head's device
  if (m <= Workspace::kKeptLogitRows) {
    io.logits = hw.logits(m);
    io.logits32 = hw.logits32(m);
    run_step(io, cache);
    return hw.download_logits(m, argmax);
  }
  // Many logit rows (e.g. every row of a long prompt): per-call buffers rather than keeping them.
  io.logits = Tensor::empty({m, config_.vocab_size}, act_, head_dev_);
  io.logits32 = Tensor::empty({m, config_.vocab_size}, DType::F32, head_dev_);
  run_step(io, cache);
  Tensor out = logits_to_host(io.logits32, m, argmax);
  hw.finish_step();
  ws.finish_step();
  return out;
}

Tensor ModelGraph::forward_decode(const Batch& batch, KVCache& cache, int64_t bucket, DeviceArgmax* argmax) {
  const int64_t n = static_cast<int64_t>(batch.tokens.size()), B = bucket;
  const int64_t m = batch.logit_rows.empty() ? n : static_cast<int64_t>(batch.logit_rows.size());
  const int64_t ps = cache.page_size();
  const int64_t pps = decode_pages_bucket(batch, ps);
  // Metadata: ids[B], positions[B], seq[B], pages[groups * (B + 1) * pps], logit_idx[B]. Row i < n is batch row i as
  // sequence i (its page-table row copied, padded with the scratch page); rows n..B-1 are padding: token 0 at
  // position 0 of sequence B, whose pages are all the scratch page.
  const int64_t o_pages = 3 * B, o_idx = o_pages + cache.n_groups() * (B + 1) * pps, total = o_idx + B;
  Workspace& ws = *ws_;
  ws.begin_step();
  ws.reserve(B, total);
  int32_t* st = ws.staging();
  decode_page_tables(batch, cache.n_groups(), B, pps, cache.scratch_page(), st + o_pages);
  decode_row_meta(batch, B, st, st + o_idx);
  ws.upload(total);

  StepIO io;
  io.n = B;
  io.m = B;
  io.ids = ws.meta(0, B);
  io.pos = ws.meta(B, B);
  io.seq = ws.meta(2 * B, B);
  io.pages = ws.meta(o_pages, cache.n_groups() * (B + 1) * pps).view({cache.n_groups() * (B + 1), pps});
  io.logit_idx = ws.meta(o_idx, B);
  io.logits = ws.logits(B);
  io.logits32 = ws.logits32(B);
  io.spans = {ops::AttentionSpan{0, B, B}};  // every row decode (padding rows share one sequence: no planning)

#ifdef EXL2_WITH_CUDA
  const int dev = device_.index;
  // A quantized cache fixes its K centring vectors in its first eager step (cache/kv_quant.h), never in a graph.
  if (!cuda::graphs_enabled() || (cache.quantized() && !cache.k_mean_set(cache.n_layers() - 1))) {
    run_step(io, cache);
  } else {
    std::vector<const void*> ptrs;
    for (int64_t l = 0; l < cache.n_layers(); ++l) {
      ptrs.push_back(cache.k(l).data());
      ptrs.push_back(cache.v(l).data());
      if (cache.quantized()) {
        ptrs.push_back(cache.k_scales(l).data());
        ptrs.push_back(cache.v_scales(l).data());
        ptrs.push_back(cache.k_mean(l).data());
        ptrs.push_back(cache.sink() ? cache.k_sink(l).data() : nullptr);
        ptrs.push_back(cache.sink() ? cache.v_sink(l).data() : nullptr);
      }
    }
    ptrs.push_back(reinterpret_cast<const void*>(static_cast<uintptr_t>(cache.bits())));  // the kernels it runs
    DecodeGraphs::Entry& e = graphs_->entries[{B, pps}];
    if (e.cache_ptrs != ptrs || e.page_size != ps) {  // another cache: start over for this shape
      e = DecodeGraphs::Entry();
      e.cache_ptrs = std::move(ptrs);
      e.page_size = ps;
    }
    if (e.graph && (e.ws_generation != ws.generation() || e.scratch_generation != cuda::scratch_generation()))
      e.graph.reset();  // a buffer it captured was reallocated
    if (e.graph) {
      e.graph->launch(dev);
    } else if (!e.warm || e.failed) {
      run_step(io, cache);
      e.warm = true;
    } else {
      auto g = std::make_unique<cuda::Graph>();
      const uint64_t gen = cuda::scratch_generation();
      bool ok = true;
      try {
        g->capture(dev, [&] { run_step(io, cache); });
      } catch (const std::exception&) {
        ok = false;  // e.g. a kernel that allocates: this shape stays eager; the eager run below rethrows real errors
      }
      if (ok && gen == cuda::scratch_generation()) {
        e.graph = std::move(g);
        e.ws_generation = ws.generation();
        e.scratch_generation = gen;
        e.graph->launch(dev);
      } else {
        if (!ok) cuda::note_capture_failure();
        e.failed = !ok;
        run_step(io, cache);
      }
    }
  }
#else
  run_step(io, cache);
#endif
  return ws.download_logits(m, argmax);
}

void ModelGraph::run_step(const StepIO& io, KVCache& cache) {
  if (split_) {
    run_step_split(io, cache);
    return;
  }
  RankRun R = run_on(acts_of(*ws_, io.n), layers_, ropes_, io.pos, io.seq, io.pages);
  embed_tokens(spec_, io.ids, embed_, R.b.h);
  StepShared sh;
  sh.cache = &cache;
  sh.spans = &io.spans;
  DecoderBody body(spec_, config_, 1, sh);
  std::vector<Phase> prog;
  for (size_t li = 0; li < layers_.size(); ++li) {  // one device: no gathers, the phases run back to back
    prog.clear();
    body.layer(prog, static_cast<int64_t>(li), li + 1 == layers_.size());
    for (const Phase& ph : prog) ph.fn(R);
  }
  run_head(R.b.h, io.logit_idx, *ws_, io);
}

void ModelGraph::run_step_split(const StepIO& io, KVCache& cache) {
#ifdef EXL2_WITH_CUDA
  const int64_t n = io.n;
  int cur = device_.index;
  auto scope = std::make_unique<cuda::ScopedDevice>(cur);
  StepActs a = acts_of(ws_on(device_), n);
  const StepMeta* md = &io.on.at(cur);
  embed_tokens(spec_, md->ids, embed_, a.h);
  // Moves the hidden state (rows 0..n) to device d's workspace and makes d current.
  auto move_to = [&](Device d) {
    if (d.index == cur) return;
    StepActs b = acts_of(ws_on(d), n);
    cuda::copy_peer_async(b.h.data(), d.index, a.h.data(), cur, a.h.nbytes());
    scope.reset();
    scope = std::make_unique<cuda::ScopedDevice>(d.index);
    a = b;
    cur = d.index;
    md = &io.on.at(cur);
  };
  StepShared sh;
  sh.cache = &cache;
  sh.spans = &io.spans;
  DecoderBody body(spec_, config_, 1, sh);
  std::vector<Phase> prog;
  for (size_t li = 0; li < layers_.size(); ++li) {  // each layer leaves h whole: it may move to the next GPU
    move_to(layer_dev_[li]);
    RankRun R = run_on(a, layers_, ropes_on_.at(cur), md->pos, md->seq, md->pages);
    prog.clear();
    body.layer(prog, static_cast<int64_t>(li), true);
    for (const Phase& ph : prog) ph.fn(R);
  }
  move_to(head_dev_);
  run_head(a.h, md->logit_idx, ws_on(head_dev_), io);
#else
  EXL2_FAIL(Unsupported, "layer split needs the CUDA backend");
#endif
}

// Only the rows whose logits are wanted go through the final norm and lm_head (gathered on the device).
void ModelGraph::run_head(const Tensor& h, const Tensor& logit_idx, const Workspace& ws, const StepIO& io) {
  const int64_t m = io.m;
  Tensor rows = h;
  if (logit_idx.defined()) {
    rows = ws.picked(m);
    ops::gather_rows(h, logit_idx, rows);
  }
  Tensor normed = ws.normed(m), logits = io.logits, logits32 = io.logits32;
  head_forward(spec_, rows, final_norm_, *lm_head_, normed, logits, logits32);
}

}  // namespace exl2
