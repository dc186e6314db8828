// The converter's calibration forward: the runtime's own decoder body (model/decoder.h) run one layer at a time of
// an unquantized model over calibration states, in fp32, with a capture hook on every linear. The converter
// (python/exl2cpp/convert/) measures and quantizes layer i from the inputs the hook reports, installs its quantized
// (dequantized, fp32) weights, runs layer i again and takes the result as layer i + 1's input.
//
// States are f32 [rows * tokens, hidden] on the device: `rows` calibration rows of `tokens` tokens, each row one
// sequence of the paged cache starting at position 0 (causal, the layer's sliding window and RoPE as the spec says).
// Every linear runs as an fp32 product (ops::matmul_nt) of its file weight (rows of a fused tensor as the module
// reads them; interleaved-RoPE q/k rows permuted as load_layer does), so the CPU backend computes the model in full
// precision and CUDA in cuBLAS fp32.
//
// A layer is split into residual blocks (DecoderBody::layer's block_ends: attention, then MLP; one block for a
// parallel residual): run(b) computes y = block_b(x). The converter's passes: measurement (run the clean block
// reporting inputs, set_ref, then per candidate set_weight + run + rel_err, commit(true)) and quantization (run with
// a hook that quantizes each linear from its input and installs the result before the product, commit(false)).
//
// Capture hook: called before each linear's product with the linear's file prefix (e.g.
// "model.layers.3.self_attn.q_proj"; a fused tensor's parts each report the fused tensor's prefix) and the product's
// input act [m, in] on the device (m = rows * tokens for a dense layer). The hook may call set_weight for any linear
// of the layer, the one being called included: the product then uses the new weight. MoE layers: the router, the
// shared expert and its gate report like dense linears (m = rows * tokens); each expert's linears (capture linears
// run by MoeExperts' per-expert path) report the expert's own prefix ("model.layers.3.block_sparse_moe.experts.5.w1")
// and only the rows routed to it: m = the (token, slot) pairs the router gave the expert, in token order (its gate and
// up read those tokens' normed states, its down their GLU products); an expert that got no token is not called.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "exl2/config.h"
#include "exl2/kv_cache.h"
#include "exl2/safetensors.h"
#include "model/decoder.h"

namespace exl2 {

using CaptureHook = std::function<void(const std::string& name, const Tensor& x)>;

// A linear of the calibration forward: fp32 weight [out, in] and bias [out] (or undefined) on the device, and the
// hook it reports its input to (null: none).
class CaptureLinear : public Linear {
 public:
  CaptureLinear(std::string name, Tensor w, Tensor b) : name_(std::move(name)), w_(std::move(w)), b_(std::move(b)) {}
  int64_t in_features() const override { return w_.size(1); }
  int64_t out_features() const override { return w_.size(0); }
  void forward(const Tensor& x, Tensor& y) override;
  Tensor weight_f32() const override { return w_.to(Device::cpu()); }
  std::string kind() const override { return "f32"; }
  size_t nbytes() const override { return w_.nbytes() + (b_.defined() ? b_.nbytes() : 0); }
  const std::string& name() const { return name_; }
  void set_weight(Tensor w) { w_ = std::move(w); }
  void set_hook(const CaptureHook* hook) { hook_ = hook; }

 private:
  std::string name_;
  Tensor w_, b_;
  const CaptureHook* hook_ = nullptr;
};

// One linear tensor of the file in a layer.
struct CalibLinear {
  std::string name;  // file prefix, "model.layers.3.self_attn.q_proj"
  // Its module: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj (fused: the first part's; a shared expert's
  // too), an expert's w1 w3 w2 (gate, up, down: ExLlamaV2's measurement roles), router, shared_expert_gate.
  std::string role;
  std::string input;  // the first linear of the layer whose product reads the same input (itself if none before)
  int64_t in = 0, out = 0;  // the file tensor's [out, in]
  bool bias = false;
  bool quantized = true;  // false: kept as the file stores it (the router, the shared expert's gate)
};

class Calibration {
 public:
  // The unquantized model in model_dir (config.json + safetensors; every check Model::load makes on them), states
  // for rows x tokens on `device` (cpu or cuda:n).
  Calibration(const std::string& model_dir, Device device, int64_t rows, int64_t tokens);
  ~Calibration();
  const ModelConfig& config() const { return config_; }
  const DecoderSpec& spec() const { return spec_; }
  Device device() const { return dev_; }
  int64_t rows() const { return rows_; }
  int64_t tokens() const { return tokens_; }
  std::vector<CalibLinear> linears(int64_t li) const;  // layer li's linear tensors in file order (experts expanded)

  void embed(const Tensor& ids);       // x = embedding (+ scale) of ids i32 [rows, tokens] (any device)
  void set_states(const Tensor& x);    // x = f32 [rows * tokens, hidden] (or [rows, tokens, hidden]; any device)
  Tensor states() const;               // x on the CPU [rows * tokens, hidden]
  Tensor output() const;               // y on the CPU
  Tensor head_input() const;           // final norm of x on the CPU: lm_head's input
  // The converter's KL sensitivity: set_head_ref(head) keeps head f32 [vocab, hidden] (any device; copied) and the
  // current head input (final norm of x) as the reference; head_kl() is then the mean over the rows * tokens
  // positions of KL(p || q), p = softmax(head @ ref), q = softmax(head @ h) with h the current head input, from
  // the logits' change head @ (h - ref) (ops::logit_kl: exactly 0 when h = ref), in blocks of `block` positions
  // (0: as many as keep the block's two [block, vocab] f32 logit arrays within 256 MiB).
  void set_head_ref(const Tensor& head);
  double head_kl(int64_t block = 0) const;

  void load_layer(int64_t li);         // the current layer: its norms and the file's linear weights
  int64_t layer() const { return li_; }
  int64_t n_blocks() const { return static_cast<int64_t>(ends_.size()); }
  // y = block b of the current layer applied to x; hook (may be empty) before each linear's product.
  void run(int64_t block, const CaptureHook& hook);
  // Replace linear `name` of the current layer by weight w f32 [out, in] (the file's layout; any device).
  void set_weight(const std::string& name, const Tensor& w);
  void reset_weight(const std::string& name);  // back to the file's weight
  void set_ref();                               // ref = y; per-row sums of ref^2 (fp64)
  double rel_err() const;  // mean over rows r of |y_r - ref_r| / max(|ref_r|, 1e-30) (Frobenius, fp64 sums)
  void commit(bool from_ref);  // x = ref (from_ref) or y
  // H f32 [in, in] on the CPU = x^T x (fp32 accumulation) for x f32 [m, in] on this device (a hook's input).
  Tensor hessian(const Tensor& x) const;
  void sync() const;  // waits for the device (timers)

 private:
  DecoderLayer load_layer_modules(int64_t li);
  std::vector<CaptureLinear*>& parts(const std::string& name);
  Tensor file_rows(int64_t li, const ModuleTensor& t, const Tensor& w) const;  // t's rows of a file-layout weight
  std::vector<double> row_sums(const Tensor& a, const Tensor& b) const;

  ModelConfig config_, config1_;  // config1_: one layer (the body runs the current layer as layer 0)
  DecoderSpec spec_, spec1_;
  TensorMap tm_;
  Device dev_;
  int64_t rows_ = 0, tokens_ = 0, n_ = 0, li_ = -1;
  Tensor x_, y_, ref_, xb_, q_, k_, v_, attn_, gate_, up_;
  Tensor pos_, seq_, pages_, final_norm_;
  Tensor head_, head_ref_;  // set_head_ref's head [vocab, hidden] and reference head input [n, hidden]
  std::vector<Tensor> ropes_;
  MoeBuffers moe_;  // MoE layers' step buffers for rows * tokens (undefined without MoE layers)
  std::unique_ptr<KVCache> cache_;
  StepShared shared_;
  std::unique_ptr<DecoderBody> body_;
  std::vector<DecoderLayer> layers_;  // the current layer
  std::vector<Phase> prog_;
  std::vector<size_t> ends_;
  std::map<std::string, std::vector<CaptureLinear*>> parts_;
  std::map<CaptureLinear*, ModuleTensor> part_of_;
  std::vector<double> den_;
};

}  // namespace exl2
