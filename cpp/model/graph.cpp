// Loading and running the Llama-family decoder graph (see graph.h). Calls ops:: only.
#include "model/graph.h"

#include <cmath>

#include "cache/kv_quant.h"
#include "core/device_api.h"
#include "model/rope.h"
#include "ops/ops.h"

namespace exl2 {

namespace {

// Norm weights are small: keep them f32 on the model's device.
Tensor load_norm(const TensorMap& tm, const std::string& name, int64_t size, Device device) {
  Tensor w = tm.get_checked(name, {size}, {DType::F32, DType::F16, DType::BF16});
  return w.to_dtype(DType::F32).to(device);
}

Tensor to_device_i32(const std::vector<int32_t>& v, Device device) {
  Tensor t = Tensor::from_vector(v, DType::I32);
  return device.is_cpu() ? t : t.to(device);
}

}  // namespace

ModelGraph::ModelGraph(const ModelConfig& c, const TensorMap& tm, const LoadOptions& opt, DecoderTraits traits,
                       int64_t max_seq_len)
    : config_(c), traits_(traits), device_(opt.device), act_(opt.device.is_cpu() ? DType::F32 : DType::F16) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t nq = c.num_attention_heads * hd, nkv = c.num_key_value_heads * hd;

  Tensor emb = tm.get_checked("model.embed_tokens.weight", {c.vocab_size, H}, {DType::F16, DType::BF16, DType::F32});
  embed_ = device_.is_cpu() ? emb : emb.to_dtype(DType::F16).to(device_);
  final_norm_ = load_norm(tm, "model.norm.weight", H, device_);
  rope_ = build_rope_table(c, max_seq_len).to(device_);

  layers_.resize(c.num_hidden_layers);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = str_cat("model.layers.", i, ".");
    DecoderLayer& L = layers_[i];
    L.attn_norm = load_norm(tm, p + "input_layernorm.weight", H, device_);
    L.mlp_norm = load_norm(tm, p + "post_attention_layernorm.weight", H, device_);
    if (traits_.qk_norm) {
      L.q_norm = load_norm(tm, p + "self_attn.q_norm.weight", hd, device_);
      L.k_norm = load_norm(tm, p + "self_attn.k_norm.weight", hd, device_);
    }
    L.q = load_linear(tm, p + "self_attn.q_proj", H, nq, traits_.qkv_bias, device_);
    L.k = load_linear(tm, p + "self_attn.k_proj", H, nkv, traits_.qkv_bias, device_);
    L.v = load_linear(tm, p + "self_attn.v_proj", H, nkv, traits_.qkv_bias, device_);
    L.o = load_linear(tm, p + "self_attn.o_proj", nq, H, traits_.o_bias, device_);
    L.gate = load_linear(tm, p + "mlp.gate_proj", H, I, traits_.mlp_bias, device_);
    L.up = load_linear(tm, p + "mlp.up_proj", H, I, traits_.mlp_bias, device_);
    L.down = load_linear(tm, p + "mlp.down_proj", I, H, traits_.mlp_bias, device_);
  }
  // lm_head: its own tensors when present (EXL2 writes a quantized lm_head even for tied models), else tied.
  if (tm.contains("lm_head.weight") || tm.contains("lm_head.q_weight")) {
    lm_head_ = load_linear(tm, "lm_head", H, c.vocab_size, false, device_);
  } else {
    EXL2_CHECK_KIND(ModelFormat, c.tie_word_embeddings, "missing tensor lm_head.weight (and tie_word_embeddings "
                    "is false in config.json)");
    lm_head_ = make_dense_linear(emb, Tensor(), device_);
  }
}

std::vector<std::pair<std::string, const Linear*>> ModelGraph::linears() const {
  std::vector<std::pair<std::string, const Linear*>> out;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const std::string p = str_cat("model.layers.", i, ".");
    const DecoderLayer& L = layers_[i];
    out.emplace_back(p + "self_attn.q_proj", L.q.get());
    out.emplace_back(p + "self_attn.k_proj", L.k.get());
    out.emplace_back(p + "self_attn.v_proj", L.v.get());
    out.emplace_back(p + "self_attn.o_proj", L.o.get());
    out.emplace_back(p + "mlp.gate_proj", L.gate.get());
    out.emplace_back(p + "mlp.up_proj", L.up.get());
    out.emplace_back(p + "mlp.down_proj", L.down.get());
  }
  out.emplace_back("lm_head", lm_head_.get());
  return out;
}

size_t ModelGraph::weight_bytes() const {
  size_t total = embed_.nbytes() + final_norm_.nbytes();
  for (const auto& kv : linears()) total += kv.second->nbytes();
  for (const DecoderLayer& L : layers_) {
    total += L.attn_norm.nbytes() + L.mlp_norm.nbytes();
    if (L.q_norm.defined()) total += L.q_norm.nbytes() + L.k_norm.nbytes();
  }
  return total;
}

Tensor ModelGraph::forward(const Batch& batch, KVCache& cache) {
  const ModelConfig& c = config_;
  const int64_t n = static_cast<int64_t>(batch.tokens.size());
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads;
  batch.validate(cache, c.vocab_size, rope_.size(0));
  EXL2_CHECK(cache.device() == device_, "forward: cache is on ", cache.device().str(), ", model on ", device_.str());

  const Tensor ids = to_device_i32(batch.tokens, device_);
  const Tensor pos = to_device_i32(batch.positions, device_);
  const Tensor seq = to_device_i32(batch.seq_of_token, device_);
  const Tensor pages = to_device_i32(batch.page_table, device_)
                           .view({static_cast<int64_t>(batch.page_table.size()) / batch.pages_per_seq,
                                  static_cast<int64_t>(batch.pages_per_seq)});

  Tensor h = Tensor::empty({n, H}, act_, device_);
  Tensor x = Tensor::empty({n, H}, act_, device_);
  Tensor q = Tensor::empty({n, nh * hd}, act_, device_);
  Tensor k = Tensor::empty({n, nkv * hd}, act_, device_);
  Tensor v = Tensor::empty({n, nkv * hd}, act_, device_);
  Tensor attn = Tensor::empty({n, nh * hd}, act_, device_);
  Tensor gate = Tensor::empty({n, I}, act_, device_);
  Tensor up = Tensor::empty({n, I}, act_, device_);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float eps = static_cast<float>(c.rms_norm_eps);

  ops::embedding(ids, embed_, h);
  for (size_t li = 0; li < layers_.size(); ++li) {
    DecoderLayer& L = layers_[li];
    ops::rms_norm(h, L.attn_norm, eps, x);
    L.q->forward(x, q);
    L.k->forward(x, k);
    L.v->forward(x, v);
    Tensor q3 = q.view({n, nh, hd}), k3 = k.view({n, nkv, hd}), v3 = v.view({n, nkv, hd});
    if (traits_.qk_norm) {
      Tensor qf = q.view({n * nh, hd}), kf = k.view({n * nkv, hd});
      ops::rms_norm(qf, L.q_norm, eps, qf);
      ops::rms_norm(kf, L.k_norm, eps, kf);
    }
    ops::rope(q3, pos, rope_);
    ops::rope(k3, pos, rope_);
    Tensor attn3 = attn.view({n, nh, hd});
    if (cache.quantized()) {  // cache/kv_quant.h
      ops::kv_write_q(k3, v3, cache.k(li), cache.k_scales(li), cache.v(li), cache.v_scales(li), cache.bits(), pos,
                      seq, pages);
      ops::attention_paged_q(q3, cache.k(li), cache.k_scales(li), cache.v(li), cache.v_scales(li), cache.bits(), pos,
                             seq, pages, scale, attn3);
    } else {
      ops::kv_write(k3, v3, cache.k(li), cache.v(li), pos, seq, pages);
      ops::attention_paged(q3, cache.k(li), cache.v(li), pos, seq, pages, scale, attn3);
    }
    L.o->forward(attn, x);
    ops::add(h, x, h);
    ops::rms_norm(h, L.mlp_norm, eps, x);
    L.gate->forward(x, gate);
    L.up->forward(x, up);
    ops::silu_mul(gate, up, gate);
    L.down->forward(gate, x);
    ops::add(h, x, h);
  }

  // Only the rows whose logits are wanted go through the final norm and lm_head.
  Tensor rows = h;
  if (!batch.logit_rows.empty()) {
    const int64_t m = static_cast<int64_t>(batch.logit_rows.size());
    rows = Tensor::empty({m, H}, act_, device_);
    for (int64_t i = 0; i < m; ++i) rows.slice(i, i + 1).copy_from(h.slice(batch.logit_rows[i], batch.logit_rows[i] + 1));
  }
  const int64_t m = rows.size(0);
  Tensor normed = Tensor::empty({m, H}, act_, device_);
  ops::rms_norm(rows, final_norm_, eps, normed);
  Tensor logits = Tensor::empty({m, c.vocab_size}, act_, device_);
  lm_head_->forward(normed, logits);
  if (act_ == DType::F32 && device_.is_cpu()) return logits;
  Tensor logits32 = Tensor::empty({m, c.vocab_size}, DType::F32, device_);
  ops::convert(logits, logits32);
  return logits32.to(Device::cpu());
}

}  // namespace exl2
