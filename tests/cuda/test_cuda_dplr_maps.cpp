// tests/cuda/test_cuda_dplr_maps.cpp — the tiled DPLR tier in the roles context parallelism gives it (the CP
// pre-pass's state maps, the local pass from an initial state), against the reference's affine maps
// (reference/include/deltacp/reference/affine.h: span_affine, span_affine_backward).
//
// A span's map S_end = M S_start + H is what a final-state-only forward of the widened problem computes:
// values [v | 0] (K zero columns) from the state [S0 | I] end at [M S0 + H | M]. The mirror: a dh0-only
// backward of values [v | 0], upstream [do | 0] and dL/dS_end = [dend | I] gives [M^T dend + dH | M^T].
// (bindings/python/deltacp/cp/local.py builds both; cuda/tiled/dplr_fwd.cu's opening comment gives the algebra.)
// The pieces run side by side as one varlen batch, as the pre-pass runs them, and every (piece, head) is
// compared with ref::span_affine / span_affine_backward<double> on the same rounded inputs:
//   - fp32, bf16 and fp16 inputs (gk in fp32 beside 16-bit ones too), chunk sizes 16 and 64, K in {32, 64, 100,
//     128} beside V in {16, 33, 64}, pieces of 1, C - 1, C, C + 1 and several chunks, and an empty one;
//   - the final-state-only forward's ht equals the full forward's bit for bit (it stores neither the chunk-start
//     states nor the read-outs, which only the output stage reads);
//   - the local forward from an initial state (o and ht) against the reference and against the naive tier;
//   - a refused shape (K = 160; fp32 K = 128 where the GPU's shared memory is too small) throws an Error naming K
//     and writes nothing (the outputs stay NaN): the check runs before any launch, so a caller may fall back.
// Relative error ||x - ref|| / ||ref|| per tensor: 1e-4 for fp32 inputs, 2e-2 for 16-bit ones (the maps' columns
// ride the same 16-bit tensor-core operands as the state; gpu_cp_check.py holds the tiled pre-pass to the same).
// Skipped without a GPU. DELTACP_TEST_SEED=<n> replays a run (the seed is printed).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "deltacp/cuda/api.h"
#include "deltacp/dtype.h"
#include "deltacp/error.h"
#include "deltacp/params.h"
#include "deltacp/reference/affine.h"
#include "deltacp/reference/chunked.h"

namespace {

using deltacp::DType;
using deltacp::Method;
using deltacp::Params;
using deltacp::Variant;
using MatD = deltacp::ref::Mat<double>;

uint64_t base_seed() {
  static const uint64_t seed = [] {
    if (const char* env = std::getenv("DELTACP_TEST_SEED"))
      return static_cast<uint64_t>(std::strtoull(env, nullptr, 10));
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }();
  return seed;
}

double round_to(double x, DType dt) {
  switch (dt) {
    case DType::f32: return static_cast<float>(x);
    case DType::bf16: return deltacp::bf16_bits_to_float(deltacp::float_to_bf16_bits(static_cast<float>(x)));
    case DType::f16: return deltacp::f16_bits_to_float(deltacp::float_to_f16_bits(static_cast<float>(x)));
    default: return x;
  }
}

// A device buffer of `n` elements of `dt`, every byte 0xFF first (NaN in fp32, bf16 and fp16).
struct Buf {
  void* ptr = nullptr;
  int64_t n = 0;
  DType dt = DType::f32;
  Buf() = default;
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  ~Buf() {
    if (ptr) cudaFree(ptr);
  }
  size_t bytes() const { return static_cast<size_t>(n * deltacp::dtype_size(dt)); }
  void poisoned(int64_t elems, DType type) {
    n = elems, dt = type;
    if (cudaMalloc(&ptr, bytes() ? bytes() : 1) != cudaSuccess) ptr = nullptr;
    if (ptr) cudaMemset(ptr, 0xFF, bytes());
  }
  void upload(const std::vector<double>& x, DType type) {
    poisoned(static_cast<int64_t>(x.size()), type);
    std::vector<unsigned char> raw(bytes());
    for (int64_t i = 0; i < n; ++i) deltacp::store_as<double>(raw.data(), i, dt, x[i]);
    if (ptr) cudaMemcpy(ptr, raw.data(), bytes(), cudaMemcpyHostToDevice);
  }
  std::vector<double> download() const {
    std::vector<unsigned char> raw(bytes());
    cudaMemcpy(raw.data(), ptr, bytes(), cudaMemcpyDeviceToHost);
    std::vector<double> out(n);
    for (int64_t i = 0; i < n; ++i) out[i] = deltacp::load_as<double>(raw.data(), i, dt);
    return out;
  }
};

struct Case {
  std::string name;
  DType dtype = DType::f32;
  bool gk_fp32 = false;  // gk in fp32 beside 16-bit inputs
  int chunk = 64;
  int64_t H = 2, K = 64, V = 64;
  std::vector<int64_t> lengths;  // the pieces (sequences of one varlen batch)
};

// Random DPLR inputs, [1, T, H, D] contiguous, rounded to the dtype under test (so the GPU and the fp64 reference
// see the same numbers): q, k unit rows; v ~ randn; gk = logsigmoid(randn + 3) / 2 (slow decays, so that the maps
// stay far from 0 over hundreds of tokens); a = -n, b = c n (n a unit row, c = sigmoid(randn)), RWKV-7's
// stable diag + low-rank transition; S0 ~ randn / 2, do ~ randn, dend ~ randn / 2.
struct Problem {
  Case c;
  int64_t T = 0, N = 0;
  std::vector<int64_t> cu;
  std::vector<double> q, k, v, gk, a, b, dout, S0, dend;

  explicit Problem(Case cs, uint64_t seed) : c(std::move(cs)) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal;
    cu.push_back(0);
    for (int64_t l : c.lengths) cu.push_back(cu.back() + l);
    T = cu.back(), N = static_cast<int64_t>(c.lengths.size());
    const int64_t rows = T * c.H;
    auto unit_rows = [&](std::vector<double>& x, double sign) {
      x.resize(rows * c.K);
      for (int64_t r = 0; r < rows; ++r) {
        double n2 = 0;
        for (int64_t d = 0; d < c.K; ++d) n2 += (x[r * c.K + d] = normal(rng)) * x[r * c.K + d];
        for (int64_t d = 0; d < c.K; ++d) x[r * c.K + d] *= sign / std::sqrt(n2);
      }
    };
    unit_rows(q, 1), unit_rows(k, 1), unit_rows(a, -1);
    b.resize(rows * c.K);
    for (int64_t r = 0; r < rows; ++r) {
      const double s = 1.0 / (1.0 + std::exp(-normal(rng)));
      for (int64_t d = 0; d < c.K; ++d) b[r * c.K + d] = -s * a[r * c.K + d];
    }
    v.resize(rows * c.V), dout.resize(rows * c.V);
    for (double& e : v) e = normal(rng);
    for (double& e : dout) e = normal(rng);
    gk.resize(rows * c.K);
    for (double& e : gk) e = -0.5 * std::log1p(std::exp(-(normal(rng) + 3.0)));
    S0.resize(N * c.H * c.K * c.V), dend.resize(S0.size());
    for (double& e : S0) e = static_cast<float>(0.5 * normal(rng));
    for (double& e : dend) e = static_cast<float>(0.5 * normal(rng));
    for (std::vector<double>* x : {&q, &k, &v, &a, &b, &dout})
      for (double& e : *x) e = round_to(e, c.dtype);
    for (double& e : gk) e = round_to(e, c.gk_fp32 ? DType::f32 : c.dtype);
  }

  double scale() const { return 1.0 / std::sqrt(static_cast<double>(c.K)); }

  // Sequence n, head h as the reference's slice.
  deltacp::ref::HeadInputs<double> head(int64_t n, int64_t h) const {
    const int64_t t0 = cu[n], len = cu[n + 1] - t0;
    deltacp::ref::HeadInputs<double> x;
    x.variant = Variant::dplr;
    x.scale = scale();
    auto rows = [&](const std::vector<double>& src, int64_t D) {
      MatD m(len, D);
      for (int64_t t = 0; t < len; ++t)
        for (int64_t d = 0; d < D; ++d) m(t, d) = src[((t0 + t) * c.H + h) * D + d];
      return m;
    };
    x.q = rows(q, c.K), x.k = rows(k, c.K), x.v = rows(v, c.V), x.g = rows(gk, c.K);
    x.a = rows(a, c.K), x.b = rows(b, c.K);
    return x;
  }
  MatD state(const std::vector<double>& s, int64_t n, int64_t h) const {
    MatD m(c.K, c.V);
    for (int64_t i = 0; i < c.K; ++i)
      for (int64_t j = 0; j < c.V; ++j) m(i, j) = s[((n * c.H + h) * c.K + i) * c.V + j];
    return m;
  }
  MatD dout_rows(int64_t n, int64_t h) const {
    const int64_t t0 = cu[n], len = cu[n + 1] - t0;
    MatD m(len, c.V);
    for (int64_t t = 0; t < len; ++t)
      for (int64_t j = 0; j < c.V; ++j) m(t, j) = dout[((t0 + t) * c.H + h) * c.V + j];
    return m;
  }
};

// [x | 0]: rows of width D widened by `extra` zero columns ([rows, D] -> [rows, D + extra]).
std::vector<double> widen(const std::vector<double>& x, int64_t D, int64_t extra) {
  const int64_t rows = static_cast<int64_t>(x.size()) / D;
  std::vector<double> out(rows * (D + extra), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; ++d) out[r * (D + extra) + d] = x[r * D + d];
  return out;
}
// [s | I] for every [K, V] state of s ([N * H, K, V] -> [N * H, K, V + K]).
std::vector<double> with_identity(const std::vector<double>& s, int64_t K, int64_t V) {
  std::vector<double> out = widen(s, V, K);
  for (int64_t m = 0; m < static_cast<int64_t>(s.size()) / (K * V); ++m)
    for (int64_t i = 0; i < K; ++i) out[(m * K + i) * (V + K) + V + i] = 1.0;
  return out;
}

double rel_err(const std::vector<double>& x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::isnan(num) ? INFINITY : std::sqrt(num / std::max(den, 1e-300));
}

double tolerance(DType dt) { return dt == DType::f32 ? 1e-4 : 2e-2; }

// The inputs of one GPU run of p (values of width W: V, or V + K widened), uploaded; every output poisoned.
struct GpuProblem {
  Buf q, k, v, gk, a, b, dout, cu, h0, ht, dht, dh0, o;
  Params p;

  GpuProblem(const Problem& pr, int64_t W, const std::vector<double>& values, const std::vector<double>* dout_w) {
    const Case& c = pr.c;
    q.upload(pr.q, c.dtype), k.upload(pr.k, c.dtype), a.upload(pr.a, c.dtype), b.upload(pr.b, c.dtype);
    v.upload(values, c.dtype);
    gk.upload(pr.gk, c.gk_fp32 ? DType::f32 : c.dtype);
    cu.poisoned(pr.N + 1, DType::f64);  // 8-byte slots for the int64 offsets
    cudaMemcpy(cu.ptr, pr.cu.data(), (pr.N + 1) * sizeof(int64_t), cudaMemcpyHostToDevice);
    if (dout_w) dout.upload(*dout_w, c.dtype);
    p.variant = Variant::dplr;
    p.dtype = c.dtype;
    p.g_fp32 = c.gk_fp32;
    p.state_dtype = DType::f32;
    p.B = 1, p.T = pr.T, p.H = c.H, p.HV = c.H, p.K = c.K, p.V = W;
    p.cu_seqlens = static_cast<const int64_t*>(cu.ptr);
    p.cu_seqlens_host = pr.cu.data();
    p.num_seqs = pr.N;
    p.scale = pr.scale();
    p.chunk_size = c.chunk;
    p.q = deltacp::contiguous_ref(q.ptr, pr.T, c.H, c.K);
    p.k = deltacp::contiguous_ref(k.ptr, pr.T, c.H, c.K);
    p.a = deltacp::contiguous_ref(a.ptr, pr.T, c.H, c.K);
    p.b = deltacp::contiguous_ref(b.ptr, pr.T, c.H, c.K);
    p.g = deltacp::contiguous_ref(gk.ptr, pr.T, c.H, c.K);
    p.v = deltacp::contiguous_ref(v.ptr, pr.T, c.H, W);
    if (dout_w) p.dout = deltacp::contiguous_ref(dout.ptr, pr.T, c.H, W);
  }
  int64_t state_elems() const { return p.num_seqs * p.HV * p.K * p.V; }
};

bool have_gpu() { return deltacp::cuda::device_available(); }

// A widened [N, H, K, V + K] result split into its value columns (j < V) and its transition columns (j >= V),
// each compared over every (piece, head) with the reference's pair `ref(n, h)` = ([K, V], [K, K]); prints both
// relative errors under their names and expects each within the dtype's tolerance.
void expect_widened_maps(const Problem& pr, const std::vector<double>& got, const char* values_name,
                         const char* transitions_name,
                         const std::function<std::pair<MatD, MatD>(int64_t n, int64_t h)>& ref) {
  const Case& c = pr.c;
  const int64_t W = c.V + c.K;
  std::vector<double> gH, gM, rH, rM;  // the value columns and the transition columns, every (piece, head)
  for (int64_t n = 0; n < pr.N; ++n)
    for (int64_t h = 0; h < c.H; ++h) {
      const auto [H, M] = ref(n, h);
      for (int64_t i = 0; i < c.K; ++i)
        for (int64_t j = 0; j < W; ++j) {
          const double e = got[((n * c.H + h) * c.K + i) * W + j];
          if (j < c.V) {
            gH.push_back(e), rH.push_back(H(i, j));
          } else {
            gM.push_back(e), rM.push_back(M(i, j - c.V));
          }
        }
    }
  const double eH = rel_err(gH, rH), eM = rel_err(gM, rM);
  std::printf("[errors] %s: %s %.2e, %s %.2e\n", c.name.c_str(), values_name, eH, transitions_name, eM);
  EXPECT_LT(eH, tolerance(c.dtype));
  EXPECT_LT(eM, tolerance(c.dtype));
}

std::vector<Case> map_cases() {
  std::vector<Case> v;
  auto add = [&](std::string name, DType dt, bool gk32, int chunk, int64_t H, int64_t K, int64_t V,
                 std::vector<int64_t> lengths) {
    v.push_back(Case{std::move(name), dt, gk32, chunk, H, K, V, std::move(lengths)});
  };
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    const std::string d = deltacp::to_string(dt);
    add(d + "_K64_V64_pieces", dt, false, 64, 2, 64, 64, {64, 1, 63, 65, 300});
    add(d + "_K128_V64_chunk16", dt, false, 16, 2, 128, 64, {17, 0, 200, 16});
  }
  add("bfloat16_K32_V16_gk_fp32", DType::bf16, true, 64, 3, 32, 16, {129, 5, 64});
  add("bfloat16_K100_V33", DType::bf16, false, 64, 1, 100, 33, {90, 140});
  add("float32_K100_V33_chunk16", DType::f32, false, 16, 1, 100, 33, {90, 31});
  return v;
}

class TiledDplrMaps : public testing::TestWithParam<Case> {};

// [M S0 + H | M] of every piece from the widened final-state-only forward, against ref::span_affine.
TEST_P(TiledDplrMaps, ForwardMapsEqualTheReferenceAffineMaps) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = base_seed() ^ std::hash<std::string>{}(GetParam().name);
  std::printf("[seed] %llu\n", static_cast<unsigned long long>(seed));
  const Problem pr(GetParam(), seed);
  const Case& c = pr.c;
  const int64_t W = c.V + c.K;
  GpuProblem g(pr, W, widen(pr.v, c.V, c.K), nullptr);
  g.h0.upload(with_identity(pr.S0, c.K, c.V), DType::f32);
  g.ht.poisoned(g.state_elems(), DType::f32);
  g.p.h0 = g.h0.ptr;
  g.p.ht = g.ht.ptr;  // and no o: final-state-only
  deltacp::cuda::forward(g.p, Method::tiled);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<double> got = g.ht.download();

  expect_widened_maps(pr, got, "M S0 + H", "M", [&](int64_t n, int64_t h) {
    const auto x = pr.head(n, h);
    const auto f = deltacp::ref::span_affine<double>(x, 0, x.n(), c.chunk);
    return std::pair<MatD, MatD>(f.apply(pr.state(pr.S0, n, h)), f.M);
  });

  // The same widened problem with o: its ht bit for bit (the final-state-only run skips stores only).
  Buf o, ht_full;
  o.poisoned(pr.T * c.H * W, c.dtype);
  ht_full.poisoned(g.state_elems(), DType::f32);
  Params full = g.p;
  full.o = deltacp::contiguous_ref(o.ptr, pr.T, c.H, W);
  full.ht = ht_full.ptr;
  deltacp::cuda::forward(full, Method::tiled);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<double> again = ht_full.download();
  int64_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) differ += !(got[i] == again[i]);
  EXPECT_EQ(differ, 0) << "the final-state-only ht differs from the full forward's";
}

// [M^T dend + dH | M^T] of every piece from the widened dh0-only backward, against ref::span_affine_backward.
TEST_P(TiledDplrMaps, BackwardMapsEqualTheReferenceAffineMaps) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = base_seed() ^ std::hash<std::string>{}(GetParam().name + "/bwd");
  std::printf("[seed] %llu\n", static_cast<unsigned long long>(seed));
  const Problem pr(GetParam(), seed);
  const Case& c = pr.c;
  const int64_t W = c.V + c.K;
  const std::vector<double> dout_w = widen(pr.dout, c.V, c.K);
  GpuProblem g(pr, W, widen(pr.v, c.V, c.K), &dout_w);
  g.dht.upload(with_identity(pr.dend, c.K, c.V), DType::f32);
  g.dh0.poisoned(g.state_elems(), DType::f32);
  g.p.dht = g.dht.ptr;
  g.p.dh0 = g.dh0.ptr;  // and no input gradient: dh0-only
  deltacp::cuda::backward(g.p, Method::tiled);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<double> got = g.dh0.download();

  expect_widened_maps(pr, got, "M^T dend + dH", "M^T", [&](int64_t n, int64_t h) {
    const auto x = pr.head(n, h);
    const auto f = deltacp::ref::span_affine_backward<double>(x, 0, x.n(), pr.dout_rows(n, h), c.chunk);
    return std::pair<MatD, MatD>(f.Mt * pr.state(pr.dend, n, h) + f.dH, f.Mt);
  });
}

// The local pass of a CP rank: the forward from an initial state (o and ht), against the reference's chunked
// forward and against the naive tier.
TEST_P(TiledDplrMaps, LocalForwardFromAnInitialState) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = base_seed() ^ std::hash<std::string>{}(GetParam().name + "/local");
  std::printf("[seed] %llu\n", static_cast<unsigned long long>(seed));
  const Problem pr(GetParam(), seed);
  const Case& c = pr.c;
  std::vector<double> o_ref(pr.T * c.H * c.V), ht_ref(pr.N * c.H * c.K * c.V);
  for (int64_t n = 0; n < pr.N; ++n)
    for (int64_t h = 0; h < c.H; ++h) {
      const auto x = pr.head(n, h);
      const auto f = deltacp::ref::chunked_forward<double>(x, pr.state(pr.S0, n, h), c.chunk);
      for (int64_t t = 0; t < x.n(); ++t)
        for (int64_t j = 0; j < c.V; ++j) o_ref[((pr.cu[n] + t) * c.H + h) * c.V + j] = f.o(t, j);
      for (int64_t i = 0; i < c.K; ++i)
        for (int64_t j = 0; j < c.V; ++j) ht_ref[((n * c.H + h) * c.K + i) * c.V + j] = f.states.back()(i, j);
    }
  std::vector<std::vector<double>> outs;
  for (Method tier : {Method::tiled, Method::naive}) {
    GpuProblem g(pr, c.V, pr.v, nullptr);
    g.h0.upload(pr.S0, DType::f32);
    g.ht.poisoned(g.state_elems(), DType::f32);
    g.o.poisoned(pr.T * c.H * c.V, c.dtype);
    g.p.h0 = g.h0.ptr, g.p.ht = g.ht.ptr;
    g.p.o = deltacp::contiguous_ref(g.o.ptr, pr.T, c.H, c.V);
    deltacp::cuda::forward(g.p, tier);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    outs.push_back(g.o.download());
    outs.push_back(g.ht.download());
  }
  const double eo = rel_err(outs[0], o_ref), eh = rel_err(outs[1], ht_ref);
  const double no = rel_err(outs[0], outs[2]), nh = rel_err(outs[1], outs[3]);
  std::printf("[errors] %s local: o %.2e ht %.2e; against the naive tier o %.2e ht %.2e\n", c.name.c_str(), eo, eh,
              no, nh);
  EXPECT_LT(eo, tolerance(c.dtype));
  EXPECT_LT(eh, tolerance(c.dtype));
  EXPECT_LT(no, 2 * tolerance(c.dtype));
  EXPECT_LT(nh, 2 * tolerance(c.dtype));
}

INSTANTIATE_TEST_SUITE_P(Cuda, TiledDplrMaps, testing::ValuesIn(map_cases()),
                         [](const testing::TestParamInfo<Case>& info) { return info.param.name; });

// What the tiled DPLR tier refuses it refuses before launching anything: the outputs stay poisoned, so a caller
// (deltacp.cp) may run the naive tier instead. K = 160 everywhere; fp32 K = 128 where the WY stage's 224,016
// bytes of shared memory exceed the GPU's opt-in limit (it runs where they fit).
TEST(TiledDplrRefusal, NothingIsWrittenBeforeTheRefusal) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  int dev = 0, limit = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), cudaSuccess);
  for (const auto& [K, dt, refused] :
       {std::tuple<int64_t, DType, bool>{160, DType::bf16, true}, {128, DType::f32, limit < 224016}}) {
    Case c{"refusal", dt, false, 64, 1, K, 32, {70}};
    const Problem pr(c, 5);
    GpuProblem g(pr, c.V, pr.v, nullptr);
    g.ht.poisoned(g.state_elems(), DType::f32);
    g.o.poisoned(pr.T * c.H * c.V, c.dtype);
    g.p.ht = g.ht.ptr;
    g.p.o = deltacp::contiguous_ref(g.o.ptr, pr.T, c.H, c.V);
    bool threw = false;
    try {
      deltacp::cuda::forward(g.p, Method::tiled);
    } catch (const deltacp::Error& e) {
      threw = true;
      EXPECT_EQ(e.argument(), "K") << e.what();
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(threw, refused) << "K = " << K << ", " << deltacp::to_string(dt) << ", opt-in limit " << limit;
    int64_t written = 0;
    for (double x : g.ht.download()) written += !std::isnan(x);
    for (double x : g.o.download()) written += !std::isnan(x);
    if (refused) EXPECT_EQ(written, 0) << "a refused call wrote " << written << " elements";
  }
}

}  // namespace
