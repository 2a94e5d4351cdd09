// The reference backend on a Params (batch.h): gather one (sequence, value head) slice in the
// scalar type S, run a telling, scatter the results back in the caller's dtype and strides.
#include "deltacp/reference/batch.h"

#include "deltacp/dtype.h"
#include "deltacp/error.h"
#include "deltacp/reference/recurrence.h"
#include "deltacp/validate.h"

namespace deltacp::ref {
namespace {

int64_t gate_dim(const Params& p) {
  switch (p.variant) {
    case Variant::delta: return 0;
    case Variant::gdn: return 1;
    default: return p.K;
  }
}

// Rows [t0, t1) of sequence n (local token indices), head h of a [B, T, heads, D] view.
// (dt: the tensor's element type; p.dtype for all but g / dg, which have p.gate_dtype().)
template <class S>
Mat<S> load_rows(const Params& p, const TensorRef& t, int64_t n, int64_t h, int64_t t0, int64_t t1, int64_t D,
                 DType dt) {
  Mat<S> m(t1 - t0, D);
  if (!t.defined() || D == 0) return m;
  const int64_t b = p.seq_batch(n), bos = p.seq_begin(n);
  for (int64_t i = t0; i < t1; ++i) {
    const int64_t base = t.offset(b, bos + i, h);
    for (int64_t d = 0; d < D; ++d) m(i - t0, d) = load_as<S>(t.ptr, base + d, dt);
  }
  return m;
}
template <class S>
Mat<S> load_rows(const Params& p, const TensorRef& t, int64_t n, int64_t h, int64_t t0, int64_t t1, int64_t D) {
  return load_rows<S>(p, t, n, h, t0, t1, D, p.dtype);
}

template <class S>
void store_rows(const Params& p, const TensorRef& t, int64_t n, int64_t h, int64_t t0, const Mat<S>& m, DType dt) {
  if (!t.defined() || m.cols() == 0) return;
  const int64_t b = p.seq_batch(n), bos = p.seq_begin(n);
  for (int64_t i = 0; i < m.rows(); ++i) {
    const int64_t base = t.offset(b, bos + t0 + i, h);
    for (int64_t d = 0; d < m.cols(); ++d) store_as<S>(t.ptr, base + d, dt, m(i, d));
  }
}
template <class S>
void store_rows(const Params& p, const TensorRef& t, int64_t n, int64_t h, int64_t t0, const Mat<S>& m) {
  store_rows<S>(p, t, n, h, t0, m, p.dtype);
}

int64_t seq_len(const Params& p, int64_t n) { return p.seq_end(n) - p.seq_begin(n); }

}  // namespace

template <class S>
HeadInputs<S> gather_head(const Params& p, int64_t n, int64_t hv, int64_t t0, int64_t t1) {
  if (t1 < 0) t1 = seq_len(p, n);
  const int64_t h = hv / p.head_group();
  HeadInputs<S> x;
  x.variant = p.variant;
  x.scale = static_cast<S>(p.scale);
  x.q = load_rows<S>(p, p.q, n, h, t0, t1, p.K);
  x.k = load_rows<S>(p, p.k, n, h, t0, t1, p.K);
  x.v = load_rows<S>(p, p.v, n, hv, t0, t1, p.V);
  x.g = load_rows<S>(p, p.g, n, hv, t0, t1, gate_dim(p), p.gate_dtype());
  if (p.variant != Variant::dplr) x.beta = load_rows<S>(p, p.beta, n, hv, t0, t1, 1).col(0);
  if (p.variant == Variant::dplr) {
    x.a = load_rows<S>(p, p.a, n, hv, t0, t1, p.K);
    x.b = load_rows<S>(p, p.b, n, hv, t0, t1, p.K);
  }
  return x;
}

template <class S>
Mat<S> gather_state(const void* ptr, DType dt, const Params& p, int64_t n, int64_t hv) {
  if (!ptr) return Mat<S>();
  Mat<S> st(p.K, p.V);
  const int64_t base = (n * p.HV + hv) * p.K * p.V;
  for (int64_t i = 0; i < p.K; ++i)
    for (int64_t j = 0; j < p.V; ++j) st(i, j) = load_as<S>(ptr, base + i * p.V + j, dt);
  return st;
}

template <class S>
void scatter_state(void* ptr, DType dt, const Params& p, int64_t n, int64_t hv, const Mat<S>& st) {
  if (!ptr) return;
  const int64_t base = (n * p.HV + hv) * p.K * p.V;
  for (int64_t i = 0; i < p.K; ++i)
    for (int64_t j = 0; j < p.V; ++j) store_as<S>(ptr, base + i * p.V + j, dt, st(i, j));
}

namespace {

// Runs `telling(x, h0)` for every (sequence, value head) and writes o and ht.
template <class S, class Telling>
void forward_each(const Params& p, Telling telling) {
  for (int64_t n = 0; n < p.num_seqs; ++n) {
    const int64_t len = seq_len(p, n);
    for (int64_t hv = 0; hv < p.HV; ++hv) {
      const Mat<S> h0 = gather_state<S>(p.h0, p.state_dtype, p, n, hv);
      if (len == 0) {  // empty sequence: the final state is the initial state
        scatter_state<S>(p.ht, p.state_dtype, p, n, hv, h0.size() ? h0 : Mat<S>(Mat<S>::Zero(p.K, p.V)));
        continue;
      }
      const HeadOutputs<S> out = telling(gather_head<S>(p, n, hv), h0);
      store_rows<S>(p, p.o, n, hv, 0, out.o);
      scatter_state<S>(p.ht, p.state_dtype, p, n, hv, out.ht);
    }
  }
}

// Writes gradients of one sequence. dq, dk (and da, db) are per query/key head: with grouped
// values several value heads add into one key head, so they are summed before the store.
template <class S>
void store_grads(const Params& p, int64_t n, int64_t h, const std::vector<HeadGrads<S>>& group, int64_t hv0) {
  Mat<S> dq = group[0].dq, dk = group[0].dk;
  for (size_t i = 1; i < group.size(); ++i) {
    dq += group[i].dq;
    dk += group[i].dk;
  }
  store_rows<S>(p, p.dq, n, h, 0, dq);
  store_rows<S>(p, p.dk, n, h, 0, dk);
  for (size_t i = 0; i < group.size(); ++i) {
    const int64_t hv = hv0 + static_cast<int64_t>(i);
    const HeadGrads<S>& gr = group[i];
    store_rows<S>(p, p.dv, n, hv, 0, gr.dv);
    store_rows<S>(p, p.dg, n, hv, 0, gr.dg, p.gate_dtype());
    if (gr.dbeta.size()) store_rows<S>(p, p.dbeta, n, hv, 0, Mat<S>(gr.dbeta));
    store_rows<S>(p, p.da, n, hv, 0, gr.da);
    store_rows<S>(p, p.db, n, hv, 0, gr.db);
    scatter_state<S>(p.dh0, p.state_dtype, p, n, hv, gr.dh0);
  }
}

// Runs `telling(x, h0, dout, dht)` for every (sequence, value head) and writes the gradients.
template <class S, class Telling>
void backward_each(const Params& p, Telling telling) {
  const int64_t G = p.head_group();
  for (int64_t n = 0; n < p.num_seqs; ++n) {
    const int64_t len = seq_len(p, n);
    for (int64_t h = 0; h < p.H; ++h) {
      std::vector<HeadGrads<S>> group;
      for (int64_t hv = h * G; hv < (h + 1) * G; ++hv) {
        const HeadInputs<S> x = gather_head<S>(p, n, hv);
        const Mat<S> h0 = gather_state<S>(p.h0, p.state_dtype, p, n, hv);
        const Mat<S> dht = gather_state<S>(p.dht, p.state_dtype, p, n, hv);
        if (len == 0) {  // dL/dh0 = dL/dht
          HeadGrads<S> gr = HeadGrads<S>::zeros_like(x);
          gr.dh0 = dht.size() ? dht : Mat<S>(Mat<S>::Zero(p.K, p.V));
          group.push_back(gr);
          continue;
        }
        const Mat<S> dout = load_rows<S>(p, p.dout, n, hv, 0, len, p.V);
        group.push_back(telling(x, h0, dout, dht));
      }
      store_grads<S>(p, n, h, group, h * G);
    }
  }
}

}  // namespace

namespace {

template <class S>
void forward_unchecked(const Params& p, Method method) {
  const int C = p.chunk_size;
  // Final-state-only forward (o null, ht given; params.h): every telling skips its outputs.
  const bool with_o = p.o.defined();
  switch (method) {
    case Method::recurrent:
      return forward_each<S>(p, [with_o](const HeadInputs<S>& x, const Mat<S>& h0) {
        return recurrent_forward(x, h0, with_o);
      });
    case Method::chunked:
      return forward_each<S>(p, [C, with_o](const HeadInputs<S>& x, const Mat<S>& h0) {
        ChunkedForward<S> f = chunked_forward(x, h0, C, with_o);
        return HeadOutputs<S>{std::move(f.o), std::move(f.states.back())};
      });
    case Method::affine:
      return forward_each<S>(p, [C, with_o](const HeadInputs<S>& x, const Mat<S>& h0) {
        return affine_forward(x, h0, C, with_o);
      });
    default:
      throw_error("method", "expected recurrent, chunked or affine for the reference, got ", to_string(method));
  }
}

// dh0-only backward (every input gradient null, dh0 given; params.h): the tellings compute all
// gradients anyway (dL/dh0 needs most of the same chain); store_grads writes only dh0.
template <class S>
void backward_unchecked(const Params& p, Method method) {
  const int C = p.chunk_size;
  switch (method) {
    case Method::recurrent:
      return backward_each<S>(p, [](const HeadInputs<S>& x, const Mat<S>& h0, const Mat<S>& d, const Mat<S>& dht) {
        return recurrent_backward(x, h0, d, dht);
      });
    case Method::chunked:
    case Method::affine:
      return backward_each<S>(p, [C](const HeadInputs<S>& x, const Mat<S>& h0, const Mat<S>& d, const Mat<S>& dht) {
        return chunked_backward(x, h0, d, dht, C);
      });
    default:
      throw_error("method", "expected recurrent, chunked or affine for the reference, got ", to_string(method));
  }
}

}  // namespace

// The numeric checks of docs/errors.md run on every call: inputs finite and g <= 0 (gdn, kda) before,
// outputs finite after (a pass over the tensors, small beside the O(T K V) work).
template <class S>
void forward(const Params& p, Method method) {
  validate_forward(p);
  DELTACP_CHECK(!p.qk_l2norm, "qk_l2norm", "expected false for the CPU reference (it takes q and k normalised: "
                "deltacp.fla_options.l2norm), got true");
  check_finite_host(p, /*backward=*/false);
  forward_unchecked<S>(p, method);
  check_outputs_host(p, /*backward=*/false);
}

template <class S>
void backward(const Params& p, Method method) {
  validate_backward(p);
  check_finite_host(p, /*backward=*/true);
  backward_unchecked<S>(p, method);
  check_outputs_host(p, /*backward=*/true);
}

// ---------------------------------------------------------------------------------------------
// Simulated context parallelism (cp.h). Every rank is simulated in turn; the "all-gather" is the
// vector of per-rank (M, H), and each merge reads only the entries of the ranks it needs.
namespace {

std::vector<int64_t> global_cu(const Params& p) {
  if (p.varlen()) return std::vector<int64_t>(p.host_cu(), p.host_cu() + p.num_seqs + 1);
  return {0, p.T};
}

// Local segment i of rank plan `pl`: global sequence n and its local token range [t0, t1)
// (indices within the sequence).
struct Segment {
  int64_t n, t0, t1;
};
Segment segment(const CpRankPlan& pl, const std::vector<int64_t>& cu, int64_t i) {
  const int64_t n = pl.seq_ids[i];
  const int64_t g0 = pl.begin + pl.cu_seqlens[i], g1 = pl.begin + pl.cu_seqlens[i + 1];
  return {n, g0 - cu[n], g1 - cu[n]};
}

// Forward all-gather + merge for value head hv: the initial state of every rank's first segment.
template <class S>
std::vector<Mat<S>> merged_initial_states(const Params& p, const std::vector<CpRankPlan>& plans,
                                          const std::vector<int64_t>& cu, int64_t hv, CpExchange<S>* ex) {
  const int world = static_cast<int>(plans.size());
  // 1. pre-pass: each rank's (M_r, H_r) over its LAST local segment, from S = 0, M = I.
  std::vector<Affine<S>> sent(world, Affine<S>::identity(p.K, p.V));
  for (int r = 0; r < world; ++r) {
    const CpRankPlan& pl = plans[r];
    if (!pl.last_continues()) continue;
    const Segment s = segment(pl, cu, pl.num_local_seqs() - 1);
    sent[r] = span_affine(gather_head<S>(p, s.n, hv, s.t0, s.t1), 0, s.t1 - s.t0, p.chunk_size);
  }
  if (ex) ex->fwd.insert(ex->fwd.end(), sent.begin(), sent.end());
  // 2-3. all-gather, then each rank folds the earlier ranks of its first segment's sequence.
  std::vector<Mat<S>> init(world);
  for (int r = 0; r < world; ++r) {
    const CpRankPlan& pl = plans[r];
    const int64_t n = pl.seq_ids.front();
    Mat<S> St = gather_state<S>(p.h0, p.state_dtype, p, n, hv);
    if (St.size() == 0) St = Mat<S>::Zero(p.K, p.V);
    for (int64_t j = r - pl.pre_ranks; j < r; ++j) St = sent[j].apply(St);
    init[r] = St;
  }
  return init;
}

}  // namespace

template <class S>
void cp_forward(const Params& p, const std::vector<int64_t>& cuts, CpExchange<S>* ex) {
  validate_forward(p);
  DELTACP_CHECK(!p.qk_l2norm, "qk_l2norm", "expected false for the CPU reference, got true");
  check_finite_host(p, false);
  DELTACP_CHECK(p.B == 1, "B", "expected B == 1 (a packed batch) for context parallelism, got ", p.B);
  const std::vector<int64_t> cu = global_cu(p);
  const std::vector<CpRankPlan> plans = cp_plan_from_cuts(cu, cuts);
  for (int64_t hv = 0; hv < p.HV; ++hv) {
    const std::vector<Mat<S>> init = merged_initial_states<S>(p, plans, cu, hv, ex);
    // 4. each rank: the chunked forward of every local segment from its initial state.
    for (const CpRankPlan& pl : plans) {
      for (int64_t i = 0; i < pl.num_local_seqs(); ++i) {
        const Segment s = segment(pl, cu, i);
        Mat<S> h0 = i == 0 ? init[pl.rank] : gather_state<S>(p.h0, p.state_dtype, p, s.n, hv);
        ChunkedForward<S> f =
            chunked_forward(gather_head<S>(p, s.n, hv, s.t0, s.t1), h0, p.chunk_size, p.o.defined());
        store_rows<S>(p, p.o, s.n, hv, s.t0, f.o);
        if (s.t1 == cu[s.n + 1] - cu[s.n]) scatter_state<S>(p.ht, p.state_dtype, p, s.n, hv, f.states.back());
      }
    }
    // Empty sequences live on no rank: their final state is their initial state.
    for (int64_t n = 0; n < p.num_seqs; ++n)
      if (cu[n + 1] == cu[n]) {
        Mat<S> h0 = gather_state<S>(p.h0, p.state_dtype, p, n, hv);
        scatter_state<S>(p.ht, p.state_dtype, p, n, hv, h0.size() ? h0 : Mat<S>(Mat<S>::Zero(p.K, p.V)));
      }
  }
  check_outputs_host(p, /*backward=*/false);
}

template <class S>
void cp_backward(const Params& p, const std::vector<int64_t>& cuts, CpExchange<S>* ex) {
  validate_backward(p);
  check_finite_host(p, true);
  DELTACP_CHECK(p.B == 1, "B", "expected B == 1 (a packed batch) for context parallelism, got ", p.B);
  const std::vector<int64_t> cu = global_cu(p);
  const std::vector<CpRankPlan> plans = cp_plan_from_cuts(cu, cuts);
  const int world = static_cast<int>(plans.size());
  const int64_t G = p.head_group();
  // Gradients are assembled per (sequence, value head) over the ranks, then stored with the
  // grouped-head sum of store_grads.
  std::vector<std::vector<HeadGrads<S>>> grads(p.num_seqs, std::vector<HeadGrads<S>>(p.HV));
  for (int64_t n = 0; n < p.num_seqs; ++n)
    for (int64_t hv = 0; hv < p.HV; ++hv) {
      grads[n][hv] = HeadGrads<S>::zeros_like(gather_head<S>(p, n, hv, 0, 0));
      const int64_t len = cu[n + 1] - cu[n];
      HeadGrads<S>& gr = grads[n][hv];
      gr.dq.setZero(len, p.K);
      gr.dk.setZero(len, p.K);
      gr.dv.setZero(len, p.V);
      gr.dg.setZero(len, p.variant == Variant::delta ? 0 : (p.variant == Variant::gdn ? 1 : p.K));
      if (p.variant != Variant::dplr) gr.dbeta.setZero(len);
      if (p.variant == Variant::dplr) {
        gr.da.setZero(len, p.K);
        gr.db.setZero(len, p.K);
      }
      const Mat<S> dht = gather_state<S>(p.dht, p.state_dtype, p, n, hv);
      gr.dh0 = dht.size() ? dht : Mat<S>(Mat<S>::Zero(p.K, p.V));  // stays so for empty sequences
    }

  for (int64_t hv = 0; hv < p.HV; ++hv) {
    const std::vector<Mat<S>> init = merged_initial_states<S>(p, plans, cu, hv, nullptr);
    // 1. pre-pass: each rank's (M_r^T, dH_r) over its FIRST local segment.
    std::vector<AffineBackward<S>> sent(world, AffineBackward<S>{Mat<S>::Identity(p.K, p.K), Mat<S>::Zero(p.K, p.V)});
    for (int r = 0; r < world; ++r) {
      const CpRankPlan& pl = plans[r];
      if (!pl.first_continues()) continue;
      const Segment s = segment(pl, cu, 0);
      const Mat<S> dout = load_rows<S>(p, p.dout, s.n, hv, s.t0, s.t1, p.V);
      sent[r] = span_affine_backward(gather_head<S>(p, s.n, hv, s.t0, s.t1), 0, s.t1 - s.t0, dout, p.chunk_size);
    }
    if (ex) ex->bwd.insert(ex->bwd.end(), sent.begin(), sent.end());
    // 2-3. all-gather; each rank folds the later ranks of its last segment's sequence, from dht.
    for (const CpRankPlan& pl : plans) {
      for (int64_t i = 0; i < pl.num_local_seqs(); ++i) {
        const Segment s = segment(pl, cu, i);
        const bool last = i + 1 == pl.num_local_seqs();
        Mat<S> dS_end = gather_state<S>(p.dht, p.state_dtype, p, s.n, hv);
        if (dS_end.size() == 0) dS_end = Mat<S>::Zero(p.K, p.V);
        if (last)
          for (int64_t j = pl.rank + pl.post_ranks; j > pl.rank; --j) dS_end = sent[j].Mt * dS_end + sent[j].dH;
        // 4. the local chunked backward from the merged forward state and the merged dS.
        const Mat<S> h0 = i == 0 ? init[pl.rank] : gather_state<S>(p.h0, p.state_dtype, p, s.n, hv);
        const Mat<S> dout = load_rows<S>(p, p.dout, s.n, hv, s.t0, s.t1, p.V);
        HeadGrads<S> gs = chunked_backward(gather_head<S>(p, s.n, hv, s.t0, s.t1), h0, dout, dS_end, p.chunk_size);
        gs.place_into(grads[s.n][hv], s.t0);
        if (s.t0 == 0) grads[s.n][hv].dh0 = gs.dh0;  // the rank holding the sequence start owns dh0
      }
    }
  }
  for (int64_t n = 0; n < p.num_seqs; ++n)
    for (int64_t h = 0; h < p.H; ++h)
      store_grads<S>(p, n, h, std::vector<HeadGrads<S>>(grads[n].begin() + h * G, grads[n].begin() + (h + 1) * G),
                     h * G);
  check_outputs_host(p, /*backward=*/true);
}

#define DELTACP_INSTANTIATE(S)                                                                      \
  template HeadInputs<S> gather_head<S>(const Params&, int64_t, int64_t, int64_t, int64_t);          \
  template Mat<S> gather_state<S>(const void*, DType, const Params&, int64_t, int64_t);              \
  template void scatter_state<S>(void*, DType, const Params&, int64_t, int64_t, const Mat<S>&);      \
  template void forward<S>(const Params&, Method);                                                   \
  template void backward<S>(const Params&, Method);                                                  \
  template void cp_forward<S>(const Params&, const std::vector<int64_t>&, CpExchange<S>*);           \
  template void cp_backward<S>(const Params&, const std::vector<int64_t>&, CpExchange<S>*);
DELTACP_INSTANTIATE(double)
DELTACP_INSTANTIATE(float)
#undef DELTACP_INSTANTIATE

}  // namespace deltacp::ref
