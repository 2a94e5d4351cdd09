// tests/cuda/test_cuda_tiers.cpp — every CUDA tier against the fp64 Eigen reference.
//
// For each (tier, variant, input dtype, shape):
//   1. draw fresh random inputs (seed printed; DELTACP_TEST_SEED=<n> replays a run):
//        q, k ~ randn, L2-normalised along K;  v ~ randn;  beta = sigmoid(randn) in (0, 1);
//        g = logsigmoid(randn + 2) (log decays < 0, mostly mild so states carry far);
//        dplr: a = -n, b = c n with n randn L2-normalised and c = sigmoid(randn) (a stable
//        diag + low-rank transition, as RWKV-7 builds it);  h0 ~ 0.1 randn;  do ~ randn;  dht ~ 0.1 randn
//      and round every input to the dtype under test (states to fp32), so the GPU and the
//      reference see exactly the same numbers;
//   2. run ref::forward<double> / ref::backward<double> (Method::recurrent) on fp64 copies;
//   3. upload, fill every GPU output with NaN bytes (0xFF) first, run the tier, download;
//   4. relative error ||x - ref|| / ||ref|| per tensor (o, ht; dq, dk, dv, dg, dbeta, da, db, dh0),
//      printed, and checked against 1e-5 (fp32 inputs) or 1e-2 (bf16 / fp16 inputs).
// Shapes that bite (docs/design.md section 7): T = 1, T < chunk, T = chunk - 1, chunk, chunk + 1,
// many short sequences (with an empty one), K != V, K in {32, 64, 128, 256}, varlen, B > 1,
// grouped values (HV = 2H), with and without h0 / ht, strided (padded) views, and g / dg kept in
// fp32 beside 16-bit inputs (Params::g_fp32, FLA's habit). Shapes marked
// naive-only use sizes (K = 100, 256, odd V, padded strides) that later tiers need not accept.
// Combos a tier does not support (deltacp::cuda::supports) are skipped, and everything that needs
// a GPU is skipped without one. Argument errors are tested without a GPU where they are caught
// before the device is touched.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "deltacp/cuda/api.h"
#include "deltacp/dtype.h"
#include "deltacp/error.h"
#include "deltacp/params.h"
#include "deltacp/reference/batch.h"

namespace deltacp {
inline void PrintTo(Variant v, std::ostream* os) { *os << to_string(v); }
inline void PrintTo(DType d, std::ostream* os) { *os << to_string(d); }
inline void PrintTo(Method m, std::ostream* os) { *os << to_string(m); }
}  // namespace deltacp

namespace {

using deltacp::DType;
using deltacp::Method;
using deltacp::Params;
using deltacp::TensorRef;
using deltacp::Variant;

#define CUDA_OK(expr)                                                                         \
  do {                                                                                        \
    cudaError_t err_ = (expr);                                                                \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_);                \
  } while (0)

// ---- shapes ---------------------------------------------------------------------------------
struct Shape {
  std::string name;
  int64_t B = 1, T = 1, H = 1, HV = 1, K = 64, V = 64;
  std::vector<int64_t> lengths;  // non-empty: varlen (B = 1, T = sum of lengths)
  bool h0 = true;                // initial state given (forward) and dh0 asked for (backward)
  bool ht = true;                // final state asked for (forward) and dht given (backward)
  bool strided = false;          // every [B, T, heads, D] tensor is a padded view
  bool g_fp32 = false;           // g and dg in fp32 beside 16-bit inputs (Params::g_fp32, as FLA keeps them)
  bool all_tiers = true;         // false: naive only
};

Shape fixed(std::string name, int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V, bool h0 = true,
            bool ht = true) {
  Shape s;
  s.name = std::move(name);
  s.B = B, s.T = T, s.H = H, s.HV = HV, s.K = K, s.V = V, s.h0 = h0, s.ht = ht;
  return s;
}
Shape varlen(std::string name, std::vector<int64_t> lengths, int64_t H, int64_t HV, int64_t K, int64_t V,
             bool h0 = true, bool ht = true) {
  Shape s = fixed(std::move(name), 1, 0, H, HV, K, V, h0, ht);
  for (int64_t l : lengths) s.T += l;
  s.lengths = std::move(lengths);
  return s;
}

std::vector<Shape> shapes() {
  std::vector<Shape> v;
  v.push_back(fixed("T1_B2", 2, 1, 2, 2, 64, 64));
  v.push_back(fixed("T37_below_chunk_noh0", 1, 37, 2, 2, 64, 64, false, true));
  v.push_back(fixed("T63_chunk_minus_1_noht", 2, 63, 2, 2, 64, 64, true, false));
  v.push_back(fixed("T64_chunk_nostates", 1, 64, 1, 1, 64, 64, false, false));
  v.push_back(fixed("T65_chunk_plus_1", 2, 65, 2, 2, 64, 64));
  v.push_back(fixed("K32_V48", 2, 50, 2, 2, 32, 48));
  v.push_back(fixed("K128_V64_T130", 1, 130, 2, 2, 128, 64));
  v.push_back(fixed("K64_V128", 1, 70, 1, 1, 64, 128));
  v.push_back(fixed("B3_T70_K128_V128", 3, 70, 2, 2, 128, 128));
  v.push_back(varlen("K128_V128_varlen_grouped", {1, 64, 0, 65, 130, 200}, 1, 2, 128, 128));
  v.push_back(fixed("grouped_HV4_H2", 2, 40, 2, 4, 64, 32));
  v.push_back(fixed("long_T300", 1, 300, 1, 1, 64, 64));
  v.push_back(varlen("varlen_mixed", {1, 63, 64, 65, 130, 7}, 2, 2, 64, 64));
  v.push_back(varlen("many_short_seqs", {3, 1, 0, 7, 2, 9, 1, 5, 4, 8, 2, 6, 3, 1, 9, 2, 7, 4, 1, 5,
                                         6, 2, 8, 3, 1, 4, 9, 2, 5, 7, 3, 6, 1, 8, 2, 4, 5, 9, 1, 3},
                     2, 2, 32, 32));
  Shape k256 = fixed("K256_V200_naive", 1, 20, 1, 1, 256, 200);
  k256.all_tiers = false;
  v.push_back(k256);
  Shape odd = varlen("K100_V33_strided_naive", {45, 0, 30}, 2, 2, 100, 33);
  odd.strided = true;
  odd.all_tiers = false;
  v.push_back(odd);
  // Odd K and V on every tier: the tiled kernels' unaligned paths (no 16-byte copies of padded rows, K not a
  // multiple of 2 in the backward's paired stores), an empty sequence, chunks cut short.
  Shape odd_tiled = varlen("K99_V33_strided", {45, 0, 30, 70}, 2, 2, 99, 33);
  odd_tiled.strided = true;
  v.push_back(odd_tiled);
  Shape gate32 = varlen("varlen_mixed_g_fp32", {1, 63, 64, 65, 130, 7}, 2, 2, 64, 64);
  gate32.g_fp32 = true;
  v.push_back(gate32);
  Shape gate32_grouped = fixed("T65_grouped_g_fp32", 2, 65, 1, 2, 128, 64);
  gate32_grouped.g_fp32 = true;
  v.push_back(gate32_grouped);
  Shape strided_b = fixed("B2_T66_strided_naive", 2, 66, 2, 4, 64, 64);
  strided_b.strided = true;
  strided_b.all_tiers = false;
  v.push_back(strided_b);
  return v;
}

// ---- random inputs rounded to the dtype under test ------------------------------------------
double round_to(double x, DType dt) {
  switch (dt) {
    case DType::f64: return x;
    case DType::f32: return static_cast<float>(x);
    case DType::bf16: return deltacp::bf16_bits_to_float(deltacp::float_to_bf16_bits(static_cast<float>(x)));
    case DType::f16: return deltacp::f16_bits_to_float(deltacp::float_to_f16_bits(static_cast<float>(x)));
  }
  return x;
}

uint64_t base_seed() {
  static const uint64_t seed = [] {
    if (const char* env = std::getenv("DELTACP_TEST_SEED")) return static_cast<uint64_t>(std::strtoull(env, nullptr, 10));
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }();
  return seed;
}

// A logical [B, T, heads, D] tensor (D = 1 for g of gdn and beta), contiguous, in double.
struct HostTensor {
  int64_t B = 0, T = 0, heads = 0, D = 0;
  std::vector<double> x;
  bool defined() const { return !x.empty(); }
  int64_t size() const { return B * T * heads * D; }
  TensorRef ref() { return x.empty() ? TensorRef{} : deltacp::contiguous_ref(x.data(), T, heads, D); }
};

struct Problem {
  Variant variant;
  DType dtype;
  Shape s;
  int64_t N = 0;
  std::vector<int64_t> cu;  // varlen offsets
  HostTensor q, k, v, g, beta, a, b, dout;
  std::vector<double> h0, dht;  // [N, HV, K, V] (fp32 values)

  Problem(Variant var, DType dt, Shape shape, uint64_t seed) : variant(var), dtype(dt), s(std::move(shape)) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal;
    auto make = [&](HostTensor& t, int64_t heads, int64_t D) {
      t.B = s.B, t.T = s.T, t.heads = heads, t.D = D;
      t.x.resize(t.size());
    };
    auto fill_randn = [&](HostTensor& t, double scale) {
      for (double& e : t.x) e = scale * normal(rng);
    };
    auto l2_normalise = [&](HostTensor& t) {
      for (int64_t r = 0; r < t.size() / t.D; ++r) {
        double n2 = 0;
        for (int64_t d = 0; d < t.D; ++d) n2 += t.x[r * t.D + d] * t.x[r * t.D + d];
        for (int64_t d = 0; d < t.D; ++d) t.x[r * t.D + d] /= std::sqrt(n2);
      }
    };
    auto sigmoid = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
    auto logsigmoid = [](double x) { return -std::log1p(std::exp(-x)); };

    N = s.lengths.empty() ? s.B : static_cast<int64_t>(s.lengths.size());
    if (!s.lengths.empty()) {
      cu.push_back(0);
      for (int64_t l : s.lengths) cu.push_back(cu.back() + l);
    }
    make(q, s.H, s.K), fill_randn(q, 1), l2_normalise(q);
    make(k, s.H, s.K), fill_randn(k, 1), l2_normalise(k);
    make(v, s.HV, s.V), fill_randn(v, 1);
    if (variant != Variant::delta) {
      make(g, s.HV, variant == Variant::gdn ? 1 : s.K);
      for (double& e : g.x) e = logsigmoid(normal(rng) + 2.0);
    }
    if (variant != Variant::dplr) {
      make(beta, s.HV, 1);
      for (double& e : beta.x) e = sigmoid(normal(rng));
    } else {
      make(a, s.HV, s.K), fill_randn(a, 1), l2_normalise(a);
      make(b, s.HV, s.K);
      for (int64_t r = 0; r < a.size() / s.K; ++r) {
        const double c = sigmoid(normal(rng));
        for (int64_t d = 0; d < s.K; ++d) {
          b.x[r * s.K + d] = c * a.x[r * s.K + d];
          a.x[r * s.K + d] = -a.x[r * s.K + d];
        }
      }
    }
    make(dout, s.HV, s.V), fill_randn(dout, 1);
    const int64_t st = N * s.HV * s.K * s.V;
    if (s.h0) {
      h0.resize(st);
      for (double& e : h0) e = static_cast<float>(0.1 * normal(rng));
    }
    if (s.ht) {
      dht.resize(st);
      for (double& e : dht) e = static_cast<float>(0.1 * normal(rng));
    }
    for (HostTensor* t : {&q, &k, &v, &beta, &a, &b, &dout})
      for (double& e : t->x) e = round_to(e, dtype);
    for (double& e : g.x) e = round_to(e, gate_dtype());
  }

  int64_t gate_dim() const { return variant == Variant::gdn ? 1 : s.K; }
  DType gate_dtype() const { return s.g_fp32 ? DType::f32 : dtype; }  // g and dg on the GPU
  int64_t state_elems() const { return N * s.HV * s.K * s.V; }

  // Sizes, variant, scale and varlen fields; pointers are filled by the callers.
  Params base_params() const {
    Params p;
    p.variant = variant;
    p.B = s.B, p.T = s.T, p.H = s.H, p.HV = s.HV, p.K = s.K, p.V = s.V;
    p.num_seqs = N;
    p.scale = 1.0 / std::sqrt(static_cast<double>(s.K));
    p.chunk_size = 64;
    return p;
  }
};

// The reference's outputs, by name.
struct Results {
  std::vector<std::pair<std::string, std::vector<double>>> tensors;
  const std::vector<double>* find(const std::string& n) const {
    for (auto& t : tensors)
      if (t.first == n) return &t.second;
    return nullptr;
  }
};

Results reference(Problem& pr, bool backward) {
  Params p = pr.base_params();
  p.dtype = DType::f64;
  p.state_dtype = DType::f64;
  if (!pr.cu.empty()) p.cu_seqlens = p.cu_seqlens_host = pr.cu.data();
  p.q = pr.q.ref(), p.k = pr.k.ref(), p.v = pr.v.ref(), p.g = pr.g.ref(), p.beta = pr.beta.ref();
  p.a = pr.a.ref(), p.b = pr.b.ref();
  p.h0 = pr.h0.empty() ? nullptr : pr.h0.data();
  const Shape& s = pr.s;
  auto like = [&](const HostTensor& t) {
    HostTensor o = t;
    std::fill(o.x.begin(), o.x.end(), NAN);
    return o;
  };
  HostTensor o = like(pr.v);
  std::vector<double> ht(pr.state_elems(), NAN), dh0(pr.state_elems(), NAN);
  p.o = o.ref();
  Results r;
  if (!backward) {
    p.ht = s.ht ? ht.data() : nullptr;
    deltacp::ref::forward<double>(p, Method::recurrent);
    r.tensors.push_back({"o", o.x});
    if (s.ht) r.tensors.push_back({"ht", ht});
    return r;
  }
  HostTensor dq = like(pr.q), dk = like(pr.k), dv = like(pr.v), dg = like(pr.g), dbeta = like(pr.beta);
  HostTensor da = like(pr.a), db = like(pr.b);
  p.dout = pr.dout.ref();
  p.dht = pr.dht.empty() ? nullptr : pr.dht.data();
  p.dq = dq.ref(), p.dk = dk.ref(), p.dv = dv.ref(), p.dg = dg.ref(), p.dbeta = dbeta.ref();
  p.da = da.ref(), p.db = db.ref();
  p.dh0 = s.h0 ? dh0.data() : nullptr;
  deltacp::ref::backward<double>(p, Method::recurrent);
  r.tensors = {{"dq", dq.x}, {"dk", dk.x}, {"dv", dv.x}};
  if (dg.defined()) r.tensors.push_back({"dg", dg.x});
  if (dbeta.defined()) r.tensors.push_back({"dbeta", dbeta.x});
  if (da.defined()) r.tensors.push_back({"da", da.x});
  if (db.defined()) r.tensors.push_back({"db", db.x});
  if (s.h0) r.tensors.push_back({"dh0", dh0});
  return r;
}

// ---- device buffers --------------------------------------------------------------------------
// A [B, T, heads, D] tensor on the GPU in `dt`, contiguous or a padded view (every axis stride
// larger than needed, so the padding catches writes outside the logical elements).
struct DeviceTensor {
  DType dt = DType::f32;
  int64_t B = 0, T = 0, heads = 0, D = 0, elems = 0;
  TensorRef view;
  void* ptr = nullptr;

  DeviceTensor() = default;
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  ~DeviceTensor() {
    if (ptr) cudaFree(ptr);
  }
  bool defined() const { return ptr != nullptr; }
  size_t bytes() const { return static_cast<size_t>(elems * deltacp::dtype_size(dt)); }

  // Shapes the view, allocates and fills every byte with 0xFF (NaN in f32, bf16 and f16).
  void allocate(int64_t B_, int64_t T_, int64_t heads_, int64_t D_, DType dt_, bool strided) {
    B = B_, T = T_, heads = heads_, D = D_, dt = dt_;
    const int64_t sh = D + (strided ? 3 : 0);
    const int64_t st = heads * sh + (strided ? 5 : 0);
    const int64_t sb = T * st + (strided ? 7 : 0);
    elems = B * sb;
    if (cudaMalloc(&ptr, bytes()) != cudaSuccess) ptr = nullptr;
    if (ptr) cudaMemset(ptr, 0xFF, bytes());
    view = TensorRef{ptr, sb, st, sh};
  }
  void upload(const HostTensor& h, bool strided) {
    allocate(h.B, h.T, h.heads, h.D, dt, strided);
    std::vector<unsigned char> raw(bytes(), 0xFF);
    for_each([&](int64_t off, int64_t i) { deltacp::store_as<double>(raw.data(), off, dt, h.x[i]); });
    cudaMemcpy(ptr, raw.data(), bytes(), cudaMemcpyHostToDevice);
  }
  // Calls f(offset in the buffer, index in the logical contiguous tensor) for every element.
  void for_each(const std::function<void(int64_t, int64_t)>& f) const {
    int64_t i = 0;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t d = 0; d < D; ++d) f(view.offset(b, t, h) + d, i++);
  }
  std::vector<unsigned char> raw() const {
    std::vector<unsigned char> r(bytes());
    cudaMemcpy(r.data(), ptr, bytes(), cudaMemcpyDeviceToHost);
    return r;
  }
  std::vector<double> download() const {
    const std::vector<unsigned char> r = raw();
    std::vector<double> out(B * T * heads * D);
    for_each([&](int64_t off, int64_t i) { out[i] = deltacp::load_as<double>(r.data(), off, dt); });
    return out;
  }
  // Number of padding bytes that are no longer 0xFF (a write outside the logical elements).
  int64_t touched_padding() const {
    const std::vector<unsigned char> r = raw();
    std::vector<char> logical(elems, 0);
    for_each([&](int64_t off, int64_t) { logical[off] = 1; });
    const int64_t es = deltacp::dtype_size(dt);
    int64_t bad = 0;
    for (int64_t e = 0; e < elems; ++e)
      if (!logical[e])
        for (int64_t byte = 0; byte < es; ++byte) bad += r[e * es + byte] != 0xFF;
    return bad;
  }
};

// fp32 buffer (states, cu_seqlens as raw bytes).
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  void poisoned(size_t n) {
    bytes = n;
    if (cudaMalloc(&ptr, n) != cudaSuccess) ptr = nullptr;
    if (ptr) cudaMemset(ptr, 0xFF, n);
  }
  template <class E>
  void upload(const std::vector<E>& x) {
    poisoned(x.size() * sizeof(E));
    if (ptr) cudaMemcpy(ptr, x.data(), bytes, cudaMemcpyHostToDevice);
  }
  std::vector<double> download_f32() const {
    std::vector<float> f(bytes / sizeof(float));
    cudaMemcpy(f.data(), ptr, bytes, cudaMemcpyDeviceToHost);
    return std::vector<double>(f.begin(), f.end());
  }
};

// Everything one GPU run needs, uploaded from a Problem.
struct GpuRun {
  Problem& pr;
  DeviceTensor q, k, v, g, beta, a, b, dout, o, dq, dk, dv, dg, dbeta, da, db;
  DeviceBuffer h0, ht, dht, dh0, cu;
  Params p;

  GpuRun(Problem& problem, bool backward) : pr(problem) {
    const Shape& s = pr.s;
    const bool st = s.strided;
    for (DeviceTensor* t : {&q, &k, &v, &g, &beta, &a, &b, &dout, &o, &dq, &dk, &dv, &dg, &dbeta, &da, &db})
      t->dt = pr.dtype;
    g.dt = dg.dt = pr.gate_dtype();
    q.upload(pr.q, st), k.upload(pr.k, st), v.upload(pr.v, st);
    if (pr.g.defined()) g.upload(pr.g, st);
    if (pr.beta.defined()) beta.upload(pr.beta, st);
    if (pr.a.defined()) a.upload(pr.a, st), b.upload(pr.b, st);
    o.allocate(s.B, s.T, s.HV, s.V, pr.dtype, st);
    const size_t state_bytes = pr.state_elems() * sizeof(float);
    if (s.h0) h0.upload(std::vector<float>(pr.h0.begin(), pr.h0.end()));
    if (!pr.cu.empty()) cu.upload(pr.cu);

    p = pr.base_params();
    p.dtype = pr.dtype;
    p.g_fp32 = s.g_fp32;
    p.state_dtype = DType::f32;
    if (!pr.cu.empty()) p.cu_seqlens = static_cast<const int64_t*>(cu.ptr), p.cu_seqlens_host = pr.cu.data();
    p.q = q.view, p.k = k.view, p.v = v.view, p.g = g.view, p.beta = beta.view, p.a = a.view, p.b = b.view;
    p.h0 = h0.ptr;
    p.o = o.view;
    if (!backward) {
      if (s.ht) ht.poisoned(state_bytes);
      p.ht = ht.ptr;
      return;
    }
    dout.upload(pr.dout, st);
    if (s.ht) dht.upload(std::vector<float>(pr.dht.begin(), pr.dht.end()));
    dq.allocate(s.B, s.T, s.H, s.K, pr.dtype, st);
    dk.allocate(s.B, s.T, s.H, s.K, pr.dtype, st);
    dv.allocate(s.B, s.T, s.HV, s.V, pr.dtype, st);
    if (pr.g.defined()) dg.allocate(s.B, s.T, s.HV, pr.gate_dim(), pr.gate_dtype(), st);
    if (pr.beta.defined()) dbeta.allocate(s.B, s.T, s.HV, 1, pr.dtype, st);
    if (pr.a.defined()) da.allocate(s.B, s.T, s.HV, s.K, pr.dtype, st), db.allocate(s.B, s.T, s.HV, s.K, pr.dtype, st);
    if (s.h0) dh0.poisoned(state_bytes);
    p.dout = dout.view, p.dht = dht.ptr;
    p.dq = dq.view, p.dk = dk.view, p.dv = dv.view, p.dg = dg.view, p.dbeta = dbeta.view;
    p.da = da.view, p.db = db.view;
    p.dh0 = dh0.ptr;
  }

  Results results(bool backward) const {
    Results r;
    if (!backward) {
      r.tensors.push_back({"o", o.download()});
      if (pr.s.ht) r.tensors.push_back({"ht", ht.download_f32()});
      return r;
    }
    r.tensors = {{"dq", dq.download()}, {"dk", dk.download()}, {"dv", dv.download()}};
    if (dg.defined()) r.tensors.push_back({"dg", dg.download()});
    if (dbeta.defined()) r.tensors.push_back({"dbeta", dbeta.download()});
    if (da.defined()) r.tensors.push_back({"da", da.download()});
    if (db.defined()) r.tensors.push_back({"db", db.download()});
    if (pr.s.h0) r.tensors.push_back({"dh0", dh0.download_f32()});
    return r;
  }

  // Padding bytes of the outputs that were written (strided shapes only).
  int64_t touched_padding(bool backward) const {
    int64_t bad = 0;
    if (!backward) return o.touched_padding();
    for (const DeviceTensor* t : {&dq, &dk, &dv, &dg, &dbeta, &da, &db})
      if (t->defined()) bad += t->touched_padding();
    return bad;
  }
};

double rel_err(const std::vector<double>& x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double d = x[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// ---- the parameterised accuracy tests --------------------------------------------------------
using Combo = std::tuple<Method, Variant, DType, Shape>;

std::string combo_name(const testing::TestParamInfo<Combo>& info) {
  const auto& [tier, variant, dtype, shape] = info.param;
  const char* dt = dtype == DType::f32 ? "f32" : dtype == DType::bf16 ? "bf16" : "f16";
  return std::string(deltacp::to_string(tier)) + "_" + deltacp::to_string(variant) + "_" + dt + "_" + shape.name;
}

class TierAccuracy : public testing::TestWithParam<Combo> {
 protected:
  // Returns false (after GTEST_SKIP's message) when this combination cannot run here.
  bool runnable(bool backward) {
    const auto& [tier, variant, dtype, shape] = GetParam();
    if (!deltacp::cuda::device_available()) return skip("no CUDA device");
    // The tiled DPLR forward and backward are opt-in (dispatch.cu's opt_in: run when the tier is named, not
    // listed by supports() until they have been validated on a GPU): their cases run here all the same.
    const bool opt_in = variant == Variant::dplr && tier == Method::tiled;
    if (!deltacp::cuda::supports(variant, tier, backward) && !opt_in)
      return skip(std::string(deltacp::to_string(tier)) + " does not implement this variant/direction");
    if (!shape.all_tiers && tier != Method::naive) return skip("naive-only shape");
    if (tier == Method::fused) {  // its kernels' reach (cuda/fused/fused_fwd.cu forward_refusal)
      int major = 0, minor = 0;
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
      const bool kv = (shape.K == 128 && (shape.V == 128 || shape.V == 256)) || (shape.K == 64 && shape.V == 64);
      if (!kv || dtype == DType::f32 || major != 9 || minor != 0)
        return skip("the fused tier takes 16-bit inputs with K = 128 and V = 128 or 256, or K = V = 64, on compute "
                    "capability 9.0");
    }
    if (variant == Variant::dplr && shape.HV != shape.H) return skip("dplr takes HV == H only");
    if (shape.g_fp32 && (dtype == DType::f32 || variant == Variant::delta))
      return skip("g_fp32 changes nothing for fp32 inputs or a gate-free variant");
    return true;
  }
  bool skip(const std::string& why) {
    skip_reason_ = why;
    return false;
  }
  std::string skip_reason_;

  // kept: the backward (on the tiled tier) reads the chunk-start states and v_new that this tier's forward kept
  // (Params::chunk_h, chunk_vnew: poisoned buffers the forward must fill) instead of recomputing them.
  void run(bool backward, bool kept = false) {
    const auto& [tier, variant, dtype, shape] = GetParam();
    const std::string name = testing::UnitTest::GetInstance()->current_test_info()->name();
    const uint64_t seed = base_seed() ^ std::hash<std::string>{}(name + (backward ? "/bwd" : "/fwd"));
    Problem pr(variant, dtype, shape, seed);
    const Results ref = reference(pr, backward);

    GpuRun gpu(pr, backward);
    ASSERT_TRUE(gpu.q.defined()) << "cudaMalloc failed";
    DeviceBuffer chunk_h, chunk_vnew;
    if (kept) {
      int64_t chunks = 0;
      for (int64_t n = 0; n < pr.N; ++n) {
        const int64_t len = shape.lengths.empty() ? shape.T : shape.lengths[static_cast<size_t>(n)];
        chunks += (len + gpu.p.chunk_size - 1) / gpu.p.chunk_size;
      }
      const int64_t es = deltacp::dtype_size(dtype), Kp = (shape.K + 15) / 16 * 16, Vp = (shape.V + 15) / 16 * 16;
      chunk_h.poisoned(static_cast<size_t>(chunks * shape.HV * Kp * Vp * es));
      chunk_vnew.poisoned(static_cast<size_t>(shape.B * shape.T * shape.HV * Vp * es));
      ASSERT_TRUE(chunk_h.ptr && chunk_vnew.ptr) << "cudaMalloc failed";
      Params fwd = gpu.p;  // the forward of the same problem, keeping its states
      fwd.dout = {}, fwd.dht = nullptr, fwd.dq = {}, fwd.dk = {}, fwd.dv = {}, fwd.dg = {}, fwd.dbeta = {};
      fwd.da = {}, fwd.db = {}, fwd.dh0 = nullptr;
      fwd.chunk_h = chunk_h.ptr, fwd.chunk_vnew = chunk_vnew.ptr;
      deltacp::cuda::forward(fwd, tier);
      gpu.p.chunk_h = chunk_h.ptr, gpu.p.chunk_vnew = chunk_vnew.ptr;
    }
    if (backward)
      deltacp::cuda::backward(gpu.p, kept ? Method::tiled : tier);
    else
      deltacp::cuda::forward(gpu.p, tier);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaGetLastError());
    const Results got = gpu.results(backward);

    const double tol = dtype == DType::f32 ? 1e-5 : 1e-2;
    std::string line;
    char buf[96];
    for (const auto& [tname, values] : got.tensors) {
      const std::vector<double>* expected = ref.find(tname);
      ASSERT_NE(expected, nullptr) << tname;
      ASSERT_EQ(expected->size(), values.size()) << tname;
      const double err = rel_err(values, *expected);
      std::snprintf(buf, sizeof(buf), " %s %.2e", tname.c_str(), err);
      line += buf;
      EXPECT_LE(err, tol) << tname << " relative error (seed " << base_seed() << ")";
    }
    if (shape.strided) EXPECT_EQ(gpu.touched_padding(backward), 0) << "writes outside the logical elements";
    std::printf("[errors] %s %s:%s (tol %.0e, seed %llu)\n", name.c_str(), backward ? "bwd" : "fwd", line.c_str(),
                tol, static_cast<unsigned long long>(base_seed()));
  }
};

TEST_P(TierAccuracy, Forward) {
  if (!runnable(false)) GTEST_SKIP() << skip_reason_;
  run(false);
}

TEST_P(TierAccuracy, Backward) {
  if (!runnable(true)) GTEST_SKIP() << skip_reason_;
  run(true);
}

// The tiled backward from the states this tier's forward kept (16-bit gdn, kda and delta on the tiled and fused
// tiers: what the autograd path runs by default).
TEST_P(TierAccuracy, BackwardFromKeptStates) {
  const auto& [tier, variant, dtype, shape] = GetParam();
  if (tier == Method::naive || dtype == DType::f32 || variant == Variant::dplr)
    GTEST_SKIP() << "the tiled and fused forwards keep 16-bit gdn, kda and delta states";
  if (!runnable(false)) GTEST_SKIP() << skip_reason_;
  if (!deltacp::cuda::supports(variant, Method::tiled, true)) GTEST_SKIP() << "no tiled backward in this build";
  run(true, /*kept=*/true);
}

INSTANTIATE_TEST_SUITE_P(Cuda, TierAccuracy,
                         testing::Combine(testing::Values(Method::naive, Method::tiled, Method::fused),
                                          testing::Values(Variant::delta, Variant::gdn, Variant::kda, Variant::dplr),
                                          testing::Values(DType::f32, DType::bf16, DType::f16),
                                          testing::ValuesIn(shapes())),
                         combo_name);

// ---- determinism: the naive tier has no atomics, so two runs agree bit for bit --------------
class NaiveDeterminism : public testing::TestWithParam<std::tuple<Variant, DType>> {};

TEST_P(NaiveDeterminism, TwoRunsBitwiseEqual) {
  if (!deltacp::cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  const auto [variant, dtype] = GetParam();
  Shape shape = varlen("det", {70, 1, 130}, 2, 2, 64, 96);
  if (variant != Variant::dplr) shape.HV = 4;  // grouped values: dq/dk sum over value heads
  Problem pr(variant, dtype, shape, base_seed());
  for (bool backward : {false, true}) {
    GpuRun first(pr, backward), second(pr, backward);
    for (GpuRun* r : {&first, &second}) {
      if (backward)
        deltacp::cuda::backward(r->p, Method::naive);
      else
        deltacp::cuda::forward(r->p, Method::naive);
    }
    CUDA_OK(cudaDeviceSynchronize());
    auto bytes = [&](GpuRun& r) {
      std::vector<std::vector<unsigned char>> out;
      if (!backward) {
        out.push_back(r.o.raw());
        std::vector<unsigned char> h(r.ht.bytes);
        cudaMemcpy(h.data(), r.ht.ptr, r.ht.bytes, cudaMemcpyDeviceToHost);
        out.push_back(h);
        return out;
      }
      for (DeviceTensor* t : {&r.dq, &r.dk, &r.dv, &r.dg, &r.dbeta, &r.da, &r.db})
        if (t->defined()) out.push_back(t->raw());
      std::vector<unsigned char> h(r.dh0.bytes);
      cudaMemcpy(h.data(), r.dh0.ptr, r.dh0.bytes, cudaMemcpyDeviceToHost);
      out.push_back(h);
      return out;
    };
    EXPECT_TRUE(bytes(first) == bytes(second)) << (backward ? "backward" : "forward") << " differs between runs";
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, NaiveDeterminism,
                         testing::Combine(testing::Values(Variant::delta, Variant::gdn, Variant::kda, Variant::dplr),
                                          testing::Values(DType::f32, DType::bf16)),
                         [](const testing::TestParamInfo<std::tuple<Variant, DType>>& info) {
                           return std::string(deltacp::to_string(std::get<0>(info.param))) + "_" +
                                  (std::get<1>(info.param) == DType::f32 ? "f32" : "bf16");
                         });

// ---- argument errors -------------------------------------------------------------------------
// A valid-looking Params over fake host addresses: the checks below fail before anything is read.
struct FakeParams {
  float storage[16] = {};
  int64_t cu_host[3] = {0, 3, 8};
  Params p;
  FakeParams() {
    p.variant = Variant::gdn;
    p.dtype = DType::bf16;
    p.state_dtype = DType::f32;
    p.B = 2, p.T = 8, p.H = 2, p.HV = 2, p.K = 64, p.V = 64;
    p.num_seqs = 2;
    p.scale = 0.125;
    TensorRef t{storage, 1, 1, 1};
    p.q = p.k = p.v = p.g = p.beta = p.o = t;
    p.dout = p.dq = p.dk = p.dv = p.dg = p.dbeta = t;
  }
};

// Runs f and returns the argument named by the deltacp::Error it throws ("<none>" if none).
std::string thrown_argument(const std::function<void()>& f) {
  try {
    f();
  } catch (const deltacp::Error& e) {
    std::printf("  [expected error] %s\n", e.what());
    return e.argument();
  } catch (const std::exception& e) {
    return std::string("<other exception: ") + e.what() + ">";
  }
  return "<none>";
}

TEST(CudaBadInput, NullRequiredPointer) {
  for (bool backward : {false, true}) {
    FakeParams f;
    f.p.q.ptr = nullptr;
    EXPECT_EQ(thrown_argument([&] {
                backward ? deltacp::cuda::backward(f.p, Method::naive) : deltacp::cuda::forward(f.p, Method::naive);
              }),
              "q");
  }
  FakeParams f;
  f.p.dk.ptr = nullptr;
  EXPECT_EQ(thrown_argument([&] { deltacp::cuda::backward(f.p, Method::naive); }), "dk");
}

TEST(CudaBadInput, StateDtypeF64) {
  FakeParams f;
  f.p.state_dtype = DType::f64;
  EXPECT_EQ(thrown_argument([&] { deltacp::cuda::forward(f.p, Method::naive); }), "state_dtype");
  EXPECT_EQ(thrown_argument([&] { deltacp::cuda::backward(f.p, Method::naive); }), "state_dtype");
}

TEST(CudaBadInput, InputDtypeF64) {
  FakeParams f;
  f.p.dtype = DType::f64;
  EXPECT_EQ(thrown_argument([&] { deltacp::cuda::forward(f.p, Method::naive); }), "dtype");
}

TEST(CudaBadInput, MissingCuSeqlensHost) {
  FakeParams f;
  f.p.B = 1;
  f.p.cu_seqlens = f.cu_host;  // stands in for a device array
  f.p.cu_seqlens_host = nullptr;
  EXPECT_EQ(thrown_argument([&] { deltacp::cuda::forward(f.p, Method::naive); }), "cu_seqlens_host");
  EXPECT_EQ(thrown_argument([&] { deltacp::cuda::backward(f.p, Method::naive); }), "cu_seqlens_host");
}

TEST(CudaBadInput, BadCuSeqlensHost) {
  FakeParams f;
  f.p.B = 1;
  f.p.cu_seqlens = f.cu_host;
  int64_t bad[3] = {0, 5, 3};  // decreasing, and does not end at T = 8
  f.p.cu_seqlens_host = bad;
  EXPECT_EQ(thrown_argument([&] { deltacp::cuda::forward(f.p, Method::naive); }), "cu_seqlens");
}

TEST(CudaBadInput, UnknownTier) {
  FakeParams f;
  EXPECT_EQ(thrown_argument([&] { deltacp::cuda::forward(f.p, Method::recurrent); }), "tier");
  EXPECT_EQ(thrown_argument([&] { deltacp::cuda::backward(f.p, Method::fused); }), "tier");
}

TEST(CudaBadInput, SupportsNamesNoUnbuiltTier) {
  EXPECT_FALSE(deltacp::cuda::supports(Variant::gdn, Method::recurrent, false));
  EXPECT_FALSE(deltacp::cuda::supports(Variant::gdn, Method::fused, true));
  for (Variant v : {Variant::delta, Variant::gdn, Variant::kda, Variant::dplr}) {
    EXPECT_TRUE(deltacp::cuda::supports(v, Method::naive, false));
    EXPECT_TRUE(deltacp::cuda::supports(v, Method::naive, true));
  }
}

// These reach the device (pointer attributes, launch-time limits): GPU only.
TEST(CudaBadInput, HostPointerRejected) {
  if (!deltacp::cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  FakeParams f;  // every tensor points at pageable host memory
  EXPECT_EQ(thrown_argument([&] { deltacp::cuda::forward(f.p, Method::naive); }), "q");
}

TEST(CudaBadInput, KeyDimensionTooLargeForNaive) {
  if (!deltacp::cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  DeviceBuffer buf;
  buf.poisoned(1024);
  FakeParams f;
  f.p.K = 300;
  TensorRef t{buf.ptr, 1, 1, 1};
  f.p.q = f.p.k = f.p.v = f.p.g = f.p.beta = f.p.o = t;
  f.p.dout = f.p.dq = f.p.dk = f.p.dv = f.p.dg = f.p.dbeta = t;
  EXPECT_EQ(thrown_argument([&] { deltacp::cuda::forward(f.p, Method::naive); }), "K");
  EXPECT_EQ(thrown_argument([&] { deltacp::cuda::backward(f.p, Method::naive); }), "K");
  CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
