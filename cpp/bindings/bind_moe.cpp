// Bindings of the MoE ops (ops/ops.h moe_route / moe_group / moe_combine) and of MoeExperts (linear/moe_linear.h)
// as _C.op_moe_* / _C.moe_experts_*, NumPy in and out, for tests/test_moe_ops.py.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>

#include "bindings/bindings.h"
#include "linear/moe_linear.h"
#ifdef EXL2_WITH_CUDA
#include "cuda/exl2_gemm.h"
#include "cuda/graph_exec.h"
#endif
#include "ops/ops.h"

namespace py = pybind11;

namespace exl2 {
namespace {

Tensor moe_arg(const py::array& a, const Device& dev) {
  Tensor t = from_numpy(a);
  return dev.is_cpu() ? t : t.to(dev);
}

}  // namespace

void bind_moe(py::module_& m) {
  m.def(
      "op_moe_route",
      [](py::array logits, int64_t k, bool renormalize, const std::string& device) {
        const Device dev = Device::parse(device);
        Tensor tl = moe_arg(logits, dev);
        const int64_t rows = tl.dim() ? tl.size(0) : 0;
        Tensor ids = Tensor::empty({rows, k > 0 ? k : 0}, DType::I32, dev);
        Tensor w = Tensor::empty({rows, k > 0 ? k : 0}, DType::F32, dev);
        {
          py::gil_scoped_release nogil;
          ops::moe_route(tl, k, renormalize, ids, w);
        }
        return py::make_tuple(to_numpy(ids), to_numpy(w));
      },
      py::arg("logits"), py::arg("k"), py::arg("renormalize"), py::arg("device") = "cpu",
      "ops::moe_route: (ids int32 [rows, k], weights float32 [rows, k]).");
  m.def(
      "op_moe_group",
      [](py::array ids, int64_t n_experts, const std::string& device) {
        const Device dev = Device::parse(device);
        Tensor ti = moe_arg(ids, dev);
        const int64_t n = ti.numel(), e = n_experts > 0 ? n_experts : 0;
        Tensor off = Tensor::empty({e + 1}, DType::I32, dev), perm = Tensor::empty({n}, DType::I32, dev);
        Tensor inv = Tensor::empty({n}, DType::I32, dev), active = Tensor::empty({e + 1}, DType::I32, dev);
        {
          py::gil_scoped_release nogil;
          ops::moe_group(ti, n_experts, off, perm, inv, active);
        }
        return py::make_tuple(to_numpy(off), to_numpy(perm), to_numpy(inv), to_numpy(active));
      },
      py::arg("ids"), py::arg("n_experts"), py::arg("device") = "cpu",
      "ops::moe_group: (offsets [E + 1], perm [P], inv [P], active [E + 1]), all int32.");
  m.def(
      "op_moe_combine",
      [](py::array expert_out, py::array weights, py::array inv, std::optional<py::array> shared,
         std::optional<py::array> shared_gate, std::optional<py::array> out, int64_t hidden,
         const std::string& device) {
        const Device dev = Device::parse(device);
        Tensor eo = moe_arg(expert_out, dev), tw = moe_arg(weights, dev), ti = moe_arg(inv, dev);
        Tensor ts = shared ? moe_arg(*shared, dev) : Tensor(), tg = shared_gate ? moe_arg(*shared_gate, dev) : Tensor();
        const int64_t rows = tw.dim() ? tw.size(0) : 0;
        Tensor to = out ? moe_arg(*out, dev) : Tensor::empty({rows, hidden}, eo.dtype(), dev);
        {
          py::gil_scoped_release nogil;
          ops::moe_combine(eo, tw, ti, ts, tg, out.has_value(), to);
        }
        return to_numpy(to);
      },
      py::arg("expert_out"), py::arg("weights"), py::arg("inv"), py::arg("shared") = py::none(),
      py::arg("shared_gate") = py::none(), py::arg("out") = py::none(), py::arg("hidden") = 0,
      py::arg("device") = "cpu",
      "ops::moe_combine; given out, the result is added into (a copy of) it (add = true), else hidden sizes out.");
  m.def(
      "moe_experts_forward",
      [](const std::string& path, const std::vector<std::string>& prefixes, py::array x, py::array ids,
         int64_t in_features, int64_t out_features, bool gather, const std::string& device, int repeats) {
        const Device dev = Device::parse(device);
        TensorMap tm = TensorMap::open(path);
        std::unique_ptr<MoeExperts> ex = MoeExperts::load(tm, prefixes, in_features, out_features, dev);
        Tensor tx = moe_arg(x, dev), ti = moe_arg(ids, dev);
        EXL2_CHECK(ti.dim() == 2, "moe_experts_forward: ids must be [rows, k], got ", ti.describe());
        const int64_t n_pairs = ti.numel(), k = ti.size(1), n_exp = ex->n_experts();
        MoeGrouping g{Tensor::empty({n_exp + 1}, DType::I32, dev), Tensor::empty({n_pairs}, DType::I32, dev),
                      Tensor::empty({n_pairs}, DType::I32, dev), Tensor::empty({n_exp + 1}, DType::I32, dev)};
        Tensor y = Tensor::empty({n_pairs, ex->out_features()}, tx.dtype(), dev);
        Tensor bytes = Tensor::zeros({2}, DType::I32, dev);
        std::vector<py::array> ys;
        MoeExperts::Path taken = MoeExperts::Path::per_expert;
        for (int r = 0; r < std::max(1, repeats); ++r) {
          {
            py::gil_scoped_release nogil;
            ops::moe_group(ti, n_exp, g.offsets, g.perm, g.inv, g.active);
            taken = ex->forward(tx, k, gather, g, y, bytes);
          }
          ys.push_back(to_numpy(y));
        }
        Tensor hb = bytes.to(Device::cpu());
        uint64_t nb = 0;
        std::memcpy(&nb, hb.data(), sizeof(nb));
        std::vector<int64_t> wb;
        for (int64_t e = 0; e < n_exp; ++e) wb.push_back(ex->weight_bytes(e));
        const char* names[] = {"grouped_exl2", "grouped_dense", "per_expert"};
        py::dict d;
        d["y"] = ys.size() == 1 ? py::object(ys[0]) : py::object(py::cast(ys));
        d["path"] = names[static_cast<int>(taken)];
        d["bytes_read"] = nb;
        d["weight_bytes"] = wb;
        return d;
      },
      py::arg("path"), py::arg("prefixes"), py::arg("x"), py::arg("ids"), py::arg("in_features"),
      py::arg("out_features"), py::arg("gather") = true, py::arg("device") = "cpu", py::arg("repeats") = 1,
      "Loads MoeExperts from `prefixes` of a .safetensors file onto `device`, groups ids int32 [rows, k] there\n"
      "(ops::moe_group) and runs forward(x, k, gather): dict y [P, out] (x's dtype; a list of `repeats` results),\n"
      "path, bytes_read (the weight bytes counted during all repeats), weight_bytes per expert.");
  m.def(
      "moe_graph_replay",
      [](const std::string& path, const std::vector<std::string>& prefixes, py::array x,
         const std::vector<py::array>& logits, int64_t k, int64_t in_features, int64_t out_features,
         const std::string& device) {
  // One routed projection step on the device: moe_route -> moe_group -> MoeExperts::forward (gather) ->
  // moe_combine, captured once into a CUDA graph (after an eager warm-up) and replayed for every logits[i]
  // (copied into the captured logits buffer); each also run eagerly. Returns (graph outputs, eager outputs).
#ifdef EXL2_WITH_CUDA
        const Device dev = Device::parse(device);
        EXL2_CHECK(dev.is_cuda() && !logits.empty(), "moe_graph_replay: a CUDA device and logits expected");
        TensorMap tm = TensorMap::open(path);
        std::unique_ptr<MoeExperts> ex = MoeExperts::load(tm, prefixes, in_features, out_features, dev);
        Tensor tx = moe_arg(x, dev), tl = moe_arg(logits[0], dev);
        const int64_t rows = tx.size(0), n_pairs = rows * k, n_exp = ex->n_experts();
        Tensor ids = Tensor::empty({rows, k}, DType::I32, dev), w = Tensor::empty({rows, k}, DType::F32, dev);
        MoeGrouping g{Tensor::empty({n_exp + 1}, DType::I32, dev), Tensor::empty({n_pairs}, DType::I32, dev),
                      Tensor::empty({n_pairs}, DType::I32, dev), Tensor::empty({n_exp + 1}, DType::I32, dev)};
        Tensor eo = Tensor::empty({n_pairs, ex->out_features()}, tx.dtype(), dev);
        Tensor y = Tensor::empty({rows, ex->out_features()}, tx.dtype(), dev);
        auto step = [&] {
          ops::moe_route(tl, k, true, ids, w);
          ops::moe_group(ids, n_exp, g.offsets, g.perm, g.inv, g.active);
          ex->forward(tx, k, true, g, eo);
          ops::moe_combine(eo, w, g.inv, Tensor(), Tensor(), false, y);
        };
        py::list graph_out, eager_out;
        py::gil_scoped_release nogil;
        step();  // warm-up: the grouped kernel's workspace grows here, not during the capture
        cuda::Graph graph;
        graph.capture(dev.index, step);
        for (const py::array& l : logits) {
          Tensor h;
          {
            py::gil_scoped_acquire gil;
            h = from_numpy(l);
          }
          tl.copy_from(h);
          graph.launch(dev.index);
          cuda::synchronize_stream(dev.index);
          Tensor yg = y.to(Device::cpu());
          step();
          cuda::synchronize_stream(dev.index);
          Tensor ye = y.to(Device::cpu());
          py::gil_scoped_acquire gil;
          graph_out.append(to_numpy(yg));
          eager_out.append(to_numpy(ye));
        }
        py::gil_scoped_acquire gil;
        return py::make_tuple(graph_out, eager_out);
#else
        (void)path, (void)prefixes, (void)x, (void)logits, (void)k, (void)in_features, (void)out_features, (void)device;
        EXL2_FAIL(Unsupported, "moe_graph_replay needs a build with the CUDA backend");
#endif
      },
      py::arg("path"), py::arg("prefixes"), py::arg("x"), py::arg("logits"), py::arg("k"), py::arg("in_features"),
      py::arg("out_features"), py::arg("device") = "cuda:0");
  m.def(
      "moe_experts_bench",
      [](const std::string& path, const std::vector<std::string>& prefixes, py::array ids, int64_t in_features,
         int64_t out_features, int iters, const std::string& device) {
  // Seconds per MoeExperts::forward (gather) on fixed ids (grouping done once), and the weight bytes one
  // call streams (the kernel's counter). For bench/bench_moe.py.
#ifdef EXL2_WITH_CUDA
        const Device dev = Device::parse(device);
        EXL2_CHECK(dev.is_cuda() && iters > 0, "moe_experts_bench: a CUDA device and iters > 0 expected");
        TensorMap tm = TensorMap::open(path);
        std::unique_ptr<MoeExperts> ex = MoeExperts::load(tm, prefixes, in_features, out_features, dev);
        Tensor ti = moe_arg(ids, dev);
        const int64_t rows = ti.size(0), k = ti.size(1), n_pairs = rows * k, n_exp = ex->n_experts();
        MoeGrouping g{Tensor::empty({n_exp + 1}, DType::I32, dev), Tensor::empty({n_pairs}, DType::I32, dev),
                      Tensor::empty({n_pairs}, DType::I32, dev), Tensor::empty({n_exp + 1}, DType::I32, dev)};
        Tensor x = Tensor::zeros({rows, ex->in_features()}, DType::F16, dev);
        Tensor y = Tensor::empty({n_pairs, ex->out_features()}, DType::F16, dev);
        Tensor bytes = Tensor::zeros({2}, DType::I32, dev);
        py::gil_scoped_release nogil;
        ops::moe_group(ti, n_exp, g.offsets, g.perm, g.inv, g.active);
        const MoeExperts::Path p = ex->forward(x, k, true, g, y, bytes);
        Tensor hb = bytes.to(Device::cpu());
        uint64_t nb = 0;
        std::memcpy(&nb, hb.data(), sizeof(nb));
        const double s = cuda::time_on_stream_seconds(dev, [&] { ex->forward(x, k, true, g, y); }, iters);
        const char* names[] = {"grouped_exl2", "grouped_dense", "per_expert"};
        py::gil_scoped_acquire gil;
        return py::make_tuple(s, nb, names[static_cast<int>(p)]);
#else
        (void)path, (void)prefixes, (void)ids, (void)in_features, (void)out_features, (void)iters, (void)device;
        EXL2_FAIL(Unsupported, "moe_experts_bench needs a build with the CUDA backend");
#endif
      },
      py::arg("path"), py::arg("prefixes"), py::arg("ids"), py::arg("in_features"), py::arg("out_features"),
      py::arg("iters") = 50, py::arg("device") = "cuda:0");
}

}  // namespace exl2
