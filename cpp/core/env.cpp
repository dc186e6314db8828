// The environment switch parser (see core/env.h).
#include "core/env.h"

#include <cctype>
#include <cstdlib>
#include <string>

#include "exl2/errors.h"

namespace exl2 {

bool env_switch(const char* name, const char* on, const char* off, bool dflt) {
  const char* v = std::getenv(name);
  std::string s = v ? v : "";
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (s.empty()) return dflt;
  if (s == on) return true;
  if (s == off) return false;
  EXL2_FAIL(InvalidArgument, name, " must be \"", on, "\"", dflt ? " (default)" : "", " or \"", off, "\"",
            dflt ? "" : " (default)", ", got \"", v, "\"");
}

}  // namespace exl2
