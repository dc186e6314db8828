// The pybind11 module exl2cpp._C: the only bridge between Python and the runtime. C++ exl2::Error kinds become
// the exception classes of exl2cpp.errors; long calls release the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "exl2/errors.h"

namespace py = pybind11;

namespace {

void translate_error(const exl2::Error& e) {
  static const char* names[] = {"InvalidArgumentError", "ModelFormatError", "UnsupportedError", "CudaError",
                                "OutOfMemoryError",     "ModelFileError",   "InternalError"};
  py::object errors = py::module_::import("exl2cpp.errors");
  py::object cls = errors.attr(names[static_cast<int>(e.kind())]);
  PyErr_SetString(cls.ptr(), e.what());
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "exl2cpp runtime (private; use the exl2cpp package)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const exl2::Error& e) {
      translate_error(e);
    }
  });
  exl2::bind_core(m);
  exl2::bind_ops(m);
  exl2::bind_model(m);
  exl2::bind_quant(m);
  exl2::bind_engine(m);
  exl2::bind_cuda(m);
  exl2::bind_engine_jobs(m);
  exl2::bind_calibration(m);
  exl2::bind_options(m);
}
