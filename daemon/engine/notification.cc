#include "daemon/engine/notification.h"

#include <cstring>

#include "common/strings.h"

namespace shardcast::daemon {

namespace {

// The daemons of a cluster run on little-endian hosts (x86-64, aarch64); the format says so.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the notification format is little-endian");

template <typename T>
void put(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

class Reader {
 public:
  explicit Reader(std::string_view b) : b_(b) {}
  template <typename T>
  bool get(T* v) {
    if (b_.size() - at_ < sizeof(T)) return false;
    std::memcpy(v, b_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return true;
  }
  bool bytes(size_t n, std::string* out) {
    if (b_.size() - at_ < n) return false;
    out->assign(b_.data() + at_, n);
    at_ += n;
    return true;
  }
  size_t left() const { return b_.size() - at_; }

 private:
  std::string_view b_;
  size_t at_ = 0;
};

}  // namespace

std::string encodeNotification(const Notification& n) {
  std::string out;
  out.reserve(notificationBytes(n.sync_id.size(), n.chunks.size()));
  put<uint32_t>(out, kNotificationMagic);
  put<uint16_t>(out, kNotificationVersion);
  put<uint16_t>(out, static_cast<uint16_t>(n.sync_id.size()));
  put<uint64_t>(out, n.fence);
  out += n.sync_id;
  put<uint32_t>(out, static_cast<uint32_t>(n.chunks.size()));
  if (n.chunks.empty()) {
    put<int32_t>(out, n.ready_node);
    put<uint32_t>(out, n.answer ? 1u : 0u);
  }
  for (const auto& c : n.chunks) {
    put<int32_t>(out, c.transfer);
    put<int32_t>(out, c.chain);
    put<int32_t>(out, c.hop);
    put<int32_t>(out, c.chunk);
    put<int32_t>(out, c.encoding);
    put<uint64_t>(out, c.checksum);
    put<uint64_t>(out, c.bytes);
    put<uint64_t>(out, c.result);
  }
  return out;
}

StatusOr<Notification> parseNotification(std::string_view bytes) {
  Reader r(bytes);
  uint32_t magic = 0;
  uint16_t version = 0, id_len = 0;
  if (!r.get(&magic) || magic != kNotificationMagic)
    return absl::InvalidArgumentError(strCat("notification: not a Shardcast notification (", bytes.size(), " bytes)"));
  if (!r.get(&version) || version != kNotificationVersion)
    return absl::InvalidArgumentError(
        strCat("notification: format version ", version, ", this daemon reads ", kNotificationVersion));
  if (!r.get(&id_len) || id_len == 0 || id_len > planner::kMaxSyncIdBytes)
    return absl::InvalidArgumentError(
        strCat("notification: sync id of ", id_len, " bytes (1 to ", planner::kMaxSyncIdBytes, ")"));
  Notification n;
  uint32_t count = 0;
  if (!r.get(&n.fence) || !r.bytes(id_len, &n.sync_id) || !r.get(&count))
    return absl::InvalidArgumentError("notification: truncated header");
  if (count == 0) {  // the readiness word
    uint32_t flags = 0;
    if (r.left() != 8 || !r.get(&n.ready_node) || !r.get(&flags) || n.ready_node < 0 || flags > 1)
      return absl::InvalidArgumentError(
          strCat("notification: a readiness word of ", r.left(), " bytes (8: a node index, flags 0 or 1)"));
    n.answer = flags == 1;
    return n;
  }
  if (count > kMaxLanded)
    return absl::InvalidArgumentError(strCat("notification: ", count, " chunks (1 to ", kMaxLanded, ")"));
  if (r.left() != static_cast<size_t>(count) * kLandedBytes)
    return absl::InvalidArgumentError(
        strCat("notification: ", r.left(), " bytes for ", count, " chunks of ", kLandedBytes));
  n.chunks.resize(count);
  for (auto& c : n.chunks) {
    r.get(&c.transfer);
    r.get(&c.chain);
    r.get(&c.hop);
    r.get(&c.chunk);
    r.get(&c.encoding);
    r.get(&c.checksum);
    r.get(&c.bytes);
    r.get(&c.result);
  }
  return n;
}

}  // namespace shardcast::daemon
