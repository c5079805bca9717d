// Backend registry and the serialised form of remote region descriptors.
#include "transport/transport.h"

#include <cstring>

#include "common/strings.h"
#include "transport/loopback/loopback.h"
#include "transport/ucx/ucx_context.h"

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

StatusOr<std::unique_ptr<Context>> createContext(const TransportOptions& options) {
  if (options.protocol != "auto" && options.protocol != "put" && options.protocol != "am")
    return absl::InvalidArgumentError(
        strCat("transport protocol \"", options.protocol, "\" (expected auto, put or am)"));
  if (options.op_timeout.count() <= 0) return absl::InvalidArgumentError("transport op_timeout must be positive");
  if (options.backend == "ucx") return createUcxContext(options);
  if (options.backend == "loopback") return createLoopbackContext(options);
  return absl::InvalidArgumentError(
      strCat("unknown transport backend \"", options.backend, "\" (expected ucx or loopback)"));
}

}  // namespace shardcast::transport
