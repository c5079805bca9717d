// What DELTA_AUTO runs (docs/delta.md, "Which is faster"): a delta sync moves fewer bytes, but
// encoding and rebuilding chunks costs time on both sides (on a GPU behind a device-to-host copy),
// so a sync of deltas can be slower than the dense one over a fast link. The coordinating daemon
// measures both per pair of groups, from the syncs it coordinated, and runs DELTA_AUTO as
// DELTA_DENSE (bases kept, so the next delta is possible) while deltas measure slower; it tries
// deltas again now and then, as the changed fraction or the link may have changed, and while
// deltas run, measures a dense sync now and then. DELTA_ALWAYS sends deltas wherever a base
// allows, unmeasured. Catch-ups (read from another replica) are neither decided nor measured.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "shardcast/v1/service.pb.h"

namespace shardcast::daemon {

class DeltaChoices {
 public:
  // Syncs that moved fewer network bytes than this are not measured: their fixed costs (calls,
  // waves) hide the bytes' cost, and deltas are kept for them.
  static constexpr uint64_t kMinMeasuredBytes = uint64_t{32} << 20;
  // A mode measured slower than the other by more than this fraction loses (noise aside).
  static constexpr double kMargin = 0.10;
  // Deltas measured slower are tried again after this many dense syncs, twice as many after each
  // try they lose again, up to kMaxProbeEvery.
  static constexpr int kProbeEvery = 8;
  static constexpr int kMaxProbeEvery = 64;

  struct Choice {
    v1::DeltaMode mode = v1::DELTA_AUTO;
    std::string why;  // "" when deltas run as asked; else why this sync runs dense
  };

  // The mode a DELTA_AUTO sync of `src` -> `dst` runs in.
  Choice choose(const std::string& src, const std::string& dst);
  // A committed sync of `src` -> `dst` that ran DELTA_AUTO or DELTA_DENSE with a cached plan: its
  // execute phase's seconds per network byte (the dense bytes every hop stands for) is a sample of
  // deltas when chunks travelled as deltas, else of dense.
  void record(const std::string& src, const std::string& dst, const v1::SyncResponse& done);

 private:
  struct Pair {
    std::optional<double> dense, delta;  // seconds per byte (moving average)
    int dense_runs = 0;                  // DELTA_AUTO syncs run dense in a row by this choice
    int delta_runs = 0;                  // and with deltas, since deltas were measured
    int probe_every = kProbeEvery;
  };
  static std::string keyOf(const std::string& src, const std::string& dst) { return src + '\n' + dst; }

  std::mutex mu_;
  std::map<std::string, Pair> pairs_;
};

}  // namespace shardcast::daemon
