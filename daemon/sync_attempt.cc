#include "daemon/sync_attempt.h"

#include <algorithm>

#include "common/strings.h"

namespace shardcast::daemon {

Status SyncAttempt::usable() const {
  if (!failure.ok()) return failure;
  if (closed) return absl::AbortedError(strCat("sync ", id, " ended"));
  return absl::OkStatus();
}

void SyncAttempt::dropQueued() {
  for (auto& [node, box] : outboxes) {
    writes_pending -= 2 * static_cast<int64_t>(box.queued.size());
    box.queued.clear();
  }
}

Status queueWrite(const std::shared_ptr<SyncAttempt>& a, int32_t node, std::shared_ptr<transport::Endpoint> endpoint,
                  SyncAttempt::Outgoing out) {
  {
    std::lock_guard<std::mutex> lock(a->mu);
    SC_RETURN_IF_ERROR(a->usable());
    a->writes_pending += 2;  // the write and its notification
    auto& box = a->outboxes[node];
    box.endpoint = std::move(endpoint);
    box.queued.push_back(std::move(out));
  }
  startWrites(a, node);
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
void startWrites(const std::shared_ptr<SyncAttempt>& a, int32_t node) {
  constexpr size_t kMaxNotification = 32 << 10;  // bytes per batch's notification (the transport takes 64 KiB)
  constexpr uint64_t kBatchBytes = uint64_t{8} << 20;
  constexpr uint64_t kOwnNoticeBytes = uint64_t{64} << 10;
  const size_t max_batch = std::min(kMaxLanded, (kMaxNotification - notificationBytes(a->id.size(), 0)) / kLandedBytes);
  // A batch of at most two chunks: each write's completion frees room for the next soon.
  const uint64_t chunk_bytes = a->plan ? static_cast<uint64_t>(a->plan->plan.options.chunk_bytes) : 0;
  const uint64_t batch_bytes = std::max<uint64_t>(
      1, std::min({kBatchBytes, a->window_bytes / 2, chunk_bytes > 0 ? 2 * chunk_bytes : kBatchBytes}));
  std::vector<SyncAttempt::Outgoing> start;
  std::shared_ptr<transport::Endpoint> ep;
  {
    std::lock_guard<std::mutex> lock(a->mu);
    if (!a->failure.ok() || a->closed) {
      a->dropQueued();
      a->cv.notify_all();
      return;
    }
    auto& box = a->outboxes[node];
    ep = box.endpoint;
    if (box.bytes_in_flight > 0 && box.bytes_in_flight + batch_bytes > a->window_bytes) return;
    uint64_t batched = 0;
    while (!box.queued.empty() &&
           (box.bytes_in_flight == 0 || box.bytes_in_flight + box.queued.front().op.length <= a->window_bytes) &&
           (batched == 0 || batched + box.queued.front().op.length <= batch_bytes) && start.size() < max_batch) {
      batched += box.queued.front().op.length;
      box.bytes_in_flight += box.queued.front().op.length;
      start.push_back(std::move(box.queued.front()));
      box.queued.pop_front();
    }
  }
  if (start.empty()) return;
  // A write's or notification's completion; a write also frees its bytes of the window. Waiters
  // care only about the last one or a failure (waking them per completion costs a context switch
  // per chunk).
  auto finished = [a, node](Status st, uint64_t window_bytes, int64_t ops) {
    bool wake;
    {
      std::lock_guard<std::mutex> lock(a->mu);
      if (!st.ok() && a->failure.ok()) a->failure = st;
      a->writes_pending -= ops;
      a->outboxes[node].bytes_in_flight -= window_bytes;
      wake = a->writes_pending == 0 || !st.ok();
    }
    if (wake) a->cv.notify_all();
  };
  Notification notification;  // the batch's small chunks
  notification.sync_id = a->id;
  notification.fence = a->fence;
  bool wrote = false;
  for (auto& out : start) {
    const uint64_t bytes = out.op.length;
    const bool own = bytes >= kOwnNoticeBytes;
    if (own)
      out.op.notice = encodeNotification({a->id, a->fence, {out.landed}});
    else
      notification.chunks.push_back(out.landed);
    if (bytes == 0) {  // an empty delta: only the word that it landed
      finished(absl::OkStatus(), 0, 1);
      continue;
    }
    wrote = true;
    ep->write(std::move(out.op), [a, node, bytes, own, finished](Status st) {
      finished(st, bytes, own ? 2 : 1);  // the write, and its notice with it
      startWrites(a, node);
    });
  }
  const auto announced = static_cast<int64_t>(notification.chunks.size());
  if (announced > 0)
    ep->notify(encodeNotification(notification), a->key,
               [finished, announced](Status st) { finished(st, 0, announced); });
  // A batch of empty deltas only: no completion of it will start what is queued behind it.
  if (!wrote) startWrites(a, node);
}

}  // namespace shardcast::daemon
