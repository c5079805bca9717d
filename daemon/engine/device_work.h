// The device copies one execution issues without waiting for them, and what has to follow them.
// A GPU packs chunk k+1 while chunk k is sent: each chunk's follow-up (checksum, encode, send)
// waits for the marks taken after its copies were issued, one chunk behind. Host-only work
// (no engine used) runs its follow-up at once, exactly as if there were no device.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "common/status.h"
#include "transport/copy_engine.h"

namespace shardcast::daemon {

class DeviceWork {
 public:
  DeviceWork() = default;
  DeviceWork(const DeviceWork&) = delete;
  DeviceWork& operator=(const DeviceWork&) = delete;
  ~DeviceWork();  // drops a follow-up still waiting and settles (errors dropped)

  // Notes that copies will be issued on `engine` (null: host memory); returns it.
  transport::CopyEngine* use(transport::CopyEngine* engine);
  // Runs `then` once every copy issued so far is done: at once when no engine was used, else
  // after the next whenCopied() has taken its marks, or at flush().
  Status whenCopied(std::function<Status()> then);
  // Runs the follow-up still waiting, after its copies.
  Status flush();
  // Waits for every copy issued so far on any engine used (a follow-up still waiting stays).
  Status settle();

 private:
  struct Pending {
    std::vector<std::shared_ptr<transport::CopyMark>> marks;
    std::function<Status()> then;
  };
  StatusOr<std::vector<std::shared_ptr<transport::CopyMark>>> marks();

  std::vector<transport::CopyEngine*> engines_;
  std::optional<Pending> pending_;
};

}  // namespace shardcast::daemon
