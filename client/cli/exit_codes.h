// Exit codes of the `shardcast` CLI, so scripts can tell failures apart.
#pragma once

namespace shardcast::cli {

enum ExitCode : int {
  kOk = 0,
  kInternal = 1,
  kUsage = 2,         // bad flags or arguments
  kInvalidInput = 3,  // a layout file or option that fails validation
  kUnreachable = 4,   // the daemon cannot be reached
  kSyncFailed = 5,    // the daemon answered, and the operation failed
  kUntrusted = 6,     // something answers on the socket as a uid this client does not trust
};

}  // namespace shardcast::cli
