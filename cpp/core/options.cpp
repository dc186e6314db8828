// The runtime options registry (exl2/options.h): the process-wide settings, text access by name, and the list of
// the settings that stay environment variables.
#include "exl2/options.h"

#include <cctype>
#include <cstdlib>
#include <mutex>

#include "exl2/errors.h"

namespace exl2 {

namespace {

std::mutex g_mutex;
RuntimeOptions g_options;

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string to_text(bool v) { return v ? "true" : "false"; }
std::string to_text(int v) { return std::to_string(v); }
std::string to_text(const std::string& v) { return v; }

// "lo..hi" -> lo, hi.
void int_range(const char* allowed, long& lo, long& hi) {
  const std::string a = allowed;
  const size_t dots = a.find("..");
  lo = std::strtol(a.substr(0, dots).c_str(), nullptr, 10);
  hi = std::strtol(a.substr(dots + 2).c_str(), nullptr, 10);
}

void parse(const char* name, const char*, const std::string& v, bool& out) {
  const std::string s = lower(v);
  if (s == "true" || s == "1") {
    out = true;
  } else if (s == "false" || s == "0") {
    out = false;
  } else {
    EXL2_FAIL(InvalidArgument, "option ", name, " must be true or false, got '", v, "'");
  }
}

void parse(const char* name, const char* allowed, const std::string& v, int& out) {
  long lo = 0, hi = 0;
  int_range(allowed, lo, hi);
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  EXL2_CHECK(!v.empty() && end && *end == '\0' && n >= lo && n <= hi, "option ", name, " must be an integer in ",
             allowed, ", got '", v, "'");
  out = static_cast<int>(n);
}

void parse(const char* name, const char* allowed, const std::string& v, std::string& out) {
  const std::string a = std::string("|") + allowed + "|";
  EXL2_CHECK(!v.empty() && v.find('|') == std::string::npos && a.find("|" + v + "|") != std::string::npos, "option ",
             name, " must be one of ", allowed, ", got '", v, "'");
  out = v;
}

}  // namespace

const RuntimeOptions& runtime_options() { return g_options; }

void set_runtime_options(const RuntimeOptions& o) {
  // Every field is checked through its text form, so a struct built in C++ meets the same rules as set_option.
  RuntimeOptions checked;
  for (const OptionInfo& info : option_registry()) set_option(checked, info.name, get_option(o, info.name));
  std::lock_guard<std::mutex> lock(g_mutex);
  g_options = checked;
}

const std::vector<OptionInfo>& option_registry() {
  static const std::vector<OptionInfo> r = [] {
    std::vector<OptionInfo> v;
    const RuntimeOptions d;
#define EXL2_OPTION_INFO(type, name, dflt, allowed, scope, doc) \
  v.push_back({#name, #type, to_text(d.name), allowed, scope, doc});
    EXL2_RUNTIME_OPTIONS(EXL2_OPTION_INFO)
#undef EXL2_OPTION_INFO
    return v;
  }();
  return r;
}

std::string get_option(const RuntimeOptions& o, const std::string& name) {
#define EXL2_OPTION_GET(type, field, dflt, allowed, scope, doc) \
  if (name == #field) return to_text(o.field);
  EXL2_RUNTIME_OPTIONS(EXL2_OPTION_GET)
#undef EXL2_OPTION_GET
  EXL2_FAIL(InvalidArgument, "unknown option '", name, "' (docs/options.md lists them)");
}

void set_option(RuntimeOptions& o, const std::string& name, const std::string& value) {
#define EXL2_OPTION_SET(type, field, dflt, allowed, scope, doc) \
  if (name == #field) {                                        \
    parse(#field, allowed, value, o.field);                    \
    return;                                                    \
  }
  EXL2_RUNTIME_OPTIONS(EXL2_OPTION_SET)
#undef EXL2_OPTION_SET
  EXL2_FAIL(InvalidArgument, "unknown option '", name, "' (docs/options.md lists them)");
}

const std::vector<EnvironmentSetting>& environment_settings() {
  static const std::vector<EnvironmentSetting> v = {
      {"EXL2CPP_NUM_THREADS", "Threads of the CPU backend's pool (>= 1; default: the hardware's), read once."},
      {"EXL2CPP_API_KEYS", "Server: comma-separated API keys, added to serve.yml's api_keys."},
      {"EXL2CPP_ADMIN_KEY", "Server: the admin key where serve.yml sets none."},
      {"EXL2CPP_CACHE", "Folder of imported models (default: $XDG_CACHE_HOME/exl2cpp/models)."},
  };
  return v;
}

}  // namespace exl2
