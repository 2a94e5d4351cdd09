// deltacp/error.h — the project's own exceptions.
//
// Bad input never crashes, hangs or returns NaN silently: every check throws deltacp::Error (or one
// of its kinds below) whose message names the argument, what was expected and what was given, e.g.
//   deltacp: argument 'cu_seqlens': expected cu_seqlens[0] == 0, got 3
// The Python bindings (bindings/src/module.cpp) raise each kind as its class of deltacp/errors.py:
//   Error          -> deltacp.InvalidArgumentError (a ValueError); argument 'cuda': deltacp.CUDAError
//   NumericError   -> deltacp.NumericError (a ValueError): non-finite inputs or outputs, a gate > 0
//   OutOfMemory    -> deltacp.OutOfMemoryError (a MemoryError)
// The contract for numeric checks is docs/errors.md.
#pragma once

#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace deltacp {

class Error : public std::runtime_error {
 public:
  Error(std::string argument, const std::string& message)
      : std::runtime_error("deltacp: argument '" + argument + "': " + message), argument_(std::move(argument)) {}
  // The name of the offending argument ("" for errors that are not about one argument).
  const std::string& argument() const { return argument_; }

 private:
  std::string argument_;
};

// Values that make the recurrence blow up: a non-finite input, a log decay g > 0, or a non-finite
// output or gradient (docs/errors.md: the message names the tensor, the first bad index and the likely cause).
class NumericError : public Error {
 public:
  using Error::Error;
};

// A device allocation that did not fit; the message gives the bytes requested and free.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

namespace detail {
// Messages are built with std::string and snprintf/to_string, not with iostreams: inside a Python
// process that also loaded torch, formatting an integer through std::ostream segfaulted on the GPU
// machines (std::ostream::_M_insert<long>, seen twice: the NCCL timeout message and a pre-pass check),
// which turned a clear error into a crash. Only types without a direct rule fall back to a stream.
inline void append_one(std::string& out, const std::string& x) { out += x; }
inline void append_one(std::string& out, const char* x) { out += x ? x : "(null)"; }
inline void append_one(std::string& out, char x) { out += x; }
inline void append_one(std::string& out, bool x) { out += x ? "1" : "0"; }
template <class T>
void append_one(std::string& out, const T& x) {
  if constexpr (std::is_integral_v<T>) {
    out += std::to_string(x);
  } else if constexpr (std::is_floating_point_v<T>) {
    if (x != x) {  // NaN: "nan" whatever its sign bit ("%g" may print "-nan")
      out += "nan";
      return;
    }
    char buf[64];
    std::snprintf(buf, sizeof buf, "%g", static_cast<double>(x));
    out += buf;
  } else if constexpr (std::is_convertible_v<const T&, const char*>) {
    append_one(out, static_cast<const char*>(x));
  } else if constexpr (std::is_convertible_v<const T&, std::string>) {
    out += std::string(x);
  } else {
    std::ostringstream os;
    os << x;
    out += os.str();
  }
}
inline void append(std::string&) {}
template <class T, class... Rest>
void append(std::string& out, const T& x, const Rest&... rest) {
  append_one(out, x);
  append(out, rest...);
}
}  // namespace detail

// Builds a message from pieces (strings, numbers): throw_error("q", "expected rank 4, got ", r).
template <class... Parts>
[[noreturn]] void throw_error(const std::string& argument, const Parts&... parts) {
  std::string message;
  detail::append(message, parts...);
  throw Error(argument, message);
}

// The same for one of Error's kinds: throw_error_as<NumericError>("g", "expected ...").
template <class E, class... Parts>
[[noreturn]] void throw_error_as(const std::string& argument, const Parts&... parts) {
  std::string message;
  detail::append(message, parts...);
  throw E(argument, message);
}

}  // namespace deltacp

// DELTACP_CHECK(cond, "arg", "expected ..., got ", x): throws deltacp::Error when cond is false.
#define DELTACP_CHECK(cond, argument, ...)                 \
  do {                                                     \
    if (!(cond)) ::deltacp::throw_error(argument, __VA_ARGS__); \
  } while (0)
