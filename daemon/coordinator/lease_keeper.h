// SyncCoordinator::LeaseKeeper: from prepare on, the daemons hold a sync under a lease this renews
// (coordinator.h). Included only by the coordinator's own files.
#pragma once

#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/strings.h"
#include "daemon/coordinator/coordinator.h"

namespace shardcast::daemon {

// From prepare on, the daemons hold the sync under a lease: this renews it with a Progress call to
// every daemon each quarter lease (recording their bytes for Watch), and gives the sync up, naming
// the node, when one has not answered for a whole lease (a node holding only replicas of a set:
// for the sync's replica deadline, when shorter).
class SyncCoordinator::LeaseKeeper {
 public:
  explicit LeaseKeeper(SyncCoordinator& c)
      : c_(c),
        answered_(c.cluster_->addresses.size(), Clock::now()),
        unanswered_since_(answered_.size(), Clock::time_point::max()) {
    // A node holding only replicas of a set may be silent for the sync's replica deadline at most.
    // (At least 200 ms: below it every replica node would look silent between two polls.)
    const auto deadline = c.req_.options().replica_deadline_ms() == 0
                              ? std::chrono::milliseconds(0)
                              : std::max(std::chrono::milliseconds(c.req_.options().replica_deadline_ms()),
                                         std::chrono::milliseconds(200));
    for (const auto& d : c.cluster_->view.daemons())
      silence_.push_back(deadline.count() > 0 && !c.replicasOnlyOn(d.node()).empty() ? std::min(deadline, c.lease_)
                                                                                     : c.lease_);
    // A folded sync has no Prepare round, whose deadline found a silent daemon as soon as the
    // gather would have: until a daemon shows it holds the attempt, it may be silent that long.
    if (c.route_ == Route::kFolded)
      unprepared_ = std::min(c.lease_, std::chrono::milliseconds(std::max(c.ctx_.config.peer_timeout_ms, 1000)));
    prepared_.assign(silence_.size(), c.route_ != Route::kFolded);
    thread_ = std::thread([this] { run(); });
  }
  ~LeaseKeeper() { stop(); }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      running_ = false;
    }
    polling_.cancel();
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  // The node that stopped answering ("" while all answer).
  std::string stalled() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stalled_;
  }
  // How long it was allowed to be silent: "250 ms, the sync's replica deadline".
  std::string allowed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return allowed_;
  }

 private:
  void run() {
    using std::chrono::milliseconds;
    auto shortest = *std::min_element(silence_.begin(), silence_.end());  // of the silences allowed
    if (unprepared_.count() > 0) shortest = std::min(shortest, unprepared_);
    const auto period = std::min(milliseconds(250), shortest / 4);
    auto pause = period;
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, pause, [&] { return !running_; })) {
      lock.unlock();
      // A poll waits for answers until the first node's allowed silence runs out (a period at
      // least, half the shortest silence at most), and one that had to wait for a silent node
      // polls again at once: a node is found silent when its silence runs out, not a poll later.
      const auto sent = Clock::now();
      const auto silentSince = [&](size_t i) {  // if it leaves this poll unanswered
        return unanswered_since_[i] != Clock::time_point::max() ? unanswered_since_[i]
                                                                : std::max(answered_[i], sent - period);
      };
      auto first_end = silentSince(0) + allowance(0);
      for (size_t i = 1; i < answered_.size(); ++i) first_end = std::min(first_end, silentSince(i) + allowance(i));
      const auto wait = std::clamp(std::chrono::duration_cast<milliseconds>(first_end - sent), period,
                                   std::max(period, shortest / 2));
      // Not through the sync's PeerClient: these calls go on after the sync is given up (its
      // calls cancelled), until the coordinator is done with it. Through the sync's relay tree:
      // a daemon silent below a relay comes back DEADLINE_EXCEEDED from the relay (in time: a
      // relay gets a margin per hop), and a relay that is silent itself is named before the
      // daemons it did not reach, which follow it in the daemons' order.
      const auto& addresses = c_.cluster_->addresses;
      v1::ProgressRequest pr;
      pr.set_sync_id(c_.id_);
      pr.set_fence(c_.fence_);
      TreeOptions options;
      options.method = "Progress";
      options.fanout = c_.peers_ ? c_.peers_->fanout() : 0;
      pr.SerializeToString(&options.common_request);
      // stop() never waits for a silent node.
      options.track = [this](grpc::ClientContext& context, bool add) { polling_.track(context, add); };
      std::vector<RawCall> calls;
      for (const auto& a : addresses) calls.push_back({a, {}, wait});
      {
        std::lock_guard<std::mutex> guard(mu_);
        if (!running_) return;
      }
      const auto results = callTree(c_.ctx_.peers, calls, options);
      std::vector<grpc::Status> st(results.size());
      std::vector<v1::ProgressResponse> got(results.size());
      for (size_t i = 0; i < results.size(); ++i) st[i] = parseResult(results[i], &got[i]);
      std::string silent;
      pause = period;
      // How long a node that left this poll unanswered is known silent: up to the poll's deadline,
      // not until now when this thread got to it late (a coordinator descheduled during the poll).
      const auto observed = std::min(Clock::now(), sent + wait);
      // A node's silence counts from its last answer, but a poll the coordinator sent later than
      // a period after it (not scheduled meanwhile: a loaded machine) counts it from the poll less
      // a period: a healthy node is not found silent for the coordinator's own delay.
      for (size_t i = 0; i < st.size(); ++i) {
        if (st[i].error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) pause = milliseconds(0);
        // NOT_FOUND: the daemon answers (the sync is not prepared there yet, or over).
        if (st[i].ok() || st[i].error_code() == grpc::StatusCode::NOT_FOUND) {
          answered_[i] = Clock::now();
          unanswered_since_[i] = Clock::time_point::max();
        } else {
          unanswered_since_[i] = silentSince(i);
        }
        if (st[i].ok()) c_.record(i, got[i].bytes_received(), got[i].bytes_sent());
        prepared_[i] = prepared_[i] || st[i].ok();  // the attempt is open there
        if (unanswered_since_[i] != Clock::time_point::max() && observed - unanswered_since_[i] >= allowance(i) &&
            silent.empty())
          silent = c_.cluster_->view.daemons()[i].node();
      }
      lock.lock();
      if (!silent.empty() && stalled_.empty() && running_) {
        stalled_ = silent;
        for (size_t i = 0; i < silence_.size(); ++i)
          if (c_.cluster_->view.daemons()[i].node() == silent)
            allowed_ = strCat(allowance(i).count(), " ms, ",
                              !prepared_[i]             ? "the peer timeout of a Prepare"
                              : silence_[i] < c_.lease_ ? "the sync's replica deadline"
                                                        : "the sync's lease");
        lock.unlock();
        spdlog::warn("sync {}: node \"{}\" has not answered in time: giving the sync up", c_.id_, silent);
        c_.giveUp(strCat("node \"", silent, "\" stopped answering"), silent);
        lock.lock();
      }
    }
  }

  // How long daemon i may stay silent now.
  std::chrono::milliseconds allowance(size_t i) const {
    return prepared_[i] ? silence_[i] : std::min(silence_[i], unprepared_);
  }

  SyncCoordinator& c_;
  std::vector<Clock::time_point> answered_;          // per daemon: its last answer (the sync's start before one)
  std::vector<Clock::time_point> unanswered_since_;  // per daemon: since when it is silent (max: it answered)
  std::vector<std::chrono::milliseconds> silence_;   // per daemon: how long it may stay silent
  std::chrono::milliseconds unprepared_{0};          // a folded sync: before its attempt is open there
  std::vector<bool> prepared_;                       // per daemon: it answered for the open attempt
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool running_ = true;
  CallSet polling_;  // the calls of the poll in flight
  std::string stalled_;
  std::string allowed_;
  std::thread thread_;
};

}  // namespace shardcast::daemon
