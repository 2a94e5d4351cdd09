// Input checks shared by every backend: each failure names the argument, the expectation and
// what was given (docs/design.md section 6). Nothing here touches tensor memory except
// check_finite_host and check_outputs_host, the numeric checks of docs/errors.md, which the
// reference runs on its host inputs and outputs.
#include "deltacp/validate.h"

#include <cmath>
#include <string>

#include "deltacp/cp_plan.h"
#include "deltacp/dtype.h"
#include "deltacp/error.h"

namespace deltacp {
namespace {

bool has_gate(Variant v) { return v != Variant::delta; }
bool has_beta(Variant v) { return v != Variant::dplr; }
bool has_ab(Variant v) { return v == Variant::dplr; }
bool per_key_gate(Variant v) { return v == Variant::kda || v == Variant::dplr; }

void require(const TensorRef& t, const char* name, const char* why) {
  DELTACP_CHECK(t.defined(), name, "expected a tensor (", why, "), got none");
}
void forbid(const TensorRef& t, const char* name, const char* why) {
  DELTACP_CHECK(!t.defined(), name, "expected no tensor (", why, "), got one");
}

}  // namespace

void check_cu_seqlens(const int64_t* cu, int64_t count, int64_t T) {
  DELTACP_CHECK(cu != nullptr, "cu_seqlens", "expected a host array, got none");
  DELTACP_CHECK(count >= 2, "cu_seqlens", "expected at least 2 entries [0, T], got ", count);
  DELTACP_CHECK(cu[0] == 0, "cu_seqlens", "expected cu_seqlens[0] == 0, got ", cu[0]);
  for (int64_t i = 1; i < count; ++i)
    DELTACP_CHECK(cu[i] >= cu[i - 1], "cu_seqlens", "expected non-decreasing offsets, got cu_seqlens[", i,
                  "] = ", cu[i], " < cu_seqlens[", i - 1, "] = ", cu[i - 1]);
  DELTACP_CHECK(cu[count - 1] == T, "cu_seqlens", "expected the last offset to equal T = ", T, ", got ",
                cu[count - 1]);
}

namespace {

// Everything both directions need: sizes, chunk size, cu_seqlens, the variant's inputs.
void validate_inputs(const Params& p) {
  const Variant v = p.variant;
  DELTACP_CHECK(v == Variant::delta || v == Variant::gdn || v == Variant::kda || v == Variant::dplr, "variant",
                "expected delta, gdn, kda or dplr, got ", static_cast<int>(v));
  DELTACP_CHECK(p.state_dtype == DType::f32 || p.state_dtype == DType::f64, "state_dtype",
                "expected float32 or float64 states, got ", to_string(p.state_dtype));
  DELTACP_CHECK(p.B >= 1, "B", "expected a batch size >= 1, got ", p.B);
  DELTACP_CHECK(p.T >= 1, "T", "expected a sequence length >= 1, got ", p.T);
  DELTACP_CHECK(p.H >= 1, "H", "expected at least one query/key head, got ", p.H);
  DELTACP_CHECK(p.HV >= 1, "HV", "expected at least one value head, got ", p.HV);
  DELTACP_CHECK(p.K >= 1, "K", "expected a key dimension > 0, got ", p.K);
  DELTACP_CHECK(p.V >= 1, "V", "expected a value dimension > 0, got ", p.V);
  DELTACP_CHECK(p.HV % p.H == 0, "HV", "expected a multiple of H = ", p.H, " (grouped values), got ", p.HV);
  if (v == Variant::dplr) DELTACP_CHECK(p.HV == p.H, "HV", "expected HV == H = ", p.H, " for dplr, got ", p.HV);
  DELTACP_CHECK(p.chunk_size == 16 || p.chunk_size == 32 || p.chunk_size == 64, "chunk_size",
                "expected 16, 32 or 64, got ", p.chunk_size);
  DELTACP_CHECK(std::isfinite(p.scale), "scale", "expected a finite scale, got ", p.scale);
  if (p.varlen()) {
    DELTACP_CHECK(p.B == 1, "cu_seqlens", "expected batch size B == 1 with cu_seqlens (packed varlen), got B = ",
                  p.B);
    DELTACP_CHECK(p.num_seqs >= 1, "cu_seqlens", "expected at least one sequence, got num_seqs = ", p.num_seqs);
    DELTACP_CHECK(p.host_cu() != nullptr, "cu_seqlens_host",
                  "expected a host copy of cu_seqlens for a varlen batch, got none");
    check_cu_seqlens(p.host_cu(), p.num_seqs + 1, p.T);
  } else {
    DELTACP_CHECK(p.num_seqs == p.B, "num_seqs", "expected num_seqs == B = ", p.B,
                  " for a fixed-length batch, got ", p.num_seqs);
  }
  require(p.q, "q", "queries [B, T, H, K]");
  require(p.k, "k", "keys [B, T, H, K]");
  require(p.v, "v", "values [B, T, HV, V]");
  if (has_gate(v)) {
    require(p.g, "g", per_key_gate(v) ? "log decay [B, T, HV, K]" : "log decay [B, T, HV]");
  } else {
    forbid(p.g, "g", "variant delta has no gate");
  }
  if (has_beta(v)) {
    require(p.beta, "beta", "step sizes [B, T, HV]");
  } else {
    forbid(p.beta, "beta", "variant dplr has no beta; it takes a and b");
  }
  if (has_ab(v)) {
    require(p.a, "a", "dplr low-rank vectors [B, T, H, K]");
    require(p.b, "b", "dplr low-rank vectors [B, T, H, K]");
  } else {
    forbid(p.a, "a", "only dplr takes a");
    forbid(p.b, "b", "only dplr takes b");
  }
}

}  // namespace

void validate_forward(const Params& p) {
  validate_inputs(p);
  // o may be left out only for the final-state-only forward (ht given; params.h).
  if (!p.final_state_only())
    require(p.o, "o", "output buffer [B, T, HV, V]; it may be omitted only when ht is given (final-state-only forward)");
}

void validate_backward(const Params& p) {
  validate_inputs(p);
  DELTACP_CHECK(!p.qk_l2norm, "qk_l2norm", "expected false for a backward (it takes q and k as the forward used "
                "them: normalised), got true");
  const Variant v = p.variant;
  require(p.dout, "do", "upstream gradient of o [B, T, HV, V]");
  if (p.dh0_only()) return;  // only dL/dh0 is wanted (params.h): no input gradient buffers at all
  const char* why_qk = "gradient buffer [B, T, H, K]; all input gradients may be omitted together only when dh0 is "
                       "given (dh0-only backward)";
  const char* why_v = "gradient buffer [B, T, HV, V]; all input gradients may be omitted together only when dh0 is "
                      "given (dh0-only backward)";
  const char* why_other = "gradient buffer shaped like its input; all input gradients may be omitted together only "
                          "when dh0 is given (dh0-only backward)";
  require(p.dq, "dq", why_qk);
  require(p.dk, "dk", why_qk);
  require(p.dv, "dv", why_v);
  if (has_gate(v)) require(p.dg, v == Variant::dplr ? "dgk" : "dg", why_other);
  if (has_beta(v)) require(p.dbeta, "dbeta", why_other);
  if (has_ab(v)) {
    require(p.da, "da", why_other);
    require(p.db, "db", why_other);
  }
}

namespace {

std::string at(int64_t b, int64_t t, int64_t h, int64_t d) {
  return "[" + std::to_string(b) + ", " + std::to_string(t) + ", " + std::to_string(h) + ", " + std::to_string(d) +
         "]";
}

// What to look for in a view: non-finite values, and for a log decay also values > 0.
enum class Scan { finite, log_decay };

// Walks a [B, T, heads, D] view (within the valid token range) and throws at the first bad value.
void check_view(const Params& p, const TensorRef& t, const char* name, int64_t heads, int64_t D, DType dt,
                const char* what, Scan scan = Scan::finite) {
  if (!t.defined()) return;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t s = 0; s < p.T; ++s)
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t base = t.offset(b, s, h);
        for (int64_t d = 0; d < D; ++d) {
          const double x = load_as<double>(t.ptr, base + d, dt);
          if (!std::isfinite(x)) throw NumericError(name, nonfinite_message(what, x, at(b, s, h, d)));
          if (scan == Scan::log_decay && x > 0) throw NumericError(name, positive_gate_message(x, at(b, s, h, d)));
        }
      }
}

void check_state(const Params& p, const void* ptr, const char* name, const char* what) {
  if (!ptr) return;
  const int64_t n = p.state_elems();
  for (int64_t i = 0; i < n; ++i) {
    const double x = load_as<double>(ptr, i, p.state_dtype);
    if (!std::isfinite(x))
      throw NumericError(name, nonfinite_message(what, x, "flat index " + std::to_string(i) + " of [N, HV, K, V]"));
  }
}

}  // namespace

std::string nonfinite_message(const char* what, double value, const std::string& index) {
  std::string m = std::string("expected finite values, found ");
  detail::append(m, value, " at ", index);
  if (std::string(what) == "input") return m;
  // A non-finite output from finite inputs with g <= 0 (both checked first): the recurrence grew
  // without bound. With log decays <= 0 the only source is the delta step I - beta k k^T, whose
  // eigenvalue along k is 1 - beta ||k||^2: below -1 (beta ||k||^2 > 2) it doubles the state's
  // component along k at every such token.
  return m + " (non-finite " + what +
         " from finite inputs): keys of large norm make the delta rule unstable (a step scales the state "
         "along k by 1 - beta ||k||^2, which exceeds 1 in size when beta ||k||^2 > 2); normalise k "
         "(use_qk_l2norm_in_kernel=True) or keep beta ||k||^2 <= 2";
}

std::string positive_gate_message(double value, const std::string& index) {
  std::string m = "expected log decays <= 0, got ";
  detail::append(m, value, " at ", index,
                 ": a positive gate multiplies the state by exp(g) > 1 every token and grows it without bound "
                 "(pass g = logsigmoid(x) or -softplus(x), as the models do)");
  return m;
}

void check_finite_host(const Params& p, bool backward) {
  const int64_t gdim = per_key_gate(p.variant) ? p.K : 1;
  const Scan gate_scan = (p.variant == Variant::gdn || p.variant == Variant::kda) ? Scan::log_decay : Scan::finite;
  check_view(p, p.q, "q", p.H, p.K, p.dtype, "input");
  check_view(p, p.k, "k", p.H, p.K, p.dtype, "input");
  check_view(p, p.v, "v", p.HV, p.V, p.dtype, "input");
  check_view(p, p.g, p.variant == Variant::dplr ? "gk" : "g", p.HV, gdim, p.gate_dtype(), "input", gate_scan);
  check_view(p, p.beta, "beta", p.HV, 1, p.dtype, "input");
  check_view(p, p.a, "a", p.HV, p.K, p.dtype, "input");
  check_view(p, p.b, "b", p.HV, p.K, p.dtype, "input");
  check_state(p, p.h0, "initial_state", "input");
  if (backward) {
    check_view(p, p.dout, "do", p.HV, p.V, p.dtype, "input");
    check_state(p, p.dht, "dht", "input");
  }
}

void check_outputs_host(const Params& p, bool backward) {
  if (!backward) {
    check_view(p, p.o, "o", p.HV, p.V, p.dtype, "output");
    check_state(p, p.ht, "ht", "output");
    return;
  }
  const int64_t gdim = per_key_gate(p.variant) ? p.K : 1;
  check_view(p, p.dq, "dq", p.H, p.K, p.dtype, "gradient");
  check_view(p, p.dk, "dk", p.H, p.K, p.dtype, "gradient");
  check_view(p, p.dv, "dv", p.HV, p.V, p.dtype, "gradient");
  check_view(p, p.dg, p.variant == Variant::dplr ? "dgk" : "dg", p.HV, gdim, p.gate_dtype(), "gradient");
  check_view(p, p.dbeta, "dbeta", p.HV, 1, p.dtype, "gradient");
  check_view(p, p.da, "da", p.HV, p.K, p.dtype, "gradient");
  check_view(p, p.db, "db", p.HV, p.K, p.dtype, "gradient");
  check_state(p, p.dh0, "dh0", "gradient");
}

}  // namespace deltacp
