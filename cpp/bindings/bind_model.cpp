// Bindings for the model area (see bindings.h).
#include "bindings/bindings.h"

namespace exl2 {
void bind_model(pybind11::module_& m) {}
}  // namespace exl2
