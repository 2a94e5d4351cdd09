// tests/cpp/shapes.h — the shapes that bite (docs/design.md section 7), shared by the test suites.
#pragma once

#include <map>
#include <random>
#include <string>

#include "problem.h"

namespace deltacp::test {

inline std::vector<int64_t> random_lengths_cu(int n, int lo, int hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> cu{0};
  for (int i = 0; i < n; ++i) cu.push_back(cu.back() + lo + static_cast<int64_t>(rng() % (hi - lo + 1)));
  return cu;
}

inline Shape varlen(std::vector<int64_t> cu, int64_t H, int64_t HV, int64_t K, int64_t V) {
  Shape s;
  s.B = 1;
  s.T = cu.back();
  s.H = H;
  s.HV = HV;
  s.K = K;
  s.V = V;
  s.cu = std::move(cu);
  return s;
}
inline Shape fixed(int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V) {
  Shape s;
  s.B = B; s.T = T; s.H = H; s.HV = HV; s.K = K; s.V = V;
  return s;
}

// name -> shape
inline std::map<std::string, Shape> biting_shapes() {
  std::map<std::string, Shape> m;
  m["T1"] = fixed(1, 1, 1, 1, 32, 16);
  m["T40_below_chunk_B2"] = fixed(2, 40, 2, 2, 32, 24);
  m["T63_chunk_minus_1"] = fixed(1, 63, 1, 1, 64, 32);
  m["T65_chunk_plus_1"] = fixed(1, 65, 1, 1, 64, 48);
  m["K128_varlen"] = varlen({0, 150, 151, 300}, 1, 1, 128, 64);
  m["many_short_seqs"] = varlen(random_lengths_cu(40, 1, 9, 7), 1, 1, 32, 32);
  m["grouped_values_B2"] = fixed(2, 130, 1, 2, 32, 40);
  m["long_seq_K64"] = varlen({0, 12, 412, 430}, 1, 1, 64, 32);
  Shape no_h0 = varlen({0, 70, 200}, 2, 2, 32, 32);
  no_h0.h0 = false;
  m["no_initial_state"] = no_h0;
  return m;
}

}  // namespace deltacp::test
