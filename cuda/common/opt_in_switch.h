// cuda/common/opt_in_switch.h — the environment switch of a kernel that is not yet the default where it applies.
//
//   if (opt_in_switch("DELTACP_X", "the X kernel", [&] { return x_refusal(p); })) launch_x(...);
//
// Unset, empty or "0": false. "1": true, or an Error naming the variable and why_not()'s reason when the kernel
// cannot run these inputs. Anything else: an Error naming the variable. Host-only.
#pragma once

#include <cstdlib>
#include <string>

#include "deltacp/error.h"

namespace deltacp::cuda {

template <class WhyNot>
bool opt_in_switch(const char* var, const char* kernel, WhyNot&& why_not) {
  const char* env = std::getenv(var);
  if (env == nullptr || *env == '\0') return false;
  const std::string v(env);
  if (v != "0" && v != "1") throw_error(var, "expected 0 or 1, got '", v, "'");
  if (v == "0") return false;
  if (const char* why = why_not()) throw_error(var, kernel, " cannot run: ", why);
  return true;
}

}  // namespace deltacp::cuda
