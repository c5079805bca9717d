#include "daemon/engine/device_work.h"

#include <algorithm>

namespace shardcast::daemon {

DeviceWork::~DeviceWork() {
  pending_.reset();  // only a failed execution leaves one: its chunk is not sent
  settle().IgnoreError();
}

transport::CopyEngine* DeviceWork::use(transport::CopyEngine* engine) {
  if (engine != nullptr && std::find(engines_.begin(), engines_.end(), engine) == engines_.end())
    engines_.push_back(engine);
  return engine;
}

StatusOr<std::vector<std::shared_ptr<transport::CopyMark>>> DeviceWork::marks() {
  std::vector<std::shared_ptr<transport::CopyMark>> out;
  for (auto* e : engines_) {
    SC_ASSIGN_OR_RETURN(auto mark, e->mark());
    if (mark) out.push_back(std::move(mark));
  }
  return out;
}

Status DeviceWork::whenCopied(std::function<Status()> then) {
  if (engines_.empty()) return then();
  SC_ASSIGN_OR_RETURN(auto taken, marks());
  SC_RETURN_IF_ERROR(flush());
  pending_ = Pending{std::move(taken), std::move(then)};
  return absl::OkStatus();
}

Status DeviceWork::flush() {
  if (!pending_) return absl::OkStatus();
  Pending p = std::move(*pending_);
  pending_.reset();
  for (auto& m : p.marks) SC_RETURN_IF_ERROR(m->wait());
  return p.then();
}

Status DeviceWork::settle() {
  Status first;  // every engine is waited for, whatever one of them answers
  for (auto* e : engines_) {
    auto mark = e->mark();
    const Status st = !mark.ok() ? mark.status() : *mark ? (*mark)->wait() : absl::OkStatus();
    if (first.ok()) first = st;
  }
  return first;
}

}  // namespace shardcast::daemon
