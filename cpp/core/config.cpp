// ModelConfig: strict reading of config.json (both the rope_scaling layout and transformers>=5 rope_parameters).
#include "exl2/config.h"

#include <cmath>
#include <filesystem>

#include "exl2/errors.h"

namespace exl2 {

const char* rope_type_name(RopeType t) {
  switch (t) {
    case RopeType::Default:
      return "default";
    case RopeType::Linear:
      return "linear";
    case RopeType::Dynamic:
      return "dynamic";
    case RopeType::Llama3:
      return "llama3";
    case RopeType::Yarn:
      return "yarn";
    case RopeType::Longrope:
      return "longrope";
  }
  return "?";
}

namespace {

// Typed lookups over one JSON object, each error naming the source file and the key.
class Reader {
 public:
  Reader(const Json& obj, std::string source, std::string prefix = "")
      : obj_(obj), source_(std::move(source)), prefix_(std::move(prefix)) {}

  // The value, or nullptr when the key is absent or null.
  const Json* get(const std::string& key) const {
    const Json* v = obj_.find(key);
    return (v && !v->is_null()) ? v : nullptr;
  }

  [[noreturn]] void bad(const std::string& key, const std::string& want, const Json& got) const {
    std::string g = got.dump();
    if (g.size() > 60) g = g.substr(0, 57) + "...";
    EXL2_FAIL(ModelFormat, source_, ": key '", prefix_, key, "' must be ", want, ", got ", g);
  }
  [[noreturn]] void missing(const std::string& key, const std::string& want) const {
    EXL2_FAIL(ModelFormat, source_, ": missing required key '", prefix_, key, "' (", want, ")");
  }

  int64_t pos_int(const std::string& key, bool required, int64_t def = 0) const {
    const Json* v = get(key);
    if (!v) {
      if (required) missing(key, "a positive integer");
      return def;
    }
    if (!v->is_integer() || v->as_int() <= 0) bad(key, "a positive integer", *v);
    return v->as_int();
  }

  // A model dimension: a positive integer of at most 2^31 - 1 (token ids, positions and page ids are 32-bit, and
  // products of two dimensions must fit 64 bits).
  int64_t dim(const std::string& key, bool required, int64_t def = 0) const {
    const int64_t d = pos_int(key, required, def);
    if (d > kMaxDim) bad(key, str_cat("a positive integer of at most ", kMaxDim), *get(key));
    return d;
  }
  static constexpr int64_t kMaxDim = 2147483647;

  int64_t nonneg_int(const std::string& key, int64_t def) const {
    const Json* v = get(key);
    if (!v) return def;
    if (!v->is_integer() || v->as_int() < 0) bad(key, "a non-negative integer", *v);
    return v->as_int();
  }

  double pos_number(const std::string& key, bool required, double def) const {
    const Json* v = get(key);
    if (!v) {
      if (required) missing(key, "a positive number");
      return def;
    }
    if (!v->is_number() || !(v->as_double() > 0) || !std::isfinite(v->as_double())) bad(key, "a positive number", *v);
    return v->as_double();
  }

  double number(const std::string& key, double def) const {
    const Json* v = get(key);
    if (!v) return def;
    if (!v->is_number() || !std::isfinite(v->as_double())) bad(key, "a number", *v);
    return v->as_double();
  }

  bool boolean(const std::string& key, bool def) const {
    const Json* v = get(key);
    if (!v) return def;
    if (!v->is_bool()) bad(key, "true or false", *v);
    return v->as_bool();
  }

  std::string string(const std::string& key, const std::string& def) const {
    const Json* v = get(key);
    if (!v) return def;
    if (!v->is_string()) bad(key, "a string", *v);
    return v->as_string();
  }

  // int, list of ints, or absent/null (empty).
  std::vector<int64_t> token_ids(const std::string& key) const {
    std::vector<int64_t> out;
    const Json* v = get(key);
    if (!v) return out;
    if (v->is_integer() && v->as_int() >= 0) {
      out.push_back(v->as_int());
      return out;
    }
    if (v->is_array()) {
      for (const Json& e : v->as_array()) {
        if (!e.is_integer() || e.as_int() < 0) bad(key, "a token id, a list of token ids or null", *v);
        out.push_back(e.as_int());
      }
      return out;
    }
    bad(key, "a token id, a list of token ids or null", *v);
  }

 const std::string& source() const { return source_; }
  const std::string& prefix() const { return prefix_; }

 private:
  const Json& obj_;
  std::string source_;
  std::string prefix_;
};

// HF transformers' yarn get_mscale (modeling_rope_utils._compute_yarn_parameters).
double yarn_get_mscale(double scale, double mscale) {
  return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// inv_freq[i] = theta^(-2i/head_dim) must fall from 1: theta <= 1 gives no rotation or frequencies that overflow.
double read_theta(const Reader& from, double def) {
  const double t = from.pos_number("rope_theta", false, def);
  if (!(t > 1)) from.bad("rope_theta", "a number greater than 1", *from.get("rope_theta"));
  return t;
}

void read_rope_entry(const Reader& top, const Reader& r, const std::string& key, const ModelConfig& c, double& theta,
                     RopeScaling& s);

// partial_rotary_factor of `from` (def when absent): the part of each head RoPE rotates, an even channel count.
double read_partial_rotary(const Reader& from, int64_t head_dim, double def) {
  const Json* v = from.get("partial_rotary_factor");
  if (!v) return def;
  const double f = from.number("partial_rotary_factor", def);
  if (!(f > 0 && f <= 1) || static_cast<int64_t>(static_cast<double>(head_dim) * f) % 2 != 0)
    from.bad("partial_rotary_factor", "a number in (0, 1] giving an even number of rotated channels", *v);
  return f;
}

// Reads the rope parameters as transformers' standardize_rope_params + _compute_*_parameters see them: one entry,
// or (rope_parameters keyed by layer type) one per layer type into c.layer_type_ropes.
void read_rope(const Reader& top, const std::string& source, ModelConfig& c) {
  const Json* rp = top.get("rope_parameters");
  std::string key = "rope_parameters";
  if (!rp) {
    rp = top.get("rope_scaling");
    key = "rope_scaling";
  }
  c.rope_theta = read_theta(top, 10000.0);
  c.rope_scaling = RopeScaling{};
  // transformers moves a top-level partial_rotary_factor into the rope dict unless the dict has its own.
  c.partial_rotary_factor = read_partial_rotary(top, c.head_dim, 1.0);
  if (!rp) return;
  if (!rp->is_object()) top.bad(key, "an object or null", *rp);
  if (!rp->contains("rope_type") && !rp->contains("type")) {
    bool nested = rp->size() > 0;
    for (const auto& kv : rp->as_object()) nested = nested && (kv.second.is_object() || kv.second.is_null());
    if (nested) {
      const double theta = c.rope_theta;
      for (const auto& kv : rp->as_object()) {
        if (kv.second.is_null()) continue;
        LayerTypeRope e{kv.first, theta, RopeScaling{}};
        const std::string sub = key + "." + kv.first;
        const Reader r(kv.second, source, top.prefix() + sub + ".");
        if (read_partial_rotary(r, c.head_dim, 1.0) != 1.0)
          EXL2_FAIL(Unsupported, source, ": ", sub, ".partial_rotary_factor (RoPE over part of each head per layer ",
                    "type) is not supported");
        read_rope_entry(top, r, sub, c, e.theta, e.scaling);
        if (kv.first == "full_attention") {
          c.rope_theta = e.theta;
          c.rope_scaling = e.scaling;
        }
        c.layer_type_ropes.push_back(e);
      }
      return;
    }
  }
  const Reader r(*rp, source, top.prefix() + key + ".");
  c.partial_rotary_factor = read_partial_rotary(r, c.head_dim, c.partial_rotary_factor);
  read_rope_entry(top, r, key, c, c.rope_theta, c.rope_scaling);
}

// One rope section (r, named key): theta (default: the caller's) and the scaling.
void read_rope_entry(const Reader& top, const Reader& r, const std::string& key, const ModelConfig& c, double& theta,
                     RopeScaling& s) {
  const std::string& source = r.source();
  theta = read_theta(r, theta);
  std::string type = r.string("rope_type", r.string("type", "default"));
  s = RopeScaling{};
  if (type == "default")
    s.type = RopeType::Default;
  else if (type == "linear")
    s.type = RopeType::Linear;
  else if (type == "dynamic")
    s.type = RopeType::Dynamic;
  else if (type == "llama3")
    s.type = RopeType::Llama3;
  else if (type == "longrope" || type == "su" || (type == "yarn" && c.model_type == "phi3"))
    s.type = RopeType::Longrope;  // transformers' Phi-3 config reads its older "su" and "yarn" as longrope
  else if (type == "yarn")
    s.type = RopeType::Yarn;
  else
    EXL2_FAIL(Unsupported, source, ": rope type '", type, "' (", key,
              ") is not supported; exl2cpp supports default, linear, dynamic, llama3, yarn and longrope");

  if (s.type == RopeType::Default) return;

  // original_max_position_embeddings: a top-level value wins (as transformers does for Phi-3), then the
  // rope dict's, then max_position_embeddings. Dynamic NTK always scales against max_position_embeddings.
  int64_t orig = top.pos_int("original_max_position_embeddings", false, 0);
  if (!orig) orig = r.pos_int("original_max_position_embeddings", false, c.max_position_embeddings);
  s.original_max_position_embeddings = s.type == RopeType::Dynamic ? c.max_position_embeddings : orig;

  if ((s.type == RopeType::Yarn || s.type == RopeType::Longrope) && !r.get("factor")) {
    s.factor = static_cast<double>(c.max_position_embeddings) / static_cast<double>(orig);
  } else {
    s.factor = r.pos_number("factor", true, 1.0);
  }

  if (s.type == RopeType::Llama3) {
    s.low_freq_factor = r.pos_number("low_freq_factor", true, 1.0);
    s.high_freq_factor = r.pos_number("high_freq_factor", true, 4.0);
    if (!(s.high_freq_factor > s.low_freq_factor))
      EXL2_FAIL(ModelFormat, source, ": ", key, ".high_freq_factor (", s.high_freq_factor,
                ") must be greater than low_freq_factor (", s.low_freq_factor, ")");
  }
  if (s.type == RopeType::Longrope) {
    const int64_t half = c.rotary_dim() / 2;
    for (const char* name : {"short_factor", "long_factor"}) {
      const Json* v = r.get(name);
      if (!v) r.missing(name, str_cat("a list of ", half, " positive numbers"));
      if (!v->is_array() || static_cast<int64_t>(v->size()) != half)
        r.bad(name, str_cat("a list of rotary dims / 2 = ", half, " positive numbers"), *v);
      std::vector<double>& f = std::string(name) == "short_factor" ? s.short_factor : s.long_factor;
      for (const Json& e : v->as_array()) {
        if (!e.is_number() || !(e.as_double() > 0) || !std::isfinite(e.as_double()))
          r.bad(name, str_cat("a list of rotary dims / 2 = ", half, " positive numbers"), *v);
        f.push_back(e.as_double());
      }
    }
    // transformers' _compute_longrope_parameters: sqrt(1 + ln(factor) / ln(original context)) unless given.
    const Json* af = r.get("attention_factor");
    if (af) {
      s.attention_factor = r.number("attention_factor", 0.0);
      if (!(s.attention_factor > 0 && s.attention_factor <= 65504.0))
        r.bad("attention_factor", "a positive number of at most 65504", *af);
    } else {
      s.attention_factor =
          s.factor <= 1.0 ? 1.0 : std::sqrt(1.0 + std::log(s.factor) / std::log(static_cast<double>(orig)));
    }
  }
  if (s.type == RopeType::Yarn) {
    // transformers: `get("beta_fast") or 32`, `get("beta_slow") or 1` (0 counts as absent).
    s.beta_fast = r.number("beta_fast", 32.0);
    if (s.beta_fast == 0) s.beta_fast = 32.0;
    s.beta_slow = r.number("beta_slow", 1.0);
    if (s.beta_slow == 0) s.beta_slow = 1.0;
    // They are rotation counts: the correction dims take log(original_max_position_embeddings / (2 pi beta)).
    if (!(s.beta_fast > 0)) r.bad("beta_fast", "a positive number (rotations)", *r.get("beta_fast"));
    if (!(s.beta_slow > 0)) r.bad("beta_slow", "a positive number (rotations)", *r.get("beta_slow"));
    s.mscale = r.number("mscale", 1.0);
    s.mscale_all_dim = r.number("mscale_all_dim", 0.0);
    s.truncate = r.boolean("truncate", true);
    // The attention factor scales cos/sin, so q and k: past the f16 range every activation after RoPE overflows.
    constexpr double kMaxAttentionFactor = 65504.0;  // largest finite f16
    const Json* af = r.get("attention_factor");
    if (af) {
      s.attention_factor = r.number("attention_factor", 0.0);
      if (!(s.attention_factor > 0 && s.attention_factor <= kMaxAttentionFactor))
        r.bad("attention_factor", "a positive number of at most 65504", *af);
    } else {
      const bool both = r.get("mscale") && r.get("mscale_all_dim") && s.mscale != 0 && s.mscale_all_dim != 0;
      if (both) {
        const double num = yarn_get_mscale(s.factor, s.mscale), den = yarn_get_mscale(s.factor, s.mscale_all_dim);
        s.attention_factor = num / den;
        if (!(den > 0))
          r.bad("mscale_all_dim", str_cat("a value with 0.1 * mscale_all_dim * ln(factor) + 1 > 0 (it is ", den,
                                          " for factor ", s.factor, ")"), *r.get("mscale_all_dim"));
        if (!(s.attention_factor > 0 && s.attention_factor <= kMaxAttentionFactor))
          r.bad("mscale", str_cat("a value giving an attention factor in (0, 65504] (got ", s.attention_factor,
                                  " with mscale_all_dim ", s.mscale_all_dim, ")"), *r.get("mscale"));
      } else {
        s.attention_factor = yarn_get_mscale(s.factor, 1.0);
      }
    }
  }
}

}  // namespace

ModelConfig ModelConfig::from_json(const Json& j, const std::string& source) {
  if (!j.is_object()) EXL2_FAIL(ModelFormat, source, ": expected a JSON object at the top level, got ", j.type_name());
  const Reader top(j, source);
  ModelConfig c;
  const Json* arch = top.get("architectures");
  if (!arch) top.missing("architectures", "a non-empty list of strings such as [\"LlamaForCausalLM\"]");
  if (!arch->is_array() || arch->size() == 0) top.bad("architectures", "a non-empty list of strings", *arch);
  for (const Json& a : arch->as_array())
    if (!a.is_string()) top.bad("architectures", "a non-empty list of strings", *arch);
  c.architecture = arch->as_array()[0].as_string();

  // A multimodal file: the text model's keys under text_config (a top-level hidden_size means a flat file).
  const Json* text = top.get("text_config");
  const bool nested = text && !top.get("hidden_size");
  if (nested && !text->is_object()) top.bad("text_config", "an object", *text);
  const Reader r(nested ? *text : j, source, nested ? "text_config." : "");
  c.raw = nested ? *text : j;
  if (nested) c.outer = j;
  // Keys the top level of a multimodal file holds for the whole model (its own value wins).
  auto whole = [&](const std::string& key) { return nested && top.get(key) ? top : r; };
  c.model_type = r.string("model_type", "");

  c.hidden_size = r.dim("hidden_size", true);
  c.num_hidden_layers = r.dim("num_hidden_layers", true);
  constexpr int64_t kMaxLayers = 65536;  // per-layer tables are sized from it before the checkpoint is read
  if (c.num_hidden_layers > kMaxLayers)
    r.bad("num_hidden_layers", str_cat("a positive integer of at most ", kMaxLayers), *r.get("num_hidden_layers"));
  c.num_attention_heads = r.dim("num_attention_heads", true);
  c.vocab_size = r.dim("vocab_size", true);
  c.intermediate_size = r.dim("intermediate_size", true);
  c.num_key_value_heads = r.dim("num_key_value_heads", false, c.num_attention_heads);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    EXL2_FAIL(ModelFormat, source, ": num_attention_heads (", c.num_attention_heads,
              ") must be a multiple of num_key_value_heads (", c.num_key_value_heads, ")");
  if (r.get("head_dim")) {
    c.head_dim = r.dim("head_dim", false);
  } else {
    if (c.hidden_size % c.num_attention_heads != 0)
      EXL2_FAIL(ModelFormat, source, ": hidden_size (", c.hidden_size, ") is not a multiple of num_attention_heads (",
                c.num_attention_heads, ") and no head_dim is given");
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  c.max_position_embeddings = r.pos_int("max_position_embeddings", false, 2048);
  c.rms_norm_eps = r.pos_number("rms_norm_eps", false, 1e-6);
  c.tie_word_embeddings = whole("tie_word_embeddings").boolean("tie_word_embeddings", false);
  c.attention_bias = r.boolean("attention_bias", false);
  c.mlp_bias = r.boolean("mlp_bias", false);
  c.hidden_act = r.string("hidden_act", "silu");
  // transformers < 5 writes torch_dtype, >= 5 writes dtype.
  const Reader& dt = whole("torch_dtype").get("torch_dtype") ? whole("torch_dtype") : whole("dtype");
  c.torch_dtype = dt.string("torch_dtype", dt.string("dtype", ""));
  c.bos_token_ids = whole("bos_token_id").token_ids("bos_token_id");
  c.eos_token_ids = whole("eos_token_id").token_ids("eos_token_id");
  c.sliding_window = r.nonneg_int("sliding_window", 0);
  if (!r.boolean("use_sliding_window", true)) c.sliding_window = 0;  // Qwen2 writes a window but disables it
  const Reader& qr = whole("quantization_config");
  const Json* q = qr.get("quantization_config");
  if (q) {
    if (!q->is_object()) qr.bad("quantization_config", "an object or null", *q);
    c.quantization_config = *q;
  }
  read_rope(r, source, c);
  return c;
}

ModelConfig ModelConfig::load(const std::string& model_dir) {
  const std::filesystem::path p = std::filesystem::path(model_dir) / "config.json";
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(p, ec);
  if (st.type() == std::filesystem::file_type::not_found)
    EXL2_FAIL(Io, p.string(), ": not found; is ", model_dir, " a model folder (config.json + *.safetensors)?");
  if (ec) EXL2_FAIL(Io, p.string(), ": cannot read (", ec.message(), ")");
  if (!std::filesystem::is_regular_file(st)) EXL2_FAIL(Io, p.string(), ": not a regular file");
  return from_json(Json::parse_file(p.string()), p.string());
}

}  // namespace exl2
