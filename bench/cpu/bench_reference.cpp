// bench_reference — the CPU reference: token recurrence vs chunked WY form (Google Benchmark).
//
// One GDN head (B = 1, H = 1), fp32, T = 1K..16K, K = V = 64 and 128; counter tokens/s.
// The chunked form turns T rank-1 updates into T / C matrix products, which is the point of
// docs/design.md section 3; bench/cpu/README in docs/perf-cpu.md records the ratio at T = 16K.
//
//   ./build/bench/cpu/bench_reference --benchmark_out=bench-cpu.json --benchmark_out_format=json
#include <benchmark/benchmark.h>

#include <cmath>
#include <random>
#include <vector>

#include "deltacp/reference/batch.h"

using namespace deltacp;

namespace {

struct Problem {
  std::vector<float> q, k, v, g, beta, o, ht;
  Params p;
  Problem(Variant var, int64_t T, int64_t K, int64_t V) {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    std::uniform_real_distribution<float> unif(0.05f, 0.95f);
    q.resize(T * K);
    k.resize(T * K);
    v.resize(T * V);
    for (auto& x : q) x = normal(rng);
    for (auto& x : v) x = normal(rng);
    for (int64_t t = 0; t < T; ++t) {
      float s = 0;
      for (int64_t d = 0; d < K; ++d) s += (k[t * K + d] = normal(rng)) * k[t * K + d];
      for (int64_t d = 0; d < K; ++d) k[t * K + d] /= std::sqrt(s);
    }
    const int64_t gd = var == Variant::kda ? K : 1;
    g.resize(T * gd);
    for (auto& x : g) x = std::log(unif(rng)) * 0.1f;
    beta.resize(T);
    for (auto& x : beta) x = unif(rng);
    o.resize(T * V);
    ht.resize(K * V);
    p.variant = var;
    p.dtype = DType::f32;
    p.state_dtype = DType::f32;
    p.B = 1; p.T = T; p.H = 1; p.HV = 1; p.K = K; p.V = V;
    p.num_seqs = 1;
    p.scale = 1.0 / std::sqrt(double(K));
    p.chunk_size = 64;
    p.q = contiguous_ref(q.data(), T, 1, K);
    p.k = contiguous_ref(k.data(), T, 1, K);
    p.v = contiguous_ref(v.data(), T, 1, V);
    p.g = contiguous_ref(g.data(), T, 1, gd);
    p.beta = contiguous_ref(beta.data(), T, 1, 1);
    p.o = contiguous_ref(o.data(), T, 1, V);
    p.ht = ht.data();
  }
};

void run(benchmark::State& state, Variant var, Method m) {
  const int64_t T = state.range(0), D = state.range(1);
  Problem pr(var, T, D, D);
  for (auto _ : state) {
    ref::forward<float>(pr.p, m);
    benchmark::DoNotOptimize(pr.o.data());
    benchmark::ClobberMemory();
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
}

void GdnRecurrent(benchmark::State& s) { run(s, Variant::gdn, Method::recurrent); }
void GdnChunked(benchmark::State& s) { run(s, Variant::gdn, Method::chunked); }
void KdaRecurrent(benchmark::State& s) { run(s, Variant::kda, Method::recurrent); }
void KdaChunked(benchmark::State& s) { run(s, Variant::kda, Method::chunked); }

void shapes(benchmark::internal::Benchmark* b) {
  for (int64_t D : {64, 128})
    for (int64_t T : {1024, 4096, 16384}) b->Args({T, D});
  b->ArgNames({"T", "KV"})->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(GdnRecurrent)->Apply(shapes);
BENCHMARK(GdnChunked)->Apply(shapes);
BENCHMARK(KdaRecurrent)->Apply(shapes);
BENCHMARK(KdaChunked)->Apply(shapes);
BENCHMARK_MAIN();
