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
// The tiled DPLR kernels (cuda/tiled/dplr_stages.cuh, one configuration each: the forward's wy, scan and output
// stages, the reverse state-gradient scan, the backward's dv and dk stages) are checked below them: 16-bit
// inputs fit sm_80 at K <= 128 and sm_86 / sm_89 at K <= 64, fp32 inputs fit sm_80 at K <= 64 and sm_90 at
// K <= 128 (the wy stage's 224 KB).
// The limits are cudaDevAttrMaxSharedMemoryPerBlockOptin: sm_80 (A100) 163 KB, sm_86 / sm_89 99 KB (the
// tiled tier supports them at K <= 64), sm_90 227 KB.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>

#include "tiled/bwd_common.cuh"
#include "tiled/bwd_decay.cuh"
#include "tiled/bwd_dh_scan.cuh"
#include "tiled/bwd_dqkg.cuh"
#include "tiled/bwd_dv_local.cuh"
#include "tiled/bwd_wy.cuh"
#include "tiled/dplr_stages.cuh"

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

// ---- the tiled DPLR kernels ----------------------------------------------------------------------------------
namespace dplr = deltacp::cuda::tiled;

template <class T, int KP>
std::vector<StageBytes> dplr_stages() {
  return {{"wy", size_t(dplr::WySmem<T, KP>::bytes)},
          {"state scan", size_t(dplr::ScanSmem<T, KP>::bytes)},
          {"output", size_t(dplr::OutSmem<T, KP>::bytes)},
          {"reverse state-gradient scan", size_t(dplr::Dh0Smem<T, KP>::bytes)},
          {"backward dv", size_t(dplr::BdvSmem<T, KP>::bytes)},
          {"backward dk", size_t(dplr::BdkSmem<T>::bytes)}};
}

template <class T, int KP>
void expect_dplr_fits(size_t limit, const char* what) {
  for (const StageBytes& st : dplr_stages<T, KP>())
    EXPECT_LE(st.smallest, limit) << "tiled DPLR " << st.name << " (" << sizeof(T) * 8 << "-bit, KP " << KP << "): "
                                  << st.smallest << " bytes do not fit " << what;
}

TEST(TiledDplrSmem, SixteenBitFitsSm80AndKeyDim64FitsSm86) {
  expect_dplr_fits<__nv_bfloat16, 128>(kSm80, "sm_80 (163 KB)");
  expect_dplr_fits<__half, 128>(kSm80, "sm_80 (163 KB)");
  expect_dplr_fits<__nv_bfloat16, 64>(kSm86, "sm_86 / sm_89 (99 KB)");
  expect_dplr_fits<__half, 64>(kSm86, "sm_86 / sm_89 (99 KB)");
}

TEST(TiledDplrSmem, Fp32FitsSm80AtKeyDim64AndSm90AtKeyDim128) {
  expect_dplr_fits<float, 64>(kSm80, "sm_80 (163 KB)");
  expect_dplr_fits<float, 128>(kSm90, "sm_90 (227 KB)");
}

// The backward's local stages are laid out so that their tiles do not overlap where both are live: the value
// phase's tiles and the key phase's score gradients and scratch share one region after the fp32 gradients.
template <class T>
void expect_dk_layout() {
  using L = dplr::BdkSmem<T>;
  EXPECT_EQ(L::region % 16, 0);
  EXPECT_GE(L::region, L::db + int64_t(dplr::kDRows) * L::ldf * 4);
  EXPECT_GE(L::bytes, L::value_end);
  EXPECT_GE(L::bytes, L::scr + int64_t(dplr::kDRows) * L::ldx * int64_t(sizeof(T)));
  // two score gradients, each its lower block triangle (block row a: 16 rows of 16 (a + 1) columns)
  EXPECT_EQ(L::dm_off(4), 16 * (L::dm_ld(0) + L::dm_ld(1) + L::dm_ld(2) + L::dm_ld(3)));
  EXPECT_GE(L::scr, L::dM + 2 * int64_t(L::dm_off(4)) * int64_t(sizeof(T)));
  // the value phase's second stage over dq, dk, db (da shares dq's tile, a shares q's)
  EXPECT_LE(L::vB + L::vstage, L::region);
  EXPECT_EQ(L::da, L::dq);
  EXPECT_EQ(L::a, L::q);
  // the second score's scaled Y rows (at most 48: rows below the last reference row) after the scratch tile
  EXPECT_GE(L::scr2, L::scr + int64_t(dplr::kDRows) * L::ldx * int64_t(sizeof(T)));
  EXPECT_GE(L::bytes, L::scr2 + 48 * L::ldx * int64_t(sizeof(T)));
  EXPECT_EQ(L::scr2 % 16, 0);
  EXPECT_EQ(L::G % 16, 0);
  EXPECT_EQ(L::dS % 16, 0);
  EXPECT_EQ(L::scr % 16, 0);
  EXPECT_EQ(L::tileM % 16, 0);
  // 16-byte rows for cp.async and ldmatrix
  EXPECT_EQ((L::ldx * sizeof(T)) % 16, 0u);
  for (int r16 = 0; r16 < 4; ++r16) {
    EXPECT_EQ((L::dm_ld(r16) * sizeof(T)) % 16, 0u);
    EXPECT_EQ((L::dm_off(r16) * sizeof(T)) % 16, 0u);
  }
  EXPECT_EQ((L::ldv * sizeof(T)) % 16, 0u);
  EXPECT_EQ(L::vstage % 16, 0);
}
template <class T, int KP>
void expect_dv_layout() {
  using L = dplr::BdvSmem<T, KP>;
  EXPECT_EQ(L::Kd % 16, 0);
  EXPECT_EQ(L::dS % 16, 0);
  EXPECT_EQ(L::dUt - L::Kd, dplr::align16(int64_t(dplr::kDRows) * L::ldk * int64_t(sizeof(T))));
  EXPECT_EQ(L::bytes - L::dS, dplr::align16(int64_t(KP) * L::ldv * int64_t(sizeof(T))));
}

TEST(TiledDplrSmem, BackwardLayouts) {
  expect_dk_layout<float>();
  expect_dk_layout<__nv_bfloat16>();
  expect_dv_layout<float, 64>();
  expect_dv_layout<float, 128>();
  expect_dv_layout<__half, 64>();
  expect_dv_layout<__half, 128>();
  // print the table of dplr_bwd.cu's opening comment
  for (int k128 = 0; k128 < 2; ++k128) {
    std::printf("[smem] KP %d: dv bf16 %lld fp32 %lld; dk bf16 %lld fp32 %lld\n", k128 ? 128 : 64,
                static_cast<long long>(k128 ? dplr::BdvSmem<__nv_bfloat16, 128>::bytes
                                            : dplr::BdvSmem<__nv_bfloat16, 64>::bytes),
                static_cast<long long>(k128 ? dplr::BdvSmem<float, 128>::bytes : dplr::BdvSmem<float, 64>::bytes),
                static_cast<long long>(dplr::BdkSmem<__nv_bfloat16>::bytes),
                static_cast<long long>(dplr::BdkSmem<float>::bytes));
  }
}
}  // namespace
