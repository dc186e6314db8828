// Bindings for the engine area (see bindings.h).
#include "bindings/bindings.h"

namespace exl2 {
void bind_engine(pybind11::module_& m) {}
}  // namespace exl2
