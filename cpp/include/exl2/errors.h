// Error types of the runtime: every failure the library can report is an exl2::Error with a kind that the
// Python bindings map to a specific exception class (ModelFormatError, UnsupportedError, ...).
// The library never aborts the host process: checks throw, callers catch.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

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
inline void format_into(std::ostringstream&) {}
template <typename T, typename... Rest>
void format_into(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  format_into(os, rest...);
}
}  // namespace detail

// Concatenate any streamable values into a string.
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  detail::format_into(os, args...);
  return os.str();
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
