// Defaults the daemon and its clients must agree on: where a local client finds its node's daemon.
// The Python client (client/python/shardcast/client.py) and the Kubernetes manifests use the same
// values; tests compare them.
#pragma once

namespace shardcast {

// The release, as --version and Status report it.
inline constexpr const char* kShardcastVersion = "0.2.0";
inline constexpr const char* kDefaultSocket = "/run/shardcast/shardcastd.sock";
inline constexpr const char* kDefaultListen = "0.0.0.0:7070";
inline constexpr const char* kDefaultMetrics = "0.0.0.0:9464";

}  // namespace shardcast
