// Bindings for the quant area (see bindings.h): EXL2 validate / unpack / dequantize / pack on NumPy arrays.
// A layer's tensors cross as a dict {"q_weight": ..., "q_scale": ..., ...}; keys may carry the module prefix
// ("model.layers.0.mlp.up_proj.q_weight"), which then names the tensors in error messages.
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>

#include "bindings/bindings.h"
#include "exl2/safetensors.h"
#include "exl2/options.h"
#include "linear/exl2_linear.h"
#include "ops/exl2_matmul.h"
#include "quant/exl2_format.h"
#include "quant/gptq.h"

#ifdef EXL2_WITH_CUDA
#include "cuda/exl2_gemm.h"
#endif

namespace py = pybind11;

namespace exl2 {

namespace {

// The arrays of one layer, kept alive while their buffers are borrowed.
struct LayerArrays {
  std::string name;  // module prefix found in the keys ("" if none)
  std::vector<py::array> keep;
  quant::Exl2Tensors t;
};

DType numpy_dtype(const py::array& a, const std::string& key) {
  const char kind = a.dtype().kind();
  const auto size = a.dtype().itemsize();
  if (kind == 'i' && size == 4) return DType::I32;
  if (kind == 'i' && size == 2) return DType::I16;
  if (kind == 'i' && size == 1) return DType::I8;
  if (kind == 'u' && size == 1) return DType::U8;
  if (kind == 'f' && size == 2) return DType::F16;
  if (kind == 'f' && size == 4) return DType::F32;
  EXL2_FAIL(ModelFormat, "EXL2 tensor '", key, "' has NumPy dtype ", std::string(py::str(a.dtype())),
            ", which no EXL2 tensor uses (int32 q_weight/q_scale/q_invperm, int16 q_groups, float16 q_scale_max)");
}

LayerArrays layer_from_dict(const py::dict& d) {
  LayerArrays L;
  for (auto item : d) {
    const std::string key = py::str(item.first);
    const size_t dot = key.rfind('.');
    const std::string suffix = dot == std::string::npos ? key : key.substr(dot + 1);
    const std::string prefix = dot == std::string::npos ? "" : key.substr(0, dot);
    quant::Exl2Array* slot = nullptr;
    if (suffix == "q_weight") slot = &L.t.q_weight;
    else if (suffix == "q_scale") slot = &L.t.q_scale;
    else if (suffix == "q_scale_max") slot = &L.t.q_scale_max;
    else if (suffix == "q_groups") slot = &L.t.q_groups;
    else if (suffix == "q_invperm") slot = &L.t.q_invperm;
    else if (suffix == "q_perm") slot = &L.t.q_perm;
    else if (suffix == "bias") slot = &L.t.bias;
    else continue;  // other tensors of the file (q_group_map, weight of other layers...) are ignored
    if (!prefix.empty()) L.name = prefix;
    py::array a = py::array::ensure(item.second, py::array::c_style);
    if (!a) throw py::type_error("exl2: value of '" + key + "' is not convertible to a NumPy array");
    quant::Exl2Array arr;
    arr.dtype = numpy_dtype(a, key);
    arr.data = a.data();
    for (py::ssize_t i = 0; i < a.ndim(); ++i) arr.shape.push_back(a.shape(i));
    arr.present = true;
    *slot = arr;
    L.keep.push_back(a);
  }
  return L;
}

template <typename T>
py::array_t<T> to_array(const std::vector<T>& v, std::vector<py::ssize_t> shape) {
  py::array_t<T> a(shape);
  std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(T));
  return a;
}

py::array f16_array(const std::vector<uint16_t>& v, std::vector<py::ssize_t> shape) {
  py::array a(py::dtype("float16"), shape);
  std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(uint16_t));
  return a;
}

py::dict layout_dict(const quant::Exl2Layout& L) {
  py::dict d;
  d["in_features"] = L.in;
  d["out_features"] = L.out;
  d["out_pad"] = L.out_pad;
  std::vector<int> bits;
  std::vector<int64_t> rows, qrow_start;
  for (const auto& g : L.groups) {
    bits.push_back(g.bits);
    rows.push_back(g.rows);
    qrow_start.push_back(g.qrow_start);
  }
  d["bits_per_group"] = bits;
  d["group_rows"] = rows;
  d["qrow_start"] = qrow_start;
  d["total_bits"] = quant::total_bits(L);
  d["bits_per_weight"] = quant::bits_per_weight(L);
  d["bits_desc"] = quant::bits_desc(L);
  return d;
}

// RAII: the CUDA EXL2 GEMM's GEMV row limit (option gemv_max_rows) for one call (threshold < 0: leave as is).
struct ThresholdScope {
  std::optional<RuntimeOptionsScope> scope;
  explicit ThresholdScope(int threshold) {
    if (threshold < 0) return;
    RuntimeOptions o = runtime_options();
    o.gemv_max_rows = threshold;
    scope.emplace(o);
  }
};

// The EXL2 linears `prefixes` (out_features each) of one .safetensors file or model folder, loaded onto dev (who:
// the binding, for the error message).
std::vector<std::unique_ptr<Linear>> load_exl2_linears(const std::string& path, const std::vector<std::string>& prefixes,
                                                       const std::vector<int64_t>& out_features, Device dev,
                                                       const char* who) {
  EXL2_CHECK(out_features.size() == prefixes.size(), who, ": ", prefixes.size(), " prefixes but ",
             out_features.size(), " out_features");
  TensorMap tm = TensorMap::open(path);
  std::vector<std::unique_ptr<Linear>> lins;
  for (size_t i = 0; i < prefixes.size(); ++i) lins.push_back(make_exl2_linear(tm, prefixes[i], -1, out_features[i], dev));
  return lins;
}
}  // namespace

void bind_quant(py::module_& m) {
  m.def(
      "gptq_quantize",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> weight,
         py::array_t<float, py::array::c_style | py::array::forcecast> u, std::vector<std::pair<int, int64_t>> groups,
         const std::string& device, const std::string& search) {
        EXL2_CHECK(search == "absmax" || search == "hmse", "gptq_quantize: search must be 'absmax' or 'hmse', got '",
                   search, "'");
        const GptqSearch mode = search == "hmse" ? GptqSearch::kHessianMse : GptqSearch::kAbsMax;
        EXL2_CHECK(weight.ndim() == 2, "gptq_quantize: weight must be float32 [in, out], got ndim ", weight.ndim());
        EXL2_CHECK(u.ndim() == 2, "gptq_quantize: u must be float32 [in, in], got ndim ", u.ndim());
        const Device dev = Device::parse(device);
        Tensor tw = Tensor::from_blob(weight.mutable_data(), {weight.shape(0), weight.shape(1)}, DType::F32,
                                      Device::cpu());
        Tensor tu = Tensor::from_blob(u.mutable_data(), {u.shape(0), u.shape(1)}, DType::F32, Device::cpu());
        std::vector<GptqGroup> gs;
        for (const auto& g : groups) gs.push_back({g.first, g.second});
        Tensor codes, nibbles, qsm, deq;
        {
          py::gil_scoped_release release;
          ops::gptq_quantize(tw, tu, gs, dev, codes, nibbles, qsm, deq, mode);
        }
        py::dict d;
        d["codes"] = to_numpy(codes);
        d["scale_nibbles"] = to_numpy(nibbles);
        d["q_scale_max"] = to_numpy(qsm);
        d["weight"] = to_numpy(deq);
        return d;
      },
      py::arg("weight"), py::arg("u"), py::arg("groups"), py::arg("device") = "cpu", py::arg("search") = "absmax",
      "GPTQ of one linear (cpp/quant/gptq.h): weight float32 [in, out] with rows in act order (dead inputs\n"
      "zeroed), u float32 [in, in] (upper Cholesky factor of the damped, permuted H^-1), groups [(bits, rows)] in\n"
      "storage order; device 'cpu' or 'cuda[:n]' (bit-identical results). Returns dict codes uint8 [in, out],\n"
      "scale_nibbles uint8 [G, out], q_scale_max float16 [G], weight float32 [in, out] (the fp16 dequantization,\n"
      "packed row order). search: the group scale search, 'absmax' (ExLlamaV2's) or 'hmse' (Hessian-weighted\n"
      "squared error, then per-column codes).");
  m.def(
      "gptq_hessian",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> x, const std::string& device) {
        EXL2_CHECK(x.ndim() == 2, "gptq_hessian: x must be float32 [tokens, in], got ndim ", x.ndim());
        const Device dev = Device::parse(device);
        Tensor tx = Tensor::from_blob(x.mutable_data(), {x.shape(0), x.shape(1)}, DType::F32, Device::cpu());
        Tensor h;
        {
          py::gil_scoped_release release;
          h = ops::gptq_hessian(tx, dev);
        }
        return to_numpy(h);
      },
      py::arg("x"), py::arg("device") = "cpu",
      "x^T x (float32 [in, in]) of x float32 [tokens, in], fp32 accumulation, on 'cpu' or 'cuda[:n]' (cuBLAS\n"
      "sgemm over chunks of 8192 tokens, so the device holds one chunk).");

  m.def(
      "exl2_validate",
      [](const py::dict& d, int64_t in_features, int64_t out_features) {
        LayerArrays L = layer_from_dict(d);
        return layout_dict(quant::validate(L.t, L.name, in_features, out_features));
      },
      py::arg("tensors"), py::arg("in_features") = -1, py::arg("out_features") = -1,
      "Validate one EXL2 linear's tensors (dict of arrays); raises ModelFormatError naming the tensor.\n"
      "Returns the layout: in/out features, out_pad, bits_per_group, group_rows, qrow_start, total_bits,\n"
      "bits_per_weight and bits_desc (ExLlamaV2's accounting).");

  m.def(
      "exl2_dequantize",
      [](const py::dict& d, double prescale, int64_t in_features, int64_t out_features) {
        LayerArrays L = layer_from_dict(d);
        const quant::Exl2Layout layout = quant::validate(L.t, L.name, in_features, out_features);
        std::vector<uint16_t> w(static_cast<size_t>(layout.in * layout.out));
        {
          py::gil_scoped_release release;
          quant::dequantize_into(L.t, layout, prescale, w.data(), false);
        }
        return f16_array(w, {layout.in, layout.out});
      },
      py::arg("tensors"), py::arg("prescale") = 1.0, py::arg("in_features") = -1, py::arg("out_features") = -1,
      "Bit-exact ExLlamaV2 dequantization: float16 W [in, out] in original input order (HF weight = W.T).");

  m.def(
      "exl2_matmul_reference",
      [](const py::dict& d, const py::array& x, int64_t in_features, int64_t out_features) {
        LayerArrays L = layer_from_dict(d);
        const quant::Exl2Layout layout = quant::validate(L.t, L.name, in_features, out_features);
        Tensor xt = from_numpy(x);
        Tensor bias;
        if (L.t.bias.present) {
          Tensor b = Tensor::from_blob(const_cast<void*>(L.t.bias.data), L.t.bias.shape, L.t.bias.dtype, Device::cpu());
          bias = b.to_dtype(DType::F32);
        }
        ops::Exl2MatmulWeights w;
        w.device = Device::cpu();
        w.in = layout.in;
        w.out = layout.out;
        w.packed = &L.t;
        w.layout = &layout;
        w.bias = &bias;
        Shape ys = xt.shape();
        if (!ys.empty()) ys.back() = layout.out;
        Tensor y = Tensor::empty(ys, xt.dtype());
        {
          py::gil_scoped_release release;
          ops::exl2_matmul(xt, w, y);
        }
        return to_numpy(y);
      },
      py::arg("tensors"), py::arg("x"), py::arg("in_features") = -1, py::arg("out_features") = -1,
      "ops::exl2_matmul on the CPU, the reference: y = x @ W + bias for x float32 or float16 [..., in] (y of x's\n"
      "dtype), W dequantized bit-exactly, fp32 sums in input order (ops/exl2_matmul.h).");

  m.def(
      "exl2_unpack",
      [](const py::dict& d, int64_t in_features, int64_t out_features) {
        LayerArrays L = layer_from_dict(d);
        const quant::Exl2Codes c = quant::unpack(L.t, L.name, in_features, out_features);
        const auto& lay = c.layout;
        const auto G = static_cast<py::ssize_t>(lay.groups.size());
        py::dict r = layout_dict(lay);
        r["codes"] = to_array(c.codes, {lay.in, lay.out});
        r["scales"] = to_array(c.scale_nibbles, {G, lay.out});
        r["q_scale_max"] = f16_array(c.q_scale_max, {G});
        r["perm"] = to_array(lay.perm, {lay.in});
        std::vector<int64_t> groups;
        for (const auto& g : lay.groups) {
          groups.push_back(g.bits);
          groups.push_back(g.rows);
        }
        r["groups"] = to_array(groups, {G, 2});
        return r;
      },
      py::arg("tensors"), py::arg("in_features") = -1, py::arg("out_features") = -1,
      "Unpack one EXL2 linear: dict with codes uint8 [in, out] (PACKED row order: row k is input feature\n"
      "perm[k]), groups int64 [G, 2] (bits, input rows), scales uint8 [G, out] (stored nibbles 0..15),\n"
      "q_scale_max float16 [G], perm int32 [in], plus the layout keys of exl2_validate.");

  m.def(
      "exl2_pack",
      [](py::array_t<uint8_t, py::array::c_style | py::array::forcecast> codes, std::vector<int> bits_per_group,
         std::vector<int64_t> group_rows, py::array_t<uint8_t, py::array::c_style | py::array::forcecast> scales,
         const py::array& q_scale_max, py::array_t<int32_t, py::array::c_style | py::array::forcecast> perm,
         int64_t out_features) {
        const int64_t G = static_cast<int64_t>(bits_per_group.size());
        EXL2_CHECK(codes.ndim() == 2 && codes.shape(1) == out_features, "exl2_pack: codes must be [in, ",
                   out_features, "], got ndim ", codes.ndim());
        const int64_t in = codes.shape(0);
        EXL2_CHECK(scales.ndim() == 2 && scales.shape(0) == G && scales.shape(1) == out_features,
                   "exl2_pack: scale_nibbles must be [", G, ", ", out_features, "]");
        EXL2_CHECK(perm.ndim() == 1 && perm.shape(0) == in, "exl2_pack: perm must be [", in, "]");
        py::array qsm = py::array::ensure(q_scale_max, py::array::c_style);
        EXL2_CHECK(qsm && qsm.dtype().kind() == 'f' && qsm.dtype().itemsize() == 2 && qsm.ndim() == 1 &&
                       qsm.shape(0) == G,
                   "exl2_pack: q_scale_max must be float16 [", G, "]");
        quant::Exl2PackInput p;
        p.codes = codes.data();
        p.group_bits = bits_per_group;
        p.group_rows = group_rows;
        p.scale_nibbles = scales.data();
        p.q_scale_max = static_cast<const uint16_t*>(qsm.data());
        p.perm = perm.data();
        p.in = in;
        p.out = out_features;
        quant::Exl2Packed r;
        {
          py::gil_scoped_release release;
          r = quant::pack(p);
        }
        py::dict d;
        d["q_weight"] = to_array(r.q_weight, {r.qrows, r.out_pad});
        d["q_scale"] = to_array(r.q_scale, {r.n_groups, r.out_pad / 8});
        d["q_scale_max"] = f16_array(r.q_scale_max, {r.n_groups});
        d["q_groups"] = to_array(r.q_groups, {2 * r.n_groups});
        d["q_invperm"] = to_array(r.q_invperm, {r.in});
        return d;
      },
      py::arg("codes"), py::arg("bits_per_group"), py::arg("group_rows"), py::arg("scale_nibbles"),
      py::arg("q_scale_max"), py::arg("perm"), py::arg("out_features"),
      "Pack codes uint8 [in, out] (PACKED row order), per-group bits and input rows (storage order, bits\n"
      "non-increasing), scale nibbles uint8 [G, out], q_scale_max float16 [G] and perm int [in] (original\n"
      "feature of packed row k) into the exact on-disk EXL2 tensors: dict q_weight, q_scale, q_scale_max,\n"
      "q_groups, q_invperm.");

  m.def(
      "exl2_linear_load",
      [](const std::string& path, const std::string& prefix, int64_t in_features, int64_t out_features,
         const py::object& x) {
        TensorMap tm = TensorMap::open(path);
        std::unique_ptr<Linear> lin = make_exl2_linear(tm, prefix, in_features, out_features, Device::cpu());
        py::dict d;
        d["kind"] = lin->kind();
        d["in_features"] = lin->in_features();
        d["out_features"] = lin->out_features();
        d["nbytes"] = lin->nbytes();
        d["device_bytes"] = lin->device_nbytes();
        d["bits_per_weight"] = lin->bits_per_weight();
        d["bits_desc"] = lin->bits_desc();
        d["weight_f32"] = to_numpy(lin->weight_f32());
        if (!x.is_none()) {
          Tensor xt = from_numpy(x.cast<py::array>(), "f32");
          Tensor y = Tensor::empty({xt.size(0), lin->out_features()}, DType::F32);
          lin->forward(xt, y);
          d["y"] = to_numpy(y);
        }
        return d;
      },
      py::arg("path"), py::arg("prefix"), py::arg("in_features") = -1, py::arg("out_features") = -1,
      py::arg("x") = py::none(),
      "Load one EXL2 linear through the Linear layer (CPU) from a .safetensors file or model folder: dict with\n"
      "kind, in/out features, nbytes, bits_per_weight, bits_desc, weight_f32 [out, in] and, given x f32\n"
      "[n, in], y = forward(x) [n, out]. For tests and tools.");
  m.def(
      "exl2_linear_forward",
      [](const std::string& path, const std::string& prefix, const py::array& x, const std::string& device,
         int64_t in_features, int64_t out_features, int threshold) {
        ThresholdScope scope(threshold);
        const Device dev = Device::parse(device);
        TensorMap tm = TensorMap::open(path);
        std::unique_ptr<Linear> lin = make_exl2_linear(tm, prefix, in_features, out_features, dev);
        Tensor xt = from_numpy(x);
        EXL2_CHECK(xt.dtype() == DType::F16 || xt.dtype() == DType::F32, "exl2_linear_forward: x must be float16 or "
                   "float32 [n, in], got ", xt.describe());
        EXL2_CHECK(xt.dim() == 2, "exl2_linear_forward: x must be [n, in], got ", xt.describe());
        Tensor y;
        {
          py::gil_scoped_release release;
          Tensor xd = xt.to(dev);
          Tensor yd = Tensor::empty({xt.size(0), lin->out_features()}, xt.dtype(), dev);
          lin->forward(xd, yd);
          y = yd.to(Device::cpu()).to_dtype(DType::F32);
        }
        return to_numpy(y);
      },
      py::arg("path"), py::arg("prefix"), py::arg("x"), py::arg("device") = "cuda", py::arg("in_features") = -1,
      py::arg("out_features") = -1, py::arg("threshold") = -1,
      "Load one EXL2 linear from a .safetensors file or model folder onto `device` and return\n"
      "y = forward(x) as float32 [n, out]; x float16 or float32 [n, in] (the activation dtype). On CUDA,\n"
      "threshold >= 0 forces the fused-kernel row limit for this call (rows <= threshold: fused GEMV,\n"
      "else dequantize + cuBLAS). For tests and tools.");

  m.def(
      "exl2_linear_forward_group",
      [](const std::string& path, const std::vector<std::string>& prefixes, const py::array& x,
         const std::vector<int64_t>& out_features, const std::string& device, bool group) {
        const Device dev = Device::parse(device);
        std::vector<std::unique_ptr<Linear>> lins =
            load_exl2_linears(path, prefixes, out_features, dev, "exl2_linear_forward_group");
        Tensor xt = from_numpy(x);
        EXL2_CHECK((xt.dtype() == DType::F16 || xt.dtype() == DType::F32) && xt.dim() == 2,
                   "exl2_linear_forward_group: x must be float16 or float32 [n, in], got ", xt.describe());
        bool grouped = false;
        std::vector<Tensor> ys;
        {
          py::gil_scoped_release release;
          Tensor xd = xt.to(dev);
          std::vector<Tensor> yd;
          for (const auto& l : lins) yd.push_back(Tensor::empty({xt.size(0), l->out_features()}, xt.dtype(), dev));
          std::vector<Linear*> ls;
          std::vector<Tensor*> yp;
          for (size_t i = 0; i < lins.size(); ++i) {
            ls.push_back(lins[i].get());
            yp.push_back(&yd[i]);
          }
          if (group)
            grouped = forward_group(ls, xd, yp);
          else
            for (size_t i = 0; i < lins.size(); ++i) lins[i]->forward(xd, yd[i]);
          for (const Tensor& y : yd) ys.push_back(y.to(Device::cpu()).to_dtype(DType::F32));
        }
        py::list out;
        for (const Tensor& y : ys) out.append(to_numpy(y));
        return py::make_tuple(out, grouped);
      },
      py::arg("path"), py::arg("prefixes"), py::arg("x"), py::arg("out_features"), py::arg("device") = "cuda",
      py::arg("group") = true,
      "Load the EXL2 linears `prefixes` (out_features each) of one .safetensors file onto `device` and apply them all\n"
      "to x (float16 or float32 [n, in]): group True through forward_group (one launch where it qualifies), False\n"
      "through forward() on each. Returns (list of float32 [n, out_i], whether the single launch ran). For tests.");

  m.def(
      "exl2_linear_forward_fused",
      [](const std::string& path, const std::vector<std::string>& prefixes, const py::array& src,
         const std::vector<int64_t>& out_features, const std::string& device, const std::string& prologue,
         std::optional<py::array> norm_w, const std::string& norm_dtype, float eps, std::optional<py::array> up,
         std::optional<py::array> y, bool fused) {
        const Device dev = Device::parse(device);
        std::vector<std::unique_ptr<Linear>> lins =
            load_exl2_linears(path, prefixes, out_features, dev, "exl2_linear_forward_fused");
        Tensor st = from_numpy(src);
        EXL2_CHECK((st.dtype() == DType::F16 || st.dtype() == DType::F32) && st.dim() == 2,
                   "exl2_linear_forward_fused: src must be float16 or float32 [n, in], got ", st.describe());
        LinearPrologue pro;
        if (prologue == "rms_norm") {
          EXL2_CHECK(norm_w.has_value(), "exl2_linear_forward_fused: prologue rms_norm needs norm_w");
          Tensor w = from_numpy(*norm_w, norm_dtype);
          pro = LinearPrologue::rms_norm(w.to(dev), eps);
        } else if (prologue == "silu_mul") {
          EXL2_CHECK(up.has_value(), "exl2_linear_forward_fused: prologue silu_mul needs up");
          pro = LinearPrologue::silu_mul(from_numpy(*up).to(dev));
        } else {
          EXL2_CHECK(prologue == "none", "exl2_linear_forward_fused: prologue must be none, rms_norm or silu_mul, got '",
                     prologue, "'");
        }
        Tensor y0 = y.has_value() ? from_numpy(*y) : Tensor();
        bool ran = false;
        std::vector<Tensor> ys;
        Tensor src_after;
        {
          py::gil_scoped_release release;
          Tensor sd = st.to(dev);
          std::vector<Tensor> yd;
          int64_t widest = st.size(1);
          for (const auto& l : lins) {
            widest = std::max(widest, l->out_features());
            yd.push_back(y0.defined() ? y0.to(dev) : Tensor::empty({st.size(0), l->out_features()}, st.dtype(), dev));
          }
          Tensor scratch = Tensor::empty({st.size(0) * (st.size(1) + widest)}, st.dtype(), dev);
          std::vector<Linear*> ls;
          std::vector<Tensor*> yp;
          for (size_t i = 0; i < lins.size(); ++i) {
            ls.push_back(lins[i].get());
            yp.push_back(&yd[i]);
          }
          if (fused)
            ran = forward_fused(ls, sd, pro, yp, y0.defined(), scratch);
          else
            forward_composed(ls, sd, pro, yp, y0.defined(), scratch);
          for (const Tensor& t : yd) ys.push_back(t.to(Device::cpu()).to_dtype(DType::F32));
          src_after = sd.to(Device::cpu()).to_dtype(DType::F32);
        }
        py::list out;
        for (const Tensor& t : ys) out.append(to_numpy(t));
        return py::make_tuple(out, ran, to_numpy(src_after));
      },
      py::arg("path"), py::arg("prefixes"), py::arg("src"), py::arg("out_features"), py::arg("device") = "cuda",
      py::arg("prologue") = "none", py::arg("norm_w") = py::none(), py::arg("norm_dtype") = "", py::arg("eps") = 1e-5f,
      py::arg("up") = py::none(), py::arg("y") = py::none(), py::arg("fused") = true,
      "Load the EXL2 linears `prefixes` of one .safetensors file onto `device` and run linear::forward_fused (fused\n"
      "True) or forward_composed on src (float16 or float32 [n, in]): prologue 'none', 'rms_norm' (norm_w [in], cast\n"
      "to norm_dtype 'f32'/'f16'/'bf16' when given, eps) or 'silu_mul' (up like src); y given ([n, out], src's dtype,\n"
      "one layer): the product is added into it. Returns (list of float32 [n, out_i], whether the fused launch ran,\n"
      "src afterwards as float32). For tests.");

  m.def(
      "exl2_linear_bench_group",
      [](const std::vector<std::string>& paths, const std::vector<std::string>& prefixes, int64_t rows, int iters,
         const std::string& device, bool group) {
#ifdef EXL2_WITH_CUDA
        const Device dev = Device::parse(device);
        EXL2_CHECK(dev.is_cuda() && rows > 0 && iters > 0 && !paths.empty() && paths.size() == prefixes.size(),
                   "exl2_linear_bench_group: a CUDA device, rows > 0, iters > 0 and one prefix per path expected");
        std::vector<TensorMap> tms;
        std::vector<std::unique_ptr<Linear>> lins;
        for (size_t i = 0; i < paths.size(); ++i) {
          tms.push_back(TensorMap::open(paths[i]));
          lins.push_back(make_exl2_linear(tms.back(), prefixes[i], -1, -1, dev));
          EXL2_CHECK(lins.back()->in_features() == lins[0]->in_features(), "exl2_linear_bench_group: layer ", i,
                     " has ", lins.back()->in_features(), " inputs, layer 0 ", lins[0]->in_features());
        }
        const int64_t in = lins[0]->in_features();
        std::vector<uint16_t> xh(static_cast<size_t>(rows * in));
        uint32_t st = 12345u;
        for (auto& v : xh) {
          st = st * 1664525u + 1013904223u;
          v = f32_to_f16(static_cast<float>(st >> 8) / 8388608.f - 1.f);
        }
        double s = 0.0;
        bool grouped = false;
        {
          py::gil_scoped_release release;
          Tensor x = Tensor::from_host(xh.data(), {rows, in}, DType::F16).to(dev);
          std::vector<Tensor> ys;
          for (const auto& l : lins) ys.push_back(Tensor::empty({rows, l->out_features()}, DType::F16, dev));
          std::vector<Linear*> ls;
          std::vector<Tensor*> yp;
          for (size_t i = 0; i < lins.size(); ++i) {
            ls.push_back(lins[i].get());
            yp.push_back(&ys[i]);
          }
          auto step = [&] {
            if (group)
              grouped = forward_group(ls, x, yp);
            else
              for (size_t i = 0; i < ls.size(); ++i) ls[i]->forward(x, ys[i]);
          };
          s = cuda::time_on_stream_seconds(dev, step, iters);
        }
        py::dict d;
        d["seconds"] = s;
        d["grouped"] = grouped;
        return d;
#else
        EXL2_FAIL(Unsupported, "exl2_linear_bench_group needs a build with the CUDA backend");
#endif
      },
      py::arg("paths"), py::arg("prefixes"), py::arg("rows") = 1, py::arg("iters") = 50, py::arg("device") = "cuda",
      py::arg("group") = true,
      "Seconds per call of the EXL2 linears prefixes[i] of paths[i] (one x of `rows` random f16 rows shared by all)\n"
      "on a CUDA device: group True through forward_group (one launch where it qualifies), False one forward() each\n"
      "(CUDA events, mean over iters after 3 warm-ups); dict seconds, grouped (whether the single launch ran).");

  m.def(
      "exl2_linear_bench",
      [](const std::string& path, const std::string& prefix, int64_t rows, int iters, const std::string& device,
         int threshold) {
#ifdef EXL2_WITH_CUDA
        ThresholdScope scope(threshold);
        const Device dev = Device::parse(device);
        EXL2_CHECK(dev.is_cuda() && rows > 0 && iters > 0, "exl2_linear_bench: a CUDA device, rows > 0 and "
                   "iters > 0 expected");
        TensorMap tm = TensorMap::open(path);
        std::unique_ptr<Linear> lin = make_exl2_linear(tm, prefix, -1, -1, dev);
        std::vector<uint16_t> xh(static_cast<size_t>(rows * lin->in_features()));
        uint32_t st = 12345u;
        for (auto& v : xh) {
          st = st * 1664525u + 1013904223u;
          v = f32_to_f16(static_cast<float>(st >> 8) / 8388608.f - 1.f);
        }
        py::dict d;
        double s = 0.0;
        {
          py::gil_scoped_release release;
          Tensor x = Tensor::from_host(xh.data(), {rows, lin->in_features()}, DType::F16).to(dev);
          Tensor y = Tensor::empty({rows, lin->out_features()}, DType::F16, dev);
          s = cuda::time_on_stream_seconds(dev, [&] { lin->forward(x, y); }, iters);
        }
        d["seconds"] = s;
        d["in_features"] = lin->in_features();
        d["out_features"] = lin->out_features();
        d["nbytes"] = lin->nbytes();
        d["device_bytes"] = lin->device_nbytes();
        d["bits_per_weight"] = lin->bits_per_weight();
        d["bits_desc"] = lin->bits_desc();
        return d;
#else
        EXL2_FAIL(Unsupported, "exl2_linear_bench needs a build with the CUDA backend");
#endif
      },
      py::arg("path"), py::arg("prefix"), py::arg("rows") = 1, py::arg("iters") = 50, py::arg("device") = "cuda",
      py::arg("threshold") = -1,
      "Seconds per forward of one EXL2 linear on a CUDA device for `rows` rows of random f16 x (CUDA events,\n"
      "mean over iters after 3 warm-ups), plus in/out features, nbytes (the file's), device_bytes (what the layer\n"
      "holds on the device: the v4 layout), bits_per_weight, bits_desc.");
}

}  // namespace exl2
