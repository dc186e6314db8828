// The decoder composition (see decoder.h): config reading for architecture files, the module tensors and their
// loading, and DecoderBody, the one layer body of the single-device graph, the layer split and tensor parallel.
#include "model/decoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "cache/kv_quant.h"
#include "model/rope.h"
#include "ops/ops.h"

namespace exl2 {

// ---- config ------------------------------------------------------------------------------------------------

const std::vector<std::string>& known_metadata_keys() {
  static const std::vector<std::string> keys = {
      // identity, dtype, tokens
      "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
      "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "tokenizer_class",
      "quantization_config",  // read by the linear loader (EXL2 tensors; other methods leave unread tensors)
      // training / framework settings that do not change inference math
      "initializer_range", "use_cache", "attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop",
      "output_attentions", "output_hidden_states", "return_dict", "use_return_dict", "torchscript",
      "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
      "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder", "finetuning_task", "prefix",
      "task_specific_params", "tf_legacy_loss", "pruned_heads", "use_bfloat16", "_attn_implementation_autoset",
      "pretraining_tp",  // HF Llama: the same product computed in slices
      // generation defaults (read by generate() only)
      "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
      "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
      "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
      "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
      "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
      "epsilon_cutoff", "eta_cutoff"};
  return keys;
}

ArchConfig::ArchConfig(const ModelConfig& config) : c_(config) {}

bool ArchConfig::has(const std::string& key) const {
  const Json* v = c_.raw.find(key);
  return v && !v->is_null();
}

const Json* ArchConfig::json(const std::string& key) {
  read_.insert(key);
  const Json* v = c_.raw.find(key);
  return v && !v->is_null() ? v : nullptr;
}

namespace {

[[noreturn]] void bad_type(const ModelConfig& c, const std::string& key, const char* want, const Json& got) {
  std::string g = got.dump();
  if (g.size() > 60) g = g.substr(0, 57) + "...";
  EXL2_FAIL(ModelFormat, "config.json: key '", key, "' must be ", want, " for ", c.architecture, ", got ", g);
}

}  // namespace

bool ArchConfig::flag(const std::string& key, bool def) {
  const Json* v = json(key);
  if (!v) return def;
  if (!v->is_bool()) bad_type(c_, key, "true or false", *v);
  return v->as_bool();
}

double ArchConfig::number(const std::string& key, double def) {
  const Json* v = json(key);
  if (!v) return def;
  if (!v->is_number() || !std::isfinite(v->as_double())) bad_type(c_, key, "a finite number", *v);
  return v->as_double();
}

int64_t ArchConfig::integer(const std::string& key, int64_t def) {
  const Json* v = json(key);
  if (!v) return def;
  if (!v->is_integer()) bad_type(c_, key, "an integer", *v);
  return v->as_int();
}

std::string ArchConfig::string(const std::string& key, const std::string& def) {
  const Json* v = json(key);
  if (!v) return def;
  if (!v->is_string()) bad_type(c_, key, "a string", *v);
  return v->as_string();
}

std::vector<std::string> ArchConfig::strings(const std::string& key) {
  std::vector<std::string> out;
  const Json* v = json(key);
  if (!v) return out;
  if (!v->is_array()) bad_type(c_, key, "a list of strings", *v);
  for (const Json& e : v->as_array()) {
    if (!e.is_string()) bad_type(c_, key, "a list of strings", *v);
    out.push_back(e.as_string());
  }
  return out;
}

void ArchConfig::accept(std::initializer_list<const char*> keys) {
  for (const char* k : keys) read_.insert(k);
}

void ArchConfig::require_value(const std::string& key, const Json& harmless, const std::string& why) {
  const Json* v = json(key);
  if (v && v->dump() != harmless.dump()) unsupported(key, why);
}

void ArchConfig::accept_outer(std::initializer_list<const char*> keys) {
  for (const char* k : keys) outer_read_.insert(k);
}

void ArchConfig::unsupported(const std::string& key, const std::string& what) const {
  const Json* v = c_.raw.find(key);
  std::string g = v ? v->dump() : "absent";
  if (g.size() > 60) g = g.substr(0, 57) + "...";
  EXL2_FAIL(Unsupported, "config.json: ", key, " = ", g, " is not supported for ", c_.architecture, ": ", what);
}

void ArchConfig::finish() const {
  const std::vector<std::string>& meta = known_metadata_keys();
  std::vector<std::string> unread;
  if (c_.raw.is_object())
    for (const auto& kv : c_.raw.as_object()) {
      if (kv.second.is_null() || read_.count(kv.first)) continue;
      if (std::find(meta.begin(), meta.end(), kv.first) != meta.end()) continue;
      unread.push_back(kv.first);
    }
  if (c_.outer.is_object())  // top-level keys of a multimodal file: named as "<key> (top level)"
    for (const auto& kv : c_.outer.as_object()) {
      if (kv.second.is_null() || outer_read_.count(kv.first)) continue;
      if (std::find(meta.begin(), meta.end(), kv.first) != meta.end()) continue;
      unread.push_back(kv.first + " (top level)");
    }
  if (unread.empty()) return;
  std::string names, read;
  for (const std::string& k : unread) names += (names.empty() ? "'" : ", '") + k + "'";
  for (const std::string& k : read_) read += (read.empty() ? "" : ", ") + k;
  EXL2_FAIL(Unsupported, "config.json: ", names, unread.size() == 1 ? " is" : " are", " not implemented for ",
            c_.architecture, " (exl2cpp would ignore ", unread.size() == 1 ? "it" : "them",
            " and compute a different model). The ", c_.architecture, " implementation reads: ", read,
            "; metadata keys are listed in cpp/model/decoder.cpp known_metadata_keys");
}

DecoderSpec llama_like(ArchConfig& a) {
  const ModelConfig& c = a.config();
  a.accept({"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
            "rope_theta", "original_max_position_embeddings",
            "partial_rotary_factor"});  // below 1 only where the architecture sets RopeSpec::rotary_dim
  // rope_parameters keyed by layer type stays unread here: an architecture with per-layer-type RoPE reads it.
  if (c.layer_type_ropes.empty()) a.accept({"rope_scaling", "rope_parameters"});
  DecoderSpec s;
  const std::string act = a.string("hidden_act", "silu");  // the MLP's act(gate) * up
  if (act == "gelu_pytorch_tanh" || act == "gelu_new")
    s.act = Activation::GeluTanh;
  else if (act != "silu")
    a.unsupported("hidden_act", "the MLP runs silu (SwiGLU) or gelu_pytorch_tanh / gelu_new (GeGLU)");
  s.norm.eps = c.rms_norm_eps;
  s.ropes.push_back(RopeSpec{false, c.rope_theta, c.rope_scaling});
  s.layers.assign(static_cast<size_t>(c.num_hidden_layers), LayerSpec{});
  return s;
}

void read_layer_windows(ArchConfig& a, DecoderSpec& s, int64_t window, int64_t first_sliding, int64_t full_every) {
  const std::vector<std::string> types = a.strings("layer_types");
  const int64_t n = static_cast<int64_t>(s.layers.size());
  if (types.empty()) {
    for (int64_t i = 0; i < n; ++i) {
      const bool full = i < first_sliding || (full_every > 0 && (i + 1) % full_every == 0);
      s.layers[i].window = full ? 0 : window;
    }
    return;
  }
  EXL2_CHECK_KIND(ModelFormat, static_cast<int64_t>(types.size()) == n, "config.json: layer_types has ",
                  types.size(), " entries but num_hidden_layers is ", n);
  for (int64_t i = 0; i < n; ++i) {
    if (types[i] == "full_attention") {
      s.layers[i].window = 0;
    } else if (types[i] == "sliding_attention") {
      s.layers[i].window = window;  // 0 (no sliding_window): HF runs such layers with full attention too
    } else {
      a.unsupported("layer_types", str_cat("layer type '", types[i], "' (layer ", i,
                                           ") is not supported (full_attention, sliding_attention)"));
    }
  }
}

void read_sparse_layers(ArchConfig& a, DecoderSpec& s) {
  const int64_t step = a.integer("decoder_sparse_step", 1);
  if (step < 1) a.unsupported("decoder_sparse_step", "must be at least 1");
  const int64_t n = static_cast<int64_t>(s.layers.size());
  std::vector<bool> dense(static_cast<size_t>(n), false);
  if (const Json* v = a.json("mlp_only_layers")) {
    if (!v->is_array()) a.unsupported("mlp_only_layers", "must be a list of layer indices");
    for (const Json& e : v->as_array()) {
      if (!e.is_integer() || e.as_int() < 0 || e.as_int() >= n)
        a.unsupported("mlp_only_layers", str_cat("entries must be layer indices in [0, ", n, ")"));
      dense[static_cast<size_t>(e.as_int())] = true;
    }
  }
  for (int64_t i = 0; i < n; ++i) s.layers[i].moe = !dense[static_cast<size_t>(i)] && (i + 1) % step == 0;
}

void read_qwen_moe(ArchConfig& a, DecoderSpec& s) {
  if (a.flag("use_sliding_window", false))
    a.unsupported("use_sliding_window", "sliding windows of Qwen-MoE models are not supported");
  a.accept({"sliding_window", "max_window_layers"});  // only read with use_sliding_window
  const char* experts = a.has("num_local_experts") ? "num_local_experts" : "num_experts";
  s.moe.n_experts = a.integer(experts, 0);
  s.moe.top_k = a.integer("num_experts_per_tok", 0);
  s.moe.inter = a.integer("moe_intermediate_size", 0);
  s.moe.renormalize = a.flag("norm_topk_prob", false);
  read_sparse_layers(a, s);
  s.names.router = "mlp.gate";
  s.names.experts = "mlp.experts.";
  s.names.expert_gate = "gate_proj";
  s.names.expert_up = "up_proj";
  s.names.expert_down = "down_proj";
  a.accept({"router_aux_loss_coef", "output_router_logits"});  // training only
}

// ---- module tensors ----------------------------------------------------------------------------------------

std::vector<ModuleTensor> layer_tensors(const DecoderSpec& s, const ModelConfig& c, int64_t li) {
  using Slot = ModuleTensor::Slot;
  const TensorNames& nm = s.names;
  const std::string p = str_cat(nm.layers, li, ".");
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t nq = c.num_attention_heads * hd, nkv = c.num_key_value_heads * hd;
  std::vector<ModuleTensor> t;
  auto norm = [&](Slot slot, const std::string& name, int64_t size) {
    if (!name.empty()) t.push_back({slot, p + name, 0, 0, 0, size, false});
  };
  auto lin = [&](Slot slot, const std::string& name, int64_t in, int64_t out, int64_t begin, int64_t width,
                 bool bias) { t.push_back({slot, p + name, in, out, begin, width, bias}); };
  norm(Slot::AttnNorm, nm.attn_norm, H);
  norm(Slot::AttnPostNorm, nm.attn_post_norm, H);
  norm(Slot::MlpNorm, nm.mlp_norm, H);
  norm(Slot::MlpPostNorm, nm.mlp_post_norm, H);
  norm(Slot::QNorm, nm.q_norm, s.qk_norm_per_head ? nq : hd);
  norm(Slot::KNorm, nm.k_norm, s.qk_norm_per_head ? nkv : hd);
  if (!nm.qkv.empty()) {
    lin(Slot::Q, nm.qkv, H, nq + 2 * nkv, 0, nq, s.qkv_bias);
    lin(Slot::K, nm.qkv, H, nq + 2 * nkv, nq, nkv, s.qkv_bias);
    lin(Slot::V, nm.qkv, H, nq + 2 * nkv, nq + nkv, nkv, s.qkv_bias);
  } else {
    lin(Slot::Q, nm.q, H, nq, 0, nq, s.qkv_bias);
    lin(Slot::K, nm.k, H, nkv, 0, nkv, s.qkv_bias);
    lin(Slot::V, nm.v, H, nkv, 0, nkv, s.qkv_bias);
  }
  lin(Slot::O, nm.o, nq, H, 0, H, s.o_bias);
  if (s.layers[li].moe) {
    const int64_t E = s.moe.n_experts, Ie = s.moe.inter, Is = s.moe.shared_inter;
    lin(Slot::Router, nm.router, H, E, 0, E, false);
    if (Is > 0) {
      lin(Slot::SharedGate, nm.shared_gate, H, Is, 0, Is, false);
      lin(Slot::SharedUp, nm.shared_up, H, Is, 0, Is, false);
      lin(Slot::SharedDown, nm.shared_down, Is, H, 0, H, false);
      lin(Slot::SharedScale, nm.shared_scale, H, 1, 0, 1, false);
    }
    auto experts = [&](Slot slot, const std::string& leaf, int64_t in, int64_t out) {
      t.push_back({slot, p + nm.experts, in, out, 0, out, false, E, leaf});
    };
    experts(Slot::ExpertGate, nm.expert_gate, H, Ie);
    experts(Slot::ExpertUp, nm.expert_up, H, Ie);
    experts(Slot::ExpertDown, nm.expert_down, Ie, H);
    return t;
  }
  if (!nm.gate_up.empty()) {
    lin(Slot::Gate, nm.gate_up, H, 2 * I, 0, I, s.mlp_bias);
    lin(Slot::Up, nm.gate_up, H, 2 * I, I, I, s.mlp_bias);
  } else {
    lin(Slot::Gate, nm.gate, H, I, 0, I, s.mlp_bias);
    lin(Slot::Up, nm.up, H, I, 0, I, s.mlp_bias);
  }
  lin(Slot::Down, nm.down, I, H, 0, H, s.mlp_bias);
  return t;
}

namespace {

bool tied_head(const DecoderSpec& s, const TensorMap& tm) {
  return !tm.contains(s.names.head + ".weight") && !tm.contains(s.names.head + ".q_weight");
}

}  // namespace

void check_tensors_read(const DecoderSpec& s, const ModelConfig& c, const TensorMap& tm) {
  std::set<std::string> norms = {s.names.embed, s.names.final_norm};
  std::map<std::string, bool> linears;  // prefix -> bias read (dense)
  for (int64_t li = 0; li < c.num_hidden_layers; ++li)
    for (const ModuleTensor& t : layer_tensors(s, c, li)) {
      if (t.expert())
        for (int64_t e = 0; e < t.experts; ++e) linears[t.expert_prefix(e)] = false;
      else if (t.linear())
        linears[t.name] = linears[t.name] || t.bias;
      else
        norms.insert(t.name);
    }
  if (!tied_head(s, tm)) linears[s.names.head] = false;
  static const char* kExl2Parts[] = {"q_weight", "q_scale", "q_scale_max", "q_groups", "q_perm", "q_invperm", "bias"};
  std::vector<std::string> unread;
  for (const std::string& name : tm.names()) {
    if (norms.count(name)) continue;
    const size_t dot = name.rfind('.');
    if (dot != std::string::npos) {
      const std::string prefix = name.substr(0, dot), part = name.substr(dot + 1);
      auto it = linears.find(prefix);
      if (it != linears.end()) {
        const bool exl2 = tm.contains(prefix + ".q_weight");
        bool ok = exl2 ? std::any_of(std::begin(kExl2Parts), std::end(kExl2Parts),
                                     [&](const char* q) { return part == q; })
                       : part == "weight" || (part == "bias" && it->second);
        if (ok) continue;
      }
    }
    const bool unused = std::any_of(s.unused_prefixes.begin(), s.unused_prefixes.end(),
                                    [&](const std::string& u) { return name.rfind(u, 0) == 0; });
    const char* kInvFreq = ".rotary_emb.inv_freq";  // older checkpoints store it; the table comes from the config
    const bool inv_freq = name.size() > std::strlen(kInvFreq) &&
                          name.compare(name.size() - std::strlen(kInvFreq), std::string::npos, kInvFreq) == 0;
    if (!unused && !inv_freq) unread.push_back(name);
  }
  if (unread.empty()) return;
  std::string shown;
  for (size_t i = 0; i < unread.size() && i < 6; ++i) shown += (i ? ", " : "") + unread[i];
  if (unread.size() > 6) shown += ", ...";
  EXL2_FAIL(Unsupported, "model: ", unread.size(), " checkpoint tensor(s) are read by no module of the ",
            c.architecture, " decoder (", shown,
            "); exl2cpp would ignore them and compute a different model. Check that config.json's architectures[0] "
            "names the model these weights belong to");
}

Tensor load_norm(const DecoderSpec& s, const TensorMap& tm, const std::string& name, int64_t size, Device dev) {
  return load_norm(s, tm, name, Shape{size}, dev);
}

Tensor load_norm(const DecoderSpec& s, const TensorMap& tm, const std::string& name, const Shape& shape, Device dev) {
  Tensor w = tm.get_checked(name, shape, {DType::F32, DType::F16, DType::BF16});
  if (s.norm.plus_one) {  // a fresh f32 copy (the file's tensor may be a read-only mapping)
    const int64_t size = w.numel();
    Tensor f = w.to_dtype(DType::F32);
    Tensor out = Tensor::empty(shape, DType::F32);
    const float* src = f.data_as<float>();
    float* dst = out.data_as<float>();
    for (int64_t i = 0; i < size; ++i) dst[i] = 1.0f + src[i];
    w = out;
  } else {
    w = w.to_dtype(DType::F32);
  }
  return dev.is_cpu() ? w : w.to(dev);  // CPU: no second copy (a mapped f32 norm stays mapped, as dense weights)
}

namespace {

// Rows [c0, c1) of a q or k projection, each head's rows reordered to the layout the kernels rotate, pairs (i,
// hd/2 + i) (q . k is unchanged when q and k are permuted alike). Interleaved RoPE (pairs (2i, 2i + 1)): new row i =
// old 2i, new hd/2 + i = old 2i + 1. Partial RoPE over the first rot channels (pairs (i, rot/2 + i)): those pairs
// become (i, hd/2 + i) for i < rot/2, and the channels it passes through fill the pairs after (cos 1, sin 0).
std::unique_ptr<Linear> load_rope_rows(const TensorMap& tm, const ModuleTensor& t, int64_t hd, int64_t rot,
                                       bool interleaved, int64_t c0, int64_t c1, Device dev) {
  EXL2_CHECK_KIND(Unsupported, !interleaved || rot == hd, t.name, ": interleaved RoPE over part of a head");
  std::vector<int64_t> rows;
  for (int64_t row = c0; row < c1; ++row)  // rows of a module start at a head
    rows.push_back(t.begin + rope_source_row(row, hd, rot, interleaved));
  return load_linear_rows(tm, t.name, t.in, t.out, t.bias, dev, rows);
}

// A q / k norm weight as attention reads it: [head_dim] for every head, or (qk_norm_per_head) rank r's heads of T
// [heads / T, head_dim]; channels reordered as load_rope_rows reorders the q / k rows (the norm's mean and variance
// over a head do not depend on the order, its weight follows the channels).
Tensor load_qk_norm(const DecoderSpec& s, const ModelConfig& c, const TensorMap& tm, const ModuleTensor& t, int64_t li,
                    Device dev, int64_t r, int64_t T) {
  const int64_t hd = c.head_dim, heads = t.width / hd;
  const bool per_head = s.qk_norm_per_head;
  EXL2_CHECK_KIND(Unsupported, !per_head || heads % T == 0, t.name, ": per-head norm weights of ", heads,
                  " heads over ", T, " tensor-parallel ranks");
  const Tensor w = load_norm(s, tm, t.name, per_head ? Shape{heads, hd} : Shape{hd}, Device::cpu());
  const int64_t rot = s.ropes[static_cast<size_t>(s.layers[li].rope)].rotary_dim;
  const bool reorder = s.rope_interleaved || (rot > 0 && rot < hd);
  const int64_t n = per_head ? heads / T * hd : hd, c0 = per_head ? r * n : 0;
  if (!reorder && n == w.numel()) return dev.is_cpu() ? w : w.to(dev);
  const Tensor f = w.to_dtype(DType::F32);
  Tensor out = Tensor::empty(per_head ? Shape{n / hd, hd} : Shape{hd}, DType::F32);
  for (int64_t i = 0; i < n; ++i)
    out.data_as<float>()[i] =
        f.data_as<float>()[reorder ? rope_source_row(c0 + i, hd, rot > 0 ? rot : hd, s.rope_interleaved) : c0 + i];
  return dev.is_cpu() ? out : out.to(dev);
}

}  // namespace

int64_t rope_source_row(int64_t row, int64_t hd, int64_t rot, bool interleaved) {
  const int64_t half = hd / 2, rh = rot / 2, ph = (hd - rot) / 2;
  const int64_t head = row / hd, i = row % hd, j = i % half;
  int64_t src;
  if (interleaved)
    src = i < half ? 2 * i : 2 * j + 1;
  else if (j < rh)
    src = i < half ? j : rh + j;
  else
    src = rot + (i < half ? j - rh : ph + j - rh);
  return head * hd + src;
}

std::unique_ptr<Linear>& linear_slot(DecoderLayer& L, ModuleTensor::Slot slot) {
  using Slot = ModuleTensor::Slot;
  switch (slot) {
    case Slot::Q: return L.q;
    case Slot::K: return L.k;
    case Slot::V: return L.v;
    case Slot::O: return L.o;
    case Slot::Gate: return L.gate;
    case Slot::Up: return L.up;
    case Slot::Down: return L.down;
    case Slot::Router: return L.router;
    case Slot::SharedGate: return L.shared_gate;
    case Slot::SharedUp: return L.shared_up;
    case Slot::SharedDown: return L.shared_down;
    case Slot::SharedScale: return L.shared_scale;
    default: EXL2_FAIL(Internal, "linear_slot: slot ", static_cast<int>(slot), " is not a single linear");
  }
}

DecoderLayer load_layer(const DecoderSpec& s, const ModelConfig& c, const TensorMap& tm, int64_t li, Device dev,
                        int64_t r, int64_t T) {
  using Slot = ModuleTensor::Slot;
  DecoderLayer L;
  for (const ModuleTensor& t : layer_tensors(s, c, li)) {
    if (!t.linear()) {
      const bool qk = t.slot == Slot::QNorm || t.slot == Slot::KNorm;
      Tensor w = qk ? load_qk_norm(s, c, tm, t, li, dev, r, T) : load_norm(s, tm, t.name, t.width, dev);
      switch (t.slot) {
        case Slot::AttnNorm: L.attn_norm = w; break;
        case Slot::AttnPostNorm: L.attn_post_norm = w; break;
        case Slot::MlpNorm: L.mlp_norm = w; break;
        case Slot::MlpPostNorm: L.mlp_post_norm = w; break;
        case Slot::QNorm: L.q_norm = w; break;
        default: L.k_norm = w; break;
      }
      continue;
    }
    // This rank's columns of the module; the router and the shared expert's gate are whole on every rank.
    const bool whole = t.slot == Slot::Router || t.slot == Slot::SharedScale;
    const int64_t w = whole ? t.width : t.width / T, c0 = whole ? 0 : r * w, c1 = c0 + w;
    if (t.expert()) {
      std::vector<std::string> prefixes;
      for (int64_t e = 0; e < t.experts; ++e) prefixes.push_back(t.expert_prefix(e));
      auto ex = MoeExperts::load(tm, prefixes, t.in, t.out, dev, c0, c1);
      (t.slot == Slot::ExpertGate ? L.expert_gate : t.slot == Slot::ExpertUp ? L.expert_up : L.expert_down) =
          std::move(ex);
      continue;
    }
    std::unique_ptr<Linear> lin;
    const int64_t rot = s.ropes[static_cast<size_t>(s.layers[li].rope)].rotary_dim;
    const bool reorder = s.rope_interleaved || (rot > 0 && rot < c.head_dim);
    if (reorder && (t.slot == Slot::Q || t.slot == Slot::K)) {
      lin = load_rope_rows(tm, t, c.head_dim, rot > 0 ? rot : c.head_dim, s.rope_interleaved, c0, c1, dev);
    } else
      lin = load_linear_cols(tm, t.name, t.in, t.out, t.bias, dev, t.begin + c0, t.begin + c1);
    linear_slot(L, t.slot) = std::move(lin);
  }
  return L;
}

void layer_linears(const DecoderSpec& s, const ModelConfig& c, int64_t li, const DecoderLayer& L,
                   const std::string& suffix, std::vector<std::pair<std::string, const Linear*>>& out) {
  using Slot = ModuleTensor::Slot;
  static const char* kPart[] = {"q", "k", "v", "o", "gate", "up", "down"};
  for (const ModuleTensor& t : layer_tensors(s, c, li)) {
    if (!t.linear()) continue;
    if (t.expert()) {
      const MoeExperts* ex = (t.slot == Slot::ExpertGate ? L.expert_gate : t.slot == Slot::ExpertUp ? L.expert_up
                                                                                                     : L.expert_down)
                                 .get();
      for (int64_t e = 0; e < t.experts; ++e) out.emplace_back(t.expert_prefix(e) + suffix, &ex->expert(e));
      continue;
    }
    const int k = static_cast<int>(t.slot) - static_cast<int>(Slot::Q);
    if (t.slot >= Slot::Router) {
      const Linear* moe[] = {L.router.get(), L.shared_gate.get(), L.shared_up.get(), L.shared_down.get(),
                             L.shared_scale.get()};
      out.emplace_back(t.name + suffix, moe[static_cast<int>(t.slot) - static_cast<int>(Slot::Router)]);
      continue;
    }
    const Linear* lin[] = {L.q.get(), L.k.get(), L.v.get(), L.o.get(), L.gate.get(), L.up.get(), L.down.get()};
    const bool fused = t.width != t.out;
    out.emplace_back(t.name + (fused ? std::string(":") + kPart[k] : std::string()) + suffix, lin[k]);
  }
}

size_t layer_norm_bytes(const DecoderLayer& L) {
  size_t n = 0;
  for (const Tensor* t : {&L.attn_norm, &L.attn_post_norm, &L.mlp_norm, &L.mlp_post_norm, &L.q_norm, &L.k_norm})
    if (t->defined()) n += t->nbytes();
  return n;
}

std::vector<Tensor> rope_tables(const DecoderSpec& s, const ModelConfig& c, int64_t max_seq_len) {
  std::vector<Tensor> out;
  for (const RopeSpec& r : s.ropes) {
    if (!r.none) {
      out.push_back(
          build_rope_table(c.head_dim, c.max_position_embeddings, r.theta, r.scaling, max_seq_len, r.rotary_dim));
      continue;
    }
    Tensor t = Tensor::empty({max_seq_len, c.head_dim}, DType::F32);  // identity: cos 1, sin 0
    float* p = t.data_as<float>();
    const int64_t half = c.head_dim / 2;
    for (int64_t pos = 0; pos < max_seq_len; ++pos)
      for (int64_t i = 0; i < half; ++i) {
        p[pos * c.head_dim + i] = 1.0f;
        p[pos * c.head_dim + half + i] = 0.0f;
      }
    out.push_back(t);
  }
  return out;
}

// ---- embedding, norms, head --------------------------------------------------------------------------------

void apply_norm(const NormSpec& n, const Tensor& x, const Tensor& w, Tensor& out) {
  if (n.type == NormType::Rms)
    ops::rms_norm(x, w, static_cast<float>(n.eps), out);
  else
    ops::layer_norm(x, w, static_cast<float>(n.eps), out);
}

void embed_tokens(const DecoderSpec& s, const Tensor& ids, const Tensor& table, Tensor& h) {
  ops::embedding(ids, table, h);
  if (s.embed_scale != 1.0) ops::scale(h, static_cast<float>(s.embed_scale), 0.0f, h);
}

void head_forward(const DecoderSpec& s, const Tensor& rows, const Tensor& final_norm, Linear& lm_head, Tensor& normed,
                  Tensor& logits, Tensor& logits32) {
  apply_norm(s.norm, rows, final_norm, normed);
  if (normed.dtype() == DType::F32) {
    lm_head.forward(normed, logits32);
  } else {
    lm_head.forward(normed, logits);
    ops::convert(logits, logits32);
  }
  if (s.logit_scale != 1.0 || s.final_softcap > 0.0)
    ops::scale(logits32, static_cast<float>(s.logit_scale), static_cast<float>(s.final_softcap), logits32);
}

// ---- the body ----------------------------------------------------------------------------------------------

void attach_moe(StepBufs& b, const MoeBuffers& m) {
  b.moe = m;
  b.expert_act = m.eg;
  b.expert_act_full = m.eg_full;
  b.shared_act = m.sg;
  b.shared_act_full = m.sg_full;
}

MoeDims moe_dims(const DecoderSpec& s, const ModelConfig& c, int64_t T) {
  MoeDims d;
  if (std::none_of(s.layers.begin(), s.layers.end(), [](const LayerSpec& l) { return l.moe; })) return d;
  d.experts = s.moe.n_experts;
  d.top_k = s.moe.top_k;
  d.expert_full = s.moe.inter;
  d.expert_cols = s.moe.inter / T;
  d.shared_full = s.moe.shared_inter;
  d.shared_cols = s.moe.shared_inter / T;
  d.hidden_cols = c.hidden_size / T;
  return d;
}

DecoderBody::DecoderBody(const DecoderSpec& spec, const ModelConfig& c, int64_t ranks, StepShared& shared)
    : spec_(spec), c_(c), T_(ranks), sh_(shared) {
  n_heads_ = c.num_attention_heads / T_;
  n_kv_ = c.num_key_value_heads / T_;
  hidden_cols_ = c.hidden_size / T_;
  inter_cols_ = c.intermediate_size / T_;
  expert_cols_ = spec.moe.inter / T_;
  shared_cols_ = spec.moe.shared_inter / T_;
  eps_ = static_cast<float>(spec.norm.eps);
  scale_ = static_cast<float>(spec.attn_scale > 0 ? spec.attn_scale : 1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  softcap_ = static_cast<float>(spec.attn_softcap);
  fuse_ = gemv_fuse_enabled();
}

void DecoderBody::norm_inplace(const Tensor& x, const Tensor& w) const {
  Tensor out = x;
  apply_norm(spec_.norm, x, w, out);
}

// x = norm(h) (pending: h += x first), then ys = lins(x). The fused path (RMSNorm as the GEMV's prologue, linear.h
// forward_fused) when h is whole and the caller allows it (it needs x to hold the normed h afterwards otherwise).
void DecoderBody::pre_norm(RankRun& R, const Tensor& w, bool pending, bool fused_ok, const std::vector<Linear*>& lins,
                           const std::vector<Tensor*>& ys) const {
  StepBufs& b = R.b;
  const bool rms = spec_.norm.type == NormType::Rms;
  if (pending && rms) {
    ops::add_rms_norm(b.h, b.x, w, eps_, b.x);  // the previous block's output joins the residual here
  } else if (pending) {
    ops::add(b.h, b.x, b.h);
    ops::layer_norm(b.h, w, eps_, b.x);
  } else if (fuse_ && fused_ok && rms) {
    forward_fused(lins, b.h, LinearPrologue::rms_norm(w, eps_), ys, false, b.x);
    return;
  } else {
    apply_norm(spec_.norm, b.h, w, b.x);
  }
  forward_group(lins, b.x, ys);  // one launch where it can (linear.h)
}

void DecoderBody::attention(RankRun& R, int64_t li) const {
  DecoderLayer& L = (*R.layers)[li];
  StepBufs& b = R.b;
  KVCache& cache = *sh_.cache;
  const int64_t n = b.h.size(0), hd = c_.head_dim, nh = n_heads_, nkv = n_kv_;
  Tensor q3 = b.q.view({n, nh, hd}), k3 = b.k.view({n, nkv, hd}), v3 = b.v.view({n, nkv, hd});
  if (L.q_norm.defined()) {
    norm_inplace(b.q.view({n * nh, hd}), L.q_norm);
    norm_inplace(b.k.view({n * nkv, hd}), L.k_norm);
  }
  const LayerSpec& ls = spec_.layers[li];
  const Tensor& rope = (*R.ropes)[ls.rope];
  Tensor attn3 = b.attn.view({n, nh, hd});
  const int64_t s = cache.shard(li, R.rank);
  // The layer group's page table (kv_cache.h CacheLayout): rows [g * n_seqs, (g + 1) * n_seqs) of R.pages.
  const int64_t groups = cache.n_groups();
  const int64_t ns = R.pages.size(0) / groups, g = cache.group(li);
  const Tensor pages = groups == 1 ? R.pages : R.pages.slice(g * ns, (g + 1) * ns);
  if (cache.quantized()) {  // cache/kv_quant.h; K is centred on a vector fixed by the layer's first write
    ops::rope_qk(q3, k3, R.pos, rope);
    bool set;
    if (sh_.cache_mutex) {  // set_k_mean writes the cache's host-side flags (rank threads)
      std::lock_guard<std::mutex> lock(*sh_.cache_mutex);
      set = cache.k_mean_set(s);
    } else {
      set = cache.k_mean_set(s);
    }
    if (!set) {
      std::unique_lock<std::mutex> lock;
      if (sh_.cache_mutex) lock = std::unique_lock<std::mutex>(*sh_.cache_mutex);
      cache.set_k_mean(s, k3, R.pos, rope);
    }
    const Tensor kc_rope = cache.k_centre_rope() ? rope : Tensor();  // RoPE-aware centre, or the fixed one
    ops::kv_write_q(k3, v3, cache.k(s), cache.k_scales(s), cache.v(s), cache.v_scales(s), cache.bits(), R.pos, R.seq,
                    pages, cache.k_mean(s), kc_rope, cache.k_sink(s), cache.v_sink(s));
    ops::attention_paged_q(q3, cache.k(s), cache.k_scales(s), cache.v(s), cache.v_scales(s), cache.bits(), R.pos,
                           R.seq, pages, scale_, attn3, kc_rope.defined() ? cache.k_mean(s) : Tensor(), kc_rope,
                           cache.k_sink(s), cache.v_sink(s), ls.window, softcap_);
  } else {
    ops::rope_qk_kv_write(q3, k3, v3, R.pos, rope, cache.k(s), cache.v(s), R.seq, pages);  // rope_qk + kv_write
    static const std::vector<ops::AttentionSpan> kNone;
    ops::attention_paged_spans(q3, cache.k(s), cache.v(s), R.pos, R.seq, pages, scale_, attn3,
                               sh_.spans ? *sh_.spans : kNone, ls.window, softcap_);
  }
}

namespace {

Phase run_phase(std::function<void(RankRun&)> fn) {
  Phase p;
  p.fn = std::move(fn);
  return p;
}
Phase gather_phase(Tensor StepBufs::*src, Tensor StepBufs::*dst, int64_t width) {
  Phase p;
  p.src = src;
  p.dst = dst;
  p.width = width;
  return p;
}

void glu(Activation act, Tensor& gate, const Tensor& up) {
  if (act == Activation::Silu)
    ops::silu_mul(gate, up, gate);
  else
    ops::gelu_tanh_mul(gate, up, gate);
}

}  // namespace

// The layer as phases. Per block (attention, MLP): the pre-norm and the block's first linears, then its output
// linear (o / down) and the residual. The output linear adds into h in its epilogue where nothing comes between
// the product and the add (one device, no post-norm, no residual scale, fused GEMVs on); otherwise its product
// goes to x (tensor parallel: each rank's columns, all-gathered into x), is post-normed and scaled there, and is
// added by the next pre-norm (add_rms_norm) or at the layer's end.
void DecoderBody::layer(std::vector<Phase>& prog, int64_t li, bool whole, std::vector<size_t>* block_ends) {
  const bool par = spec_.residual == Residual::Parallel;
  const bool tp = T_ > 1, scaled = spec_.residual_scale != 1.0;
  const Activation act = spec_.act;
  const bool attn_fused = fuse_ && !tp && !scaled && spec_.names.attn_post_norm.empty();
  const bool mlp_fused = fuse_ && !tp && !scaled && spec_.names.mlp_post_norm.empty();
  const bool silu_in_down = mlp_fused && act == Activation::Silu;  // SiLU * up as down's GEMV prologue
  const float rscale = static_cast<float>(spec_.residual_scale);

  // After a block's output linear wrote x: its post-norm and scale; then x is pending (or added now).
  auto finish = [rscale, scaled, this](RankRun& R, const Tensor& post, bool add_now) {
    if (post.defined()) norm_inplace(R.b.x, post);
    if (scaled) ops::scale(R.b.x, rscale, 0.0f, R.b.x);
    if (add_now) ops::add(R.b.h, R.b.x, R.b.h);
  };
  // The block output: linear `lin` over `in` (gathered into `in_full` first under tensor parallel).
  auto block_out = [&](std::unique_ptr<Linear> DecoderLayer::*lin, Tensor DecoderLayer::*post, Tensor StepBufs::*in,
                       Tensor StepBufs::*in_full, int64_t in_cols, bool fused, bool silu_pro, bool add_now) {
    if (fused) {  // h whole afterwards
      prog.push_back(run_phase([=](RankRun& R) {
        const LinearPrologue pro = silu_pro ? LinearPrologue::silu_mul(R.b.up) : LinearPrologue::none();
        forward_fused({((*R.layers)[li].*lin).get()}, R.b.*in, pro, {&R.b.h}, true, R.b.x);
      }));
      pending_ = false;
      return;
    }
    if (!tp) {
      prog.push_back(run_phase([=](RankRun& R) {
        DecoderLayer& L = (*R.layers)[li];
        (L.*lin)->forward(R.b.*in, R.b.x);
        finish(R, L.*post, add_now);
      }));
    } else {
      prog.push_back(gather_phase(in, in_full, in_cols));
      prog.push_back(run_phase([=](RankRun& R) { ((*R.layers)[li].*lin)->forward(R.b.*in_full, R.b.out); }));
      prog.push_back(gather_phase(&StepBufs::out, &StepBufs::x, hidden_cols_));
      const bool post_defined = (lin == &DecoderLayer::o ? !spec_.names.attn_post_norm.empty()
                                                         : !spec_.names.mlp_post_norm.empty());
      if (post_defined || scaled || add_now)
        prog.push_back(run_phase([=](RankRun& R) { finish(R, (*R.layers)[li].*post, add_now); }));
    }
    pending_ = !add_now;
  };

  // Attention (parallel residual: the MLP's gate / up read the same normed x).
  const bool pending_in = pending_;
  prog.push_back(run_phase([=](RankRun& R) {
    DecoderLayer& L = (*R.layers)[li];
    StepBufs& b = R.b;
    pre_norm(R, L.attn_norm, pending_in, !par, {L.q.get(), L.k.get(), L.v.get()}, {&b.q, &b.k, &b.v});
    attention(R, li);
    if (par) {
      forward_group({L.gate.get(), L.up.get()}, b.x, {&b.gate, &b.up});
      if (!silu_in_down) glu(act, b.gate, b.up);
    }
  }));
  pending_ = false;
  const bool blocks = block_ends != nullptr;
  block_out(&DecoderLayer::o, &DecoderLayer::attn_post_norm, &StepBufs::attn, &StepBufs::attn_full,
            n_heads_ * c_.head_dim, attn_fused, false, par || blocks);
  if (blocks && !par) block_ends->push_back(prog.size());
  if (spec_.layers[li].moe) {
    moe_block(prog, li);
    if (blocks && pending_) {
      prog.push_back(run_phase([](RankRun& R) { ops::add(R.b.h, R.b.x, R.b.h); }));
      pending_ = false;
    }
  } else {
    if (!par) {
      const bool pending_mlp = pending_;
      prog.push_back(run_phase([=](RankRun& R) {
        DecoderLayer& L = (*R.layers)[li];
        StepBufs& b = R.b;
        pre_norm(R, L.mlp_norm, pending_mlp, true, {L.gate.get(), L.up.get()}, {&b.gate, &b.up});
        if (!silu_in_down) glu(act, b.gate, b.up);
      }));
      pending_ = false;
    }
    block_out(&DecoderLayer::down, &DecoderLayer::mlp_post_norm, &StepBufs::gate, &StepBufs::gate_full, inter_cols_,
              mlp_fused, silu_in_down, blocks);
  }
  if (blocks) block_ends->push_back(prog.size());
  if (whole && pending_) {
    prog.push_back(run_phase([](RankRun& R) { ops::add(R.b.h, R.b.x, R.b.h); }));
    pending_ = false;
  }
}

// The MoE MLP (sequential residual): x = norm(h); router logits (and the shared expert's gate / up / gate logit)
// from x; top-k and grouping on the device; the chosen experts' gate / up over their gathered rows (only their
// weights are read: MoeExperts) and the GLU; their down projections in position order; the weighted sum (+ the gated
// shared expert) into h in one rounding (one device, no post-norm or scale), else into x (T = 1) or this rank's
// columns of x, gathered. Tensor parallel: every rank routes the same replicated x with the whole router (the same
// ids everywhere), holds columns [r, r + 1) / T of each expert's gate / up intermediate and of every down projection's
// output (as the dense MLP: exact, no partial sums); the GLU products are gathered to full width (the experts' over
// P = n * top_k rows), the sums to full hidden width.
void DecoderBody::moe_block(std::vector<Phase>& prog, int64_t li) {
  const bool tp = T_ > 1, scaled = spec_.residual_scale != 1.0, post = !spec_.names.mlp_post_norm.empty();
  const bool shared = spec_.moe.shared_inter > 0, renorm = spec_.moe.renormalize;
  const int64_t k = spec_.moe.top_k, E = spec_.moe.n_experts;
  const Activation act = spec_.act;
  const float rscale = static_cast<float>(spec_.residual_scale);
  const bool add_h = !tp && !post && !scaled;
  const bool pending_in = pending_;
  prog.push_back(run_phase([=](RankRun& R) {
    DecoderLayer& L = (*R.layers)[li];
    StepBufs& b = R.b;
    MoeBuffers& m = b.moe;
    std::vector<Linear*> lins = {L.router.get()};
    std::vector<Tensor*> ys = {&m.logits};
    if (shared) {
      lins.insert(lins.end(), {L.shared_gate.get(), L.shared_up.get(), L.shared_scale.get()});
      ys.insert(ys.end(), {&m.sg, &m.su, &m.sgate});
    }
    pre_norm(R, L.mlp_norm, pending_in, false, lins, ys);  // the experts read the normed x too
    ops::moe_route(m.logits, k, renorm, m.ids, m.weights);
    ops::moe_group(m.ids, E, m.g.offsets, m.g.perm, m.g.inv, m.g.active);
    L.expert_gate->forward(b.x, k, true, m.g, m.eg);
    L.expert_up->forward(b.x, k, true, m.g, m.eu);
    glu(act, m.eg, m.eu);
    if (shared) glu(act, m.sg, m.su);
  }));
  if (tp) {
    Phase g = gather_phase(&StepBufs::expert_act, &StepBufs::expert_act_full, expert_cols_);
    g.rows_per_token = k;
    prog.push_back(g);
    if (shared) prog.push_back(gather_phase(&StepBufs::shared_act, &StepBufs::shared_act_full, shared_cols_));
  }
  auto finish = [=](RankRun& R) {
    if (post) norm_inplace(R.b.x, (*R.layers)[li].mlp_post_norm);
    if (scaled) ops::scale(R.b.x, rscale, 0.0f, R.b.x);
  };
  prog.push_back(run_phase([=](RankRun& R) {
    DecoderLayer& L = (*R.layers)[li];
    StepBufs& b = R.b;
    MoeBuffers& m = b.moe;
    L.expert_down->forward(m.eg_full, k, false, m.g, m.eo);
    if (shared) L.shared_down->forward(m.sg_full, m.so);
    Tensor& out = add_h ? b.h : (tp ? b.out : b.x);
    ops::moe_combine(m.eo, m.weights, m.g.inv, shared ? m.so : Tensor(), shared ? m.sgate : Tensor(), add_h, out);
    if (!tp && !add_h) finish(R);
  }));
  if (tp) {
    prog.push_back(gather_phase(&StepBufs::out, &StepBufs::x, hidden_cols_));
    if (post || scaled) prog.push_back(run_phase(finish));
  }
  pending_ = !add_h;
}

}  // namespace exl2
