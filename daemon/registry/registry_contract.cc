// The registry's side of the version contract (docs/daemon.md, "Rank states"): syncs begin and
// end on ranks atomically, owners acquire and publish around their writes, clients wait for
// versions (daemon/registry/registry.h).
#include <spdlog/spdlog.h>

#include <algorithm>
#include <string_view>

#include "common/refusal.h"
#include "common/strings.h"
#include "daemon/registry/registry.h"
#include "daemon/registry/sync_preconditions.h"

namespace shardcast::daemon {

namespace {

std::string rankList(const std::vector<int32_t>& ranks) {
  std::vector<std::string> s;
  for (int32_t r : ranks) s.push_back(std::to_string(r));
  return strJoin(s, ",");
}

}  // namespace

namespace {

// The digest `group` was planned with when it is one of `dst`'s groups; null otherwise.
const std::string* digestIn(const Registry::Destination& dst, const std::string& group) {
  for (const auto& [g, digest] : dst)
    if (g == group) return &digest;
  return nullptr;
}

}  // namespace

RankFacts Registry::factsOf(const Rank& r) {
  RankFacts facts{r.state, r.held, r.committed, r.role, r.doubled(), ""};
  if (!r.writer.empty())
    facts.written = strCat("sync ", r.writer, " is writing it");
  else if (!r.lingering.empty())
    facts.written = strCat("writes of sync ", r.user(), " are still landing in it");
  return facts;
}

namespace {

// What a draining rank's detail says until drained() (kDraining).
constexpr std::string_view kStillLanding = " (writes or copies still landing: no sync until they are done)";

bool isIn(const std::vector<std::string>& groups, const std::string& group) {
  return std::find(groups.begin(), groups.end(), group) != groups.end();
}

}  // namespace

Status Registry::beginSync(const std::string& id, const std::string& src, const std::string& dst, uint64_t version,
                           const std::string& src_digest, const std::string& dst_digest, uint64_t fence, Base* base) {
  return beginSync(id, src, Destination{{dst, dst_digest}}, version, src_digest, fence, base);
}

// One function, over 80 lines, by design: it runs under the registry's lock from the first check
// to the last change, every check before any change, so a sync that any rank refuses changes no
// rank (split, each part would need the lock's state and the checks' results handed on).
Status Registry::beginSync(const std::string& id, const std::string& src, const Destination& dst, uint64_t version,
                           const std::string& src_digest, uint64_t fence, Base* base, bool seed,
                           const std::vector<uint64_t>& supersedes, const std::map<std::string, uint32_t>& owners,
                           const std::map<std::string, std::string>& fingerprints) {
  if (!planner::isVersion(version))
    return absl::InvalidArgumentError(
        strCat("sync ", id, ": version ", version, " is not in ", planner::kVersionRange));
  std::lock_guard<std::mutex> lock(mu_);
  // The groups are the owners' the coordinator found (under this lock: a rank that changed hands
  // since its gather is neither read nor written). A destination group's refusal names it, so a
  // replica set's coordinator cuts that replica alone.
  for (const auto& [group, owner] : owners) {
    const bool read = group == src;
    if (!read && !digestIn(dst, group)) continue;
    const auto g = groups_.find(group);
    if (g == groups_.end() || (g->second.owner && *g->second.owner == owner)) continue;
    return refusedBy(absl::FailedPreconditionError(strCat(
                         "sync ", id, ": group ", quote(group), " on node ", quote(node_), " is ",
                         g->second.owner ? strCat("uid ", *g->second.owner, "'s") : std::string("no uid's"),
                         ", but its coordinator found it uid ", owner, "'s: its ranks changed hands since the gather, ",
                         read ? "not read" : "not written", " (retry the sync)")),
                     read ? std::string() : group);
  }
  std::vector<Rank*> readers, writers;
  for (const auto& [key, r] : ranks_) {
    const std::string who = strCat("group \"", r->group, "\" rank ", r->rank, " on node \"", node_, "\"");
    const std::string* dst_digest = digestIn(dst, key.first);
    if (r->orphaned && (key.first == src || dst_digest))
      return refusedBy(absl::FailedPreconditionError(
                           strCat("sync ", id, ": ", who, " is left by its client (its session ended while sync ",
                                  r->user(), " used it): no sync ", key.first == src ? "reads" : "writes", " it")),
                       key.first == src ? std::string() : key.first);
    if ((key.first == src && r->digest != src_digest) || (dst_digest && r->digest != *dst_digest))
      return refusedBy(
          absl::FailedPreconditionError(strCat("sync ", id, ": ", who, " registered layout ", r->digest,
                                               " since the sync was planned (for ",
                                               key.first == src ? src_digest : *dst_digest, "): retry the sync")),
          key.first == src ? std::string() : key.first);
    // (Fails closed: a plan that names fingerprints names every group it reads or writes.)
    if (const auto f = fingerprints.find(key.first); !fingerprints.empty() && (key.first == src || dst_digest) &&
                                                     (f == fingerprints.end() || r->fingerprint != f->second))
      return refusedBy(absl::FailedPreconditionError(strCat(
                           "sync ", id, ": ", who, " registered a layout other than the one the sync was planned for, ",
                           "under the same digest ", r->digest, " (crafted to collide?): refused")),
                       key.first == src ? std::string() : key.first);
    if (key.first == src && seed) {
      if (const std::string why = seedRefusal(factsOf(*r), version); !why.empty())
        return absl::FailedPreconditionError(strCat("sync ", id, ": ", who, why));
      SC_RETURN_IF_ERROR(checkSegments(*r));
      readers.push_back(r.get());
    } else if (key.first == src) {
      if (r->role != v1::ROLE_SOURCE)
        return absl::FailedPreconditionError(
            strCat("sync ", id, ": ", who, " is a destination; a sync reads only source groups"));
      if (const std::string why = sourceRefusal(factsOf(*r), version); !why.empty())
        return absl::FailedPreconditionError(strCat("sync ", id, ": ", who, why));
      SC_RETURN_IF_ERROR(checkSegments(*r));
      readers.push_back(r.get());
    } else if (dst_digest) {
      // A refusal here is this group's own (its ranks' state): it names the group, so that a
      // replica set's coordinator cuts that replica only (common/grpc_status.h).
      // A retried attempt of this sync (same id and version, another fence, the earlier one's
      // fence among those it supersedes: the same Sync call) over ranks an earlier attempt still
      // writes or last wrote, with writes of it maybe still landing (a peer frozen
      // mid-write): they carry this version's bytes to where this attempt writes them too, so
      // this attempt may write and commit the rank; the earlier attempts linger (Rank::lingering)
      // and hold it against anything else until they have ended. Not double-buffered ranks: their
      // engine reads the set a commit flips to without waiting for writes.
      const bool earlier_writes = !r->writer.empty() || !r->lingering.empty();
      const auto superseded = [&](uint64_t f) {
        return std::find(supersedes.begin(), supersedes.end(), f) != supersedes.end();
      };
      bool retried = earlier_writes && !r->doubled() &&
                     (r->writer.empty() || (r->writer == id && r->writing == version && superseded(r->writer_fence)));
      for (const auto& [earlier, what] : r->lingering)
        retried = retried && what.id == id && what.version == version && superseded(earlier);
      // (parameters, not captures: a lambda may not capture structured bindings before C++20's clang 16)
      const auto writable = [&](const Rank& rank, const std::string& group) -> Status {
        if (rank.role != v1::ROLE_DESTINATION)
          return absl::FailedPreconditionError(
              strCat("sync ", id, ": ", who,
                     " is a source; a sync writes only destination groups (refusing to overwrite it)"));
        if (rank.held && (!rank.doubled() || rank.pinned != rank.active))
          return absl::FailedPreconditionError(
              strCat("sync ", id, ": ", who, " does not accept updates (acquired by its client",
                     rank.doubled() ? ", which still reads the set this sync would write)" : ")"));
        if (!rank.writer.empty() && !retried)
          return absl::FailedPreconditionError(strCat("sync ", id, ": a sync into group \"", group, "\" (", rank.writer,
                                                      ") is in progress on node \"", node_, "\""));
        if (!rank.lingering.empty() && !retried)
          return absl::FailedPreconditionError(strCat("sync ", id, ": ", who,
                                                      " does not accept updates (writes of sync ", rank.user(),
                                                      " are still landing in it)"));
        if (!rank.readers.empty())  // a catch-up reads it as its seed
          return absl::FailedPreconditionError(strCat("sync ", id, ": ", who, " is being read by sync ",
                                                      rank.readers.begin()->first, " (a catch-up seeded from it)"));
        // (a rank no sync writes is EMPTY with nothing committed, READY or DIRTY)
        if (const std::string why = destinationRefusal(factsOf(rank), version); !why.empty())
          return absl::FailedPreconditionError(strCat("sync ", id, ": ", who, why));
        SC_RETURN_IF_ERROR(checkSegments(rank));
        return absl::OkStatus();
      };
      SC_RETURN_IF_ERROR(refusedBy(writable(*r, key.first), key.first));
      writers.push_back(r.get());
    }
  }
  if (base != nullptr) {
    *base = {};
    bool common = !writers.empty();
    for (const Rank* r : writers)
      common = common && r->state == v1::RANK_READY && r->committed_by != 0 &&
               r->committed == writers.front()->committed && r->committed_by == writers.front()->committed_by;
    if (common) *base = {writers.front()->committed, writers.front()->committed_by};
  }
  for (Rank* r : readers) r->readers.insert({id, fence});
  for (Rank* r : writers) {
    if (!r->writer.empty()) {  // a retry taking over from an earlier attempt of this sync (above)
      r->lingering[r->writer_fence] = {r->writer, r->writing};
      if (r->state == v1::RANK_UPDATING) {  // that attempt has not ended yet: it may have written
        r->state = v1::RANK_DIRTY;
        r->detail = strCat("sync ", id, " wrote part of version ", version, " in an earlier attempt");
      }
      spdlog::info(
          "sync {}: group \"{}\" rank {} taken over from its earlier attempt (fence {}), whose writes may "
          "still land",
          id, r->group, r->rank, r->writer_fence);
    }
    r->writer = id;
    r->writer_fence = fence;
    r->before = r->state;
    r->before_detail = r->detail;
    r->writing = version;
    if (!r->doubled()) r->state = v1::RANK_UPDATING;  // double-buffered: the set in use does not change
  }
  if (!writers.empty() || !readers.empty()) state_cv_.notify_all();
  return absl::OkStatus();
}

Status Registry::checkSync(const std::string& src, const std::string& dst) const {
  return checkSync(src, std::vector<std::string>{dst});
}

Status Registry::checkSync(const std::string& src, const std::vector<std::string>& dst) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [key, r] : ranks_)
    if (key.first == src || isIn(dst, key.first)) SC_RETURN_IF_ERROR(checkSegments(*r));
  return absl::OkStatus();
}

std::vector<v1::RankStatus> Registry::endSync(const std::string& id, uint64_t fence, const std::string& src,
                                              const std::string& dst, SyncEnd end, const std::string& reason) {
  return endSync(id, fence, src, std::vector<std::string>{dst}, end, reason);
}

std::vector<v1::RankStatus> Registry::endSync(const std::string& id, uint64_t fence, const std::string& src,
                                              const std::vector<std::string>& dst, SyncEnd end,
                                              const std::string& reason) {
  std::map<std::string, std::vector<int32_t>> touched;  // by group
  std::vector<v1::RankStatus> after;
  uint64_t version = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, r] : ranks_) {
      if (key.first == src)
        if (const auto reading = r->readers.find({id, fence}); reading != r->readers.end()) r->readers.erase(reading);
      if (!isIn(dst, key.first)) continue;
      if (const auto earlier = r->lingering.find(fence); earlier != r->lingering.end() && earlier->second.id == id) {
        // A later attempt of the id took the rank over: this one only stops lingering, once
        // nothing of it can land any more.
        if (end != SyncEnd::kDraining) r->lingering.erase(earlier);
        continue;
      }
      if (r->writer != id || r->writer_fence != fence) continue;
      r->writer.clear();
      version = r->writing;
      // (Logged below when committed or made DIRTY: a double-buffered rank that did not commit
      // keeps its state.)
      if (!r->doubled() || end == SyncEnd::kCommit) touched[key.first].push_back(r->rank);
      if (r->doubled()) {
        // Commit flips to the set just written; otherwise the set in use is untouched: the rank
        // stays where it was (the other set is rewritten whole by the next sync). The set in use
        // is the next delta's base (a delta is rebuilt from it into the other set); a sync that
        // failed after writing may have failed because it no longer holds its version (its
        // engine wrote it: a delta's DATA_LOSS), so the next sync is dense for it.
        if (end == SyncEnd::kCommit) {
          r->active = 1 - r->active;
          r->state = v1::RANK_READY;
          r->committed = r->writing;
          r->committed_by = r->writer_fence;
          r->detail.clear();
        } else if (end != SyncEnd::kRevert) {
          r->committed_by = 0;
        }
        if (end == SyncEnd::kDraining) r->writer = id;  // its other set is still being written
        after.push_back(statusOf(*r));
        continue;
      }
      switch (end) {
        case SyncEnd::kCommit:
          r->state = v1::RANK_READY;
          r->committed = r->writing;
          r->committed_by = r->writer_fence;
          r->detail.clear();
          break;
        case SyncEnd::kRevert:
          r->state = r->before;
          r->detail = r->before_detail;
          break;
        case SyncEnd::kDirty:
        case SyncEnd::kDraining:
          r->state = v1::RANK_DIRTY;
          r->committed_by = 0;
          r->detail = strCat("sync ", id, " wrote part of version ", r->writing, " and did not commit: ", reason);
          if (end == SyncEnd::kDraining) {
            r->writer = id;  // still held: writes of it are still landing
            r->detail += kStillLanding;
          }
          break;
      }
      after.push_back(statusOf(*r));
    }
    removeOrphans();
  }
  state_cv_.notify_all();
  for (const auto& [group, ranks] : touched) {
    if (end == SyncEnd::kCommit)
      spdlog::info("group \"{}\" ranks {} on node \"{}\" are READY at version {} (sync {})", group, rankList(ranks),
                   node_, version, id);
    else if (end == SyncEnd::kDirty)
      spdlog::warn("group \"{}\" ranks {} are DIRTY: sync {} failed after writing: {}", group, rankList(ranks), id,
                   reason);
  }
  return after;
}

StatusOr<v1::RankStatus> Registry::acquire(const std::string& group, int32_t rank, const MemoryCaller& caller,
                                           std::chrono::milliseconds timeout, const std::function<bool()>& gone,
                                           uint64_t registration) {
  std::unique_lock<std::mutex> lock(mu_);
  const std::string who = strCat("group \"", group, "\" rank ", rank);
  Rank* r = findRank(group, rank);
  if (r == nullptr) return absl::NotFoundError(strCat(who, " is not registered on node \"", node_, "\""));
  SC_RETURN_IF_ERROR(mayChange(*r, caller, "acquire", registration));
  if (r->held) return absl::FailedPreconditionError(strCat(who, " is already acquired"));
  // The rank object may be replaced while waiting (after a restart of its client): look it up
  // again each time; and another acquire may win the wait.
  auto free = [&] {
    r = findRank(group, rank);
    // A double-buffered destination's writer writes the other set: not waited for.
    return stopping_ || r == nullptr ||
           (r->readers.empty() && r->lingering.empty() && (r->writer.empty() || r->doubled()));
  };
  // In steps, to notice a caller that went away.
  const auto until = std::chrono::steady_clock::now() + timeout;
  bool ok = free();
  while (!ok && std::chrono::steady_clock::now() < until) {
    if (gone && gone()) return absl::CancelledError(strCat(who, ": the caller went away while waiting to acquire it"));
    const auto step = std::min<std::chrono::steady_clock::duration>(std::chrono::milliseconds(100),
                                                                    until - std::chrono::steady_clock::now());
    ok = state_cv_.wait_for(lock, step, free);
  }
  if (stopping_) return absl::UnavailableError(strCat("shardcastd on node \"", node_, "\" is stopping"));
  if (r == nullptr) return absl::NotFoundError(strCat(who, " was unregistered while waiting to acquire it"));
  if (!ok)
    return absl::DeadlineExceededError(
        strCat(who, " on node \"", node_, "\": sync ", r->user(), " still uses it after ", timeout.count(), " ms"));
  if (r->held) return absl::FailedPreconditionError(strCat(who, " was acquired by another caller meanwhile"));
  SC_RETURN_IF_ERROR(mayChange(*r, caller, "acquire", registration));  // re-registered while waiting: by whom?
  r->held = true;
  if (r->role == v1::ROLE_SOURCE) r->state = v1::RANK_UPDATING;
  if (r->doubled()) r->pinned = r->active;
  state_cv_.notify_all();
  return statusOf(*r);
}

StatusOr<v1::RankStatus> Registry::release(const std::string& group, int32_t rank, uint64_t version,
                                           const MemoryCaller& caller, uint64_t registration) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string who = strCat("group \"", group, "\" rank ", rank);
  Rank* r = findRank(group, rank);
  if (r == nullptr) return absl::NotFoundError(strCat(who, " is not registered on node \"", node_, "\""));
  SC_RETURN_IF_ERROR(mayChange(*r, caller, version ? "publish" : "release", registration));
  if (r->role == v1::ROLE_SOURCE) {
    if (!planner::isVersion(version))
      return absl::InvalidArgumentError(
          strCat(who, ": a source rank publishes a version in ", planner::kVersionRange, ", not ", version));
    if (version < r->committed || (r->held && version == r->committed))
      return absl::InvalidArgumentError(strCat(
          who, ": version ", version, r->held ? " is not newer than" : " is older than", " version ", r->committed,
          " it published before", r->held ? " (acquired and written: publish a new version)" : ""));
    if (!r->held && r->state == v1::RANK_READY && version != r->committed)
      return absl::FailedPreconditionError(strCat(who, " publishes version ", version,
                                                  " without acquiring it after version ", r->committed,
                                                  ": acquire first (a sync may be reading it)"));
    r->state = v1::RANK_READY;
    r->committed = version;
  } else {
    if (version != 0)
      return absl::InvalidArgumentError(
          strCat(who, " is a destination: only syncs give it versions (release with version 0)"));
    if (!r->held) return absl::FailedPreconditionError(strCat(who, " is not acquired"));
  }
  r->held = false;
  r->pinned = -1;
  state_cv_.notify_all();
  return statusOf(*r);
}

StatusOr<v1::WaitVersionResponse> Registry::waitVersion(const std::string& group, uint64_t version,
                                                        std::chrono::milliseconds timeout,
                                                        const std::function<bool()>& gone) const {
  std::unique_lock<std::mutex> lock(mu_);
  v1::WaitVersionResponse out;
  Status failed = absl::OkStatus();
  auto check = [&] {
    out.Clear();
    if (stopping_) {
      failed = absl::UnavailableError(strCat("shardcastd on node \"", node_, "\" is stopping"));
      return true;
    }
    uint64_t min = UINT64_MAX;
    bool any = false;
    for (const auto& [key, r] : ranks_) {
      if (key.first != group) continue;
      any = true;
      const v1::RankStatus st = statusOf(*r);
      if (st.state() == v1::RANK_DIRTY) {
        failed = absl::FailedPreconditionError(
            strCat("group \"", group, "\" rank ", r->rank, " on node \"", node_, "\" is DIRTY: ", st.detail()));
        return true;
      }
      min = std::min(min, st.state() == v1::RANK_READY ? st.version() : 0);
      *out.add_ranks() = st;
    }
    if (!any) {
      failed = absl::NotFoundError(strCat("group \"", group, "\" has no ranks registered on node \"", node_, "\""));
      return true;
    }
    out.set_version(min);
    return min >= version;
  };
  // In steps, to notice a caller that went away (as acquire does).
  const auto until = std::chrono::steady_clock::now() + timeout;
  bool done = check();
  while (!done && std::chrono::steady_clock::now() < until) {
    if (gone && gone())
      return absl::CancelledError(
          strCat("wait for group \"", group, "\" version ", version, " on node \"", node_, "\": the caller went away"));
    const auto step = std::min<std::chrono::steady_clock::duration>(std::chrono::milliseconds(100),
                                                                    until - std::chrono::steady_clock::now());
    done = state_cv_.wait_for(lock, step, check);
  }
  if (!failed.ok()) return failed;
  return out;
}

void Registry::drained(const std::string& id, uint64_t fence, const std::string& src,
                       const std::vector<std::string>& dst) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, r] : ranks_) {
      if (key.first == src)
        if (const auto reading = r->readers.find({id, fence}); reading != r->readers.end()) r->readers.erase(reading);
      if (!isIn(dst, key.first)) continue;
      if (const auto earlier = r->lingering.find(fence); earlier != r->lingering.end() && earlier->second.id == id)
        r->lingering.erase(earlier);
      if (r->writer == id && r->writer_fence == fence) {
        r->writer.clear();
        if (const auto at = r->detail.rfind(kStillLanding); at != std::string::npos) r->detail.erase(at);
      }
    }
    removeOrphans();
  }
  state_cv_.notify_all();
  spdlog::info("sync {}: its last writes into group(s) {} on node \"{}\" are done", id, fmt::join(dst, ", "), node_);
}

void Registry::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  state_cv_.notify_all();
}

}  // namespace shardcast::daemon
