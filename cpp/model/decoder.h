// The decoder as a composition of modules. An architecture file (cpp/model/arch/<name>.cpp) reads config.json
// through an ArchConfig and returns a DecoderSpec: which embedding scale, norms, attention options, MLP, residual
// pattern and head the model uses, the tensor names of each module, and per layer its sliding window and RoPE.
// DecoderBody runs that composition, the same code for one device, a layer split and tensor parallel (where each
// linear is a column-parallel shard whose output is all-gathered: the only collectives of a layer). The CUDA fast
// paths (norm and SiLU*up as GEMV prologues, the residual add as the o / down GEMV's epilogue, the grouped q/k/v
// and gate/up GEMV, the fused RoPE + KV write) are used where a module's options allow; other options run the
// same math as composed ops.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "exl2/config.h"
#include "exl2/kv_cache.h"
#include "exl2/safetensors.h"
#include "linear/linear.h"
#include "linear/moe_linear.h"

namespace exl2 {

namespace ops {
struct AttentionSpan;  // ops/ops.h
}

// ---- the layer description ----------------------------------------------------------------------------------

enum class NormType {
  Rms,    // x / sqrt(mean(x^2) + eps) * w
  Layer,  // LayerNorm without bias: (x - mean) / sqrt(var + eps) * w (Cohere)
};
struct NormSpec {
  NormType type = NormType::Rms;
  double eps = 1e-6;
  bool plus_one = false;  // the file stores w, the model applies (1 + w) (Gemma); folded in at load
};

enum class Activation {
  Silu,      // SwiGLU: silu(gate) * up
  GeluTanh,  // GeGLU: gelu_tanh(gate) * up (Gemma's gelu_pytorch_tanh)
};

enum class Residual {
  Sequential,  // h += attn(norm(h)); h += mlp(norm(h))
  Parallel,    // x = norm(h); h += attn(x) + mlp(x) (Cohere)
};

// One RoPE table: none (layers without positional rotation: an identity table, so the fused RoPE + KV write
// still applies), or a base and a scaling (model/rope.h).
struct RopeSpec {
  bool none = false;
  double theta = 10000.0;
  RopeScaling scaling;
  int64_t rotary_dim = 0;  // > 0: RoPE on each head's first rotary_dim channels only (Phi-4-mini); 0: all
};

struct LayerSpec {
  int64_t window = 0;  // sliding window in keys (the row's own included); 0: full causal attention
  int rope = 0;        // index into DecoderSpec::ropes
  bool moe = false;    // the MLP is DecoderSpec::moe's mixture of experts (else the dense gate / up / down)
};

// Tensor names. Per-layer names are relative to layers + "<i>."; "" means the module is absent.
struct TensorNames {
  std::string embed = "model.embed_tokens.weight";
  std::string layers = "model.layers.";
  std::string final_norm = "model.norm.weight";
  std::string head = "lm_head";  // linear prefix; absent from the file: tied to the embedding
  std::string attn_norm = "input_layernorm.weight";
  std::string attn_post_norm;  // Gemma 2/3: "post_attention_layernorm.weight" (on the attention output)
  std::string mlp_norm = "post_attention_layernorm.weight";  // "" with Residual::Parallel (attn_norm's output)
  std::string mlp_post_norm;                                  // Gemma 2/3: "post_feedforward_layernorm.weight"
  std::string q = "self_attn.q_proj", k = "self_attn.k_proj", v = "self_attn.v_proj", o = "self_attn.o_proj";
  std::string qkv;  // fused [q; k; v] rows (Phi-3): set instead of q/k/v
  std::string q_norm, k_norm;  // per-head norms of q and k before RoPE (Qwen3, Gemma 3): "self_attn.q_norm.weight"
  std::string gate = "mlp.gate_proj", up = "mlp.up_proj", down = "mlp.down_proj";
  std::string gate_up;  // fused [gate; up] rows (Phi-3): set instead of gate/up
  // MoE layers: the router linear, expert e's linears <experts><e>.<expert_gate / _up / _down>, the shared expert's
  // linears and its gate linear (hidden -> 1; "": no shared expert).
  std::string router = "block_sparse_moe.gate", experts = "block_sparse_moe.experts.";
  std::string expert_gate = "w1", expert_up = "w3", expert_down = "w2";
  std::string shared_gate, shared_up, shared_down, shared_scale;
};

// The mixture-of-experts MLP of the layers with LayerSpec::moe (Mixtral, Qwen2-MoE, Qwen3-MoE): router logits
// (a linear, hidden -> n_experts), the top_k experts of highest softmax probability per token (ops::moe_route;
// renormalize: their k probabilities divided by their sum, Mixtral and norm_topk_prob), each expert a GLU MLP of
// width `inter` (the spec's activation), their outputs summed with those weights; plus, with shared_inter > 0, a
// shared expert (a GLU MLP of width shared_inter) times sigmoid(shared gate linear, hidden -> 1) (Qwen2-MoE).
struct MoeSpec {
  int64_t n_experts = 0, top_k = 0, inter = 0, shared_inter = 0;
  bool renormalize = true;
};

struct DecoderSpec {
  TensorNames names;
  std::vector<std::string> unused_prefixes;  // tensors of parts not run (a vision tower): present, never read
  NormSpec norm;                             // every norm of the model
  double embed_scale = 1.0;                  // h = embedding * scale (Gemma: sqrt(hidden); Granite)
  bool qkv_bias = false, o_bias = false, mlp_bias = false;
  bool rope_interleaved = false;  // RoPE on pairs (2i, 2i+1) (Cohere): q/k rows are permuted at load to the
                                  // rotate-half layout the kernels use (q . k is unchanged)
  bool qk_norm_per_head = false;  // q_norm / k_norm hold a weight per head, [n_heads, head_dim] / [n_kv_heads,
                                  // head_dim] (Cohere use_qk_norm; LayerNorm); else one [head_dim] for all heads
  double attn_scale = 0.0;        // softmax scale; 0: 1 / sqrt(head_dim)
  double attn_softcap = 0.0;      // > 0: scores -> cap * tanh(scores / cap) (Gemma 2)
  Activation act = Activation::Silu;
  MoeSpec moe;
  Residual residual = Residual::Sequential;
  double residual_scale = 1.0;  // block outputs scaled before the residual add (Granite residual_multiplier)
  double logit_scale = 1.0;     // logits * scale (Cohere logit_scale, Granite 1 / logits_scaling)
  double final_softcap = 0.0;   // > 0: logits -> cap * tanh(logits / cap) (Gemma 2)
  std::vector<RopeSpec> ropes;  // at least one
  std::vector<LayerSpec> layers;  // [num_hidden_layers]
};

// ---- reading config.json for an architecture file -------------------------------------------------------------

// config.json as an architecture file sees it: the parsed common fields (config()) plus typed reads of any key,
// each read recording the key as implemented. finish() raises UnsupportedError naming every key that was neither
// read, accepted nor on the list of metadata that never changes the computation (known_metadata_keys()).
class ArchConfig {
 public:
  explicit ArchConfig(const ModelConfig& config);
  const ModelConfig& config() const { return c_; }
  const std::string& arch() const { return c_.architecture; }
  bool has(const std::string& key) const;  // present and not null
  bool flag(const std::string& key, bool def);
  double number(const std::string& key, double def);
  int64_t integer(const std::string& key, int64_t def);
  std::string string(const std::string& key, const std::string& def);
  std::vector<std::string> strings(const std::string& key);  // a list of strings; absent: empty
  const Json* json(const std::string& key);                   // the raw value (nullptr: absent or null)
  void accept(std::initializer_list<const char*> keys);       // implemented through config() (or by the caller)
  // A multimodal file (config().outer: the text model under text_config): its top-level keys that the architecture
  // implements or that describe parts it does not run (vision_config, image token ids). finish() names the others,
  // text_config itself included: an architecture that does not accept it runs no nested config.
  void accept_outer(std::initializer_list<const char*> keys);
  // A key that must be absent, null or `harmless` (its value that changes nothing): UnsupportedError otherwise.
  void require_value(const std::string& key, const Json& harmless, const std::string& why);
  [[noreturn]] void unsupported(const std::string& key, const std::string& what) const;
  void finish() const;

 private:
  const ModelConfig& c_;
  std::set<std::string> read_, outer_read_;
};

// Keys of config.json that are metadata (names, token ids, training-only settings, generation defaults).
const std::vector<std::string>& known_metadata_keys();

// The Llama composition from the common keys (sizes, rms_norm_eps, rope_theta / rope_scaling / rope_parameters,
// tie_word_embeddings, hidden_act silu or gelu_pytorch_tanh, max_position_embeddings): pre-norm RMSNorm, GQA
// attention with RoPE, SwiGLU (GeGLU), no biases, no windows. Architecture files start here. rope_parameters keyed
// by layer type is left unread (finish() refuses it) for the architecture that implements it to read.
DecoderSpec llama_like(ArchConfig& c);
// Per-layer windows from layer_types ("full_attention" / "sliding_attention"; read here): sliding layers get
// `window` (the architecture's reading of sliding_window), full ones none. Without layer_types, layers from
// first_sliding on get `window` (HF's default layer_types; Qwen2's max_window_layers), except with full_every > 0
// every full_every-th layer (i + 1 divisible by it: Gemma 2 / 3's patterns), which is full.
void read_layer_windows(ArchConfig& c, DecoderSpec& s, int64_t window, int64_t first_sliding = 0,
                        int64_t full_every = 0);
// MoE layers as Qwen-MoE picks them: layer i is one when i is not in mlp_only_layers (a list of layer indices) and
// (i + 1) % decoder_sparse_step == 0 (both read here; defaults [] and 1).
void read_sparse_layers(ArchConfig& c, DecoderSpec& s);
// The experts of Qwen2-MoE / Qwen3-MoE: num_experts (HF transformers 5 writes num_local_experts), num_experts_per_tok,
// moe_intermediate_size, norm_topk_prob, the sparse layers (read_sparse_layers), the names mlp.gate and
// mlp.experts.N.gate_proj / up_proj / down_proj; use_sliding_window must be false (sliding_window and
// max_window_layers are read only with it). The shared expert is the caller's.
void read_qwen_moe(ArchConfig& c, DecoderSpec& s);

// Registry keyed by config.json architectures[0]: one line per architecture in registry.cpp.
using ArchFn = DecoderSpec (*)(ArchConfig& config);
void register_architecture(const std::string& name, ArchFn fn);
std::vector<std::string> known_architectures();
// The composition of `config` (UnsupportedError for unknown architectures, listing the known ones; for keys the
// architecture does not implement; for specs the body cannot run yet, e.g. experts).
DecoderSpec decoder_spec(const ModelConfig& config);

// ---- weights ----------------------------------------------------------------------------------------------------

// One layer's modules on one device (a rank's shards under tensor parallel). Norm weights f32 with (1 + w)
// folded in; q_norm / k_norm [head_dim] or (qk_norm_per_head) this rank's heads [heads, head_dim], channels in the
// order of the q/k rows; linears as loaded (dense or EXL2), q/k rows permuted for interleaved or partial RoPE.
struct DecoderLayer {
  Tensor attn_norm, attn_post_norm, mlp_norm, mlp_post_norm, q_norm, k_norm;
  std::unique_ptr<Linear> q, k, v, o, gate, up, down;
  // MoE layers (gate / up / down absent): the router and shared expert gate (full on every rank), the shared
  // expert's linears and the experts (rank shards as gate / up / down: see DecoderBody).
  std::unique_ptr<Linear> router, shared_gate, shared_up, shared_down, shared_scale;
  std::unique_ptr<MoeExperts> expert_gate, expert_up, expert_down;
};

// A layer's tensors as the modules read them: a norm weight, or a linear (its file prefix and the output columns
// [begin, begin + width) of the file's rows it takes: fused qkv / gate_up tensors give several).
// Experts: one entry per projection, its linears <name><e>.<leaf> for e < experts (no bias).
struct ModuleTensor {
  enum class Slot {
    AttnNorm, AttnPostNorm, MlpNorm, MlpPostNorm, QNorm, KNorm, Q, K, V, O, Gate, Up, Down,
    Router, SharedGate, SharedUp, SharedDown, SharedScale, ExpertGate, ExpertUp, ExpertDown
  };
  Slot slot;
  std::string name;                // norm: the tensor; linear: the prefix
  int64_t in = 0, out = 0;         // linear: input features, rows of the file's tensor
  int64_t begin = 0, width = 0;    // linear: this module's rows (norm: width = its size)
  bool bias = false;               // linear: a bias is required (and read)
  int64_t experts = 0;             // experts: their number
  std::string leaf{};              // experts: the linear's name in an expert
  bool linear() const { return slot >= Slot::Q; }
  bool expert() const { return slot >= Slot::ExpertGate; }
  std::string expert_prefix(int64_t e) const { return str_cat(name, e, ".", leaf); }
};
std::vector<ModuleTensor> layer_tensors(const DecoderSpec& spec, const ModelConfig& c, int64_t li);
// The member of L that holds a linear slot (Q .. Down).
std::unique_ptr<Linear>& linear_slot(DecoderLayer& L, ModuleTensor::Slot slot);
// Row `row` of a q or k projection in the layout the kernels rotate (pairs (i, head_dim/2 + i)) is this row of the
// file's, for RoPE over the first rot channels of a head, interleaved (pairs (2i, 2i + 1)) or not (rows of a module
// start at a head; load_layer reorders q/k so when interleaved or rot < head_dim).
int64_t rope_source_row(int64_t row, int64_t head_dim, int64_t rot, bool interleaved);

// UnsupportedError naming the checkpoint tensors no module reads (and not under spec.unused_prefixes); run before
// any weight is placed. Linear parts: .weight / .bias, EXL2's q_weight / q_scale / q_scale_max / q_groups /
// q_perm / q_invperm.
void check_tensors_read(const DecoderSpec& spec, const ModelConfig& c, const TensorMap& tm);

// Loads layer li onto dev; rank r of T takes output columns [r, r + 1) * width / T of every linear (T = 1: all).
DecoderLayer load_layer(const DecoderSpec& spec, const ModelConfig& c, const TensorMap& tm, int64_t li, Device dev,
                        int64_t r = 0, int64_t T = 1);
Tensor load_norm(const DecoderSpec& spec, const TensorMap& tm, const std::string& name, int64_t size, Device dev);
Tensor load_norm(const DecoderSpec& spec, const TensorMap& tm, const std::string& name, const Shape& shape, Device dev);
// (name, linear) of a layer's linears in file order; fused tensors name their part ("...qkv_proj:q").
void layer_linears(const DecoderSpec& spec, const ModelConfig& c, int64_t li, const DecoderLayer& L,
                   const std::string& suffix, std::vector<std::pair<std::string, const Linear*>>& out);
size_t layer_norm_bytes(const DecoderLayer& L);
// The RoPE tables f32 [max_seq_len, head_dim] on the host, by spec.ropes index.
std::vector<Tensor> rope_tables(const DecoderSpec& spec, const ModelConfig& c, int64_t max_seq_len);

// out = the spec's norm of x with weight w (RMSNorm or LayerNorm; out may alias x).
void apply_norm(const NormSpec& norm, const Tensor& x, const Tensor& w, Tensor& out);
// Embedding (+ scale) into h.
void embed_tokens(const DecoderSpec& spec, const Tensor& ids, const Tensor& table, Tensor& h);
// The head over rows (already picked): final norm into normed, lm_head into logits (act) and logits32 (f32;
// logits unused when act is f32), then logit scale and soft-cap on logits32.
void head_forward(const DecoderSpec& spec, const Tensor& rows, const Tensor& final_norm, Linear& lm_head,
                  Tensor& normed, Tensor& logits, Tensor& logits32);

// ---- the body ---------------------------------------------------------------------------------------------------

// One rank's (one device's) buffers for a step. T = 1: attn_full is attn, gate_full is gate, out is x.
struct StepBufs {
  Tensor h, x, q, k, v, attn, gate, up;  // act [n, this rank's width]
  Tensor attn_full, gate_full;            // o_proj's / down_proj's input gathered to full width (T > 1)
  Tensor out;                             // a shard's o / down output [n, hidden / T] (T > 1)
  // MoE layers (attach_moe; undefined for dense models): the expert GLU product [P, expert cols / T] and gathered
  // [P, expert intermediate] (P = n * top_k positions, ops::moe_group's order), the shared expert's [n, cols / T]
  // and [n, shared intermediate]; the rest of the MoE step in moe.
  Tensor expert_act{}, expert_act_full{}, shared_act{}, shared_act_full{};
  MoeBuffers moe{};
};
// b's MoE views from a workspace's MoE buffers (T = 1: the *_full views are the shards themselves).
void attach_moe(StepBufs& b, const MoeBuffers& m);
// The MoE buffer widths of a spec on T ranks (all 0 without MoE layers).
MoeDims moe_dims(const DecoderSpec& spec, const ModelConfig& c, int64_t ranks);

// What a phase of the body reads on one rank.
struct RankRun {
  int rank = 0;
  std::vector<DecoderLayer>* layers = nullptr;
  const std::vector<Tensor>* ropes = nullptr;  // this device's RoPE tables
  StepBufs b;
  Tensor pos, seq, pages;  // i32 [n], [n], [n_seqs, pages_per_seq] on this device
};

// A step of the program: a per-rank computation, or (fn empty) an all-gather of each rank's b.*src [N, width]
// into every rank's b.*dst [N, T * width] (columns of rank r at r * width), N = n * rows_per_token (MoE expert
// positions: top_k).
struct Phase {
  std::function<void(RankRun&)> fn;
  Tensor StepBufs::*src = nullptr;
  Tensor StepBufs::*dst = nullptr;
  int64_t width = 0;
  int64_t rows_per_token = 1;
};

// The step's state shared by the ranks.
struct StepShared {
  KVCache* cache = nullptr;
  std::mutex* cache_mutex = nullptr;  // guards the cache's host-side K-centre flags (rank threads); may be null
  const std::vector<ops::AttentionSpan>* spans = nullptr;  // attention planning hint; null or empty: none
};

class DecoderBody {
 public:
  // ranks: T of tensor parallel (1: one device per layer); q/kv heads, intermediate and hidden columns per rank.
  DecoderBody(const DecoderSpec& spec, const ModelConfig& c, int64_t ranks, StepShared& shared);
  // Appends layer li's phases. whole: h holds the complete residual stream after the layer (the last layer, and
  // every layer of a split model); otherwise the layer may leave its last block output in b.x, added by the next
  // layer's first norm (one kernel). block_ends (the converter's calibration, model/calibration.h): every residual
  // block (attention, MLP; with Residual::Parallel the one block of both) adds its output into h at its end, and
  // prog.size() after each block is appended.
  void layer(std::vector<Phase>& prog, int64_t li, bool whole, std::vector<size_t>* block_ends = nullptr);

 private:
  void pre_norm(RankRun& R, const Tensor& w, bool pending, bool fused_ok, const std::vector<Linear*>& lins,
                const std::vector<Tensor*>& ys) const;
  void attention(RankRun& R, int64_t li) const;
  void norm_inplace(const Tensor& x, const Tensor& w) const;
  void moe_block(std::vector<Phase>& prog, int64_t li);  // the MoE MLP of layer li (pre-norm to residual)

  const DecoderSpec& spec_;
  const ModelConfig& c_;
  int64_t T_;
  StepShared& sh_;
  int64_t n_heads_, n_kv_, hidden_cols_, inter_cols_, expert_cols_, shared_cols_;
  float eps_, scale_, softcap_;
  bool fuse_;
  bool pending_ = false;  // b.x holds a block output not yet in h
};

}  // namespace exl2
