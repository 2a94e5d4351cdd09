// tests/cpp/expect_error.h — the bad-input check shared by the C++ tests.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "deltacp/error.h"

namespace deltacp::test {

// Runs fn, expects deltacp::Error for `argument` whose message contains `words`.
inline void expect_error(const std::function<void()>& fn, const std::string& argument, const std::string& words) {
  try {
    fn();
    ADD_FAILURE() << "expected deltacp::Error for '" << argument << "', nothing was thrown";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << "message: " << e.what();
  }
}

}  // namespace deltacp::test
