// The cluster as the last committed sync between two groups saw it, per caller: a sync that
// repeats it (RL's next step: same groups, same layouts, the next version) skips the gather, the
// round of Describe calls that asks every daemon what it holds (docs/performance.md, "Control
// plane"). Nothing is taken on trust: each daemon's Prepare checks that its registrations are
// still those the view holds (PrepareRequest.expect: its instance and registry generation) and
// checks the version contract on its ranks as every Prepare does; any refusal of such an attempt
// makes the coordinator run the sync again with a full gather (so errors read as they always
// did). Daemons outside the kept view are not asked: nothing is written there, and what they
// registered since (a group of the same name, another uid's) is seen by the next full gather.
// Plain syncs only: a replica set's membership and a catch-up's seed are decided anew at every
// gather. A replica set's sync keeps less (SetMemo): what lets the next one, after its gather,
// name the layouts in its Prepare by digest.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "daemon/coordinator/cluster.h"
#include "daemon/engine/plan_cache.h"
#include "shardcast/v1/layout.pb.h"
#include "shardcast/v1/service.pb.h"

namespace shardcast::daemon {

struct RepeatView {
  std::shared_ptr<const ClusterSnapshot> cluster;
  v1::Layout src, dst;  // complete layouts of both groups
  // Their digests: a repeated sync's Prepare names them by these (PrepareRequest.src_digest), and
  // the coordinator finds its own plan by them, so neither digests a layout again.
  LayoutDigests digests;
  // The daemons' Prepare answers, by daemon (the cluster's order), as the next sync will find
  // them: `targets` where each lands that sync's writes, `next_targets` (double-buffered
  // destinations: they flip at every commit) the one after. A repeated dense sync tells every
  // daemon these in its first Execute, with the Prepare riding on it (each daemon checks they are
  // still its own), so no Prepare round runs.
  std::vector<v1::PrepareResponse> prepared;
  // Folds refused in a row (a daemon's landing targets not those kept, say): at kMaxFoldRefusals
  // these groups' syncs stop folding (a refused fold costs a second attempt).
  int fold_refusals = 0;
  static constexpr int kMaxFoldRefusals = 3;
  // How long the kept sync's Prepare took: a repeated sync's Prepare gets the peer timeout (a
  // daemon silent to it is found as soon as the gather would have), so a sync whose Prepare takes
  // longer than half of that (many split fp8 blocks read from GPUs, say) always gathers.
  double prepare_seconds = 0;

  // Whether a view whose Prepare took `prepare_seconds` may be repeated under a peer timeout of
  // `peer_timeout_ms` (at least 1 s counts): half of it at most, as prepare_seconds says.
  static bool quickEnough(double prepare_seconds, int peer_timeout_ms) {
    return prepare_seconds * 2000 <= std::max(peer_timeout_ms, 1000);
  }
};

// A replica set's last committed sync, per caller: its plan's key (the source's and every
// member's digest, the budgets) and its daemons. A sync whose gather finds the same plan key and
// the same daemons (node and instance: a restarted daemon's plan cache is empty) sends its Prepare
// with the layouts by digest (PrepareRequest.replica_digests); a daemon whose cache lost the plan
// refuses it as a stale view, and the coordinator runs the sync again with the layouts.
struct SetMemo {
  std::string plan_key;
  std::vector<std::pair<std::string, std::string>> daemons;  // (node, instance), the gather's order
  // Syncs in a row whose Prepare by digest a daemon refused for want of the plan (its cache too
  // small for what it syncs: --plan-cache-entries): at kMaxStaleRefusals this pair's syncs send
  // the layouts (a refusal costs a Prepare round) until the plan key changes.
  int stale_refusals = 0;
  static constexpr int kMaxStaleRefusals = 3;
};

class RepeatCache {
 public:
  // The views kept at most (one per pair of groups and caller): the oldest goes first.
  static constexpr size_t kMaxViews = 256;

  // Who asks for which sync: a view is reused only by the same caller for the same groups.
  static std::string keyOf(const v1::SyncRequest& req, std::optional<uint32_t> caller_uid);

  std::shared_ptr<const RepeatView> find(const std::string& key) const;
  void keep(const std::string& key, std::shared_ptr<const RepeatView> view);
  // Forgets both the view and the set memo kept under `key`.
  void forget(const std::string& key);

  std::optional<SetMemo> findSet(const std::string& key) const;
  void keepSet(const std::string& key, SetMemo memo);
  // A set's Prepare by digest under `key` was refused as a stale view: the plain view goes, the
  // set memo stays with one more refusal counted; returns the count (0: no memo).
  int setStale(const std::string& key);

 private:
  mutable std::mutex mu_;
  uint64_t next_ = 0;
  std::map<std::string, std::pair<uint64_t, std::shared_ptr<const RepeatView>>> views_;  // key -> (age, view)
  std::map<std::string, std::pair<uint64_t, SetMemo>> sets_;                             // key -> (age, memo)
};

}  // namespace shardcast::daemon
