// Bindings for the core area (see bindings.h).
#include "bindings/bindings.h"

namespace exl2 {
void bind_core(pybind11::module_& m) {}
}  // namespace exl2
