// SHA-256 of layouts' serialisations: what tells two layouts apart where their xxHash64 digests,
// which can be made to collide, would not (docs/security.md, "Layout digests are not collision
// resistant").
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace shardcast::daemon {

// SHA-256 of `bytes`: 32 raw bytes.
std::string sha256(std::string_view bytes);

// One fingerprint of several byte strings: SHA-256 over each one's length and SHA-256, so that no
// two lists read alike; each one's SHA-256 into `each` when given (one pass over the bytes).
std::string sha256OfParts(const std::vector<std::string>& parts, std::vector<std::string>* each = nullptr);

}  // namespace shardcast::daemon
