// bindings/src/head_api.cpp — the reference's per-(sequence, head) pieces, in fp64, for notebooks and
// tests: one slice of n tokens as 2-D numpy arrays (rows are tokens), results back as numpy.
//
//   HeadInputs(variant, q, k, v, g, beta, a, b, scale)    q, k [n, K]; v [n, V]; g gdn [n, 1],
//                                                         kda/dplr [n, K], delta [n, 0]; beta [n]
//                                                         (empty for dplr); a, b [n, K] (dplr) or [0, 0]
//   recurrent_forward / recurrent_backward               telling 1 (recurrence.h)
//   chunk_wy, chunk_step, chunked_forward / _backward    telling 2 (chunked.h): A, T = (I + A)^-1, W, U
//   chunk_affine, span_affine, span_affine_tokens,       telling 3 (affine.h): S_end = M S_start + H
//   compose, affine_forward, span_affine_backward
//
// Every shape is checked here (deltacp::Error -> ValueError): the reference functions assume
// consistent Eigen sizes and would read out of bounds otherwise.
#include <pybind11/eigen.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "deltacp/error.h"
#include "deltacp/reference/affine.h"
#include "deltacp/reference/recurrence.h"

namespace py = pybind11;

namespace deltacp::bindings {
namespace {

using S = double;
using MatD = ref::Mat<S>;
using VecD = ref::Vec<S>;
using Inputs = ref::HeadInputs<S>;

std::string dims(const MatD& m) { return "[" + std::to_string(m.rows()) + ", " + std::to_string(m.cols()) + "]"; }

void check_dims(const MatD& m, int64_t rows, int64_t cols, const char* name, const char* pattern) {
  if (m.rows() != rows || m.cols() != cols) {
    throw Error(name, std::string("expected shape ") + pattern + " = [" + std::to_string(rows) + ", " +
                          std::to_string(cols) + "], got " + dims(m));
  }
}

Inputs make_inputs(const std::string& variant, MatD q, MatD k, MatD v, MatD g, VecD beta, MatD a, MatD b,
                   double scale) {
  Inputs x;
  x.variant = variant_from_string(variant);
  const int64_t n = q.rows(), K = q.cols(), V = v.cols();
  check_dims(k, n, K, "k", "[n, K]");
  if (v.rows() != n) throw Error("v", "expected " + std::to_string(n) + " rows (like q), got " + dims(v));
  switch (x.variant) {
    case Variant::delta: check_dims(g, n, 0, "g", "[n, 0] (delta has no gate)"); break;
    case Variant::gdn: check_dims(g, n, 1, "g", "[n, 1]"); break;
    case Variant::kda: check_dims(g, n, K, "g", "[n, K]"); break;
    case Variant::dplr: check_dims(g, n, K, "gk", "[n, K]"); break;
  }
  if (x.variant == Variant::dplr) {
    if (beta.size() != 0) throw Error("beta", "dplr takes no beta, got " + std::to_string(beta.size()) + " entries");
    check_dims(a, n, K, "a", "[n, K]");
    check_dims(b, n, K, "b", "[n, K]");
  } else {
    if (beta.size() != n) {
      throw Error("beta", "expected " + std::to_string(n) + " entries, got " + std::to_string(beta.size()));
    }
    if (a.size() != 0) throw Error("a", std::string("is not used by variant '") + variant + "'");
    if (b.size() != 0) throw Error("b", std::string("is not used by variant '") + variant + "'");
  }
  (void)V;
  x.q = std::move(q);
  x.k = std::move(k);
  x.v = std::move(v);
  x.g = std::move(g);
  x.beta = std::move(beta);
  x.a = std::move(a);
  x.b = std::move(b);
  x.scale = scale;
  return x;
}

// An optional K x V state: empty means zero.
void check_state(const MatD& s, const Inputs& x, const char* name) {
  if (s.size() != 0) check_dims(s, x.K(), x.V(), name, "[K, V]");
}
void check_rows(const MatD& m, int64_t rows, const Inputs& x, const char* name) {
  check_dims(m, rows, x.V(), name, "[n, V]");
}
void check_chunk(int chunk_size) {
  if (chunk_size <= 0) throw Error("chunk_size", "expected a positive chunk size, got " + std::to_string(chunk_size));
}
void check_span(const Inputs& x, int64_t t0, int64_t t1) {
  if (t0 < 0 || t1 < t0 || t1 > x.n()) {
    throw Error("t0, t1", "expected 0 <= t0 <= t1 <= n = " + std::to_string(x.n()) + ", got t0 = " +
                              std::to_string(t0) + ", t1 = " + std::to_string(t1));
  }
}

py::dict grads_to_python(const ref::HeadGrads<S>& g, Variant variant) {
  py::dict d;
  d["dq"] = g.dq;
  d["dk"] = g.dk;
  d["dv"] = g.dv;
  if (variant == Variant::dplr) {
    d["dgk"] = g.dg;
    d["da"] = g.da;
    d["db"] = g.db;
  } else {
    if (variant != Variant::delta) d["dg"] = g.dg;
    d["dbeta"] = g.dbeta;
  }
  d["dh0"] = g.dh0;
  return d;
}

py::dict wy_to_python(const ref::ChunkWY<S>& wy, Variant variant) {
  py::dict d;
  d["G"] = wy.G;
  d["A"] = wy.A;
  d["T"] = wy.T;
  d["W"] = wy.W;
  d["U"] = wy.U;
  if (variant == Variant::dplr) d["Ak"] = wy.Ak;
  return d;
}

}  // namespace

void register_head_api(py::module_& m) {
  py::class_<Inputs>(m, "HeadInputs", "One (sequence, value head) slice of n tokens, fp64 (reference/types.h).")
      .def(py::init(&make_inputs), py::arg("variant"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"),
           py::arg("beta"), py::arg("a"), py::arg("b"), py::arg("scale"))
      .def_property_readonly("n", &Inputs::n)
      .def_property_readonly("K", &Inputs::K)
      .def_property_readonly("V", &Inputs::V)
      .def_property_readonly("variant", [](const Inputs& x) { return std::string(to_string(x.variant)); })
      .def("slice", [](const Inputs& x, int64_t t0, int64_t t1) {
        check_span(x, t0, t1);
        return x.slice(t0, t1);
      });

  m.def("head_recurrent_forward", [](const Inputs& x, const MatD& h0) {
    check_state(h0, x, "initial_state");
    auto out = ref::recurrent_forward<S>(x, h0);
    return py::make_tuple(out.o, out.ht);
  });
  m.def("head_recurrent_backward", [](const Inputs& x, const MatD& h0, const MatD& dout, const MatD& dht) {
    check_state(h0, x, "initial_state");
    check_rows(dout, x.n(), x, "do");
    check_state(dht, x, "dht");
    return grads_to_python(ref::recurrent_backward<S>(x, h0, dout, dht), x.variant);
  });
  m.def("head_chunk_wy", [](const Inputs& x) { return wy_to_python(ref::chunk_wy<S>(x), x.variant); });
  m.def("head_chunk_step", [](const Inputs& x, const MatD& S0) {
    check_dims(S0, x.K(), x.V(), "S0", "[K, V]");
    auto step = ref::chunk_step<S>(x, ref::chunk_wy<S>(x), S0);
    py::dict d;
    d["v_new"] = step.v_new;
    d["o"] = step.o;
    d["S_end"] = step.S_end;
    return d;
  });
  m.def("head_chunked_forward", [](const Inputs& x, const MatD& h0, int chunk_size) {
    check_state(h0, x, "initial_state");
    check_chunk(chunk_size);
    auto f = ref::chunked_forward<S>(x, h0, chunk_size);
    py::dict d;
    d["states"] = f.states;  // list of [K, V]; the Python side stacks them
    d["v_new"] = f.v_new;
    d["o"] = f.o;
    return d;
  });
  m.def("head_chunked_backward",
        [](const Inputs& x, const MatD& h0, const MatD& dout, const MatD& dht, int chunk_size) {
          check_state(h0, x, "initial_state");
          check_rows(dout, x.n(), x, "do");
          check_state(dht, x, "dht");
          check_chunk(chunk_size);
          return grads_to_python(ref::chunked_backward<S>(x, h0, dout, dht, chunk_size), x.variant);
        });
  m.def("head_chunk_affine", [](const Inputs& x) {
    auto a = ref::chunk_affine<S>(x, ref::chunk_wy<S>(x));
    return py::make_tuple(a.M, a.H);
  });
  m.def("head_span_affine", [](const Inputs& x, int64_t t0, int64_t t1, int chunk_size) {
    check_span(x, t0, t1);
    check_chunk(chunk_size);
    auto a = ref::span_affine<S>(x, t0, t1, chunk_size);
    return py::make_tuple(a.M, a.H);
  });
  m.def("head_span_affine_tokens", [](const Inputs& x, int64_t t0, int64_t t1) {
    check_span(x, t0, t1);
    auto a = ref::span_affine_tokens<S>(x, t0, t1);
    return py::make_tuple(a.M, a.H);
  });
  m.def("head_affine_forward", [](const Inputs& x, const MatD& h0, int chunk_size) {
    check_state(h0, x, "initial_state");
    check_chunk(chunk_size);
    auto out = ref::affine_forward<S>(x, h0, chunk_size);
    return py::make_tuple(out.o, out.ht);
  });
  m.def("head_span_affine_backward",
        [](const Inputs& x, int64_t t0, int64_t t1, const MatD& dout, int chunk_size) {
          check_span(x, t0, t1);
          check_rows(dout, t1 - t0, x, "do");
          check_chunk(chunk_size);
          auto a = ref::span_affine_backward<S>(x, t0, t1, dout, chunk_size);
          return py::make_tuple(a.Mt, a.dH);
        });
  m.def("compose", [](const MatD& M2, const MatD& H2, const MatD& M1, const MatD& H1) {
    const int64_t K = M1.rows(), V = H1.cols();
    check_dims(M1, K, K, "M1", "[K, K]");
    check_dims(M2, K, K, "M2", "[K, K]");
    check_dims(H1, K, V, "H1", "[K, V]");
    check_dims(H2, K, V, "H2", "[K, V]");
    auto c = ref::compose<S>(ref::Affine<S>{M2, H2}, ref::Affine<S>{M1, H1});
    return py::make_tuple(c.M, c.H);
  });
  m.def("unit_lower_inverse", [](const MatD& A) {
    check_dims(A, A.rows(), A.rows(), "A", "[n, n]");
    return ref::unit_lower_inverse<S>(A);
  });
  m.def(
      "chunk_ranges",
      [](int64_t n, int chunk_size) {
        check_chunk(chunk_size);
        if (n < 0) throw Error("n", "expected n >= 0, got " + std::to_string(n));
        return ref::chunk_ranges(n, chunk_size);
      },
      py::arg("n"), py::arg("chunk_size"));
}

}  // namespace deltacp::bindings
