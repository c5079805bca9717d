// Backend registry and the serialised form of remote region descriptors.
#include "transport/transport.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "common/strings.h"

namespace shardcast::transport {

const char* memoryKindName(MemoryKind kind) { return kind == MemoryKind::kCuda ? "cuda" : "host"; }

namespace {
constexpr char kMagic[4] = {'S', 'C', 'R', '1'};

void putU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t getU64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}
}  // namespace

std::string RemoteRegion::serialize() const {
  std::string out(kMagic, 4);
  putU64(out, base);
  putU64(out, size);
  putU64(out, rkey.size());
  return out + rkey;
}

StatusOr<RemoteRegion> RemoteRegion::parse(const std::string& bytes) {
  if (bytes.size() < 28 || std::memcmp(bytes.data(), kMagic, 4) != 0)
    return absl::InvalidArgumentError(
        strCat("remote region descriptor of ", bytes.size(), " bytes is not a shardcast region descriptor"));
  RemoteRegion r;
  r.base = getU64(bytes.data() + 4);
  r.size = getU64(bytes.data() + 12);
  const uint64_t len = getU64(bytes.data() + 20);
  if (len != bytes.size() - 28)
    return absl::InvalidArgumentError(
        strCat("remote region descriptor: rkey length ", len, " but ", bytes.size() - 28, " bytes follow"));
  r.rkey = bytes.substr(28);
  return r;
}

void randomBytes(void* out, size_t n) {
  auto* p = static_cast<unsigned char*>(out);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::getrandom(p + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    // getrandom cannot fail once the kernel's pool is initialised (since boot on any system
    // that runs this); a secret from anything weaker would be guessable, so there is no fallback.
    if (r < 0) std::abort();
    got += static_cast<size_t>(r);
  }
}

WriteKey WriteKey::random() {
  WriteKey k;
  do randomBytes(k.bytes.data(), kBytes);
  while (k.empty());
  return k;
}

StatusOr<WriteKey> WriteKey::fromBytes(std::string_view raw) {
  if (raw.size() != kBytes)
    return absl::InvalidArgumentError(strCat("a write key is ", kBytes, " bytes, not ", raw.size()));
  WriteKey k;
  std::memcpy(k.bytes.data(), raw.data(), kBytes);
  if (k.empty()) return absl::InvalidArgumentError("a write key of all zero bytes");
  return k;
}

bool WriteKey::empty() const {
  for (const unsigned char b : bytes)
    if (b != 0) return false;
  return true;
}

std::map<std::string, std::string> settingsOf(const TransportOptions& options, std::string_view backend) {
  std::map<std::string, std::string> own;
  for (const auto& [name, value] : options.settings)
    if (name.size() > backend.size() && name.compare(0, backend.size(), backend) == 0 && name[backend.size()] == '.')
      own.emplace(name.substr(backend.size() + 1), value);
  return own;
}

Status checkWriteRanges(const WriteOp& op, const std::string& peer_name) {
  if (!op.src || op.src_offset > op.src->size() || op.length > op.src->size() - op.src_offset)
    return absl::OutOfRangeError(strCat("write to peer '", peer_name, "': source range [", op.src_offset, ", +",
                                        op.length, ") exceeds the local region of ", op.src ? op.src->size() : 0,
                                        " bytes"));
  if (op.dst_offset > op.dst.size || op.length > op.dst.size - op.dst_offset)
    return absl::OutOfRangeError(strCat("write to peer '", peer_name, "': target range [", op.dst_offset, ", +",
                                        op.length, ") exceeds the remote region of ", op.dst.size, " bytes"));
  if (op.key.empty())
    return absl::InvalidArgumentError(strCat("write to peer '", peer_name, "': no write key (every write needs one)"));
  if (op.notice.size() > kMaxNotifyBytes)
    return absl::InvalidArgumentError(
        strCat("write to peer '", peer_name, "': a notice of ", op.notice.size(), " bytes exceeds ", kMaxNotifyBytes));
  return absl::OkStatus();
}

}  // namespace shardcast::transport
