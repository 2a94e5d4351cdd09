// deltacp/reference/batch.h — the reference backend on a Params: gather, run a telling, scatter.
//
// Inputs may be any DType (converted to S on load); outputs are written in p.dtype, states in
// p.state_dtype. All loops are over (sequence, value head); everything is host memory.
#pragma once

#include <vector>

#include "deltacp/params.h"
#include "deltacp/reference/cp.h"
#include "deltacp/reference/recurrence.h"

namespace deltacp::ref {

// Slice of sequence n, value head hv, tokens [t0, t1) of that sequence (local indices).
template <class S>
HeadInputs<S> gather_head(const Params& p, int64_t n, int64_t hv, int64_t t0 = 0, int64_t t1 = -1);
template <class S>
Mat<S> gather_state(const void* ptr, DType dt, const Params& p, int64_t n, int64_t hv);  // empty if ptr null
template <class S>
void scatter_state(void* ptr, DType dt, const Params& p, int64_t n, int64_t hv, const Mat<S>& st);

// Validates p (validate_forward + check_finite_host) and writes o (and ht when given).
// method: recurrent, chunked or affine.
template <class S>
void forward(const Params& p, Method method);

// Validates p (validate_backward + check_finite_host) and writes dq, dk, dv, dg, dbeta (da, db
// for dplr) and dh0 when given. method: recurrent or chunked (affine uses the chunked backward).
template <class S>
void backward(const Params& p, Method method);

// Simulated CP over ranks cut at `cuts` (B must be 1). Writes what forward()/backward() write.
// When `exchange` is given it receives what each rank sent.
template <class S>
void cp_forward(const Params& p, const std::vector<int64_t>& cuts, CpExchange<S>* exchange = nullptr);
template <class S>
void cp_backward(const Params& p, const std::vector<int64_t>& cuts, CpExchange<S>* exchange = nullptr);

}  // namespace deltacp::ref
