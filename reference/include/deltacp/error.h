// deltacp/error.h — the project's own exception.
//
// Bad input never crashes, hangs or returns NaN silently: every check throws deltacp::Error
// whose message names the argument, what was expected and what was given, e.g.
//   deltacp: argument 'cu_seqlens': expected cu_seqlens[0] == 0, got 3
// The Python bindings translate it to ValueError (argument errors) or RuntimeError.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

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

namespace detail {
inline void append(std::ostringstream&) {}
template <class T, class... Rest>
void append(std::ostringstream& os, const T& x, const Rest&... rest) {
  os << x;
  append(os, rest...);
}
}  // namespace detail

// Builds a message from streamable pieces: throw_error("q", "expected rank 4, got ", r).
template <class... Parts>
[[noreturn]] void throw_error(const std::string& argument, const Parts&... parts) {
  std::ostringstream os;
  detail::append(os, parts...);
  throw Error(argument, os.str());
}

}  // namespace deltacp

// DELTACP_CHECK(cond, "arg", "expected ..., got ", x): throws deltacp::Error when cond is false.
#define DELTACP_CHECK(cond, argument, ...)                 \
  do {                                                     \
    if (!(cond)) ::deltacp::throw_error(argument, __VA_ARGS__); \
  } while (0)
