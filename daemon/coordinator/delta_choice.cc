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
    p.dense_runs = 0;
    return {};
  }
  if (p.dense_runs >= p.probe_every) {  // try deltas again: this sync measures them anew
    p.dense_runs = 0;
    p.probe_every = std::min(2 * p.probe_every, kMaxProbeEvery);
    return {};
  }
  ++p.dense_runs;
  return {v1::DELTA_DENSE, strCat("delta syncs of ", quote(src), " -> ", quote(dst), " measured slower than dense (",
                                  gbps(*p.delta), " against ", gbps(*p.dense),
                                  " of the weights' bytes, while executing): dense, bases kept; deltas "
                                  "tried again in ",
                                  p.probe_every - p.dense_runs + 1, " syncs")};
}

void DeltaChoices::record(const std::string& src, const std::string& dst, const v1::SyncResponse& done) {
  if (done.delta() != v1::DELTA_AUTO && done.delta() != v1::DELTA_DENSE) return;
  if (done.network_bytes() < kMinMeasuredBytes || done.execute_seconds() <= 0) return;
  const double sample = done.execute_seconds() / static_cast<double>(done.network_bytes());
  std::lock_guard<std::mutex> lock(mu_);
  Pair& p = pairs_[keyOf(src, dst)];
  if (done.delta_chunks() == 0) {
    average(p.dense, sample);
    return;
  }
  average(p.delta, sample);
  if (p.dense && *p.delta <= *p.dense * (1 + kMargin)) p.probe_every = kProbeEvery;  // deltas win again
}

}  // namespace shardcast::daemon
