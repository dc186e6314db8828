// Bindings for Model, KVCache and the page pool. forward releases the GIL.
#include <pybind11/stl.h>

#include <cstring>

#include "bindings/bindings.h"
#include "exl2/model.h"
#include "model/decoder.h"
#include "model/graph.h"
#include "model/load_checks.h"

namespace py = pybind11;

namespace exl2 {

namespace {

std::vector<int32_t> to_i32_vector(const py::handle& obj, const char* what) {
  py::array_t<int64_t, py::array::c_style | py::array::forcecast> a;
  try {
    a = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(obj);
  } catch (...) {
  }
  EXL2_CHECK(a, what, " must be a sequence of integers");
  std::vector<int32_t> v(static_cast<size_t>(a.size()));
  const int64_t* p = a.data();
  for (size_t i = 0; i < v.size(); ++i) {
    EXL2_CHECK(p[i] >= INT32_MIN && p[i] <= INT32_MAX, what, "[", i, "] = ", p[i], " does not fit int32");
    v[i] = static_cast<int32_t>(p[i]);
  }
  return v;
}

}  // namespace

void bind_model(py::module_& m) {
  py::class_<PagePool>(m, "PagePool")
      .def_property_readonly("n_pages", &PagePool::n_pages)
      .def_property_readonly("n_free", &PagePool::n_free)
      .def_property_readonly("n_used", &PagePool::n_used)
      .def("alloc", &PagePool::alloc, py::arg("n"))
      .def("retain", &PagePool::retain)
      .def("release", &PagePool::release)
      .def("refcount", &PagePool::refcount);

  py::class_<KVCache>(m, "KVCache")
      .def_property_readonly("page_size", &KVCache::page_size)
      .def_property_readonly("n_pages", &KVCache::n_pages)
      .def_property_readonly("n_layers", &KVCache::n_layers)
      .def_property_readonly("bytes_per_token", &KVCache::bytes_per_token)
      .def_property_readonly("dtype", [](const KVCache& c) { return std::string(dtype_name(c.dtype())); })
      .def_property_readonly("cache_type", [](const KVCache& c) { return std::string(cache_type_name(c.type())); })
      .def_property_readonly("layer_devices",
                             [](const KVCache& c) {
                               std::vector<std::string> out;
                               for (int64_t l = 0; l < c.n_layers(); ++l) out.push_back(c.layer_device(l).str());
                               return out;
                             })
      .def_property_readonly("tp", &KVCache::tp)
      // Quantized caches: the K centre's kind ("rope" or "fixed", cache/kv_quant.h; "" for float caches) and a
      // copy of a layer's (shard's) centring vector, f32 [n_heads_kv, head_dim] (zeros until the first write).
      .def_property_readonly("k_centre",
                             [](const KVCache& c) {
                               return std::string(!c.quantized() ? "" : c.k_centre_rope() ? "rope" : "fixed");
                             })
      .def_property_readonly("sink", &KVCache::sink)  // quantized caches: position 0's rows kept in f16
      .def(
          "k_mean",
          [](KVCache& c, int64_t layer) {
            EXL2_CHECK(c.quantized(), "KVCache.k_mean: only quantized caches centre K");
            EXL2_CHECK(layer >= 0 && layer < c.n_layers() * c.tp(), "KVCache.k_mean: layer ", layer,
                       " out of range [0, ", c.n_layers() * c.tp(), ")");
            return to_numpy(c.k_mean(layer).to(Device::cpu()));
          },
          py::arg("layer"))
      .def_property_readonly("pool", py::overload_cast<>(&KVCache::pool), py::return_value_policy::reference_internal);

  py::class_<Model>(m, "Model")
      .def_static(
          "load",
          [](const std::string& path, const std::string& device, int64_t max_seq_len, std::vector<int> layer_devices,
             int head_device, const std::vector<std::string>& tp_devices, py::object progress) {
            LoadOptions opt;
            opt.device = Device::parse(device);
            opt.max_seq_len = max_seq_len;
            opt.layer_devices = std::move(layer_devices);
            opt.head_device = head_device;
            for (const std::string& d : tp_devices) opt.tp_devices.push_back(Device::parse(d));
            // held by a shared_ptr: copies of the options (made without the GIL) never touch the refcount; the last
            // one goes with `opt`, after the GIL is back
            auto fn = progress.is_none() ? nullptr : std::make_shared<py::object>(progress);
            if (fn)
              opt.progress = [fn](int64_t done, int64_t total) {
                py::gil_scoped_acquire gil;  // the load runs without the GIL; a Python error ends it
                (*fn)(done, total);
              };
            py::gil_scoped_release release;
            return Model::load(path, opt);
          },
          py::arg("path"), py::arg("device") = "cpu", py::arg("max_seq_len") = 0,
          py::arg("layer_devices") = std::vector<int>{}, py::arg("head_device") = -1,
          py::arg("tp_devices") = std::vector<std::string>{}, py::arg("progress") = py::none(),
          "Load a model; layer_devices (one CUDA index per layer) and head_device split it across GPUs; tp_devices\n"
          "(e.g. [\"cuda:0\", \"cuda:1\"], or [\"cpu\"] * N virtual ranks) runs it tensor-parallel. progress(done,\n"
          "total) is called as modules load (embedding, each layer, head: total = layers + 2).")
      .def_property_readonly("config_json", [](const Model& md) { return md.config().raw.dump(); })
      .def_property_readonly("device", [](const Model& md) { return md.device().str(); })
      .def_property_readonly("layer_devices",
                             [](const Model& md) {
                               std::vector<std::string> out;
                               for (const Device& d : md.layer_devices()) out.push_back(d.str());
                               return out;
                             })
      .def_property_readonly("head_device", [](const Model& md) { return md.head_device().str(); })
      .def_property_readonly("split", &Model::split)
      .def_property_readonly("tp_devices",
                             [](const Model& md) {
                               std::vector<std::string> out;
                               for (const Device& d : md.tp_devices()) out.push_back(d.str());
                               return out;
                             })
      .def_property_readonly("max_seq_len", &Model::max_seq_len)
      .def_property_readonly("vocab_size", [](const Model& md) { return md.config().vocab_size; })
      .def_property_readonly("architecture", [](const Model& md) { return md.config().architecture; })
      .def("info_json", &Model::info_json)
      .def(
          "make_cache",
          [](const Model& md, int64_t n_tokens, int page_size, const std::string& cache_type) {
            return md.make_cache(n_tokens, page_size, parse_cache_type(cache_type, md.device()));
          },
          py::arg("n_tokens"), py::arg("page_size") = 256, py::arg("cache_type") = "auto")
      .def(
          "forward",
          [](Model& md, KVCache& cache, py::object tokens, py::object positions, py::object seq_of_token,
             py::object page_table, int pages_per_seq, py::object logit_rows) {
            Batch b;
            b.tokens = to_i32_vector(tokens, "tokens");
            b.positions = to_i32_vector(positions, "positions");
            b.seq_of_token = to_i32_vector(seq_of_token, "seq_of_token");
            b.page_table = to_i32_vector(page_table, "page_table");
            b.pages_per_seq = pages_per_seq;
            if (!logit_rows.is_none()) b.logit_rows = to_i32_vector(logit_rows, "logit_rows");
            Tensor logits;
            {
              py::gil_scoped_release release;
              logits = md.forward(b, cache);
            }
            py::array_t<float> out({logits.size(0), logits.size(1)});
            std::memcpy(out.mutable_data(), logits.data(), logits.nbytes());
            return out;
          },
          py::arg("cache"), py::arg("tokens"), py::arg("positions"), py::arg("seq_of_token"), py::arg("page_table"),
          py::arg("pages_per_seq"), py::arg("logit_rows") = py::none(),
          "Run one batch step; returns float32 logits [rows, vocab] for logit_rows (all rows when None).");
  m.def(
      "decoder_names",
      [](const std::string& folder) {
        const DecoderSpec s = decoder_spec(ModelConfig::load(folder));
        py::dict d;
        d["embed"] = s.names.embed;
        d["layers"] = s.names.layers;
        d["final_norm"] = s.names.final_norm;
        d["head"] = s.names.head;
        d["unused_prefixes"] = s.unused_prefixes;
        return d;
      },
      py::arg("folder"),
      "Where the architecture of <folder>/config.json finds its tensors (DecoderSpec::names): embed and final_norm "
      "tensor names, the layers prefix (\"model.layers.\": layer i is <layers><i>.), the head linear prefix, and "
      "unused_prefixes (parts present in the file but not run, such as a vision tower).");
  m.def(
      "weight_load_bytes",
      [](const std::string& folder, int64_t max_seq_len, std::vector<int> layer_devices, int head_device, int device,
         int64_t tp) -> py::tuple {
        const ModelConfig c = ModelConfig::load(folder);
        const TensorMap tm = TensorMap::open(folder);
        check_layers(c, tm, folder + "/config.json", /*extra_layers_ok=*/true);  // sizes stray layers (tests)
        if (tp > 0) {
          size_t head = 0;
          std::vector<size_t> per = tp_weight_bytes(c, tm, tp, max_seq_len, &head);
          return py::make_tuple(per, head);
        }
        LoadOptions o;
        o.device = Device::cuda(device);
        o.layer_devices = std::move(layer_devices);
        o.head_device = head_device;
        return py::make_tuple(weight_bytes_per_device(c, tm, o, max_seq_len), size_t{0});
      },
      py::arg("folder"), py::arg("max_seq_len"), py::arg("layer_devices") = std::vector<int>{},
      py::arg("head_device") = -1, py::arg("device") = 0, py::arg("tp") = 0,
      "Tests: the CUDA loaders' weight sizes (model/graph.h) without loading: tp > 0: (tp_weight_bytes per rank, "
      "rank 0's head), else (weight_bytes_per_device by CUDA index, 0). The indices are not checked against the "
      "visible GPUs; in a build without the CUDA EXL2 kernels an EXL2 linear counts q_weight + q_scale + bias.");
  m.def("weight_sizing_walks", &weight_sizing_walks,
        "Tests: walks over a model's tensors made to size its weights since the process started (a CUDA load makes "
        "one: its out-of-memory check and weight-arena reserves share it; a CPU load none).");
}

}  // namespace exl2
