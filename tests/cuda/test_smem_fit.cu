// tests/cuda/test_smem_fit.cu — host-only: every stage of the tiled backward has a launch configuration whose
// shared memory fits the GPUs the build targets, so that no supported shape is refused for lack of it.
//
// The layouts are the kernels' own constexpr structs (cuda/tiled/bwd_*.cuh), evaluated on the host: no GPU
// is needed, so CI checks them. Each stage's launch (cuda/tiled/tiled_bwd.cu) takes its fastest
// configuration where it fits max_smem_optin() and falls back to the smallest one listed here otherwise:
//   B0 bwd_dv_local   one configuration
//   B1 bwd_dh_scan    BV 64 or 32, one or two load stages      smallest: BV 32, one stage
//   B2 bwd_dqkg       one or two V stages                      smallest: one stage
//   B3 bwd_wy         one or two V stages                      smallest: one stage
//   B4 bwd_decay      gdn / delta: one; kda: the tensor-core kernel (16-bit) or the element-by-element one
// The limits are cudaDevAttrMaxSharedMemoryPerBlockOptin: sm_80 (A100) 163 KB, sm_86 / sm_89 99 KB (the
// tiled tier supports them at K <= 64), sm_90 227 KB.
#include <gtest/gtest.h>

#include <cstddef>
#include <string>
#include <vector>

#include "tiled/bwd_common.cuh"
#include "tiled/bwd_decay.cuh"
#include "tiled/bwd_dh_scan.cuh"
#include "tiled/bwd_dqkg.cuh"
#include "tiled/bwd_dv_local.cuh"
#include "tiled/bwd_wy.cuh"

namespace {
using namespace deltacp::cuda::tiled::bwd;

constexpr size_t kSm80 = 166912, kSm86 = 101376, kSm90 = 232448;

struct StageBytes {
  std::string name;
  size_t smallest;  // the configuration the launch falls back to
};

template <class Op, int KP, bool PERKEY>
std::vector<StageBytes> stages() {
  std::vector<StageBytes> s;
  s.push_back({"B0 dv_local", DvLocalSmem<Op, KP, PERKEY>{}.total});
  s.push_back({"B1 dh_scan", DhScanSmem<Op, KP, 1, 32>{}.total});
  s.push_back({"B2 dqkg", DqkgSmem<Op, KP, PERKEY, 1>{}.total});
  s.push_back({"B3 wy", WyBwdSmem<Op, KP, PERKEY, 1>{}.total});
  if constexpr (PERKEY) s.push_back({"B4 decay (kda, element by element)", DecayKdaSmem<Op, KP>{}.total});
  else s.push_back({"B4 decay (scalar)", DecayScalarSmem<Op, KP>{}.total});
  return s;
}

template <class Op, int KP, bool PERKEY>
void expect_fits(size_t limit, const char* what) {
  for (const StageBytes& st : stages<Op, KP, PERKEY>())
    EXPECT_LE(st.smallest, limit) << st.name << " (" << sizeof(Op) * 8 << "-bit, KP " << KP
                                  << (PERKEY ? ", kda" : ", gdn / delta") << "): smallest configuration "
                                  << st.smallest << " bytes does not fit " << what;
}

template <class Op>
void expect_all(size_t limit, const char* what, bool k128) {
  expect_fits<Op, 64, false>(limit, what);
  expect_fits<Op, 64, true>(limit, what);
  if (k128) {
    expect_fits<Op, 128, false>(limit, what);
    expect_fits<Op, 128, true>(limit, what);
  }
}

TEST(TiledBackwardSmem, EveryStageFitsSm80) {
  expect_all<float>(kSm80, "sm_80 (163 KB)", true);
  expect_all<__nv_bfloat16>(kSm80, "sm_80 (163 KB)", true);
  expect_all<__half>(kSm80, "sm_80 (163 KB)", true);
}

TEST(TiledBackwardSmem, KeyDim64FitsSm86) {
  expect_all<float>(kSm86, "sm_86 / sm_89 (99 KB)", false);
  expect_all<__nv_bfloat16>(kSm86, "sm_86 / sm_89 (99 KB)", false);
  expect_all<__half>(kSm86, "sm_86 / sm_89 (99 KB)", false);
}

// On Hopper the fast configurations must fit, or the launch would silently take the slow ones: the
// tensor-core kda B4, two V stages for B2 and B3 (the benchmarks' configurations).
TEST(TiledBackwardSmem, FastConfigurationsFitSm90) {
  EXPECT_LE((DecayKdaTcSmem<__nv_bfloat16, 128>{}.total), kSm90);
  EXPECT_LE((DqkgSmem<float, 128, true, 2>{}.total), kSm90);
  EXPECT_LE((WyBwdSmem<float, 128, true, 2>{}.total), kSm90);
  EXPECT_LE((DhScanSmem<float, 128, 1, 64>{}.total), kSm90);
}
}  // namespace
