// distributed/tests/cp_body_host_test.cpp — the CP pre-pass and merge bodies (distributed/include/deltacp/distributed/cp_body.h)
// run on the host with one "thread" and checked against the Eigen reference in fp64:
//
//   forward pre-pass  [X_H | X_M]  == [M start + H | M]        (ref::span_affine)
//   backward pre-pass [Y_dH | Y_Mt] == [Mt dend + dH | Mt]     (ref::span_affine_backward)
//   merge             fold S <- A_j S + B_j                     (a direct Eigen fold)
//   OneCaller         NcclComm's one-thread-at-a-time guard (cp.h): a second thread gets CommBusy
//
// for gdn, kda, delta and dplr, spans shorter than, equal to and longer than a chunk, grouped value
// heads, and column tiles that do not divide V + K. The kernels in cp_kernels.cu run exactly these
// bodies on the GPU (one thread block per work item), so this checks their arithmetic without a GPU.
// Exit status non-zero on any failure; prints one line per case.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "deltacp/distributed/cp.h"
#include "deltacp/distributed/cp_body.h"
#include "deltacp/reference/affine.h"

using namespace deltacp;
using ref::Mat;

namespace {

struct Problem {
  int variant;
  int64_t n, H, HV, K, V;
  int chunk;
  std::vector<float> q, k, v, g, beta, a, b, dout, start, dend;  // [1, n, heads, D] / [HV, K, V]
};

Problem make(int variant, int64_t n, int64_t H, int64_t HV, int64_t K, int64_t V, int chunk, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  Problem p{variant, n, H, HV, K, V, chunk, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  auto fill = [&](std::vector<float>& x, size_t count, float scale) {
    x.resize(count);
    for (auto& e : x) e = nd(rng) * scale;
  };
  fill(p.q, n * H * K, 1.f);
  fill(p.k, n * H * K, 1.f);
  for (int64_t t = 0; t < n * H; ++t) {  // unit keys
    float s = 0;
    for (int64_t d = 0; d < K; ++d) s += p.k[t * K + d] * p.k[t * K + d];
    for (int64_t d = 0; d < K; ++d) p.k[t * K + d] /= std::sqrt(s);
  }
  fill(p.v, n * HV * V, 1.f);
  const int64_t gd = variant == dist::kGdn ? 1 : K;
  p.g.resize(n * HV * gd);
  for (auto& e : p.g) e = -0.3f * ud(rng);
  p.beta.resize(n * HV);
  for (auto& e : p.beta) e = ud(rng);
  fill(p.a, n * HV * K, 0.3f);
  fill(p.b, n * HV * K, 0.3f);
  fill(p.dout, n * HV * V, 1.f);
  fill(p.start, HV * K * V, 1.f);
  fill(p.dend, HV * K * V, 1.f);
  return p;
}

dist::Span span_of(const Problem& p) {
  dist::Span s;
  s.variant = p.variant;
  s.dtype = dist::kF32;
  s.n = p.n;
  s.H = p.H;
  s.HV = p.HV;
  s.K = p.K;
  s.V = p.V;
  s.chunk = p.chunk;
  s.scale = 1.f / std::sqrt(float(p.K));
  auto ref = [](const std::vector<float>& x, int64_t heads, int64_t D) {
    return dist::Ref{x.data(), heads * D, D};
  };
  s.q = ref(p.q, p.H, p.K);
  s.k = ref(p.k, p.H, p.K);
  s.v = ref(p.v, p.HV, p.V);
  s.g = ref(p.g, p.HV, p.variant == dist::kGdn ? 1 : p.K);
  s.beta = ref(p.beta, p.HV, 1);
  s.a = ref(p.a, p.HV, p.K);
  s.b = ref(p.b, p.HV, p.K);
  s.dout = ref(p.dout, p.HV, p.V);
  return s;
}

ref::HeadInputs<double> head(const Problem& p, int64_t hv) {
  ref::HeadInputs<double> x;
  x.variant = static_cast<Variant>(p.variant);
  x.scale = 1.0 / std::sqrt(double(p.K));
  const int64_t h = hv / (p.HV / p.H), n = p.n, K = p.K, V = p.V;
  x.q.resize(n, K);
  x.k.resize(n, K);
  x.v.resize(n, V);
  const int64_t gd = p.variant == dist::kDelta ? 0 : (p.variant == dist::kGdn ? 1 : K);
  x.g.resize(n, gd);
  if (p.variant != dist::kDplr) x.beta.resize(n);
  if (p.variant == dist::kDplr) {
    x.a.resize(n, K);
    x.b.resize(n, K);
  }
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t d = 0; d < K; ++d) {
      x.q(t, d) = p.q[(t * p.H + h) * K + d];
      x.k(t, d) = p.k[(t * p.H + h) * K + d];
      if (p.variant == dist::kDplr) {
        x.a(t, d) = p.a[(t * p.HV + hv) * K + d];
        x.b(t, d) = p.b[(t * p.HV + hv) * K + d];
      }
    }
    for (int64_t j = 0; j < V; ++j) x.v(t, j) = p.v[(t * p.HV + hv) * V + j];
    const int64_t gstride = p.variant == dist::kGdn ? 1 : K;
    for (int64_t d = 0; d < gd; ++d) x.g(t, d) = p.g[(t * p.HV + hv) * gstride + d];
    if (p.variant != dist::kDplr) x.beta(t) = p.beta[t * p.HV + hv];
  }
  return x;
}

// Runs prep over every (chunk, head) and the scan over every (column tile, head), as the kernels do.
// `span` overrides span_of(p) (same sizes, other element types).
std::vector<float> run_prepass(const Problem& p, bool backward, int64_t CT, const dist::Span* span = nullptr) {
  const dist::Span s = span ? *span : span_of(p);
  const int64_t NC = s.nchunks(), rows = (p.variant == dist::kDplr && !backward) ? 2 * p.chunk : p.chunk;
  std::vector<float> Wx(p.HV * NC * rows * p.K), Ux(p.HV * NC * rows * p.V), Kbx(Wx.size()), Qg(Wx.size()),
      dO(Ux.size()), d(p.HV * NC * p.K);
  dist::Work w{Wx.data(), Ux.data(), Kbx.data(), Qg.data(), dO.data(), d.data(), rows};
  std::vector<float> smem(dist::prep_smem_floats(p.chunk, p.K, p.variant, backward));
  for (int64_t hv = 0; hv < p.HV; ++hv)
    for (int64_t c = 0; c < NC; ++c) dist::prep_body({0, 1}, s, w, c, hv, backward, smem.data());
  std::vector<float> out(p.HV * p.K * (p.V + p.K), NAN);
  smem.assign(dist::scan_smem_floats(rows, p.K, CT), 0.f);
  const float* init = backward ? p.dend.data() : p.start.data();
  for (int64_t hv = 0; hv < p.HV; ++hv)
    for (int64_t col0 = 0; col0 < p.V + p.K; col0 += CT)
      dist::scan_body({0, 1}, s, w, hv, col0, CT, backward, init, out.data(), smem.data());
  return out;
}

// The larger error, NaN if either is NaN (std::max(a, NaN) would return a and hide it).
double worst(double a, double b) { return (std::isnan(a) || std::isnan(b)) ? NAN : std::max(a, b); }

double rel_err(const Mat<double>& got, const Mat<double>& want) {
  return (got - want).norm() / std::max(want.norm(), 1e-300);
}

Mat<double> block(const std::vector<float>& buf, int64_t hv, int64_t K, int64_t width, int64_t col0, int64_t cols) {
  Mat<double> m(K, cols);
  for (int64_t d = 0; d < K; ++d)
    for (int64_t j = 0; j < cols; ++j) m(d, j) = buf[(hv * K + d) * width + col0 + j];
  return m;
}

Mat<double> state(const std::vector<float>& s, int64_t hv, int64_t K, int64_t V) { return block(s, hv, K, V, 0, V); }

int failures = 0;

void check(const char* what, const char* variant, int64_t n, double err, double tol) {
  const bool ok = err <= tol && std::isfinite(err);
  std::printf("%-4s %-22s n=%-3lld rel err %.2e (tol %.0e) %s\n", variant, what, (long long)n, err, tol,
              ok ? "ok" : "FAIL");
  if (!ok) ++failures;
}

void run_case(int variant, const char* name, int64_t n, int64_t H, int64_t HV, int chunk, int64_t CT) {
  const int64_t K = 8, V = 6;
  const Problem p = make(variant, n, H, HV, K, V, chunk, 1234u + unsigned(n) * 7u + unsigned(variant));
  const std::vector<float> fwd = run_prepass(p, false, CT);
  const std::vector<float> bwd = run_prepass(p, true, CT);
  double ef = 0, eb = 0;
  for (int64_t hv = 0; hv < HV; ++hv) {
    const ref::HeadInputs<double> x = head(p, hv);
    const ref::Affine<double> f = ref::span_affine(x, 0, n, chunk);
    const Mat<double> S0 = state(p.start, hv, K, V);
    ef = worst(ef, rel_err(block(fwd, hv, K, V + K, 0, V), f.M * S0 + f.H));
    ef = worst(ef, rel_err(block(fwd, hv, K, V + K, V, K), f.M));
    Mat<double> dout(n, V);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < V; ++j) dout(t, j) = p.dout[(t * HV + hv) * V + j];
    const ref::AffineBackward<double> bk = ref::span_affine_backward(x, 0, n, dout, chunk);
    const Mat<double> dend = state(p.dend, hv, K, V);
    eb = worst(eb, rel_err(block(bwd, hv, K, V + K, 0, V), bk.Mt * dend + bk.dH));
    eb = worst(eb, rel_err(block(bwd, hv, K, V + K, V, K), bk.Mt));
  }
  check("forward [H | M]", name, n, ef, 2e-5);
  check("backward [dH | M^T]", name, n, eb, 2e-5);
}

// bf16 bits of x, round to nearest even (finite inputs).
uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// bf16 q, k, v, beta, a, b, do beside a float32 g (FLA's usual setup): the bodies must read g in
// its own dtype. Reference: the same bodies on fp32 copies of the bf16 values (every bf16 value
// is exact in fp32, so the two runs do identical arithmetic and must agree bitwise).
void run_case_fp32_gate(int variant, const char* name) {
  const int64_t n = 40, H = variant == dist::kDplr ? 2 : 1, HV = 2, K = 8, V = 6;
  Problem p = make(variant, n, H, HV, K, V, 16, 99u + unsigned(variant));
  std::vector<std::vector<uint16_t>> bits;
  auto round_all = [&](std::vector<float>& x) {
    bits.emplace_back(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      bits.back()[i] = to_bf16(x[i]);
      x[i] = from_bf16(bits.back()[i]);
    }
    return bits.back().data();
  };
  const uint16_t* q = round_all(p.q);
  const uint16_t* k = round_all(p.k);
  const uint16_t* v = round_all(p.v);
  const uint16_t* beta = round_all(p.beta);
  const uint16_t* a = round_all(p.a);
  const uint16_t* b = round_all(p.b);
  const uint16_t* dout = round_all(p.dout);
  for (auto& e : p.g) e *= 1.0f + 1e-3f;  // g keeps bits a bf16 read would lose (not bf16-exact)
  dist::Span s16 = span_of(p);
  s16.dtype = dist::kBf16;
  s16.g_dtype = dist::kF32;  // s16.g still points at the fp32 g
  s16.q.ptr = q;
  s16.k.ptr = k;
  s16.v.ptr = v;
  s16.beta.ptr = beta;
  s16.a.ptr = a;
  s16.b.ptr = b;
  s16.dout.ptr = dout;
  for (bool backward : {false, true}) {
    const std::vector<float> want = run_prepass(p, backward, 5);
    const std::vector<float> got = run_prepass(p, backward, 5, &s16);
    double diff = 0;  // max |got - want|, NaN as soon as one element is NaN
    for (size_t i = 0; i < want.size(); ++i) {
      const double d = std::fabs(double(got[i]) - double(want[i]));
      if (!(d <= diff)) diff = d;
    }
    check(backward ? "bf16 + fp32 g backward" : "bf16 + fp32 g forward", name, n, diff, 0.0);
  }
}

void run_merge() {
  const int64_t world = 4, HV = 2, K = 8, V = 6, W = V + K;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 0.5f);
  std::vector<float> gathered(world * HV * K * W);
  for (auto& e : gathered) e = nd(rng);
  for (int64_t first : {0, 1, 3})
    for (int64_t step : {1, -1}) {
      const int64_t count = step > 0 ? world - first : first + 1;
      std::vector<float> out(HV * K * V, NAN), smem(dist::merge_smem_floats(K, 4));
      for (int64_t hv = 0; hv < HV; ++hv)
        for (int64_t col0 = 0; col0 < V; col0 += 4)
          dist::merge_body({0, 1}, gathered.data(), HV, K, V, hv, col0, 4, first, count, step, out.data(),
                           smem.data());
      double err = 0;
      for (int64_t hv = 0; hv < HV; ++hv) {
        Mat<double> S = Mat<double>::Zero(K, V);
        for (int64_t t = 0; t < count; ++t) {
          const int64_t j = first + t * step;
          Mat<double> B(K, V), A(K, K);
          for (int64_t d = 0; d < K; ++d) {
            for (int64_t c = 0; c < V; ++c) B(d, c) = gathered[((j * HV + hv) * K + d) * W + c];
            for (int64_t e = 0; e < K; ++e) A(d, e) = gathered[((j * HV + hv) * K + d) * W + V + e];
          }
          S = A * S + B;
        }
        err = worst(err, rel_err(state(out, hv, K, V), S));
      }
      check(step > 0 ? "merge ascending" : "merge descending", "all", count, err, 1e-5);
    }
}

}  // namespace

// NcclComm's guard (cp.h OneCaller): while one thread is inside a call, another thread's call throws
// CommBusy naming that call; a nested call of the same thread passes and releases nothing; once the
// outer call returns, another thread gets in.
void run_one_caller() {
  std::atomic<std::thread::id> caller{};
  bool ok = true;
  std::string raised;
  {
    const dist::OneCaller outer(caller, "the outer call");
    { const dist::OneCaller nested(caller, "a nested call"); }
    ok &= caller.load() == std::this_thread::get_id();  // the nested guard left it held
    std::thread other([&] {
      try {
        const dist::OneCaller second(caller, "the all-gather of the CP states");
      } catch (const dist::CommBusy& e) {
        raised = e.what();
      }
    });
    other.join();
    ok &= raised.find("the all-gather of the CP states") != std::string::npos &&
          raised.find("another thread") != std::string::npos;
    ok &= caller.load() == std::this_thread::get_id();  // the refused call took nothing
  }
  ok &= caller.load() == std::thread::id{};
  bool entered = false;
  std::thread later([&] {
    const dist::OneCaller again(caller, "a later call");
    entered = true;
  });
  later.join();
  ok &= entered && caller.load() == std::thread::id{};
  std::printf("%s one caller at a time: refused with \"%s\"\n", ok ? "ok  " : "FAIL", raised.c_str());
  if (!ok) ++failures;
}

int main() {
  const struct {
    int variant;
    const char* name;
  } variants[] = {{dist::kGdn, "gdn"}, {dist::kKda, "kda"}, {dist::kDelta, "delta"}, {dist::kDplr, "dplr"}};
  for (const auto& v : variants) {
    const int64_t H = v.variant == dist::kDplr ? 2 : 1, HV = 2;  // grouped values except for dplr
    for (int64_t n : {1, 15, 16, 17, 40}) run_case(v.variant, v.name, n, H, HV, 16, 5);
    run_case(v.variant, v.name, 70, H, HV, 32, 14);
    if (v.variant != dist::kDelta) run_case_fp32_gate(v.variant, v.name);
  }
  run_merge();
  run_one_caller();
  std::printf("%s: %d failure(s)\n", failures ? "FAIL" : "OK", failures);
  return failures ? 1 : 0;
}
