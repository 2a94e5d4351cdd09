// deltacp/reference/recurrence.h — telling 1: the token recurrence and its exact backward.
//
//   gdn, kda, delta:  S <- D_t S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T (scale q_t)
//                     D_t = e^{g_t} I (gdn), diag(e^{g_t}) (kda), I (delta)
//   dplr:             S <- diag(e^{gk_t}) S + k_t v_t^T + b_t (a_t^T S);        o_t = S^T (scale q_t)
//
// The backward walks the tokens in reverse with dS, recovering each S_{t-1} from the stored
// states (the reference keeps all of them: clarity over memory).
#pragma once

#include "deltacp/reference/types.h"

namespace deltacp::ref {

// h0 may be empty (zero initial state). with_outputs = false: only the final state (o stays empty).
template <class S>
HeadOutputs<S> recurrent_forward(const HeadInputs<S>& x, const Mat<S>& h0, bool with_outputs = true);

// dht may be empty (zero). Returns every gradient including dh0.
template <class S>
HeadGrads<S> recurrent_backward(const HeadInputs<S>& x, const Mat<S>& h0, const Mat<S>& dout, const Mat<S>& dht);

}  // namespace deltacp::ref
