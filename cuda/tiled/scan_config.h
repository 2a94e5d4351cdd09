// cuda/tiled/scan_config.h — the launch choices the two sequential scans share: the forward state
// scan (stage 3 of tiled_fwd.cu) and the backward dh scan (B1, bwd_dh_scan.cuh).
//
// Both walk a sequence's chunks one after another with one CTA per (sequence, value head, BV-wide
// column tile). A step is short, so the wider the tile the less the head's W / K / q tiles are
// re-read across tiles, but the fewer CTAs there are to run in parallel; and a second load stage
// overlaps the next chunk's loads with this chunk's products but halves the CTAs an SM holds.
//
//   scan_tile_width(widths, ctas_of)  the widest of `widths` (descending) that still gives at least
//                                      one CTA per two SMs, else the narrowest.
//                                      DELTACP_TILED_SCAN_BV=16|32|64 forces (the widest allowed
//                                      width not above it, else the narrowest allowed).
//   scan_two_stages(ctas, one, two, cap)  two stages when they fit in shared memory and add no wave
//                                      of CTAs. DELTACP_TILED_SCAN_STAGES=1|2 forces (2 only if it fits).
// Tests and tuning runs use the variables to exercise every configuration.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>

#include "../common/device_info.h"
#include "deltacp/error.h"

namespace deltacp::cuda::tiled {

template <class CtasOf>
int scan_tile_width(std::initializer_list<int> widths, CtasOf ctas_of) {
  if (const char* env = std::getenv("DELTACP_TILED_SCAN_BV")) {
    const int want = std::atoi(env);
    DELTACP_CHECK(want == 16 || want == 32 || want == 64, "DELTACP_TILED_SCAN_BV", "expected 16, 32 or 64, got ",
                  env);
    for (int w : widths)
      if (w <= want) return w;
    return *(widths.end() - 1);
  }
  for (int w : widths)
    if (ctas_of(w) * 2 >= sm_count()) return w;
  return *(widths.end() - 1);
}

inline bool scan_two_stages(int64_t ctas, size_t bytes_one, size_t bytes_two, int cap) {
  const bool fits = bytes_two <= static_cast<size_t>(max_smem_optin());
  if (const char* env = std::getenv("DELTACP_TILED_SCAN_STAGES")) return std::atoi(env) == 2 && fits;
  auto waves = [&](size_t bytes) {
    const int64_t slots = int64_t(sm_count()) * ctas_per_sm(bytes, cap);
    return (ctas + slots - 1) / slots;
  };
  return fits && waves(bytes_two) <= waves(bytes_one);
}

}  // namespace deltacp::cuda::tiled
