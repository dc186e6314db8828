// Bindings for the engine area (see bindings.h): SamplerSettings, Sampler and sampler_probs (the final distribution,
// for exact tests). Logits cross as 1-D float32 NumPy arrays read in place; sampling runs without the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

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
      .def(py::init([](float temperature, int32_t top_k, float top_p, float min_p, float typical,
                       float repetition_penalty, float frequency_penalty, float presence_penalty,
                       int32_t penalty_window, const py::object& logit_bias, std::vector<int32_t> banned_tokens,
                       uint64_t seed, int32_t top_logprobs) {
             SamplerSettings s;
             s.temperature = temperature;
             s.top_k = top_k;
             s.top_p = top_p;
             s.min_p = min_p;
             s.typical = typical;
             s.repetition_penalty = repetition_penalty;
             s.frequency_penalty = frequency_penalty;
             s.presence_penalty = presence_penalty;
             s.penalty_window = penalty_window;
             s.logit_bias = to_bias(logit_bias);
             s.banned_tokens = std::move(banned_tokens);
             s.seed = seed;
             s.top_logprobs = top_logprobs;
             s.validate();
             return s;
           }),
           py::kw_only(), py::arg("temperature") = 1.0f, py::arg("top_k") = 0, py::arg("top_p") = 1.0f,
           py::arg("min_p") = 0.0f, py::arg("typical") = 1.0f, py::arg("repetition_penalty") = 1.0f,
           py::arg("frequency_penalty") = 0.0f, py::arg("presence_penalty") = 0.0f, py::arg("penalty_window") = -1,
           py::arg("logit_bias") = py::none(), py::arg("banned_tokens") = std::vector<int32_t>{},
           py::arg("seed") = 0, py::arg("top_logprobs") = 0)
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
          py::arg("logits"), py::arg("context") = std::vector<int32_t>{},
          py::arg("generated") = std::vector<int32_t>{},
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
          py::arg("logits"), py::arg("context") = std::vector<int32_t>{},
          py::arg("generated") = std::vector<int32_t>{},
          "The final distribution sample() would draw from, float64 [vocab]; does not advance step.")
      .def_property_readonly("settings", &Sampler::settings)
      .def_property_readonly("seed", &Sampler::seed)
      .def_property("step", &Sampler::step, &Sampler::set_step)
      .def_static("uniform", &Sampler::uniform, py::arg("seed"), py::arg("step"));

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
