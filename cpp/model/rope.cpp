// RoPE inverse frequencies and cos/sin tables (see rope.h); formulas follow HF transformers' modeling_rope_utils.
#include "model/rope.h"

#include <algorithm>
#include <cmath>

namespace exl2 {

std::vector<double> rope_inv_freq(int64_t head_dim, int64_t max_position_embeddings, double theta,
                                  const RopeScaling& rs, int64_t max_pos, double* attention_factor) {
  const int64_t dim = head_dim;
  const int64_t half = dim / 2;
  double base = theta;
  *attention_factor = 1.0;
  const int64_t orig = rs.original_max_position_embeddings > 0 ? rs.original_max_position_embeddings
                                                               : max_position_embeddings;
  if (rs.type == RopeType::Dynamic && max_pos > orig) {
    const double seq = static_cast<double>(max_pos);
    base = base * std::pow(rs.factor * seq / orig - (rs.factor - 1.0), double(dim) / double(dim - 2));
  }
  std::vector<double> inv(half);
  for (int64_t i = 0; i < half; ++i) inv[i] = 1.0 / std::pow(base, double(2 * i) / double(dim));

  switch (rs.type) {
    case RopeType::Default:
    case RopeType::Dynamic:
      break;
    case RopeType::Linear:
      for (double& f : inv) f /= rs.factor;
      break;
    case RopeType::Longrope: {  // HF picks the long factors once the sequence passes the original context
      const std::vector<double>& ext = max_pos > orig ? rs.long_factor : rs.short_factor;
      for (int64_t i = 0; i < half; ++i) inv[i] /= ext[static_cast<size_t>(i)];
      *attention_factor = rs.attention_factor;
      break;
    }
    case RopeType::Llama3: {
      const double old_ctx = static_cast<double>(orig);
      const double low_wl = old_ctx / rs.low_freq_factor;
      const double high_wl = old_ctx / rs.high_freq_factor;
      for (double& f : inv) {
        const double wl = 2.0 * M_PI / f;
        if (wl > low_wl) {
          f = f / rs.factor;
        } else if (wl >= high_wl) {  // medium band: smooth interpolation
          const double smooth = (old_ctx / wl - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
          f = (1.0 - smooth) * f / rs.factor + smooth * f;
        }
      }
      break;
    }
    case RopeType::Yarn: {
      auto get_mscale = [](double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
      if (rs.attention_factor > 0) {
        *attention_factor = rs.attention_factor;
      } else if (rs.mscale != 0 && rs.mscale_all_dim != 0) {
        *attention_factor = get_mscale(rs.factor, rs.mscale) / get_mscale(rs.factor, rs.mscale_all_dim);
      } else {
        *attention_factor = get_mscale(rs.factor, 1.0);
      }
      auto corr_dim = [&](double rot) {
        return (dim * std::log(double(orig) / (rot * 2.0 * M_PI))) / (2.0 * std::log(base));
      };
      double low = corr_dim(rs.beta_fast), high = corr_dim(rs.beta_slow);
      if (rs.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, double(dim - 1));
      if (low == high) high += 0.001;
      for (int64_t i = 0; i < half; ++i) {
        const double pos_freq = std::pow(base, double(2 * i) / double(dim));
        const double extra = 1.0 / pos_freq, inter = 1.0 / (rs.factor * pos_freq);
        const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
        const double extra_factor = 1.0 - ramp;
        inv[i] = inter * (1.0 - extra_factor) + extra * extra_factor;
      }
      break;
    }
  }
  return inv;
}

Tensor build_rope_table(int64_t head_dim, int64_t max_position_embeddings, double theta, const RopeScaling& rs,
                        int64_t max_pos, int64_t rotary_dim) {
  double factor = 1.0;
  const int64_t rot = rotary_dim > 0 ? rotary_dim : head_dim;
  const std::vector<double> inv = rope_inv_freq(rot, max_position_embeddings, theta, rs, max_pos, &factor);
  const int64_t dim = head_dim, half = dim / 2;
  Tensor t = Tensor::empty({max_pos, dim}, DType::F32);
  float* p = t.data_as<float>();
  for (int64_t pos = 0; pos < max_pos; ++pos) {
    for (int64_t i = rot / 2; i < half; ++i) {  // channels RoPE passes through: no rotation, no attention factor
      p[pos * dim + i] = 1.0f;
      p[pos * dim + half + i] = 0.0f;
    }
    for (int64_t i = 0; i < rot / 2; ++i) {
      // HF forms pos * inv_freq in fp32 before cos/sin; at long contexts that rounding matters more than
      // the double product, so match it.
      const float angle = static_cast<float>(pos) * static_cast<float>(inv[i]);
      p[pos * dim + i] = static_cast<float>(std::cos(double(angle)) * factor);
      p[pos * dim + half + i] = static_cast<float>(std::sin(double(angle)) * factor);
    }
  }
  return t;
}

std::vector<double> rope_inv_freq(const ModelConfig& c, int64_t max_pos, double* attention_factor) {
  return rope_inv_freq(c.rotary_dim(), c.max_position_embeddings, c.rope_theta, c.rope_scaling, max_pos,
                       attention_factor);
}

Tensor build_rope_table(const ModelConfig& c, int64_t max_pos) {
  return build_rope_table(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, max_pos,
                          c.rotary_dim());
}

}  // namespace exl2
