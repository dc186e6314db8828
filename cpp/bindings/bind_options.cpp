// Bindings of the runtime options registry (exl2/options.h) and the EXL2 matmul op's planner and CPU reference
// (ops/exl2_matmul.h): get / set the options by name, the registry for docs/options.md, a plan as a dict.
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "exl2/options.h"
#include "ops/exl2_matmul.h"

#ifdef EXL2_WITH_CUDA
#include "cuda/exl2_gemm.h"
#endif

namespace py = pybind11;

namespace exl2 {

namespace {

// A Python value as option text: bool -> "true"/"false", int -> decimal, str as is.
std::string option_text(const std::string& name, const py::handle& v) {
  if (py::isinstance<py::bool_>(v)) return v.cast<bool>() ? "true" : "false";
  if (py::isinstance<py::int_>(v)) return std::to_string(v.cast<long long>());
  if (py::isinstance<py::str>(v)) return v.cast<std::string>();
  EXL2_FAIL(InvalidArgument, "option ", name, ": a bool, int or str expected, got ", std::string(py::str(py::type::handle_of(v))));
}

py::object option_value(const OptionInfo& info, const std::string& text) {
  if (info.type == "bool") return py::bool_(text == "true");
  if (info.type == "int") return py::int_(std::stoll(text));
  return py::str(text);
}

py::dict options_dict(const RuntimeOptions& o) {
  py::dict d;
  for (const OptionInfo& info : option_registry()) d[info.name.c_str()] = option_value(info, get_option(o, info.name));
  return d;
}

py::dict plan_dict(const ops::Exl2MatmulPlan& p) {
  py::dict d;
  d["kernel"] = ops::exl2_kernel_name(p.kernel);
  py::list launches;
  for (const ops::Exl2Launch& l : p.launches) {
    py::dict e;
    e["row0"] = l.row0;
    e["rows"] = l.rows;
    e["kernel"] = ops::exl2_kernel_name(l.kernel);
    e["m_tile"] = l.m_tile;
    launches.append(e);
  }
  d["launches"] = launches;
  d["slices"] = p.tuning.slices;
  d["chunks_per_slice"] = p.tuning.chunks_per_slice;
  d["tuned_on"] = p.tuned_on;
  d["tuned"] = p.tuned;
  d["note"] = p.note;
  return d;
}

}  // namespace

void bind_options(py::module_& m) {
  m.def(
      "get_options", []() { return options_dict(runtime_options()); },
      "The runtime options in force (exl2/options.h), as a dict name -> bool / int / str.");
  m.def(
      "set_options",
      [](const py::dict& d) {
        RuntimeOptions o = runtime_options();
        for (const auto& kv : d) {
          const std::string name = kv.first.cast<std::string>();
          set_option(o, name, option_text(name, kv.second));
        }
        set_runtime_options(o);
      },
      py::arg("options"),
      "Set some runtime options by name (the others keep their values). InvalidArgumentError naming an unknown\n"
      "option or a bad value; nothing changes then.");
  m.def(
      "default_options", []() { return options_dict(RuntimeOptions{}); }, "The options' defaults, as a dict.");
  m.def(
      "option_registry",
      []() {
        py::list l;
        for (const OptionInfo& i : option_registry()) {
          py::dict d;
          d["name"] = i.name;
          d["type"] = i.type;
          d["default"] = i.default_value;
          d["allowed"] = i.allowed;
          d["scope"] = i.scope;
          d["doc"] = i.doc;
          l.append(d);
        }
        return l;
      },
      "Every runtime option: name, type (bool / int / choice), default and allowed values as text, scope, doc.");
  m.def(
      "environment_settings",
      []() {
        py::list l;
        for (const EnvironmentSetting& e : environment_settings()) l.append(py::make_tuple(e.name, e.doc));
        return l;
      },
      "The settings that stay environment variables: [(name, doc)].");

  m.def(
      "exl2_matmul_plan",
      [](int64_t rows, int64_t in_features, int64_t out_features, bool f16, int n_layers, bool fused,
         const std::string& gpu_name, int cc, int sm_count, const py::dict& tuning) {
        ops::Exl2MatmulShape s;
        s.rows = rows;
        s.in = in_features;
        s.out = out_features;
        s.f16 = f16;
        s.n_layers = n_layers;
        s.fused = fused;
        ops::Exl2GpuInfo g{gpu_name, cc, sm_count};
        ops::Exl2MatmulTuning t;
        for (const auto& kv : tuning) {
          const std::string k = kv.first.cast<std::string>();
          if (k == "gemv_max_rows") t.gemv_max_rows = kv.second.cast<int>();
          else if (k == "m32") t.m32 = kv.second.cast<bool>();
          else if (k == "group") t.group = kv.second.cast<bool>();
          else if (k == "reference") t.reference = kv.second.cast<bool>();
          else if (k == "slices") t.slices = kv.second.cast<int>();
          else if (k == "chunks_per_slice") t.chunks_per_slice = kv.second.cast<int>();
          else EXL2_FAIL(InvalidArgument, "exl2_matmul_plan: unknown tuning '", k, "'");
        }
        return plan_dict(ops::plan_exl2_matmul(s, g, t));
      },
      py::arg("rows"), py::arg("in_features"), py::arg("out_features"), py::arg("f16") = true,
      py::arg("n_layers") = 1, py::arg("fused") = false, py::arg("gpu_name") = "NVIDIA H200", py::arg("cc") = 90,
      py::arg("sm_count") = 132, py::arg("tuning") = py::dict(),
      "The EXL2 matmul planner (pure; ops/exl2_matmul.h) for a layer shape on a described GPU: dict kernel,\n"
      "launches [{row0, rows, kernel, m_tile}], slices, chunks_per_slice, tuned_on, tuned, note. tuning: any of\n"
      "gemv_max_rows, m32, group, reference, slices, chunks_per_slice.");
  m.def(
      "exl2_matmul_plan_for_device",
      [](int index, int64_t rows, int64_t in_features, int64_t out_features, bool f16) {
#ifdef EXL2_WITH_CUDA
        ops::Exl2MatmulShape s;
        s.rows = rows;
        s.in = in_features;
        s.out = out_features;
        s.f16 = f16;
        return plan_dict(ops::plan_exl2_matmul(s, cuda::exl2_gpu_info(index), ops::exl2_tuning_from_options()));
#else
        (void)index, (void)rows, (void)in_features, (void)out_features, (void)f16;
        EXL2_FAIL(Unsupported, "exl2_matmul_plan_for_device: this build has no CUDA backend");
#endif
      },
      py::arg("index"), py::arg("rows"), py::arg("in_features"), py::arg("out_features"), py::arg("f16") = true,
      "The plan ops::exl2_matmul makes on CUDA device `index` under the options in force (see exl2_matmul_plan).");
}

}  // namespace exl2
