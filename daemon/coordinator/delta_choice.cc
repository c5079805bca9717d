#include "daemon/coordinator/delta_choice.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "common/strings.h"

namespace shardcast::daemon {

namespace {

// The weight of a new sample in a moving average: a change of link or changed fraction shows
// within a few syncs, one slow sync does not decide alone.
constexpr double kNewWeight = 0.5;

void average(std::optional<double>& into, double sample) {
  into = into ? (1 - kNewWeight) * *into + kNewWeight * sample : sample;
}

std::string gbps(double seconds_per_byte) { return fmt::format("{:.2f} GB/s", 1e-9 / seconds_per_byte); }

}  // namespace

DeltaChoices::Choice DeltaChoices::choose(const std::string& src, const std::string& dst) {
  std::lock_guard<std::mutex> lock(mu_);
  Pair& p = pairs_[keyOf(src, dst)];
  if (!p.dense || !p.delta || *p.delta <= *p.dense * (1 + kMargin)) {
    // Deltas run; now and then a dense sync measures what they are compared with (at all, or
    // anew: the link or the changed fraction may have moved since).
    if (p.delta && ((!p.dense && p.delta_runs >= kProbeEvery) || p.delta_runs >= kMaxProbeEvery)) {
      p.delta_runs = 0;
      return {v1::DELTA_DENSE,
              strCat("measuring a dense sync of ", quote(src), " -> ", quote(dst), " against its delta syncs (after ",
                     p.dense ? kMaxProbeEvery : kProbeEvery, " of them), bases kept")};
    }
    p.dense_runs = 0;
    if (p.delta) ++p.delta_runs;
    return {};
  }
  if (p.dense_runs >= p.probe_every) {  // try deltas again: this sync measures them anew
    p.dense_runs = 0;
    p.probe_every = std::min(2 * p.probe_every, kMaxProbeEvery);
    return {};
  }
  ++p.dense_runs;
  p.delta_runs = 0;
  return {v1::DELTA_DENSE, strCat("delta syncs of ", quote(src), " -> ", quote(dst), " measured slower than dense (",
                                  gbps(*p.delta), " against ", gbps(*p.dense),
                                  " of the weights' bytes, while executing): dense, bases kept; deltas "
                                  "tried again in ",
                                  p.probe_every - p.dense_runs + 1, " syncs")};
}

void DeltaChoices::record(const std::string& src, const std::string& dst, const v1::SyncResponse& done) {
  if (done.delta() != v1::DELTA_AUTO && done.delta() != v1::DELTA_DENSE) return;
  // A sync that planned (the pair's first, or layouts changed) also allocated and connected.
  if (!done.plan_cached() || done.network_bytes() < kMinMeasuredBytes || done.execute_seconds() <= 0) return;
  const double sample = done.execute_seconds() / static_cast<double>(done.network_bytes());
  std::lock_guard<std::mutex> lock(mu_);
  Pair& p = pairs_[keyOf(src, dst)];
  if (done.delta_chunks() == 0) {
    average(p.dense, sample);
    p.delta_runs = 0;  // measured just now
    return;
  }
  average(p.delta, sample);
  if (p.dense && *p.delta <= *p.dense * (1 + kMargin)) p.probe_every = kProbeEvery;  // deltas win again
}

}  // namespace shardcast::daemon
