// Bindings for the converter's calibration forward (model/calibration.h): _C.Calibration. A run's hook is a Python
// callable hook(name) called with the GIL held before each linear's product; inside it, input() / input_hessian()
// read the product's input and set_weight() may replace any linear of the layer.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>

#include "bindings/bindings.h"
#include "model/calibration.h"

namespace py = pybind11;

namespace exl2 {

namespace {

struct PyCalibration {
  std::unique_ptr<Calibration> c;
  const Tensor* pending = nullptr;  // the input of the linear whose hook is running

  const Tensor& input() const {
    EXL2_CHECK(pending != nullptr, "Calibration.input / input_hessian: only inside a run's hook");
    return *pending;
  }
};

py::array states_of(const PyCalibration& s, Tensor t) {
  return to_numpy(t.view({s.c->rows(), s.c->tokens(), t.size(-1)}));
}

}  // namespace

void bind_calibration(py::module_& m) {
  py::class_<PyCalibration>(m, "Calibration",
                            "The converter's calibration forward: one decoder layer at a time of an unquantized model "
                            "through the runtime's decoder body, fp32, with capture hooks (model/calibration.h).")
      .def(py::init([](const std::string& path, const std::string& device, int64_t rows, int64_t tokens) {
             const Device dev = Device::parse(device);
             py::gil_scoped_release nogil;
             auto s = std::make_unique<PyCalibration>();
             s->c = std::make_unique<Calibration>(path, dev, rows, tokens);
             return s;
           }),
           py::arg("path"), py::arg("device"), py::arg("rows"), py::arg("tokens"))
      .def_property_readonly("rows", [](const PyCalibration& s) { return s.c->rows(); })
      .def_property_readonly("tokens", [](const PyCalibration& s) { return s.c->tokens(); })
      .def_property_readonly("n_layers", [](const PyCalibration& s) { return s.c->config().num_hidden_layers; })
      .def_property_readonly("hidden", [](const PyCalibration& s) { return s.c->config().hidden_size; })
      .def_property_readonly("names",
                             [](const PyCalibration& s) {
                               const TensorNames& n = s.c->spec().names;
                               py::dict d;
                               d["embed"] = n.embed;
                               d["layers"] = n.layers;
                               d["final_norm"] = n.final_norm;
                               d["head"] = n.head;
                               return d;
                             },
                             "Tensor names of the model's embedding, layers prefix, final norm and head (linear "
                             "prefix; absent from the file: tied to the embedding).")
      .def(
          "linears",
          [](const PyCalibration& s, int64_t li) {
            py::list out;
            for (const CalibLinear& l : s.c->linears(li)) {
              py::dict d;
              d["name"] = l.name;
              d["role"] = l.role;
              d["input"] = l.input;
              d["in"] = l.in;
              d["out"] = l.out;
              d["bias"] = l.bias;
              d["quantized"] = l.quantized;
              out.append(d);
            }
            return out;
          },
          py::arg("layer"), "Layer `layer`'s linear tensors in file order (each expert's own): dicts name, role, input (the first linear "
          "reading the same input), in, out, bias, quantized (false: the router and shared expert gate, kept as "
          "stored).")
      .def(
          "embed",
          [](PyCalibration& s, const py::array& ids) {
            Tensor t = from_numpy(ids);
            py::gil_scoped_release nogil;
            s.c->embed(t);
          },
          py::arg("ids"), "x = the embedding of ids int32 [rows, tokens].")
      .def(
          "set_states",
          [](PyCalibration& s, const py::array& x) {
            Tensor t = from_numpy(x);
            py::gil_scoped_release nogil;
            s.c->set_states(t);
          },
          py::arg("x"))
      .def("states", [](const PyCalibration& s) { return states_of(s, s.c->states()); },
           "x float32 [rows, tokens, hidden].")
      .def("output", [](const PyCalibration& s) { return states_of(s, s.c->output()); },
           "y (the last run's block output) float32 [rows, tokens, hidden].")
      .def("head_input", [](const PyCalibration& s) { return states_of(s, s.c->head_input()); },
           "The final norm of x, float32 [rows, tokens, hidden]: lm_head's input.")
      .def(
          "load_layer",
          [](PyCalibration& s, int64_t li) {
            py::gil_scoped_release nogil;
            s.c->load_layer(li);
          },
          py::arg("layer"))
      .def_property_readonly("n_blocks", [](const PyCalibration& s) { return s.c->n_blocks(); },
                             "Residual blocks of the loaded layer (attention, MLP; 1 for a parallel residual).")
      .def(
          "run",
          [](PyCalibration& s, int64_t block, std::optional<py::function> hook) {
            CaptureHook h;
            if (hook) {
              py::function fn = *hook;
              h = [&s, fn](const std::string& name, const Tensor& x) {
                py::gil_scoped_acquire gil;
                s.pending = &x;
                try {
                  fn(name);
                } catch (...) {
                  s.pending = nullptr;
                  throw;
                }
                s.pending = nullptr;
              };
            }
            py::gil_scoped_release nogil;
            s.c->run(block, h);
          },
          py::arg("block"), py::arg("hook") = py::none(),
          "y = block `block` of the loaded layer applied to x; hook(name) before each linear's product (name: the "
          "file prefix; input() / input_hessian() read the product's input there).")
      .def(
          "input",
          [](const PyCalibration& s) {
            const Tensor& x = s.input();
            return to_numpy(x.to(Device::cpu()));
          },
          "Inside a hook: the product's input float32 [m, in].")
      .def(
          "input_rows", [](const PyCalibration& s) { return s.input().size(0); },
          "Inside a hook: the product's input rows m (an expert's: the tokens routed to it).")
      .def_property_readonly("moe",
                             [](const PyCalibration& s) {
                               const MoeSpec& m = s.c->spec().moe;
                               py::dict d;
                               d["experts"] = m.n_experts;
                               d["top_k"] = m.top_k;
                               d["intermediate"] = m.inter;
                               d["shared_intermediate"] = m.shared_inter;
                               return d;
                             },
                             "The MoE layers' sizes (experts 0: none).")
      .def(
          "input_hessian",
          [](const PyCalibration& s) {
            const Tensor& x = s.input();
            Tensor h;
            {
              py::gil_scoped_release nogil;
              h = s.c->hessian(x);
            }
            return to_numpy(h);
          },
          "Inside a hook: x^T x float32 [in, in] of the product's input, on the calibration device.")
      .def(
          "set_weight",
          [](PyCalibration& s, const std::string& name, const py::array& w) {
            Tensor t = from_numpy(w);
            py::gil_scoped_release nogil;
            s.c->set_weight(name, t);
          },
          py::arg("name"), py::arg("weight"), "Linear `name` of the loaded layer computes with weight [out, in].")
      .def(
          "reset_weight",
          [](PyCalibration& s, const std::string& name) {
            py::gil_scoped_release nogil;
            s.c->reset_weight(name);
          },
          py::arg("name"))
      .def(
          "set_head_ref",
          [](PyCalibration& s, const py::array& head) {
            Tensor t = from_numpy(head);
            py::gil_scoped_release nogil;
            s.c->set_head_ref(t);
          },
          py::arg("head"),
          "Keep head [vocab, hidden] and the current head input as head_kl's reference (model/calibration.h).")
      .def(
          "head_kl",
          [](const PyCalibration& s, int64_t block) {
            py::gil_scoped_release nogil;
            return s.c->head_kl(block);
          },
          py::arg("block") = 0,
          "Mean over positions of KL(softmax(head @ ref) || softmax(head @ h)), h the current head input, in blocks "
          "of `block` positions (0: automatic).")
      .def("set_ref",
           [](PyCalibration& s) {
             py::gil_scoped_release nogil;
             s.c->set_ref();
           })
      .def("rel_err",
           [](const PyCalibration& s) {
             py::gil_scoped_release nogil;
             return s.c->rel_err();
           })
      .def(
          "commit",
          [](PyCalibration& s, bool from_ref) {
            py::gil_scoped_release nogil;
            s.c->commit(from_ref);
          },
          py::arg("from_ref"))
      .def("sync", [](const PyCalibration& s) {
        py::gil_scoped_release nogil;
        s.c->sync();
      });
}

}  // namespace exl2
