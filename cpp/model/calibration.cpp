// The converter's calibration forward (model/calibration.h): one layer of the decoder body over resident fp32
// states, with capture hooks on its linears, and the block error sums and Hessians the converter reads.
#include "model/calibration.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "core/device_api.h"
#include "model/load_checks.h"
#include "ops/ops.h"
#include "quant/gptq.h"

#ifdef EXL2_WITH_CUDA
#include "cuda/multi_device.h"
#endif

namespace exl2 {

namespace {

constexpr int kPageSize = 256;         // tokens per cache page (the runtime's default, python/exl2cpp/model.py)
constexpr int64_t kSqdiffParts = 64;  // parts per calibration row of the error sums

Tensor f32(const Shape& s, Device d) { return Tensor::empty(s, DType::F32, d); }

const char* role_of(ModuleTensor::Slot s) {
  using Slot = ModuleTensor::Slot;
  switch (s) {
    case Slot::Q: return "q_proj";
    case Slot::K: return "k_proj";
    case Slot::V: return "v_proj";
    case Slot::O: return "o_proj";
    case Slot::Gate: return "gate_proj";
    case Slot::Up: return "up_proj";
    case Slot::Down: return "down_proj";
    case Slot::Router: return "router";
    case Slot::SharedGate: return "gate_proj";
    case Slot::SharedUp: return "up_proj";
    case Slot::SharedDown: return "down_proj";
    case Slot::SharedScale: return "shared_expert_gate";
    case Slot::ExpertGate: return "w1";
    case Slot::ExpertUp: return "w3";
    case Slot::ExpertDown: return "w2";
    default: EXL2_FAIL(Internal, "calibration: slot ", static_cast<int>(s), " has no measurement role");
  }
}

// Clears the linears' hook when a run ends (also when the hook or an op raised).
struct HookScope {
  std::vector<CaptureLinear*> lins;
  HookScope(std::vector<CaptureLinear*> l, const CaptureHook* h) : lins(std::move(l)) {
    for (CaptureLinear* c : lins) c->set_hook(h);
  }
  ~HookScope() {
    for (CaptureLinear* c : lins) c->set_hook(nullptr);
  }
};

}  // namespace

void CaptureLinear::forward(const Tensor& x, Tensor& y) {
  if (hook_ && *hook_ && x.size(0) > 0) (*hook_)(name_, x);
  ops::matmul_nt(x, w_, b_, y);
}

Calibration::Calibration(const std::string& model_dir, Device device, int64_t rows, int64_t tokens)
    : config_(ModelConfig::load(model_dir)), tm_(TensorMap::open(model_dir)), dev_(device), rows_(rows),
      tokens_(tokens) {
  const std::string source = (std::filesystem::path(model_dir) / "config.json").string();
  EXL2_CHECK_KIND(Unsupported, config_.head_dim % 2 == 0, "config.json: head_dim must be even, got ",
                  config_.head_dim);
  check_layers(config_, tm_, source);
  spec_ = decoder_spec(config_);
  check_tensors_read(spec_, config_, tm_);
  EXL2_CHECK(rows > 0 && tokens > 0, "calibration: rows and tokens must be > 0, got ", rows, ", ", tokens);
  check_max_seq_len(config_, tokens, false, source);
  check_rope(config_, tokens, source);
  n_ = rows * tokens;
  const int64_t H = config_.hidden_size, I = config_.intermediate_size;
  const int64_t nq = config_.num_attention_heads * config_.head_dim, nkv = config_.num_key_value_heads * config_.head_dim;
  for (const Tensor& t : rope_tables(spec_, config_, tokens)) ropes_.push_back(t.to(dev_));
  config1_ = config_;
  config1_.num_hidden_layers = 1;
  const int64_t per_seq = (tokens + kPageSize - 1) / kPageSize;
  cache_ = std::make_unique<KVCache>(config1_, dev_, rows * per_seq, kPageSize, DType::F32);
  std::vector<int32_t> pos(static_cast<size_t>(n_)), seq(static_cast<size_t>(n_)), pages(rows * per_seq);
  for (int64_t i = 0; i < n_; ++i) {
    pos[i] = static_cast<int32_t>(i % tokens);
    seq[i] = static_cast<int32_t>(i / tokens);
  }
  for (int64_t p = 0; p < rows * per_seq; ++p) pages[p] = static_cast<int32_t>(p);
  pos_ = Tensor::from_vector(pos, DType::I32).to(dev_);
  seq_ = Tensor::from_vector(seq, DType::I32).to(dev_);
  pages_ = Tensor::from_vector(pages, DType::I32).view({rows, per_seq}).to(dev_);
  shared_.cache = cache_.get();
  x_ = f32({n_, H}, dev_);
  y_ = f32({n_, H}, dev_);
  xb_ = f32({n_, H}, dev_);
  q_ = f32({n_, nq}, dev_);
  k_ = f32({n_, nkv}, dev_);
  v_ = f32({n_, nkv}, dev_);
  attn_ = f32({n_, nq}, dev_);
  gate_ = f32({n_, I}, dev_);
  up_ = f32({n_, I}, dev_);
  final_norm_ = load_norm(spec_, tm_, spec_.names.final_norm, H, dev_);
  const MoeDims m = moe_dims(spec_, config_, 1);
  if (m.experts > 0) {  // T = 1: the *_full buffers are the shards themselves
    const int64_t P = n_ * m.top_k;
    moe_.logits = f32({n_, m.experts}, dev_);
    moe_.ids = Tensor::empty({n_, m.top_k}, DType::I32, dev_);
    moe_.weights = f32({n_, m.top_k}, dev_);
    moe_.g.offsets = Tensor::empty({m.experts + 1}, DType::I32, dev_);
    moe_.g.active = Tensor::empty({m.experts + 1}, DType::I32, dev_);
    moe_.g.perm = Tensor::empty({P}, DType::I32, dev_);
    moe_.g.inv = Tensor::empty({P}, DType::I32, dev_);
    moe_.eg = moe_.eg_full = f32({P, m.expert_full}, dev_);
    moe_.eu = f32({P, m.expert_full}, dev_);
    moe_.eo = f32({P, H}, dev_);
    if (m.shared_full > 0) {
      moe_.sg = moe_.sg_full = f32({n_, m.shared_full}, dev_);
      moe_.su = f32({n_, m.shared_full}, dev_);
      moe_.so = f32({n_, H}, dev_);
      moe_.sgate = f32({n_, 1}, dev_);
    }
  }
}

Calibration::~Calibration() = default;

std::vector<CalibLinear> Calibration::linears(int64_t li) const {
  EXL2_CHECK(li >= 0 && li < config_.num_hidden_layers, "calibration: layer ", li, " is not in [0, ",
             config_.num_hidden_layers, ")");
  using Slot = ModuleTensor::Slot;
  std::vector<CalibLinear> out;
  // The body's input groups: q/k/v read the attention norm's x; gate/up, the router and the shared expert's gate,
  // up and gate logit the MLP's; expert e's gate and up its routed rows of it; every other linear its own input.
  std::map<int64_t, std::string> first;
  constexpr int64_t kExpertIn = 1 << 20, kExpertDownIn = 2 << 20;  // + e: above every dense group
  auto add = [&](const ModuleTensor& t, const std::string& name, int64_t group) {
    const std::string input = first.emplace(group, name).first->second;
    const bool quantized = t.slot != Slot::Router && t.slot != Slot::SharedScale;
    out.push_back({name, role_of(t.slot), input, t.in, t.out, t.bias, quantized});
  };
  for (const ModuleTensor& t : layer_tensors(spec_, config_, li)) {
    if (!t.linear() || (!out.empty() && out.back().name == t.name)) continue;  // a fused tensor once
    if (t.expert()) {
      for (int64_t e = 0; e < t.experts; ++e)
        add(t, t.expert_prefix(e), (t.slot == Slot::ExpertDown ? kExpertDownIn : kExpertIn) + e);
      continue;
    }
    const bool mlp_in = t.slot == Slot::Gate || t.slot == Slot::Up || t.slot == Slot::Router ||
                        t.slot == Slot::SharedGate || t.slot == Slot::SharedUp || t.slot == Slot::SharedScale;
    add(t, t.name, t.slot <= Slot::V ? 0 : mlp_in ? 1 : 2 + static_cast<int64_t>(t.slot));
  }
  return out;
}

void Calibration::embed(const Tensor& ids) {
  EXL2_CHECK(ids.defined() && ids.dtype() == DType::I32 && ids.numel() == n_, "calibration: ids must be i32 [",
             rows_, ", ", tokens_, "], got ", ids.defined() ? ids.describe() : std::string("undefined"));
  Tensor h = f32({n_, config_.hidden_size}, Device::cpu());
  embed_tokens(spec_, ids.to(Device::cpu()).view({n_}), tm_.get(spec_.names.embed), h);  // a row gather: host
  x_.copy_from(h);
}

void Calibration::set_states(const Tensor& x) {
  EXL2_CHECK(x.defined() && x.dtype() == DType::F32 && x.numel() == n_ * config_.hidden_size,
             "calibration: states must be f32 [", rows_, " * ", tokens_, ", ", config_.hidden_size, "], got ",
             x.defined() ? x.describe() : std::string("undefined"));
  x_.copy_from(x.view({n_, config_.hidden_size}));
}

Tensor Calibration::states() const { return x_.to(Device::cpu()); }
Tensor Calibration::output() const { return y_.to(Device::cpu()); }

Tensor Calibration::head_input() const {
  Tensor out = f32({n_, config_.hidden_size}, dev_);
  apply_norm(spec_.norm, x_, final_norm_, out);
  return out.to(Device::cpu());
}

void Calibration::set_head_ref(const Tensor& head) {
  const int64_t H = config_.hidden_size;
  EXL2_CHECK(head.defined() && head.dim() == 2 && head.size(1) == H && head.size(0) > 0 && dtype_is_float(head.dtype()),
             "calibration: head must be a float [vocab, ", H, "] matrix, got ",
             head.defined() ? head.describe() : std::string("undefined"));
  const Tensor h = head.device().is_cpu() ? head : head.to(Device::cpu());
  head_ = h.to_dtype(DType::F32).to(dev_);
  head_ref_ = f32({n_, H}, dev_);
  apply_norm(spec_.norm, x_, final_norm_, head_ref_);
}

double Calibration::head_kl(int64_t block) const {
  EXL2_CHECK(head_.defined(), "calibration: head_kl needs set_head_ref first");
  EXL2_CHECK(block >= 0, "calibration: head_kl's block must be >= 0 (0: automatic), got ", block);
  constexpr int64_t kBlockBytes = int64_t(256) << 20;  // z and d of one block of positions
  const int64_t H = config_.hidden_size, V = head_.size(0);
  const int64_t c = std::max<int64_t>(1, std::min<int64_t>(n_, block > 0 ? block : kBlockBytes / (8 * V)));
  Tensor dx = f32({n_, H}, dev_), neg = f32({c, H}, dev_), z = f32({c, V}, dev_), d = f32({c, V}, dev_);
  Tensor kl = f32({n_}, dev_);
  apply_norm(spec_.norm, x_, final_norm_, dx);
  for (int64_t a = 0; a < n_; a += c) {
    const int64_t len = std::min(c, n_ - a);
    Tensor ref = head_ref_.slice(a, a + len), x = dx.slice(a, a + len), ng = neg.slice(0, len);
    Tensor zs = z.slice(0, len), ds = d.slice(0, len), ks = kl.slice(a, a + len);
    ops::scale(ref, -1.0f, 0.0f, ng);
    ops::add(x, ng, x);  // h - ref, exactly as the f32 subtraction rounds it
    ops::matmul_nt(ref, head_, Tensor(), zs);
    ops::matmul_nt(x, head_, Tensor(), ds);
    ops::logit_kl(zs, ds, ks);
  }
  const Tensor host = kl.to(Device::cpu());
  double tot = 0.0;
  for (int64_t i = 0; i < n_; ++i) tot += host.data_as<float>()[i];
  return tot / static_cast<double>(n_);
}

Tensor Calibration::file_rows(int64_t li, const ModuleTensor& t, const Tensor& w) const {
  using Slot = ModuleTensor::Slot;
  const Tensor src = w.device().is_cpu() ? w : w.to(Device::cpu());
  EXL2_CHECK(src.dim() == 2 && src.size(0) == t.out && src.size(1) == t.in, "calibration: weight of ", t.name,
             " must be [", t.out, ", ", t.in, "], got ", src.describe());
  const int64_t hd = config_.head_dim, rot = spec_.ropes[static_cast<size_t>(spec_.layers[li].rope)].rotary_dim;
  const bool perm = (spec_.rope_interleaved || (rot > 0 && rot < hd)) && (t.slot == Slot::Q || t.slot == Slot::K);
  if (!perm) return src.slice(t.begin, t.begin + t.width).to_dtype(DType::F32).to(dev_);
  const Tensor f = src.to_dtype(DType::F32);
  Tensor out = f32({t.width, t.in}, Device::cpu());
  for (int64_t r = 0; r < t.width; ++r)
    std::memcpy(out.data_as<float>() + r * t.in,
                f.data_as<float>() + (rope_source_row(r, hd, rot > 0 ? rot : hd, spec_.rope_interleaved) + t.begin) * t.in,
                static_cast<size_t>(t.in) * 4);
  return out.to(dev_);
}

void Calibration::load_layer(int64_t li) {
  EXL2_CHECK(li >= 0 && li < config_.num_hidden_layers, "calibration: layer ", li, " is not in [0, ",
             config_.num_hidden_layers, ")");
  body_.reset();
  prog_.clear();
  ends_.clear();
  parts_.clear();
  part_of_.clear();
  layers_.clear();
  // The norms as the graph loads them; the file's linears (CPU views) replaced by fp32 capture linears.
  DecoderLayer L = load_layer_modules(li);
  layers_.push_back(std::move(L));
  li_ = li;
  spec1_ = spec_;
  spec1_.layers = {spec_.layers[li]};
  body_ = std::make_unique<DecoderBody>(spec1_, config1_, 1, shared_);
  body_->layer(prog_, 0, true, &ends_);
}

DecoderLayer Calibration::load_layer_modules(int64_t li) {
  using Slot = ModuleTensor::Slot;
  DecoderLayer L = exl2::load_layer(spec_, config_, tm_, li, Device::cpu());
  for (Tensor* t : {&L.attn_norm, &L.attn_post_norm, &L.mlp_norm, &L.mlp_post_norm, &L.q_norm, &L.k_norm})
    if (t->defined()) *t = t->to(dev_);
  for (const ModuleTensor& t : layer_tensors(spec_, config_, li)) {
    if (!t.linear()) continue;
    if (t.expert()) {  // fp32 capture linears behind MoeExperts' per-expert path
      std::vector<std::unique_ptr<Linear>> lins;
      for (int64_t e = 0; e < t.experts; ++e) {
        const std::string name = t.expert_prefix(e);
        auto lin = std::make_unique<CaptureLinear>(name, file_rows(li, t, tm_.get(name + ".weight")), Tensor());
        parts_[name].push_back(lin.get());
        part_of_[lin.get()] = t;
        lins.push_back(std::move(lin));
      }
      auto ex = MoeExperts::from_linears(std::move(lins), dev_);
      (t.slot == Slot::ExpertGate ? L.expert_gate : t.slot == Slot::ExpertUp ? L.expert_up : L.expert_down) =
          std::move(ex);
      continue;
    }
    const Tensor w = file_rows(li, t, tm_.get(t.name + ".weight"));
    Tensor b;
    if (t.bias) {
      EXL2_CHECK_KIND(Unsupported, !(spec_.rope_interleaved && (t.slot == Slot::Q || t.slot == Slot::K)), t.name,
                      ": q/k biases with interleaved RoPE are not supported by the converter");  // reordered rows
      b = tm_.get(t.name + ".bias").slice(t.begin, t.begin + t.width).to_dtype(DType::F32).to(dev_);
    }
    auto lin = std::make_unique<CaptureLinear>(t.name, w, b);
    parts_[t.name].push_back(lin.get());
    part_of_[lin.get()] = t;
    linear_slot(L, t.slot) = std::move(lin);
  }
  return L;
}

std::vector<CaptureLinear*>& Calibration::parts(const std::string& name) {
  auto it = parts_.find(name);
  EXL2_CHECK(it != parts_.end(), "calibration: layer ", li_, " has no linear '", name, "'");
  return it->second;
}

void Calibration::set_weight(const std::string& name, const Tensor& w) {
  for (CaptureLinear* p : parts(name)) p->set_weight(file_rows(li_, part_of_.at(p), w));
}

void Calibration::reset_weight(const std::string& name) {
  for (CaptureLinear* p : parts(name)) p->set_weight(file_rows(li_, part_of_.at(p), tm_.get(name + ".weight")));
}

void Calibration::run(int64_t block, const CaptureHook& hook) {
  EXL2_CHECK(body_, "calibration: load_layer first");
  EXL2_CHECK(block >= 0 && block < n_blocks(), "calibration: block ", block, " is not in [0, ", n_blocks(), ")");
  std::vector<CaptureLinear*> lins;
  for (auto& kv : parts_) lins.insert(lins.end(), kv.second.begin(), kv.second.end());
  HookScope scope(lins, &hook);
#ifdef EXL2_WITH_CUDA
  std::unique_ptr<cuda::ScopedDevice> on;  // kernels launch on the current device
  if (dev_.is_cuda()) on = std::make_unique<cuda::ScopedDevice>(dev_.index);
#endif
  y_.copy_from(x_);
  RankRun R;
  R.layers = &layers_;
  R.ropes = &ropes_;
  R.b = StepBufs{y_, xb_, q_, k_, v_, attn_, gate_, up_, attn_, gate_, xb_};
  if (moe_.logits.defined()) attach_moe(R.b, moe_);
  R.pos = pos_;
  R.seq = seq_;
  R.pages = pages_;
  const size_t begin = block == 0 ? 0 : ends_[block - 1];
  for (size_t p = begin; p < ends_[block]; ++p) prog_[p].fn(R);
}

std::vector<double> Calibration::row_sums(const Tensor& a, const Tensor& b) const {
  const int64_t cols = tokens_ * config_.hidden_size, cnt = rows_ * kSqdiffParts;
  std::vector<double> part(static_cast<size_t>(cnt));
  if (dev_.is_cpu()) {
    cpu::gptq_sqdiff(a.data_as<float>(), b.defined() ? b.data_as<float>() : nullptr, rows_, cols, kSqdiffParts,
                     part.data());
  } else {
#ifdef EXL2_WITH_CUDA
    Tensor pd = Tensor::empty({2 * cnt}, DType::F32, dev_);  // fp64 as f32 pairs (Tensor has no f64)
    cuda::gptq_sqdiff(a.data_as<float>(), b.defined() ? b.data_as<float>() : nullptr, rows_, cols, kSqdiffParts,
                      static_cast<double*>(pd.data()));
    device::copy(part.data(), Device::cpu(), pd.data(), dev_, static_cast<size_t>(cnt) * sizeof(double));
#else
    EXL2_FAIL(Unsupported, "calibration: device ", dev_.str(), " needs a build with the CUDA backend");
#endif
  }
  std::vector<double> sums(static_cast<size_t>(rows_), 0.0);
  for (int64_t r = 0; r < rows_; ++r)
    for (int64_t p = 0; p < kSqdiffParts; ++p) sums[r] += part[r * kSqdiffParts + p];
  return sums;
}

void Calibration::set_ref() {
  if (!ref_.defined()) ref_ = f32({n_, config_.hidden_size}, dev_);
  ref_.copy_from(y_);
  den_ = row_sums(ref_, Tensor());
}

double Calibration::rel_err() const {
  EXL2_CHECK(ref_.defined() && !den_.empty(), "calibration: rel_err needs set_ref first");
  const std::vector<double> num = row_sums(y_, ref_);
  double s = 0.0;
  for (int64_t r = 0; r < rows_; ++r) s += std::sqrt(num[r]) / std::max(std::sqrt(den_[r]), 1e-30);
  return s / static_cast<double>(rows_);
}

void Calibration::commit(bool from_ref) {
  EXL2_CHECK(!from_ref || ref_.defined(), "calibration: commit(from_ref) needs set_ref first");
  x_.copy_from(from_ref ? ref_ : y_);
}

Tensor Calibration::hessian(const Tensor& x) const {
  EXL2_CHECK(x.defined() && x.dtype() == DType::F32 && x.dim() == 2 && x.device() == dev_,
             "calibration: hessian needs f32 [m, in] on ", dev_.str(), ", got ",
             x.defined() ? x.describe() : std::string("undefined"));
  const int64_t in = x.size(1);
  Tensor h = f32({in, in}, Device::cpu());
  if (dev_.is_cpu()) {
    cpu::gptq_hessian(x.data_as<float>(), x.size(0), in, h.data_as<float>(), false);
    return h;
  }
#ifdef EXL2_WITH_CUDA
  Tensor hd = f32({in, in}, dev_);
  cuda::gptq_hessian(x.data_as<float>(), x.size(0), in, hd.data_as<float>(), false);
  h.copy_from(hd);
  return h;
#else
  EXL2_FAIL(Unsupported, "calibration: device ", dev_.str(), " needs a build with the CUDA backend");
#endif
}

void Calibration::sync() const {
  if (dev_.is_cuda()) device::cuda_synchronize(dev_.index);
}

}  // namespace exl2
