// deltacp/reference/cp.h — telling 4: context parallelism simulated in one process.
//
// Forward (docs/design.md section 4): each rank folds its LAST local segment from (S = 0, M = I) into
// (M_r, H_r); the ranks all-gather [H_r | M_r]; rank r's initial state for its first segment is the
// fold over the earlier ranks j of the same sequence, S <- M_j S + H_j, started from the user's h0
// of that sequence; then each rank runs the chunked forward on its own tokens.
// Backward mirrored: each rank folds its FIRST local segment into (M_r^T, dH_r); the fold from
// the later ranks, dS <- M_j^T dS + dH_j started from the user's dht, gives the gradient arriving
// at the rank's last segment end. Chunk boundaries restart at each rank's first token (as on
// real ranks), so results equal the single-process ones only to rounding.
#pragma once

#include <vector>

#include "deltacp/cp_plan.h"
#include "deltacp/reference/affine.h"

namespace deltacp::ref {

// What one simulated rank exchanged, for tests and notebooks.
template <class S>
struct CpExchange {
  // Entry [hv * world + r]: what rank r sent for value head hv (identity / zero when its segment
  // does not continue across the boundary).
  std::vector<Affine<S>> fwd;          // (M_r, H_r) of the last local segment
  std::vector<AffineBackward<S>> bwd;  // (M_r^T, dH_r) of the first local segment
};

}  // namespace deltacp::ref
