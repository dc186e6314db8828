// Bindings for the ops area (see bindings.h).
#include "bindings/bindings.h"

namespace exl2 {
void bind_ops(pybind11::module_& m) {}
}  // namespace exl2
