// The abort of a given-up sync, delivered late (late_aborts.h).
#include "daemon/coordinator/late_aborts.h"

#include <spdlog/spdlog.h>

#include <algorithm>

namespace shardcast::daemon {

LateAborts::~LateAborts() {
  std::vector<Call*> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;  // from here on nothing is reaped: `out` stays valid
    for (const auto& call : calls_)
      if (!call->done) out.push_back(call.get());
  }
  for (Call* call : out) call->context.TryCancel();  // (not under mu_: a callback takes it)
  std::unique_lock<std::mutex> lock(mu_);
  ended_.wait(lock, [&] {
    return std::all_of(calls_.begin(), calls_.end(), [](const auto& c) { return c->done && c->started; });
  });
}

void LateAborts::send(const std::string& node, const std::string& address, const v1::FinishRequest& abort,
                      std::chrono::milliseconds within) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) return;
  reap();
  if (calls_.size() >= kMaxInFlight) {
    spdlog::warn(
        "sync {}: {} aborts already wait for daemons that went silent: node \"{}\" ends the attempt when "
        "its lease runs out",
        abort.sync_id(), calls_.size(), node);
    return;
  }
  auto call = std::make_unique<Call>();
  call->request = abort;
  call->node = node;
  call->sent = std::chrono::steady_clock::now();
  call->context.set_deadline(std::chrono::system_clock::now() + within);
  call->context.set_wait_for_ready(true);  // through a reconnect: a partition that heals
  call->stub = v1::Peer::NewStub(peers_.channel(address));
  Call* c = call.get();
  calls_.push_back(std::move(call));
  lock.unlock();  // (its callback takes the lock, and may run before Finish returns)
  c->stub->async()->Finish(&c->context, &c->request, &c->response, [this, c](const grpc::Status& st) { ended(c, st); });
  lock.lock();
  c->started = true;  // reaped only from here: its stub and channel are not freed under Finish
  ended_.notify_all();
}

void LateAborts::ended(Call* call, const grpc::Status& st) {
  const double late = std::chrono::duration<double>(std::chrono::steady_clock::now() - call->sent).count();
  if (st.ok())
    spdlog::info(
        "sync {}: node \"{}\" took the abort {:.1f} s after the sync was given up (it had not answered "
        "then): its ranks are free",
        call->request.sync_id(), call->node, late);
  else  // NOT_FOUND: it had ended the attempt itself (its lease, or a restart)
    spdlog::debug("sync {}: the late abort to node \"{}\" ended after {:.1f} s: {}", call->request.sync_id(),
                  call->node, late, st.error_message());
  std::lock_guard<std::mutex> lock(mu_);
  if (st.ok()) ++delivered_;
  call->done = true;
  ended_.notify_all();
}

void LateAborts::reap() {
  calls_.erase(std::remove_if(calls_.begin(), calls_.end(), [](const auto& c) { return c->done && c->started; }),
               calls_.end());
}

size_t LateAborts::inFlight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<size_t>(std::count_if(calls_.begin(), calls_.end(), [](const auto& c) { return !c->done; }));
}

size_t LateAborts::delivered() const {
  std::lock_guard<std::mutex> lock(mu_);
  return delivered_;
}

}  // namespace shardcast::daemon
