// Descriptors a local client handed to the daemon on the side channel (common/fd_passing.h), kept
// under a random one-time token until the registration that names it (a CudaAllocationsHandle)
// takes them. Thread-safe.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/fd_passing.h"
#include "common/status.h"

namespace shardcast::daemon {

class HandedFds {
 public:
  // Unclaimed tokens a uid may hold (a new one past this closes that uid's oldest) and how long one
  // is kept unclaimed: descriptors handed over and never registered do not pile up in the daemon.
  static constexpr size_t kPerUid = 256;
  static constexpr std::chrono::minutes kUnclaimedFor{5};
  // Descriptors held unclaimed: per uid (a hand-over past it closes that uid's oldest tokens) and
  // in all (a hand-over past it is refused, RESOURCE_EXHAUSTED): handed-over descriptors cannot
  // exhaust the daemon's, whatever the number of uids.
  static constexpr size_t kFdsPerUid = 1024;
  static constexpr size_t kFdsTotal = 4096;

  // Keeps `fds`, sent by `uid` (SO_PEERCRED), for one registration; returns its token.
  StatusOr<std::string> put(uid_t uid, std::vector<OwnedFd> fds);
  // The descriptors behind `token`, once: only `uid`'s own token (any uid's with `any_owner`, root).
  StatusOr<std::vector<OwnedFd>> take(const std::string& token, uid_t uid, bool any_owner);
  size_t pending() const;
  // Closes the tokens unclaimed for longer than kUnclaimedFor at `now` (the side channel calls it
  // while idle, so expiry does not wait for the next hand-over or registration).
  void sweep(std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now());

 private:
  struct Entry {
    uid_t uid;
    std::vector<OwnedFd> fds;
    std::chrono::steady_clock::time_point at;
  };
  // With mu_ held: entries unclaimed for too long move to `dropped` (closed by the caller after it
  // unlocks: a close must never run under mu_).
  void expire(std::chrono::steady_clock::time_point now, std::vector<Entry>* dropped);

  mutable std::mutex mu_;
  std::map<std::string, Entry> by_token_;
};

}  // namespace shardcast::daemon
