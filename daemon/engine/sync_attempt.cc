#include "daemon/engine/sync_attempt.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>

#include "common/strings.h"

namespace shardcast::daemon {

using Phase = SyncAttempt::Phase;

// ---- Outbox ----

void Outbox::queue(int32_t node, std::shared_ptr<transport::Endpoint> endpoint, Write w) {
  pending_ += 2;  // the write and its notification
  auto& n = nodes_[node];
  n.endpoint = std::move(endpoint);
  n.queued.push_back(std::move(w));
}

std::vector<Outbox::Write> Outbox::take(int32_t node, const Limits& limits,
                                        std::shared_ptr<transport::Endpoint>* endpoint) {
  std::vector<Write> start;
  auto& n = nodes_[node];
  *endpoint = n.endpoint;
  if (n.bytes_in_flight > 0 && n.bytes_in_flight + limits.batch_bytes > limits.window_bytes) return start;
  uint64_t batched = 0;
  while (!n.queued.empty() &&
         (n.bytes_in_flight == 0 || n.bytes_in_flight + n.queued.front().op.length <= limits.window_bytes) &&
         (batched == 0 || batched + n.queued.front().op.length <= limits.batch_bytes) &&
         start.size() < limits.max_batch) {
    batched += n.queued.front().op.length;
    n.bytes_in_flight += n.queued.front().op.length;
    start.push_back(std::move(n.queued.front()));
    n.queued.pop_front();
  }
  return start;
}

void Outbox::completed(int32_t node, uint64_t bytes, int64_t ops) {
  pending_ -= ops;
  nodes_[node].bytes_in_flight -= bytes;
}

void Outbox::dropQueued() {
  for (auto& [node, n] : nodes_) {
    pending_ -= 2 * static_cast<int64_t>(n.queued.size());
    n.queued.clear();
  }
}

// ---- SyncAttempt: phases ----

std::string_view SyncAttempt::name(Phase p) {
  switch (p) {
    case Phase::kPreparing:
      return "preparing";
    case Phase::kPrepared:
      return "prepared";
    case Phase::kExecuting:
      return "executing";
    case Phase::kClosing:
      return "closing";
    case Phase::kDraining:
      return "draining";
    case Phase::kClosed:
      return "closed";
  }
  return "?";
}

Phase SyncAttempt::phase() const { return phase_.load(); }

void SyncAttempt::moveTo(Phase to) {
  const Phase from = phase_.load();
  bool allowed = false;
  switch (to) {
    case Phase::kPrepared:
      allowed = from == Phase::kPreparing || from == Phase::kExecuting;
      break;
    case Phase::kExecuting:
      allowed = from == Phase::kPrepared;
      break;
    case Phase::kClosing:
      allowed = from == Phase::kPrepared || from == Phase::kExecuting;
      break;
    case Phase::kDraining:
      allowed = from == Phase::kClosing;
      break;
    case Phase::kClosed:
      allowed = from == Phase::kPreparing || from == Phase::kClosing || from == Phase::kDraining;
      break;
    case Phase::kPreparing:
      break;
  }
  if (!allowed) {
    spdlog::critical("sync {}: an attempt moved from {} to {}, which is not a transition (a bug)", id, name(from),
                     name(to));
    std::abort();
  }
  phase_ = to;
}

void SyncAttempt::publish() {
  std::lock_guard<std::mutex> lock(mu_);
  moveTo(Phase::kPrepared);
  renew();  // the lease runs from here: planning and allocating do not count against it
}

void SyncAttempt::abandon() {
  std::lock_guard<std::mutex> lock(mu_);
  moveTo(Phase::kClosed);
}

Status SyncAttempt::beginExecute(const std::string& node) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_.ok()) return failure_;
  if (phase_ == Phase::kExecuting)
    // One wave at a time: a second Execute of this attempt (a retried call) would share its
    // staging and landed-chunk queue with the one running.
    return absl::FailedPreconditionError(
        strCat("sync ", id, ": an execute of this attempt is already running on node \"", node, "\""));
  if (phase_ != Phase::kPrepared) return absl::AbortedError(strCat("sync ", id, " ended"));
  moveTo(Phase::kExecuting);
  ++executes_;
  return absl::OkStatus();
}

void SyncAttempt::endExecute(int32_t wave, bool ok) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    --executes_;
    if (phase_ == Phase::kExecuting) {
      moveTo(Phase::kPrepared);
      if (ok) waves_done_.insert(wave);
    }
  }
  cv_.notify_all();
}

Registry::SyncEnd SyncAttempt::beginClose(Registry::SyncEnd end, const std::string& node, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  const bool commit = end == Registry::SyncEnd::kCommit;
  // A write of this node failed after its execute returned: the bytes are not all there.
  if (commit && !failure_.ok()) end = Registry::SyncEnd::kDirty;
  // A destination commits only what it saw land: the coordinator's word alone is not enough.
  if (const std::string gap = commit && failure_.ok() ? missing() : ""; !gap.empty()) {
    failure_ = absl::FailedPreconditionError(strCat("commit refused on node \"", node, "\": ", gap));
    spdlog::warn("sync {}: {}", id, std::string(failure_.message()));
    end = Registry::SyncEnd::kDirty;
  }
  moveTo(Phase::kClosing);
  if (failure_.ok() && !commit) failure_ = absl::AbortedError(strCat("sync ", id, " aborted: ", reason));
  outbox_.dropQueued();
  cv_.notify_all();
  return end;
}

bool SyncAttempt::quiesce(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [&] { return quietLocked(); });
}

bool SyncAttempt::quiet() const {
  std::lock_guard<std::mutex> lock(mu_);
  return quietLocked();
}

bool SyncAttempt::quietLocked() const { return outbox_.pending() == 0 && executes_ == 0; }

void SyncAttempt::drain(bool reading) {
  std::lock_guard<std::mutex> lock(mu_);
  drains_reading_ = reading;
  moveTo(Phase::kDraining);
}

bool SyncAttempt::drainsReading() const {
  std::lock_guard<std::mutex> lock(mu_);
  return drains_reading_;
}

void SyncAttempt::endClose() {
  std::lock_guard<std::mutex> lock(mu_);
  moveTo(Phase::kClosed);
}

std::string SyncAttempt::missing() const {
  if (self < 0) return "";  // nothing of the sync lands or is read here
  std::string waves;
  for (int32_t w = 0; w < plan->waves; ++w)
    if (!waves_done_.count(w)) waves += strCat(waves.empty() ? "" : ", ", w);
  int64_t expected = 0;
  for (const int64_t n : plan->node(self).incoming) expected += n;
  const auto landed = static_cast<int64_t>(seen_.size());
  if (waves.empty() && landed == expected) return "";
  std::string out;
  if (!waves.empty()) out = strCat("wave(s) ", waves, " of ", plan->waves, " not executed here; ");
  return strCat(out, landed, " of the ", expected, " chunks planned to land here arrived and were checked (group \"",
                dst_group, "\" goes dirty here)");
}

// ---- SyncAttempt: while prepared or executing ----

Status SyncAttempt::usable() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_.ok()) return failure_;
  if (phase_ != Phase::kPrepared && phase_ != Phase::kExecuting)
    return absl::AbortedError(strCat("sync ", id, " ended"));
  return absl::OkStatus();
}

void SyncAttempt::fail(Status st) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.ok()) failure_ = std::move(st);
  }
  cv_.notify_all();
}

Status SyncAttempt::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void SyncAttempt::announce(const std::vector<LandedChunk>& chunks) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    landed_.insert(landed_.end(), chunks.begin(), chunks.end());
  }
  cv_.notify_all();
}

StatusOr<SyncAttempt::Next> SyncAttempt::nextLanded(Clock::time_point deadline, bool all_processed) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool woke = cv_.wait_until(
      lock, deadline, [&] { return !failure_.ok() || !landed_.empty() || (all_processed && outbox_.pending() == 0); });
  if (!failure_.ok()) return failure_;
  if (!woke) return Next{Next::kTimedOut};
  if (landed_.empty()) return Next{Next::kDone};  // all landed, processed and forwarded
  Next next{Next::kChunk, landed_.front()};
  landed_.pop_front();
  return next;
}

bool SyncAttempt::landOnce(int32_t transfer, int32_t chunk) {
  std::lock_guard<std::mutex> lock(mu_);
  return seen_.insert({transfer, chunk}).second;
}

void SyncAttempt::pin(std::shared_ptr<void> keep_alive) {
  std::lock_guard<std::mutex> lock(mu_);
  pinned_.push_back(std::move(keep_alive));
}

std::shared_ptr<transport::MemoryRegion> SyncAttempt::staging() const {
  std::lock_guard<std::mutex> lock(mu_);
  return staging_;
}

void SyncAttempt::setStaging(std::shared_ptr<transport::MemoryRegion> staging) {
  std::lock_guard<std::mutex> lock(mu_);
  staging_ = std::move(staging);
}

bool SyncAttempt::executing() const {
  std::lock_guard<std::mutex> lock(mu_);
  return executes_ > 0;
}

std::pair<std::shared_ptr<transport::MemoryRegion>, std::shared_ptr<transport::MemoryRegion>>
SyncAttempt::takeMemory() {
  std::lock_guard<std::mutex> lock(mu_);
  if (outbox_.pending() != 0 || executes_ != 0) return {};
  return {std::move(arena), std::move(staging_)};
}

int64_t SyncAttempt::writesPending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return outbox_.pending();
}

// ---- SyncAttempt: writes ----

// A folded attempt's daemons prepared without waiting for each other, so a write could reach a
// node that has not opened the attempt yet (refused there, or over RMA landing in ranks it has
// not taken). Each node says when it has it open, to the nodes it writes to and those writing to
// it; a word that reaches a node not open yet is dropped there, but that node then says so itself
// once open, and is answered: of any two, the one opening second always hears and is heard. A
// node still waiting for a word says its own again every 100 ms (Execution::receive), and every
// word that is not an answer is answered: a word lost with a broken connection is not waited for
// until the sync's timeout.
void SyncAttempt::gateWrites(std::map<int32_t, std::shared_ptr<transport::Endpoint>> peers) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    gated_ = true;
    handshake_ = peers;
  }
  for (const auto& [node, endpoint] : peers) sayReady(endpoint, false);
}

void SyncAttempt::peerReady(int32_t node, bool answer) {
  std::shared_ptr<transport::Endpoint> to_answer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ready_.insert(node);
    // Not told yet (its word came before gateWrites): gateWrites' own word reaches it, and counts.
    if (const auto it = handshake_.find(node); !answer && it != handshake_.end()) to_answer = it->second;
  }
  if (to_answer) sayReady(to_answer, true);
  startWrites(node);
}

void SyncAttempt::sayReadyAgain(int32_t node, std::shared_ptr<transport::Endpoint> endpoint) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    handshake_[node] = endpoint;  // its answers go there too
  }
  sayReady(endpoint, false);
}

std::vector<int32_t> SyncAttempt::unready() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int32_t> out;
  for (const auto& [node, endpoint] : handshake_)
    if (ready_.count(node) == 0) out.push_back(node);
  return out;
}

void SyncAttempt::sayReady(const std::shared_ptr<transport::Endpoint>& endpoint, bool answer) const {
  Notification word;
  word.sync_id = id;
  word.fence = fence;
  word.ready_node = self;
  word.answer = answer;
  // A word lost with its peer: the writes waiting for it time out, naming the node (unready()).
  endpoint->notify(encodeNotification(word), key, [](const Status&) {});
}

Status SyncAttempt::send(int32_t node, std::shared_ptr<transport::Endpoint> endpoint, Outbox::Write w) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.ok()) return failure_;
    if (phase_ != Phase::kPrepared && phase_ != Phase::kExecuting)
      return absl::AbortedError(strCat("sync ", id, " ended"));
    outbox_.queue(node, std::move(endpoint), std::move(w));
  }
  startWrites(node);
  return absl::OkStatus();
}

// At least one write is always in flight while any is queued. Without the window every chunk
// would be on the wire at once; the transport then completes them all near the end, and relays
// and fan-out could not start before the last byte arrived. Writes start in batches of up to
// kBatchBytes (or half the window, if smaller) once a batch fits in the window. A relay forwards
// nothing it has not heard of, so a chunk of kOwnNoticeBytes or more carries its own announcement
// (WriteOp::notice: over TCP in the write's header, heard of as it lands, not after a round trip
// and behind the chunks sent after it); the smaller ones of a batch share one notification
// (delivered once every write before it is visible): a message and a wake-up of the receiving
// thread per batch, not per small chunk. The window keeps the link busy across the round trip of
// an acknowledged write. A write's completion starts more.
void SyncAttempt::startWrites(int32_t node) {
  constexpr size_t kMaxNotification = 32 << 10;  // bytes per batch's notification (the transport takes 64 KiB)
  constexpr uint64_t kBatchBytes = uint64_t{8} << 20;
  constexpr uint64_t kOwnNoticeBytes = uint64_t{64} << 10;
  // A batch of at most two chunks: each write's completion frees room for the next soon.
  const uint64_t chunk_bytes = plan ? static_cast<uint64_t>(plan->plan.options.chunk_bytes) : 0;
  const Outbox::Limits limits{
      window_bytes,
      std::max<uint64_t>(1, std::min({kBatchBytes, window_bytes / 2, chunk_bytes > 0 ? 2 * chunk_bytes : kBatchBytes})),
      std::min(kMaxLanded, (kMaxNotification - notificationBytes(id.size(), 0)) / kLandedBytes)};
  std::vector<Outbox::Write> start;
  std::shared_ptr<transport::Endpoint> ep;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.ok() || (phase_ != Phase::kPrepared && phase_ != Phase::kExecuting)) {
      outbox_.dropQueued();
      cv_.notify_all();
      return;
    }
    if (gated_ && ready_.count(node) == 0) return;  // it has not said it has the attempt open yet
    start = outbox_.take(node, limits, &ep);
  }
  if (start.empty()) return;
  // A write's or notification's completion; a write also frees its bytes of the window. Waiters
  // care only about the last one or a failure (waking them per completion costs a context switch
  // per chunk).
  auto self_ref = shared_from_this();
  auto finished = [self_ref, node](Status st, uint64_t window, int64_t ops) {
    SyncAttempt& a = *self_ref;
    bool wake;
    {
      std::lock_guard<std::mutex> lock(a.mu_);
      if (!st.ok() && a.failure_.ok()) a.failure_ = st;
      a.outbox_.completed(node, window, ops);
      wake = a.outbox_.pending() == 0 || !st.ok();
    }
    if (wake) a.cv_.notify_all();
  };
  Notification notification;  // the batch's small chunks
  notification.sync_id = id;
  notification.fence = fence;
  bool wrote = false;
  for (auto& out : start) {
    const uint64_t bytes = out.op.length;
    const bool own = bytes >= kOwnNoticeBytes;
    if (own)
      out.op.notice = encodeNotification({id, fence, {out.landed}});
    else
      notification.chunks.push_back(out.landed);
    if (bytes == 0) {  // an empty delta: only the word that it landed
      finished(absl::OkStatus(), 0, 1);
      continue;
    }
    wrote = true;
    ep->write(std::move(out.op), [self_ref, node, bytes, own, finished](Status st) {
      finished(st, bytes, own ? 2 : 1);  // the write, and its notice with it
      self_ref->startWrites(node);
    });
  }
  const auto announced = static_cast<int64_t>(notification.chunks.size());
  if (announced > 0)
    ep->notify(encodeNotification(notification), key, [finished, announced](Status st) { finished(st, 0, announced); });
  // A batch of empty deltas only: no completion of it will start what is queued behind it.
  if (!wrote) startWrites(node);
}

// ---- AttemptTable ----

bool AttemptTable::isOpen(const SyncAttempt& a) {
  const Phase p = a.phase();
  return p == Phase::kPrepared || p == Phase::kExecuting;
}

StatusOr<std::shared_ptr<SyncAttempt>> AttemptTable::begin(const std::shared_ptr<SyncAttempt>& a,
                                                           const std::vector<uint64_t>& supersedes,
                                                           std::chrono::milliseconds wait) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = open_.find(a->id);
  if (it != open_.end()) {
    const uint64_t earlier = it->second->fence;
    if (std::find(supersedes.begin(), supersedes.end(), earlier) == supersedes.end())
      return absl::AlreadyExistsError(strCat("sync ", a->id, " is already prepared on node \"", node_, "\""));
    if (!isOpen(*it->second)) {
      // Still being prepared here: given up now, so its Prepare ends refused and leaves the table.
      rememberGivenUp(a->id, earlier);
      const bool settled = left_.wait_for(lock, wait, [&] {
        const auto now = open_.find(a->id);
        return now == open_.end() || now->second->fence != earlier || isOpen(*now->second);
      });
      it = open_.find(a->id);
      if (!settled || (it != open_.end() && it->second->fence != earlier))
        return absl::AlreadyExistsError(strCat("sync ", a->id, " is already prepared on node \"", node_,
                                               "\" (an earlier attempt of it is still being prepared here)"));
    }
  }
  if (given_up_.count({a->id, a->fence}))
    return absl::AbortedError(strCat("sync ", a->id, " was given up by its coordinator before it was prepared here"));
  // An attempt a Finish ended is not prepared again (a repeated commit would take the new one).
  if (closed_.count({a->id, a->fence}))
    return absl::AbortedError(strCat("sync ", a->id, " already ended on node \"", node_, "\" (this attempt)"));
  std::shared_ptr<SyncAttempt> superseded;
  if (it != open_.end()) {  // prepared or executing: this Prepare carries the abort that did not arrive
    superseded = std::move(it->second);
    open_.erase(it);
  }
  open_.emplace(a->id, a);
  return superseded;
}

void AttemptTable::rememberGivenUp(const std::string& id, uint64_t fence) {
  given_up_.insert({id, fence});
  given_up_order_.push_back({id, fence});
  if (given_up_order_.size() > kGivenUpKept) {
    given_up_.erase(given_up_order_.front());
    given_up_order_.pop_front();
  }
}

Status AttemptTable::publish(const std::shared_ptr<SyncAttempt>& a) {
  std::lock_guard<std::mutex> lock(mu_);
  // Its coordinator may have given it up while this Prepare was on its way (prepares go to every
  // daemon at once): a Finish that found nothing prepared left its word here.
  if (given_up_.count({a->id, a->fence}))
    return absl::AbortedError(
        strCat("sync ", a->id, " was given up by its coordinator while it was being prepared on node \"", node_, "\""));
  a->publish();
  left_.notify_all();
  return absl::OkStatus();
}

void AttemptTable::abandon(const std::shared_ptr<SyncAttempt>& a) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = open_.find(a->id);
    if (it != open_.end() && it->second == a) open_.erase(it);
  }
  a->abandon();
  left_.notify_all();
}

bool AttemptTable::awaitPrepare(const std::string& id, uint64_t fence, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return left_.wait_for(lock, timeout, [&] {
    auto it = open_.find(id);
    return it == open_.end() || it->second->fence != fence || it->second->phase() != SyncAttempt::Phase::kPreparing;
  });
}

std::shared_ptr<SyncAttempt> AttemptTable::find(const std::string& id, uint64_t fence) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = open_.find(id);
  if (it == open_.end() || !isOpen(*it->second) || (fence != 0 && it->second->fence != fence)) return nullptr;
  return it->second;
}

BlockAmaxes* SyncAttempt::blockAmaxes(const std::string& weight, size_t blocks) {
  std::lock_guard<std::mutex> lock(amaxes_mu_);
  auto it = amaxes_.find(weight);
  if (it != amaxes_.end()) return it->second.get();  // never replaced: packers hold it (the key fixes `blocks`)
  // 8 bytes per block of the whole weight: within a budget per attempt (tiny blocks, 1 x 128 say,
  // would cost more than they save); past it the blocks are read again.
  if (blocks > kAmaxSlotsKept - amax_slots_) return nullptr;
  amax_slots_ += blocks;
  return amaxes_.emplace(weight, std::make_unique<BlockAmaxes>(blocks)).first->second.get();
}

std::shared_ptr<SyncAttempt> AttemptTable::takeForClose(const std::string& id, uint64_t fence,
                                                        std::optional<bool> commit) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = open_.find(id);
  if (it == open_.end() || !isOpen(*it->second) || (fence != 0 && it->second->fence != fence)) {
    if (fence != 0) rememberGivenUp(id, fence);
    return nullptr;
  }
  auto a = std::move(it->second);
  open_.erase(it);
  if (commit && fence != 0) {  // under the same lock: a repeated Finish finds the one or the other
    const auto key = std::make_pair(id, fence);
    Closed entry;
    entry.commit = *commit;
    if (closed_.insert_or_assign(key, std::move(entry)).second) closed_order_.push_back(key);
    if (closed_order_.size() > kClosedKept) {
      closed_.erase(closed_order_.front());
      closed_order_.pop_front();
    }
  }
  return a;
}

void AttemptTable::closed(const std::string& id, uint64_t fence, const StatusOr<v1::FinishResponse>& outcome) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = closed_.find({id, fence});
    if (it == closed_.end()) return;  // pushed out by later ones meanwhile
    it->second.done = true;
    it->second.outcome = outcome;
  }
  closed_cv_.notify_all();
}

std::optional<StatusOr<v1::FinishResponse>> AttemptTable::closedBefore(const std::string& id, uint64_t fence,
                                                                       bool commit, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto key = std::make_pair(id, fence);
  if (!closed_.count(key)) return std::nullopt;
  const bool ended = closed_cv_.wait_for(lock, timeout, [&] {
    auto it = closed_.find(key);
    return it == closed_.end() || it->second.done;
  });
  auto it = closed_.find(key);
  if (it == closed_.end()) return std::nullopt;
  if (it->second.commit != commit)
    return absl::FailedPreconditionError(
        strCat("sync ", id, " was ", it->second.commit ? "committed" : "aborted", " on node \"", node_, "\" already"));
  if (!ended)
    return absl::UnavailableError(
        strCat("sync ", id, " on node \"", node_, "\": an earlier Finish is still ending it"));
  return it->second.outcome;
}

std::vector<std::shared_ptr<SyncAttempt>> AttemptTable::takeExpired(SyncAttempt::Clock::time_point now) {
  std::vector<std::shared_ptr<SyncAttempt>> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = open_.begin(); it != open_.end();) {
    if (isOpen(*it->second) && it->second->expired(now)) {
      out.push_back(std::move(it->second));
      it = open_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

std::vector<std::shared_ptr<SyncAttempt>> AttemptTable::takeAll() {
  std::vector<std::shared_ptr<SyncAttempt>> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = open_.begin(); it != open_.end();) {
    if (isOpen(*it->second)) {
      out.push_back(std::move(it->second));
      it = open_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

void AttemptTable::addDraining(std::shared_ptr<SyncAttempt> a) {
  std::lock_guard<std::mutex> lock(mu_);
  draining_.push_back(std::move(a));
}

std::vector<std::shared_ptr<SyncAttempt>> AttemptTable::takeDrained(
    const std::function<bool(const SyncAttempt&)>& drained) {
  std::vector<std::shared_ptr<SyncAttempt>> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = draining_.begin(); it != draining_.end();) {
    if (drained(**it)) {
      out.push_back(std::move(*it));
      it = draining_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

}  // namespace shardcast::daemon
