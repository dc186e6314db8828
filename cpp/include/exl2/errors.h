// Error types of the runtime: every failure the library can report is an exl2::Error with a kind that the
// Python bindings map to a specific exception class (ModelFormatError, UnsupportedError, ...).
// The library never aborts the host process: checks throw, callers catch.
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace exl2 {

enum class ErrorKind {
  InvalidArgument,  // bad argument from the caller (shape, dtype, sampling setting...) -> ValueError
  ModelFormat,      // malformed or inconsistent model files (safetensors, config.json, EXL2 tensors)
  Unsupported,      // well-formed input we do not handle (architecture, dtype, bit width...)
  Cuda,             // a CUDA runtime or cuBLAS call failed
  OutOfMemory,      // an allocation (host or device) failed; message carries the numbers
  Io,               // file missing, unreadable, truncated
  Internal,         // a broken invariant inside the library (a bug: please report)
};

const char* error_kind_name(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

namespace detail {
// Formatting without iostreams: error messages are built on paths where a host process's locale/iostream state
// must not matter (an iostream call crashed inside libstdc++ on one GPU machine's Python build).
inline void append(std::string& out, const std::string& v) { out += v; }
inline void append(std::string& out, const char* v) { out += v ? v : "(null)"; }
inline void append(std::string& out, char v) { out += v; }
inline void append(std::string& out, bool v) { out += v ? "true" : "false"; }
template <typename T>
void append(std::string& out, const T& v) {
  if constexpr (std::is_floating_point_v<T>) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
    out += buf;
  } else if constexpr (std::is_integral_v<T>) {
    out += std::to_string(v);
  } else if constexpr (std::is_enum_v<T>) {
    out += std::to_string(static_cast<long long>(v));
  } else if constexpr (std::is_pointer_v<T>) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%p", static_cast<const void*>(v));
    out += buf;
  } else {
    out += v.str();  // types with a str() method (Device)
  }
}
}  // namespace detail

// Concatenate values (strings, numbers, bools, objects with .str()) into a string.
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::string out;
  (detail::append(out, args), ...);
  return out;
}

template <typename... Args>
[[noreturn]] void throw_error(ErrorKind kind, const Args&... args) {
  throw Error(kind, str_cat(args...));
}

}  // namespace exl2

// EXL2_CHECK(cond, "what was expected", got, "how to fix") -> InvalidArgument error with the pieces joined.
#define EXL2_CHECK(cond, ...)                                                          \
  do {                                                                                 \
    if (!(cond)) ::exl2::throw_error(::exl2::ErrorKind::InvalidArgument, __VA_ARGS__); \
  } while (0)

// Same, with an explicit kind: EXL2_CHECK_KIND(ModelFormat, cond, ...).
#define EXL2_CHECK_KIND(kind, cond, ...)                                    \
  do {                                                                      \
    if (!(cond)) ::exl2::throw_error(::exl2::ErrorKind::kind, __VA_ARGS__); \
  } while (0)

#define EXL2_FAIL(kind, ...) ::exl2::throw_error(::exl2::ErrorKind::kind, __VA_ARGS__)
