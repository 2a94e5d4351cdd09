// Ring attention's CUDA step (cuda/attention/ring_step.h) against the fp64 Eigen reference
// (deltacp/reference/attention.h) on the same rounded inputs: this rank's queries against two key
// blocks of zig-zag positions, merged into the fp32 accumulators, equal attention over both blocks
// (o and lse); the backward with the final (lse, delta) gives dq, and each block's dk, dv. bf16 and
// fp16, head dims 64 and 128, grouped K/V, causal and not. GTEST_SKIP without a GPU.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "attention/ring_step.h"
#include "deltacp/dtype.h"
#include "deltacp/error.h"
#include "deltacp/reference/attention.h"

namespace {

using deltacp::DType;
using Mat = deltacp::ref::Mat<double>;
using Vec = deltacp::ref::Vec<double>;
namespace ca = deltacp::cuda::attention;

bool gpu_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Host values rounded to the dtype: (bits for the device, the rounded value as double).
struct Rounded {
  std::vector<uint16_t> bits;
  std::vector<double> value;
};

Rounded round_to(const std::vector<float>& x, DType dt) {
  Rounded r;
  for (float f : x) {
    const uint16_t b = dt == DType::bf16 ? deltacp::float_to_bf16_bits(f) : deltacp::float_to_f16_bits(f);
    r.bits.push_back(b);
    r.value.push_back(dt == DType::bf16 ? deltacp::bf16_bits_to_float(b) : deltacp::f16_bits_to_float(b));
  }
  return r;
}

template <class T>
T* upload(const std::vector<T>& h) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, h.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

template <class T>
std::vector<T> download(const T* d, size_t n) {
  std::vector<T> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

double rel(const Mat& a, const Mat& b) { return (a - b).norm() / std::max(b.norm(), 1e-300); }

struct Case {
  DType dtype;
  int D;
  int HKV;
  bool causal;
};

class RingStep : public ::testing::TestWithParam<Case> {};

TEST_P(RingStep, EqualsReference) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA device";
  const Case c = GetParam();
  const int B = 2, H = 4, HKV = c.HKV, D = c.D, G = H / HKV;
  // 4 ranks, 160 tokens, blocks of 20: rank 1 holds [20, 40) and [120, 140); rank 3 [60, 80) and [80, 100).
  const std::vector<int64_t> qpos = [] {
    std::vector<int64_t> p;
    for (int t = 20; t < 40; ++t) p.push_back(t);
    for (int t = 120; t < 140; ++t) p.push_back(t);
    return p;
  }();
  const std::vector<int64_t> kpos2 = [] {
    std::vector<int64_t> p;
    for (int t = 60; t < 100; ++t) p.push_back(t);
    return p;
  }();
  const std::vector<int64_t>& kpos1 = qpos;  // the rank's own block first
  const int n = static_cast<int>(qpos.size());
  std::mt19937_64 gen(static_cast<uint64_t>(D * 10 + HKV));
  std::normal_distribution<float> nd;
  auto rnd = [&](size_t count) {
    std::vector<float> v(count);
    for (auto& x : v) x = nd(gen);
    return v;
  };
  const Rounded q = round_to(rnd(size_t(B) * n * H * D), c.dtype), dout = round_to(rnd(size_t(B) * n * H * D), c.dtype);
  const Rounded k[2] = {round_to(rnd(size_t(B) * n * HKV * D), c.dtype), round_to(rnd(size_t(B) * n * HKV * D), c.dtype)};
  const Rounded v[2] = {round_to(rnd(size_t(B) * n * HKV * D), c.dtype), round_to(rnd(size_t(B) * n * HKV * D), c.dtype)};
  const double scale = 1.0 / std::sqrt(double(D));

  // [B, T, heads, D] row (b, t, h) as an Eigen row.
  auto head_rows = [&](const std::vector<double>& x, int heads, int b, int h, int T) {
    Mat m(T, D);
    for (int t = 0; t < T; ++t)
      for (int d = 0; d < D; ++d) m(t, d) = x[((size_t(b) * T + t) * heads + h) * D + d];
    return m;
  };

  ca::RingStepArgs a;
  a.dtype = c.dtype;
  a.B = B, a.Tq = n, a.Tk = n, a.H = H, a.HKV = HKV, a.D = D;
  a.causal = c.causal;
  a.scale = static_cast<float>(scale);
  const int64_t qs[3] = {int64_t(n) * H * D, int64_t(H) * D, D}, ks[3] = {int64_t(n) * HKV * D, int64_t(HKV) * D, D};
  for (int i = 0; i < 3; ++i) a.q_s[i] = a.do_s[i] = qs[i], a.k_s[i] = a.v_s[i] = ks[i];
  uint16_t* d_q = upload(q.bits);
  uint16_t* d_do = upload(dout.bits);
  uint16_t* d_k[2] = {upload(k[0].bits), upload(k[1].bits)};
  uint16_t* d_v[2] = {upload(v[0].bits), upload(v[1].bits)};
  int64_t* d_qpos = upload(qpos);
  int64_t* d_kpos[2] = {upload(kpos1), upload(kpos2)};
  float* d_o = upload(std::vector<float>(size_t(B) * H * n * D, 0.f));
  float* d_lse = upload(std::vector<float>(size_t(B) * H * n, -INFINITY));
  a.q = d_q;
  a.qpos = d_qpos;
  a.o_acc = d_o;
  a.lse_acc = d_lse;
  for (int blk = 0; blk < 2; ++blk) {
    a.k = d_k[blk], a.v = d_v[blk], a.kpos = d_kpos[blk];
    ca::ring_step_forward(a, nullptr);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> o = download(d_o, size_t(B) * H * n * D), lse = download(d_lse, size_t(B) * H * n);

  // Backward: delta = rowdot(dO, O) from the kernel's O, dq over both blocks, dk / dv per block.
  std::vector<float> delta(size_t(B) * H * n);
  for (int bh = 0; bh < B * H; ++bh)
    for (int i = 0; i < n; ++i) {
      double s = 0;
      for (int d = 0; d < D; ++d)
        s += dout.value[((size_t(bh / H) * n + i) * H + bh % H) * D + d] * o[(size_t(bh) * n + i) * D + d];
      delta[size_t(bh) * n + i] = static_cast<float>(s);
    }
  float* d_delta = upload(delta);
  float* d_dq = upload(std::vector<float>(size_t(B) * H * n * D, 0.f));
  std::vector<float> dk[2], dv[2];
  a.dout = d_do, a.lse = d_lse, a.delta = d_delta, a.dq_acc = d_dq;
  for (int blk = 0; blk < 2; ++blk) {
    float* d_dk = upload(std::vector<float>(size_t(B) * HKV * n * D, 0.f));
    float* d_dv = upload(std::vector<float>(size_t(B) * HKV * n * D, 0.f));
    a.k = d_k[blk], a.v = d_v[blk], a.kpos = d_kpos[blk], a.dk_acc = d_dk, a.dv_acc = d_dv;
    ca::ring_step_backward(a, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    dk[blk] = download(d_dk, size_t(B) * HKV * n * D);
    dv[blk] = download(d_dv, size_t(B) * HKV * n * D);
    cudaFree(d_dk);
    cudaFree(d_dv);
  }
  const std::vector<float> dq = download(d_dq, size_t(B) * H * n * D);

  // The reference, per (b, h), over the two blocks' keys; dk / dv summed over the group's heads.
  std::vector<int64_t> kpos_all = kpos1;
  kpos_all.insert(kpos_all.end(), kpos2.begin(), kpos2.end());
  double err_o = 0, err_lse = 0, err_dq = 0, err_dk = 0, err_dv = 0;
  for (int b = 0; b < B; ++b) {
    std::vector<Mat> dk_ref(HKV, Mat::Zero(2 * n, D)), dv_ref(HKV, Mat::Zero(2 * n, D));
    for (int h = 0; h < H; ++h) {
      const int hk = h / G;
      const Mat qh = head_rows(q.value, H, b, h, n), doh = head_rows(dout.value, H, b, h, n);
      Mat kh(2 * n, D), vh(2 * n, D);
      kh << head_rows(k[0].value, HKV, b, hk, n), head_rows(k[1].value, HKV, b, hk, n);
      vh << head_rows(v[0].value, HKV, b, hk, n), head_rows(v[1].value, HKV, b, hk, n);
      const auto fwd = deltacp::ref::attention_forward<double>(qh, kh, vh, scale, c.causal, qpos, kpos_all);
      const auto grads = deltacp::ref::attention_backward<double>(qh, kh, vh, doh, scale, c.causal, qpos, kpos_all);
      Mat o_k(n, D), dq_k(n, D);
      Vec lse_k(n);
      for (int i = 0; i < n; ++i) {
        lse_k(i) = lse[(size_t(b) * H + h) * n + i];
        for (int d = 0; d < D; ++d) {
          o_k(i, d) = o[((size_t(b) * H + h) * n + i) * D + d];
          dq_k(i, d) = dq[((size_t(b) * H + h) * n + i) * D + d];
        }
      }
      err_o = std::max(err_o, rel(o_k, fwd.o));
      err_lse = std::max(err_lse, rel(Mat(lse_k), Mat(fwd.lse)));
      err_dq = std::max(err_dq, rel(dq_k, grads.dq));
      dk_ref[hk] += grads.dk;
      dv_ref[hk] += grads.dv;
    }
    for (int hk = 0; hk < HKV; ++hk) {
      Mat dk_k(2 * n, D), dv_k(2 * n, D);
      for (int blk = 0; blk < 2; ++blk)
        for (int j = 0; j < n; ++j)
          for (int d = 0; d < D; ++d) {
            dk_k(blk * n + j, d) = dk[blk][((size_t(b) * HKV + hk) * n + j) * D + d];
            dv_k(blk * n + j, d) = dv[blk][((size_t(b) * HKV + hk) * n + j) * D + d];
          }
      err_dk = std::max(err_dk, rel(dk_k, dk_ref[hk]));
      err_dv = std::max(err_dv, rel(dv_k, dv_ref[hk]));
    }
  }
  EXPECT_LT(err_o, 1e-4);
  EXPECT_LT(err_lse, 1e-4);
  EXPECT_LT(err_dq, 1e-4);
  EXPECT_LT(err_dk, 1e-4);
  EXPECT_LT(err_dv, 1e-4);
  for (void* p : {static_cast<void*>(d_q), static_cast<void*>(d_do), static_cast<void*>(d_k[0]),
                  static_cast<void*>(d_k[1]), static_cast<void*>(d_v[0]), static_cast<void*>(d_v[1]),
                  static_cast<void*>(d_qpos), static_cast<void*>(d_kpos[0]), static_cast<void*>(d_kpos[1]),
                  static_cast<void*>(d_o), static_cast<void*>(d_lse), static_cast<void*>(d_delta),
                  static_cast<void*>(d_dq)})
    cudaFree(p);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (DType dt : {DType::bf16, DType::f16})
    for (int D : {64, 128})
      for (int hkv : {4, 2})
        for (bool causal : {true, false}) out.push_back({dt, D, hkv, causal});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cuda, RingStep, ::testing::ValuesIn(cases()), [](const auto& info) {
  const Case& c = info.param;
  return std::string(c.dtype == DType::bf16 ? "bf16" : "fp16") + "_D" + std::to_string(c.D) + "_hkv" +
         std::to_string(c.HKV) + (c.causal ? "_causal" : "_full");
});

// Argument errors need no GPU: they are checked before any launch.
TEST(RingStepBadInput, NamesTheArgument) {
  ca::RingStepArgs a;
  a.B = 1, a.Tq = 4, a.Tk = 4, a.H = 2, a.HKV = 2, a.D = 96;
  try {
    ca::ring_step_forward(a, nullptr);
    ADD_FAILURE() << "head dim 96 accepted";
  } catch (const deltacp::Error& e) {
    EXPECT_EQ(e.argument(), "q");
  }
  a.D = 64;
  a.HKV = 3;
  try {
    ca::ring_step_forward(a, nullptr);
    ADD_FAILURE() << "3 key/value heads for 2 query heads accepted";
  } catch (const deltacp::Error& e) {
    EXPECT_EQ(e.argument(), "k");
  }
}

}  // namespace
