// cuda/common/kernel_switch.h — the environment switch of a faster kernel that runs only on some inputs.
//
//   if (kernel_switch("DELTACP_X", "the X kernel", [&] { return x_refusal(p); })) launch_x(...);
//
// Unset or empty: true exactly where why_not() returns nullptr (the kernel runs wherever it applies, the
// portable kernels elsewhere), or false for a path not yet validated on a GPU (unset_on = false: opt-in).
// "0": false (the portable kernels, for comparisons and bisection). "1": true, or an Error naming the
// variable and why_not()'s reason when the kernel cannot run these inputs (a benchmark or test that must time
// or check this kernel fails instead of silently measuring the fallback). Anything else: an Error naming the
// variable. Host-only.
#pragma once

#include <cstdlib>
#include <string>

#include "deltacp/error.h"

namespace deltacp::cuda {

template <class WhyNot>
bool kernel_switch(const char* var, const char* kernel, WhyNot&& why_not, bool unset_on = true) {
  const char* env = std::getenv(var);
  const bool unset = env == nullptr || *env == '\0';
  if (unset && !unset_on) return false;
  if (!unset) {
    const std::string v(env);
    if (v != "0" && v != "1") throw_error(var, "expected 0 or 1, got '", v, "'");
    if (v == "0") return false;
  }
  const char* why = why_not();
  if (why != nullptr && !unset) throw_error(var, kernel, " cannot run: ", why);
  return why == nullptr;
}

}  // namespace deltacp::cuda
