// Bindings for the core area (see bindings.h): NumPy <-> Tensor copies, safetensors, JSON, config, device query.
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>

#include "backend/cpu/isa.h"
#include "bindings/bindings.h"
#include "core/device_api.h"
#include "core/weight_arena.h"
#include "exl2/config.h"
#include "exl2/json.h"
#include "exl2/safetensors.h"

namespace py = pybind11;

namespace exl2 {

namespace {

const char* numpy_name(DType d) {
  switch (d) {
    case DType::F32:
      return "float32";
    case DType::F16:
      return "float16";
    case DType::BF16:
      return "uint16";  // raw bits
    case DType::I32:
      return "int32";
    case DType::I16:
      return "int16";
    case DType::I8:
      return "int8";
    case DType::U8:
      return "uint8";
  }
  return "?";
}

// "f16", "float16", "bf16", ... -> DType; false when unknown.
bool parse_dtype_name(const std::string& s, DType* out) {
  static const std::pair<const char*, DType> table[] = {
      {"f32", DType::F32},   {"float32", DType::F32},   {"f16", DType::F16}, {"float16", DType::F16},
      {"bf16", DType::BF16}, {"bfloat16", DType::BF16}, {"i32", DType::I32}, {"int32", DType::I32},
      {"i16", DType::I16},   {"int16", DType::I16},     {"i8", DType::I8},   {"int8", DType::I8},
      {"u8", DType::U8},     {"uint8", DType::U8}};
  for (const auto& e : table) {
    if (s == e.first) {
      *out = e.second;
      return true;
    }
  }
  return false;
}

py::object json_to_py(const Json& j) {
  switch (j.type()) {
    case Json::Type::Null:
      return py::none();
    case Json::Type::Bool:
      return py::bool_(j.as_bool());
    case Json::Type::Number:
      if (j.is_integer()) return py::int_(j.as_int());
      return py::float_(j.as_double());
    case Json::Type::String:
      return py::str(j.as_string());
    case Json::Type::Array: {
      py::list out;
      for (const Json& v : j.as_array()) out.append(json_to_py(v));
      return std::move(out);
    }
    case Json::Type::Object: {
      py::dict out;
      for (const auto& kv : j.as_object()) out[py::str(kv.first)] = json_to_py(kv.second);
      return std::move(out);
    }
  }
  return py::none();
}

py::dict rope_to_py(const RopeScaling& s) {
  py::dict d;
  d["type"] = rope_type_name(s.type);
  d["factor"] = s.factor;
  d["low_freq_factor"] = s.low_freq_factor;
  d["high_freq_factor"] = s.high_freq_factor;
  d["original_max_position_embeddings"] = s.original_max_position_embeddings;
  d["beta_fast"] = s.beta_fast;
  d["beta_slow"] = s.beta_slow;
  d["mscale"] = s.mscale;
  d["mscale_all_dim"] = s.mscale_all_dim;
  d["attention_factor"] = s.attention_factor;
  d["truncate"] = s.truncate;
  return d;
}

py::dict config_to_py(const ModelConfig& c) {
  py::dict d;
  d["architecture"] = c.architecture;
  d["model_type"] = c.model_type;
  d["hidden_size"] = c.hidden_size;
  d["intermediate_size"] = c.intermediate_size;
  d["num_hidden_layers"] = c.num_hidden_layers;
  d["num_attention_heads"] = c.num_attention_heads;
  d["num_key_value_heads"] = c.num_key_value_heads;
  d["head_dim"] = c.head_dim;
  d["vocab_size"] = c.vocab_size;
  d["max_position_embeddings"] = c.max_position_embeddings;
  d["rms_norm_eps"] = c.rms_norm_eps;
  d["rope_theta"] = c.rope_theta;
  d["rope_scaling"] = rope_to_py(c.rope_scaling);
  d["tie_word_embeddings"] = c.tie_word_embeddings;
  d["attention_bias"] = c.attention_bias;
  d["mlp_bias"] = c.mlp_bias;
  d["hidden_act"] = c.hidden_act;
  d["torch_dtype"] = c.torch_dtype;
  d["bos_token_ids"] = c.bos_token_ids;
  d["eos_token_ids"] = c.eos_token_ids;
  d["sliding_window"] = c.sliding_window;
  d["quantization_config"] = json_to_py(c.quantization_config);
  return d;
}

}  // namespace

py::array to_numpy(const Tensor& t) {
  EXL2_CHECK(t.defined(), "to_numpy: the tensor is undefined");
  const Tensor h = t.device().is_cpu() ? t : t.to(Device::cpu());
  std::vector<py::ssize_t> shape(h.shape().begin(), h.shape().end());
  py::array out(py::dtype(numpy_name(h.dtype())), shape);
  if (h.nbytes()) std::memcpy(out.mutable_data(), h.data(), h.nbytes());
  return out;
}

Tensor from_numpy(const py::array& a, const std::string& dtype) {
  py::module_ np = py::module_::import("numpy");
  const std::string src = py::str(a.dtype().attr("name"));
  DType target;
  if (dtype.empty()) {
    if (!parse_dtype_name(src, &target))
      EXL2_FAIL(InvalidArgument, "arrays of dtype ", src,
                " are not accepted; use float32, float16, int32, int16, int8 or uint8 (bf16: uint16 bits with "
                "dtype='bf16'), e.g. a.astype(np.float32)");
  } else if (!parse_dtype_name(dtype, &target)) {
    EXL2_FAIL(InvalidArgument, "unknown dtype '", dtype, "'; use f32, f16, bf16, i32, i16, i8 or u8");
  }
  py::array c;
  if (target == DType::BF16) {
    if (src == "uint16") {
      c = np.attr("asarray")(a, py::none(), "C");
    } else if (src == "float32" || src == "float64" || src == "float16") {
      // Round-to-nearest-even float -> bf16 bits.
      py::array f = np.attr("asarray")(a, "float32", "C");
      Tensor out = Tensor::empty(Shape(f.shape(), f.shape() + f.ndim()), DType::BF16);
      const float* p = static_cast<const float*>(f.data());
      uint16_t* q = out.data_as<uint16_t>();
      for (int64_t i = 0; i < out.numel(); ++i) q[i] = f32_to_bf16(p[i]);
      return out;
    } else {
      EXL2_FAIL(InvalidArgument, "bf16 needs a uint16 array of raw bits or a float array, got ", src);
    }
  } else {
    c = np.attr("asarray")(a, numpy_name(target), "C");  // keeps 0-d shapes, unlike ascontiguousarray
  }
  Shape shape(c.shape(), c.shape() + c.ndim());
  return Tensor::from_host(c.data(), shape, target);
}

void bind_core(py::module_& m) {
  m.def(
      "read_safetensors",
      [](const std::string& path) {
        TensorMap tm = TensorMap::open(path);
        py::dict out;
        for (const auto& name : tm.names()) out[py::str(name)] = to_numpy(tm.get(name));
        return out;
      },
      py::arg("path"),
      "Read every tensor of a .safetensors file or model folder (copies). bf16 comes back as uint16 bits.");
  m.def(
      "read_tensor",
      [](const std::string& path, const std::string& name, std::optional<Shape> shape,
         std::vector<std::string> dtypes) {
        TensorMap tm = TensorMap::open(path);
        if (!shape && dtypes.empty()) return to_numpy(tm.get(name));
        std::vector<DType> want;
        for (const auto& d : dtypes) {
          DType t;
          if (!parse_dtype_name(d, &t)) EXL2_FAIL(InvalidArgument, "unknown dtype '", d, "'");
          want.push_back(t);
        }
        if (!shape) shape = tm.info(name).shape;
        return to_numpy(tm.get_checked(name, *shape, want));
      },
      py::arg("path"), py::arg("name"), py::arg("shape") = py::none(), py::arg("dtypes") = std::vector<std::string>{},
      "One tensor (copied), checked against `shape` (-1: any) and `dtypes` when given (TensorMap::get_checked).");
  m.def(
      "safetensors_names", [](const std::string& path) { return TensorMap::open(path).names(); }, py::arg("path"),
      "Sorted tensor names of a .safetensors file or model folder.");
  m.def(
      "parse_json", [](const std::string& text) { return json_to_py(Json::parse(text, "<json>")); }, py::arg("text"),
      "Parse JSON text (str or UTF-8 bytes) strictly into Python objects.");
  m.def(
      "dump_json", [](const std::string& text) { return Json::parse(text, "<json>").dump(); }, py::arg("text"),
      "Parse then re-serialize JSON text compactly (tests the writer).");
  m.def(
      "load_config", [](const std::string& model_dir) { return config_to_py(ModelConfig::load(model_dir)); },
      py::arg("model_dir"), "Parsed ModelConfig of <model_dir>/config.json as a dict.");
  m.def(
      "numpy_roundtrip", [](const py::array& a, const std::string& dtype) { return to_numpy(from_numpy(a, dtype)); },
      py::arg("array"), py::arg("dtype") = "", "from_numpy then to_numpy (tests the Tensor <-> NumPy bridge).");
  auto arena_stats = [] {
    const WeightArenaStats st = weight_arena_stats();
    py::dict d;
    d["slabs"] = st.slabs;
    d["slab_bytes"] = st.slab_bytes;
    d["used_bytes"] = st.used_bytes;
    d["live_bytes"] = st.live_bytes;
    d["live_allocs"] = st.live_allocs;
    d["overflow_slabs"] = st.overflow_slabs;
    return d;
  };
  m.def("weight_arena_stats", arena_stats,
        "Process-wide weight arena counters (core/weight_arena.h): slabs, slab_bytes, used_bytes, live_bytes, "
        "live_allocs, overflow_slabs.");
  m.def(
      "weight_arena_script",
      [arena_stats](const std::string& device, size_t reserve, const std::vector<std::string>& ops) {
        // Tests the arena directly: inside one WeightArenaScope(device, reserve), runs ops in order: "a<bytes>"
        // allocates a u8 tensor (kept), "b<bytes>" allocates one under a WeightArenaBypass (kept), "c<bytes>" one on the CPU, "f<i>" frees
        // tensor i, "s" records the stats. Returns {"addrs": [address per allocation], "stats": [...]}; every
        // tensor and the scope are gone when it returns.
        const Device dev = Device::parse(device);
        std::vector<Tensor> keep;
        py::list addrs, stats;
        {
          WeightArenaScope scope(dev, reserve);
          for (const std::string& op : ops) {
            EXL2_CHECK(!op.empty(), "weight_arena_script: empty op");
            const std::string arg = op.substr(1);
            if (op[0] == 'a' || op[0] == 'b' || op[0] == 'c') {
              const int64_t n = std::stoll(arg);
              std::unique_ptr<WeightArenaBypass> off;
              if (op[0] == 'b') off = std::make_unique<WeightArenaBypass>();
              keep.push_back(Tensor::empty({n}, DType::U8, op[0] == 'c' ? Device::cpu() : dev));
              addrs.append(reinterpret_cast<uintptr_t>(keep.back().data()));
            } else if (op[0] == 'f') {
              const size_t i = std::stoul(arg);
              EXL2_CHECK(i < keep.size(), "weight_arena_script: f", i, " but ", keep.size(), " allocations");
              keep[i] = Tensor();
            } else if (op[0] == 's') {
              stats.append(arena_stats());
            } else {
              EXL2_FAIL(InvalidArgument, "weight_arena_script: unknown op '", op, "'");
            }
          }
        }
        stats.append(arena_stats());  // the scope ended, the tensors still alive
        keep.clear();
        py::dict out;
        out["addrs"] = addrs;
        out["stats"] = stats;
        return out;
      },
      py::arg("device"), py::arg("reserve"), py::arg("ops"),
      "Test driver of the weight arena (ops: a<bytes>, b<bytes> bypassed, c<bytes> on the CPU, f<i> free, s stats).");
  m.def("cuda_device_count", &device::cuda_device_count, "Number of CUDA devices (0 without CUDA).");
  m.def("cuda_compiled", &device::cuda_compiled, "Whether this build has the CUDA backend.");
  m.def(
      "cpu_isa", [] { return std::string(cpu::cpu_isa_name(cpu::cpu_isa())); },
      "The vector ISA the CPU kernels run with now: 'baseline', 'avx2' or 'avx512' (backend/cpu/isa.h).");
  m.def(
      "set_cpu_isa", [](const std::string& isa) { cpu::set_cpu_isa(cpu::parse_cpu_isa(isa)); }, py::arg("isa"),
      "Force the CPU kernels' ISA ('baseline', 'avx2', 'avx512'; UnsupportedError if this CPU or build lacks it), "
      "for tests and benchmarks; the default is the best this CPU supports.");
  m.def(
      "build_info",
      [] {
        auto names = [](const std::vector<cpu::CpuIsa>& isas) {
          std::vector<std::string> out;
          for (cpu::CpuIsa i : isas) out.push_back(cpu::cpu_isa_name(i));
          return out;
        };
        py::dict d;
        d["cpu_isa"] = cpu::cpu_isa_name(cpu::cpu_isa());
        d["cpu_isa_best"] = cpu::cpu_isa_name(cpu::best_cpu_isa());
        d["cpu_isas_supported"] = names(cpu::supported_cpu_isas());
        d["cpu_isas_compiled"] = names(cpu::compiled_cpu_isas());
#ifdef EXL2_BUILD_NATIVE
        d["native"] = true;
#else
        d["native"] = false;
#endif
        d["cuda"] = device::cuda_compiled();
        std::vector<int> archs;
#ifdef EXL2_BUILD_CUDA_ARCHS
        for (int a : {EXL2_BUILD_CUDA_ARCHS}) archs.push_back(a);
#endif
        d["cuda_archs"] = archs;
        d["compiler"] = std::string(__VERSION__);
        return d;
      },
      "What this build holds: cpu_isa (in use), cpu_isa_best, cpu_isas_supported / cpu_isas_compiled, native "
      "(-march=native), cuda (backend compiled), cuda_archs (SM versions of the device code), compiler.");
  m.def("cuda_missing_reason", &device::cuda_missing_reason,
        "Why this build has no CUDA backend, as recorded when it was configured (\"\" when it has one).");
  m.def("require_cuda_backend", &device::require_cuda_backend, py::arg("what"),
        "Raise UnsupportedError naming `what`, why this build has no CUDA backend and how to rebuild; a no-op on a "
        "CUDA build.");
}

}  // namespace exl2
