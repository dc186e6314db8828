// Bindings for the engine area (see bindings.h): SamplerSettings, Sampler and sampler_probs (the final distribution,
// for exact tests). Logits cross as 1-D float32 NumPy arrays read in place; sampling runs without the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <string>

#include "bindings/bindings.h"
#include "engine/sampler.h"
#include "exl2/errors.h"

namespace py = pybind11;

namespace exl2 {

namespace {

using LogitsArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

// logit_bias from Python: a {id: bias} dict or a sequence of (id, bias) pairs.
std::vector<std::pair<int32_t, float>> to_bias(const py::object& obj) {
  std::vector<std::pair<int32_t, float>> out;
  if (obj.is_none()) return out;
  if (py::isinstance<py::dict>(obj)) {
    for (auto item : py::reinterpret_borrow<py::dict>(obj))
      out.emplace_back(item.first.cast<int32_t>(), item.second.cast<float>());
    return out;
  }
  return obj.cast<std::vector<std::pair<int32_t, float>>>();
}

// SamplerSettings' keyword fields (logit_bias aside): name -> setter from a Python value (pybind11's casts).
using FieldSetter = void (*)(SamplerSettings&, py::handle);
const std::map<std::string, FieldSetter>& sampler_fields() {
#define EXL2_FIELD(name) \
  {#name, [](SamplerSettings& s, py::handle v) { s.name = v.cast<decltype(SamplerSettings::name)>(); }}
  static const std::map<std::string, FieldSetter> fields = {
      EXL2_FIELD(temperature),         EXL2_FIELD(top_k),
      EXL2_FIELD(top_p),               EXL2_FIELD(min_p),
      EXL2_FIELD(typical),             EXL2_FIELD(repetition_penalty),
      EXL2_FIELD(frequency_penalty),   EXL2_FIELD(presence_penalty),
      EXL2_FIELD(penalty_window),      EXL2_FIELD(banned_tokens),
      EXL2_FIELD(allowed_tokens),      EXL2_FIELD(min_tokens),
      EXL2_FIELD(stop_tokens),         EXL2_FIELD(smoothing_factor),
      EXL2_FIELD(smoothing_curve),     EXL2_FIELD(temperature_last),
      EXL2_FIELD(min_temp),            EXL2_FIELD(max_temp),
      EXL2_FIELD(temp_exponent),       EXL2_FIELD(top_a),
      EXL2_FIELD(tfs),                 EXL2_FIELD(mirostat_mode),
      EXL2_FIELD(mirostat_tau),        EXL2_FIELD(mirostat_eta),
      EXL2_FIELD(xtc_probability),     EXL2_FIELD(xtc_threshold),
      EXL2_FIELD(dry_multiplier),      EXL2_FIELD(dry_base),
      EXL2_FIELD(dry_allowed_length),  EXL2_FIELD(dry_range),
      EXL2_FIELD(dry_sequence_breakers), EXL2_FIELD(seed),
      EXL2_FIELD(top_logprobs),
  };
#undef EXL2_FIELD
  return fields;
}

std::string field_names() {
  std::string out = "logit_bias";
  for (const auto& [name, set] : sampler_fields()) out += ", " + name;
  return out;
}

const float* check_logits(const LogitsArray& logits) {
  EXL2_CHECK(logits.ndim() == 1, "sampler: logits must be a 1-D array [vocab] of float32, got ", logits.ndim(),
             " dimensions; pass one row, e.g. logits[-1]");
  EXL2_CHECK(logits.shape(0) > 0, "sampler: logits is empty; expected [vocab] with vocab > 0");
  return logits.data();
}

}  // namespace

void bind_engine(pybind11::module_& m) {
  py::class_<SamplerSettings>(m, "SamplerSettings",
                              "Per-job sampling settings; see cpp/engine/sampler.h for the pipeline and ranges.")
      .def(py::init([](const py::kwargs& kw) {
             SamplerSettings s;
             for (auto item : kw) {
               const std::string k = item.first.cast<std::string>();
               const py::handle v = item.second;
               if (k == "logit_bias") {
                 s.logit_bias = to_bias(py::reinterpret_borrow<py::object>(v));
                 continue;
               }
               auto it = sampler_fields().find(k);
               EXL2_CHECK(it != sampler_fields().end(), "SamplerSettings: unknown field '", k, "'; the fields are ",
                          field_names());
               try {
                 it->second(s, v);
               } catch (const py::cast_error&) {
                 EXL2_FAIL(InvalidArgument, "SamplerSettings.", k, " = ", py::repr(v).cast<std::string>(),
                           " has the wrong type (see cpp/engine/sampler.h for each field's type)");
               }
             }
             s.validate();
             return s;
           }),
           "SamplerSettings(**fields): keyword arguments only, each a field below (defaults: cpp/engine/sampler.h).")
      .def_readonly("temperature", &SamplerSettings::temperature)
      .def_readonly("top_k", &SamplerSettings::top_k)
      .def_readonly("top_p", &SamplerSettings::top_p)
      .def_readonly("min_p", &SamplerSettings::min_p)
      .def_readonly("typical", &SamplerSettings::typical)
      .def_readonly("repetition_penalty", &SamplerSettings::repetition_penalty)
      .def_readonly("frequency_penalty", &SamplerSettings::frequency_penalty)
      .def_readonly("presence_penalty", &SamplerSettings::presence_penalty)
      .def_readonly("penalty_window", &SamplerSettings::penalty_window)
      .def_readonly("logit_bias", &SamplerSettings::logit_bias)
      .def_readonly("banned_tokens", &SamplerSettings::banned_tokens)
      .def_readonly("seed", &SamplerSettings::seed)
      .def_readonly("top_logprobs", &SamplerSettings::top_logprobs)
      .def_readonly("allowed_tokens", &SamplerSettings::allowed_tokens)
      .def_readonly("min_tokens", &SamplerSettings::min_tokens)
      .def_readonly("stop_tokens", &SamplerSettings::stop_tokens)
      .def_readonly("smoothing_factor", &SamplerSettings::smoothing_factor)
      .def_readonly("smoothing_curve", &SamplerSettings::smoothing_curve)
      .def_readonly("temperature_last", &SamplerSettings::temperature_last)
      .def_readonly("min_temp", &SamplerSettings::min_temp)
      .def_readonly("max_temp", &SamplerSettings::max_temp)
      .def_readonly("temp_exponent", &SamplerSettings::temp_exponent)
      .def_readonly("top_a", &SamplerSettings::top_a)
      .def_readonly("tfs", &SamplerSettings::tfs)
      .def_readonly("mirostat_mode", &SamplerSettings::mirostat_mode)
      .def_readonly("mirostat_tau", &SamplerSettings::mirostat_tau)
      .def_readonly("mirostat_eta", &SamplerSettings::mirostat_eta)
      .def_readonly("xtc_probability", &SamplerSettings::xtc_probability)
      .def_readonly("xtc_threshold", &SamplerSettings::xtc_threshold)
      .def_readonly("dry_multiplier", &SamplerSettings::dry_multiplier)
      .def_readonly("dry_base", &SamplerSettings::dry_base)
      .def_readonly("dry_allowed_length", &SamplerSettings::dry_allowed_length)
      .def_readonly("dry_range", &SamplerSettings::dry_range)
      .def_readonly("dry_sequence_breakers", &SamplerSettings::dry_sequence_breakers)
      .def("validate", &SamplerSettings::validate, py::arg("vocab") = -1)
      .def("__repr__", &SamplerSettings::to_string);

  py::class_<Sampler>(m, "Sampler", "One job's sampler: settings + resolved seed + step counter.")
      .def(py::init<SamplerSettings>(), py::arg("settings"))
      .def(
          "sample",
          [](Sampler& self, const LogitsArray& logits, const std::vector<int32_t>& context,
             const std::vector<int32_t>& generated) {
            const float* p = check_logits(logits);
            const int64_t vocab = logits.shape(0);
            SampleResult r;
            {
              py::gil_scoped_release release;
              r = self.sample(p, vocab, context, generated);
            }
            return py::make_tuple(r.token, r.logprob, py::cast(r.top));
          },
          py::arg("logits"), py::arg("context") = std::vector<int32_t>{}, py::arg("generated") = std::vector<int32_t>{},
          "Sample one token: -> (token, logprob, [(id, logprob), ...]); advances step by one.")
      .def(
          "probs",
          [](const Sampler& self, const LogitsArray& logits, const std::vector<int32_t>& context,
             const std::vector<int32_t>& generated) {
            const float* p = check_logits(logits);
            std::vector<double> probs;
            {
              py::gil_scoped_release release;
              probs = self.final_probs(p, logits.shape(0), context, generated);
            }
            return py::array_t<double>(static_cast<py::ssize_t>(probs.size()), probs.data());
          },
          py::arg("logits"), py::arg("context") = std::vector<int32_t>{}, py::arg("generated") = std::vector<int32_t>{},
          "The final distribution sample() would draw from, float64 [vocab]; does not advance step.")
      .def_property_readonly("settings", &Sampler::settings)
      .def_property_readonly("seed", &Sampler::seed)
      .def_property("step", &Sampler::step, &Sampler::set_step)
      .def_property_readonly(
          "mirostat_mu",
          [](const Sampler& self) -> py::object {
            if (!self.settings().mirostat()) return py::none();
            return py::float_(self.mirostat_mu());
          },
          "Mirostat's mu for the next sample (None when mirostat is off).")
      .def_static("uniform", &Sampler::uniform, py::arg("seed"), py::arg("step"), py::arg("stream") = 0,
                  "The job RNG's draw in [0, 1) at (seed, step); stream 0 = the token draw, 1 = XTC's coin.");

  m.def(
      "sampler_probs",
      [](const SamplerSettings& settings, const LogitsArray& logits, const std::vector<int32_t>& context,
         const std::vector<int32_t>& generated) {
        SamplerSettings s = settings;
        if (s.seed == 0) s.seed = 1;  // the distribution does not depend on the seed: skip random_device
        const Sampler sampler(s);
        const float* p = check_logits(logits);
        std::vector<double> probs;
        {
          py::gil_scoped_release release;
          probs = sampler.final_probs(p, logits.shape(0), context, generated);
        }
        return py::array_t<double>(static_cast<py::ssize_t>(probs.size()), probs.data());
      },
      py::arg("settings"), py::arg("logits"), py::arg("context") = std::vector<int32_t>{},
      py::arg("generated") = std::vector<int32_t>{},
      "Final sampling distribution (float64 [vocab], zero outside the support) for these settings and logits.");
}

}  // namespace exl2
