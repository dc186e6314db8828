// Switches read from the environment: one parse and one error message for every two-way EXL2CPP_* variable.
#pragma once

namespace exl2 {

// A two-way switch from the environment variable `name`, compared case-insensitively: unset or empty -> dflt,
// `on` -> true, `off` -> false; anything else throws InvalidArgument naming the variable, both values and the
// default. Read at every call (callers that want it once keep it in a static).
bool env_switch(const char* name, const char* on, const char* off, bool dflt = true);

}  // namespace exl2
