// Model::load's checks on sizes, RoPE parameters and the checkpoint's layers (see load_checks.h).
#include "model/load_checks.h"

#include <cmath>

#include "core/checked.h"
#include "model/rope.h"

namespace exl2 {

namespace {

// The decoder layer index of "<prefix><i>.<rest>" (prefix "model.layers."), or -1 for other names (and for indices past 2^62, which no
// config can have).
int64_t layer_index(const std::string& name, const std::string& prefix) {
  const size_t n = prefix.size();
  if (name.compare(0, n, prefix) != 0) return -1;
  int64_t i = 0;
  size_t k = n;
  for (; k < name.size() && name[k] >= '0' && name[k] <= '9'; ++k) {
    if (i > (int64_t(1) << 62) / 10) return -1;
    i = i * 10 + (name[k] - '0');
  }
  return (k > n && k < name.size() && name[k] == '.') ? i : -1;
}

// Up to `max` names joined with ", " (and how many more).
std::string name_list(const std::vector<std::string>& names, size_t max = 8) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < max; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > max) out += str_cat(" and ", names.size() - max, " more");
  return out;
}

}  // namespace

void check_max_seq_len(const ModelConfig& c, int64_t max_seq_len, bool from_config, const std::string& source) {
  if (from_config) {
    EXL2_CHECK(max_seq_len > 0 && max_seq_len <= kMaxSeqLen, source, ": max_position_embeddings ", max_seq_len,
               " is larger than ", kMaxSeqLen, " (positions are 32-bit); load with an explicit max_seq_len");
  } else {
    EXL2_CHECK(max_seq_len > 0 && max_seq_len <= kMaxSeqLen, "max_seq_len ", max_seq_len, " is larger than ",
               kMaxSeqLen, " (positions are 32-bit); load with a smaller max_seq_len");
  }
  const int64_t table = checked_mul(ErrorKind::OutOfMemory, {max_seq_len, c.head_dim, 4},
                                    "the RoPE table of max_seq_len ", max_seq_len, " x head_dim ", c.head_dim, " floats");
  check_host_fits(static_cast<size_t>(table),
                  str_cat("the RoPE table for max_seq_len ", max_seq_len, " (", max_seq_len, " x head_dim ", c.head_dim,
                          " x 4 bytes)"),
                  "; load with a smaller max_seq_len");
}

void check_rope(const ModelConfig& c, int64_t max_seq_len, const std::string& source) {
  double factor = 1.0;
  const std::vector<double> inv = rope_inv_freq(c, max_seq_len, &factor);
  const char* key = c.raw.find("rope_parameters") && !c.raw.find("rope_parameters")->is_null() ? "rope_parameters"
                                                                                                 : "rope_scaling";
  for (size_t i = 0; i < inv.size(); ++i) {
    // The table holds f32 angles pos * inv_freq: an inverse frequency must be finite as a float (one that rounds to
    // 0 is a dimension without rotation, as a huge rope_theta gives).
    const float f = static_cast<float>(inv[i]);
    EXL2_CHECK_KIND(ModelFormat, std::isfinite(f) && f >= 0, source, ": rope_theta ", c.rope_theta, " with '", key,
                    "' (", rope_type_name(c.rope_scaling.type), ", factor ", c.rope_scaling.factor,
                    ") gives RoPE inverse frequency ", inv[i], " at dimension ", 2 * i,
                    "; it must be finite and not negative: check these values");
  }
}

void check_layers(const ModelConfig& c, const TensorMap& tensors, const std::string& source, bool extra_layers_ok,
                  const std::string& prefix) {
  int64_t n_ckpt = 0;
  for (const std::string& name : tensors.names()) {
    const int64_t li = layer_index(name, prefix);
    if (li >= n_ckpt) n_ckpt = li + 1;
  }
  const int64_t n = c.num_hidden_layers;
  EXL2_CHECK_KIND(ModelFormat, n <= n_ckpt, source, ": num_hidden_layers is ", n, " but ", tensors.source(), " holds ",
                  n_ckpt, " layers (", prefix, "0 to ", prefix, n_ckpt - 1,
                  "); fix num_hidden_layers or download the complete model");
  if (n < n_ckpt && !extra_layers_ok) {
    std::vector<std::string> left;
    for (const std::string& name : tensors.names())
      if (layer_index(name, prefix) >= n) left.push_back(name);
    EXL2_FAIL(ModelFormat, source, ": num_hidden_layers is ", n, " but ", tensors.source(), " holds ", n_ckpt,
              " layers; their tensors would be left unread: ", name_list(left),
              ". Set num_hidden_layers to ", n_ckpt, " (or remove those layers from the checkpoint)");
  }
}

}  // namespace exl2
