// Bindings for the quant area (see bindings.h).
#include "bindings/bindings.h"

namespace exl2 {
void bind_quant(pybind11::module_& m) {}
}  // namespace exl2
