#include "daemon/service.h"

#include <atomic>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <atomic>
#include <condition_variable>
#include <set>
#include <mutex>
#include <functional>
#include <thread>

#include "common/strings.h"
#include "planner/limits.h"
#include "planner/plan.h"
#include "planner/report.h"

namespace shardcast::daemon {

ShardcastService::ShardcastService(const DaemonConfig& config, const AccessPolicy& access, Registry& registry,
                                   PeerSet& peers, SyncEngine& engine, Metrics& metrics, std::string transport)
    : config_(config), access_(access), registry_(registry), peers_(peers), engine_(engine), metrics_(metrics),
      transport_(std::move(transport)) {}

std::string ShardcastService::selfAddress() const {
  if (config_.listen.empty()) return "unix:" + config_.socket;
  const auto colon = config_.listen.rfind(':');
  const std::string host = config_.listen.substr(0, colon);
  return (host == "0.0.0.0" || host == "[::]" ? "127.0.0.1" : host) + config_.listen.substr(colon);
}

StatusOr<std::pair<ClusterView, std::vector<std::string>>> ShardcastService::clusterWithAddresses() {
  SC_ASSIGN_OR_RETURN(auto peers, peers_.describeAll());
  SC_ASSIGN_OR_RETURN(auto view, ClusterView::build(registry_.describe(), peers));
  std::vector<std::string> addresses{selfAddress()};
  for (const auto& p : peers) addresses.push_back(p.address);
  return std::make_pair(std::move(view), std::move(addresses));
}

shardcast::Status ShardcastService::checkVersions(const ClusterView& view, const std::string& src, const std::string& dst,
                                                  uint64_t version) const {
  // Destinations first: a replayed old sync is told so, whatever its sources hold now.
  for (const auto& d : view.daemons())
    for (const auto& r : d.ranks())
      if (r.group() == dst && (r.state() == v1::RANK_READY || r.state() == v1::RANK_DIRTY) && r.version() >= version)
        return absl::FailedPreconditionError(strCat("sync: group \"", dst, "\" rank ", r.rank(), " on node \"", d.node(),
                                                    "\" is at version ", r.version(), ": version ", version, " is not newer"));
  for (const auto& d : view.daemons())
    for (const auto& r : d.ranks()) {
      const std::string who = strCat("group \"", r.group(), "\" rank ", r.rank(), " on node \"", d.node(), "\"");
      if (r.group() == src && r.state() == v1::RANK_UPDATING)
        return absl::FailedPreconditionError(strCat("sync: ", who, " is being written by its owner (acquired, not published)"));
      if (r.group() == src && (r.state() != v1::RANK_READY || r.version() != version))
        return absl::FailedPreconditionError(strCat("sync: ", who,
                                                    r.state() == v1::RANK_READY ? strCat(" published version ", r.version())
                                                                                : std::string(" has published no version"),
                                                    ", not ", version));
    }
  return absl::OkStatus();
}

std::string ShardcastService::firstSilent(const std::vector<std::string>& addresses,
                                          const std::vector<v1::DescribeResponse>& daemons) {
  std::vector<grpc::Status> st(addresses.size());
  std::vector<std::thread> asks;
  for (size_t i = 0; i < addresses.size(); ++i)
    asks.emplace_back([&, i] {
      grpc::ClientContext c;
      c.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(std::min(config_.peer_timeout_ms, 1000)));
      v1::ProgressRequest pr;  // the cheapest call: answers NOT_FOUND once the sync is gone
      pr.set_sync_id("");
      v1::ProgressResponse r;
      st[i] = v1::Peer::NewStub(peers_.channel(addresses[i]))->Progress(&c, pr, &r);
    });
  for (auto& t : asks) t.join();
  for (size_t i = 0; i < addresses.size(); ++i)
    if (st[i].error_code() == grpc::StatusCode::UNAVAILABLE || st[i].error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
      return daemons[i].node();
  return "";
}

uint64_t ShardcastService::newFence() {
  std::lock_guard<std::mutex> lock(fence_mu_);
  uint64_t f = 0;
  while (f == 0) f = fence_rng_();
  return f;
}

grpc::Status ShardcastService::Sync(grpc::ServerContext* ctx, const v1::SyncRequest* req, v1::SyncResponse* out) {
  const auto caller = access_.client(*ctx);
  if (!caller.ok()) return toGrpc(caller.status());
  if (auto sized = planner::checkStringLengths(*req); !sized.ok()) return toGrpc(sized);
  const grpc::Status st = coordinate(*req, out);
  if (st.ok()) {
    ++metrics_.syncs_ok;
    metrics_.sync_micros_sum += static_cast<uint64_t>(out->seconds() * 1e6);
  } else {
    ++metrics_.syncs_failed;
  }
  return st;
}

grpc::Status ShardcastService::coordinate(const v1::SyncRequest& request, v1::SyncResponse* out) {
  const v1::SyncRequest* req = &request;
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  if (req->src_group().empty() || req->dst_group().empty() || req->src_group() == req->dst_group())
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "sync: give two different groups (src_group, dst_group)");
  if (req->version() == 0 || req->version() >= kMaxVersion)
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        strCat("sync: version ", req->version(), " is not in [1, 2^63)"));
  // A client's sync id travels in the daemons' notifications (space-separated lines).
  const bool id_ok = req->sync_id().size() <= 128 && std::all_of(req->sync_id().begin(), req->sync_id().end(), [](char c) {
                       return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' || c == ':';
                     });
  if (!id_ok)
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "sync: sync_id must be at most 128 characters of letters, digits and - _ . :");
  const uint32_t timeout_ms = req->options().timeout_ms() ? req->options().timeout_ms() : 300000;
  const auto deadline = start + std::chrono::milliseconds(timeout_ms);

  const std::string id =
      req->sync_id().empty() ? strCat(config_.node, "-", registry_.instance().substr(0, 8), "-", next_sync_++, "-v", req->version())
                             : req->sync_id();
  // Daemons tell the attempts of one id apart by their fence; a client that reuses the id of a
  // sync still running here is refused outright.
  if (!progress_.start(id))
    return grpc::Status(grpc::StatusCode::ALREADY_EXISTS, strCat("sync: a sync with id \"", id, "\" is still running on node \"",
                                                                 config_.node, "\""));
  const uint64_t fence = newFence();
  auto gather_failed = [&](const shardcast::Status& st) {
    progress_.update(id, [&](v1::SyncProgress& p) {
      p.set_state("failed");
      p.set_error(std::string(st.message()));
    });
    return toGrpc(st);
  };
  // Gather: both groups complete across the cluster (or wait for them, if asked).
  StatusOr<std::pair<ClusterView, std::vector<std::string>>> cluster = absl::UnknownError("");
  StatusOr<v1::Layout> src = absl::UnknownError(""), dst = absl::UnknownError("");
  while (true) {
    cluster = clusterWithAddresses();
    if (cluster.ok()) {
      src = cluster->first.completeGroup(req->src_group());
      dst = cluster->first.completeGroup(req->dst_group());
      // Roles are not worth waiting for: a wrong one is the caller's mistake.
      if (src.ok() && cluster->first.role(req->src_group()) != v1::ROLE_SOURCE)
        return gather_failed(absl::FailedPreconditionError(
            strCat("sync: group \"", req->src_group(), "\" is registered as a destination; a sync reads only source groups")));
      if (dst.ok() && cluster->first.role(req->dst_group()) != v1::ROLE_DESTINATION)
        return gather_failed(absl::FailedPreconditionError(strCat(
            "sync: group \"", req->dst_group(), "\" is registered as a source; a sync writes only destination groups (refusing to "
            "overwrite it)")));
    }
    const shardcast::Status st = !cluster.ok() ? cluster.status() : !src.ok() ? src.status() : dst.status();
    if (st.ok()) {
      // The version contract, as the daemons described it (each daemon checks again, atomically,
      // when it prepares): fail before preparing anything, naming the rank.
      if (auto contract = checkVersions(cluster->first, req->src_group(), req->dst_group(), req->version()); !contract.ok())
        return gather_failed(contract);
      break;
    }
    if (!req->options().wait_for_ranks() || Clock::now() + std::chrono::milliseconds(100) > deadline) return gather_failed(st);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  bool cached = false;
  const uint64_t budget = static_cast<uint64_t>(config_.staging_mib) << 20;
  const uint64_t chunk_bytes = static_cast<uint64_t>(config_.chunk_mib) << 20;
  auto plan = engine_.plans().get(*src, *dst, budget, chunk_bytes, &cached);
  if (!plan.ok()) return gather_failed(plan.status());

  progress_.update(id, [&](v1::SyncProgress& p) {
    p.set_state("preparing");
    p.set_bytes_total(static_cast<uint64_t>((*plan)->plan.stats.network_bytes));
    p.set_waves(static_cast<uint32_t>((*plan)->waves));
    for (const auto& d : cluster->first.daemons()) {
      auto* n = p.add_nodes();
      n->set_node(d.node());
      n->set_state("pending");
    }
  });
  auto node_state = [&](size_t i, const std::string& state, const std::string& error = "") {
    progress_.update(id, [&](v1::SyncProgress& p) {
      p.mutable_nodes(static_cast<int>(i))->set_state(state);
      if (!error.empty()) p.mutable_nodes(static_cast<int>(i))->set_error(error);
      p.set_seconds(std::chrono::duration<double>(Clock::now() - start).count());
    });
  };
  auto sync_failed = [&](const shardcast::Status& st) {
    progress_.update(id, [&](v1::SyncProgress& p) {
      p.set_state("failed");
      p.set_error(std::string(st.message()));
      p.set_seconds(std::chrono::duration<double>(Clock::now() - start).count());
    });
    return toGrpc(st);
  };
  const auto& addresses = cluster->second;
  const auto& daemons = cluster->first.daemons();
  auto call_deadline = [&] { return std::chrono::system_clock::now() + (deadline - Clock::now()); };
  // Calls in flight to the daemons, cancelled when the sync is given up.
  std::mutex calls_mu;
  std::set<grpc::ClientContext*> calls;
  bool given_up = false;
  auto track = [&](grpc::ClientContext* c) {
    std::lock_guard<std::mutex> lock(calls_mu);
    if (given_up) c->TryCancel();
    calls.insert(c);
  };
  auto untrack = [&](grpc::ClientContext* c) {
    std::lock_guard<std::mutex> lock(calls_mu);
    calls.erase(c);
  };
  // Ends the sync on every daemon, in parallel (a stopped daemon costs one peer timeout, not one
  // per daemon); returns the failures of commits.
  std::atomic<bool> executed{false};
  auto finish_all = [&](bool commit, const std::string& reason) {
    std::vector<grpc::Status> results(addresses.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < addresses.size(); ++i)
      threads.emplace_back([&, i] {
        grpc::ClientContext c;
        c.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(config_.peer_timeout_ms));
        v1::FinishRequest f;
        f.set_sync_id(id);
        f.set_fence(fence);
        f.set_commit(commit);
        f.set_executed(executed);
        f.set_reason(reason);
        v1::FinishResponse r;
        results[i] = v1::Peer::NewStub(peers_.channel(addresses[i]))->Finish(&c, f, &r);
        if (results[i].ok() && r.ranks_size() > 0)  // what the sync left this node's ranks at, for Watch
          progress_.update(id, [&](v1::SyncProgress& p) {
            if (static_cast<int>(i) < p.nodes_size()) *p.mutable_nodes(static_cast<int>(i))->mutable_ranks() = r.ranks();
          });
      });
    for (auto& t : threads) t.join();
    return results;
  };
  auto give_up = [&](const std::string& reason) {
    {
      std::lock_guard<std::mutex> lock(calls_mu);
      if (given_up) return;
      given_up = true;
      for (auto* c : calls) c->TryCancel();
    }
    finish_all(false, reason);
  };

  auto seconds_since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  out->set_gather_seconds(seconds_since(start));
  const auto prepare_start = Clock::now();
  // Prepare every daemon: it plans (cached) and allocates where transfers land on it.
  v1::ExecuteRequest exec;
  exec.set_sync_id(id);
  exec.set_timeout_ms(timeout_ms);
  exec.set_verify(req->options().verify());
  exec.set_fence(fence);
  auto record = [&](size_t i, uint64_t received, uint64_t sent) {
    progress_.update(id, [&](v1::SyncProgress& p) {
      auto* n = p.mutable_nodes(static_cast<int>(i));
      n->set_bytes_received(std::max(n->bytes_received(), received));
      n->set_bytes_sent(std::max(n->bytes_sent(), sent));
      uint64_t total = 0;
      for (const auto& node : p.nodes()) total += node.bytes_received();
      p.set_bytes_done(total);
      p.set_seconds(std::chrono::duration<double>(Clock::now() - start).count());
    });
  };
  // From here on the daemons hold the sync under a lease this coordinator renews (Progress calls,
  // every quarter lease); a daemon that stops answering for a lease fails the sync, named.
  const auto lease = std::chrono::milliseconds(config_.sync_lease_ms);
  std::vector<Clock::time_point> answered(addresses.size(), Clock::now());
  std::mutex poll_mu;
  std::condition_variable poll_cv;
  bool polling = true;
  std::string stalled;  // the node that stopped answering, under poll_mu
  std::thread poller([&] {
    std::unique_lock<std::mutex> lock(poll_mu);
    const auto period = std::min(std::chrono::milliseconds(250), lease / 4);
    while (!poll_cv.wait_for(lock, period, [&] { return !polling; })) {
      lock.unlock();
      std::vector<std::thread> asks;
      std::vector<v1::ProgressResponse> got(addresses.size());
      std::vector<grpc::Status> st(addresses.size());
      for (size_t i = 0; i < addresses.size(); ++i)
        asks.emplace_back([&, i] {
          grpc::ClientContext c;
          c.set_deadline(std::chrono::system_clock::now() + std::max(period, lease / 2));
          v1::ProgressRequest pr;
          pr.set_sync_id(id);
          pr.set_fence(fence);
          st[i] = v1::Peer::NewStub(peers_.channel(addresses[i]))->Progress(&c, pr, &got[i]);
        });
      for (auto& t : asks) t.join();
      std::string silent;
      for (size_t i = 0; i < addresses.size(); ++i) {
        // NOT_FOUND: the daemon answers (the sync is not prepared there yet, or over).
        if (st[i].ok() || st[i].error_code() == grpc::StatusCode::NOT_FOUND) answered[i] = Clock::now();
        if (st[i].ok()) record(i, got[i].bytes_received(), got[i].bytes_sent());
        if (Clock::now() - answered[i] > lease && silent.empty()) silent = daemons[i].node();
      }
      lock.lock();
      if (!silent.empty() && stalled.empty() && polling) {
        stalled = silent;
        lock.unlock();
        spdlog::warn("sync {}: node \"{}\" has not answered for {} ms: giving the sync up", id, silent, lease.count());
        give_up(strCat("node \"", silent, "\" stopped answering"));
        lock.lock();
      }
    }
  });
  auto stop_poller = [&] {
    {
      std::lock_guard<std::mutex> lock(poll_mu);
      polling = false;
    }
    poll_cv.notify_all();
    if (poller.joinable()) poller.join();
  };
  struct OnExit {
    std::function<void()> fn;
    ~OnExit() { fn(); }
  } poller_stopped{stop_poller};
  auto stalled_node = [&] {
    std::lock_guard<std::mutex> lock(poll_mu);
    return stalled;
  };
  for (size_t i = 0; i < addresses.size(); ++i) {
    grpc::ClientContext c;
    c.set_deadline(call_deadline());
    v1::PrepareRequest p;
    p.set_lease_ms(static_cast<uint32_t>(lease.count()));
    p.set_fence(fence);
    p.set_sync_id(id);
    *p.mutable_src() = *src;
    *p.mutable_dst() = *dst;
    p.set_version(req->version());
    p.set_staging_bytes(budget);
    p.set_chunk_bytes(chunk_bytes);
    v1::PrepareResponse r;
    track(&c);
    const grpc::Status st = v1::Peer::NewStub(peers_.channel(addresses[i]))->Prepare(&c, p, &r);
    untrack(&c);
    if (!st.ok()) {
      const std::string node = stalled_node().empty() ? daemons[i].node() : stalled_node();
      const shardcast::Status failure = fromGrpc(st, strCat("sync ", id, ": prepare on node \"", node, "\""));
      give_up(std::string(failure.message()));
      stop_poller();
      return sync_failed(failure);
    }
    auto* n = exec.add_nodes();
    n->set_node(daemons[i].node());
    n->set_transport_address(daemons[i].transport_address());
    *n->mutable_targets() = r.targets();
  }

  out->set_prepare_seconds(seconds_since(prepare_start));
  const auto execute_start = Clock::now();
  // Execute every wave everywhere at once, waves in order; the first failure aborts the others.
  progress_.update(id, [](v1::SyncProgress& p) { p.set_state("executing"); });
  std::vector<grpc::Status> results(addresses.size());
  // Bytes of the waves each node has finished: the floor under what the poller reports.
  std::vector<uint64_t> done_received(addresses.size(), 0), done_sent(addresses.size(), 0);
  std::atomic<uint64_t> landed_direct{0};
  for (int32_t wave = 0; wave < (*plan)->waves; ++wave) {
    exec.set_wave(static_cast<uint32_t>(wave));
    std::vector<std::thread> threads;
    executed = true;
    for (size_t i = 0; i < addresses.size(); ++i)
      threads.emplace_back([&, i] {
        grpc::ClientContext c;
        c.set_deadline(call_deadline() + std::chrono::seconds(5));
        node_state(i, "executing");
        v1::ExecuteResponse part;
        track(&c);
        results[i] = v1::Peer::NewStub(peers_.channel(addresses[i]))->Execute(&c, exec, &part);
        untrack(&c);
        if (results[i].ok()) {
          done_received[i] += part.bytes_received();
          done_sent[i] += part.bytes_sent();
          landed_direct += part.bytes_landed_direct();
          record(i, done_received[i], done_sent[i]);
          if (wave + 1 == (*plan)->waves) node_state(i, "done");
        } else {
          node_state(i, results[i].error_code() == grpc::StatusCode::ABORTED ? "aborted" : "failed", results[i].error_message());
          give_up(strCat("node \"", daemons[i].node(), "\" failed: ", results[i].error_message()));  // once
        }
      });
    for (auto& t : threads) t.join();
    bool all_ok = true;
    for (const auto& r : results) all_ok = all_ok && r.ok();
    if (!all_ok) break;
    progress_.update(id, [&](v1::SyncProgress& p) { p.set_waves_done(static_cast<uint32_t>(wave + 1)); });
  }
  if (const std::string node = stalled_node(); !node.empty()) {
    stop_poller();
    return sync_failed(absl::UnavailableError(strCat("sync ", id, " failed: node \"", node, "\" stopped answering (for ",
                                                     lease.count(), " ms, the sync's lease)")));
  }
  // A node that failed because a peer vanished reports the peer; the peer itself may not answer
  // at all. Name the daemon that is gone when there is one (a quick Describe each).
  bool any_failed = false;
  for (const auto& r : results) any_failed = any_failed || !r.ok();
  if (any_failed) {
    const std::string gone = firstSilent(addresses, daemons);
    if (!gone.empty()) {
      stop_poller();
      std::string first;
      for (size_t i = 0; i < addresses.size() && first.empty(); ++i)
        if (!results[i].ok() && results[i].error_code() != grpc::StatusCode::ABORTED &&
            results[i].error_code() != grpc::StatusCode::CANCELLED)
          first = strCat(" (node \"", daemons[i].node(), "\": ", results[i].error_message(), ")");
      spdlog::warn("sync {} failed: node \"{}\" does not answer{}", id, gone, first);
      return sync_failed(absl::UnavailableError(strCat("sync ", id, " failed: node \"", gone, "\" does not answer", first)));
    }
  }
  for (size_t i = 0; i < addresses.size(); ++i) {
    if (results[i].ok() || results[i].error_code() == grpc::StatusCode::ABORTED ||
        results[i].error_code() == grpc::StatusCode::CANCELLED)
      continue;
    stop_poller();
    spdlog::warn("sync {} failed on node \"{}\": {}", id, daemons[i].node(), results[i].error_message());
    return sync_failed(fromGrpc(results[i], strCat("sync ", id, " failed on node \"", daemons[i].node(), "\"")));
  }
  for (size_t i = 0; i < addresses.size(); ++i)
    if (!results[i].ok()) {
      stop_poller();
      return sync_failed(fromGrpc(results[i], strCat("sync ", id, " failed on node \"", daemons[i].node(), "\"")));
    }
  out->set_execute_seconds(seconds_since(execute_start));
  const auto finish_start = Clock::now();
  const auto committed = finish_all(true, "");
  stop_poller();
  out->set_finish_seconds(seconds_since(finish_start));
  // A daemon that did not commit (it restarted, or its lease ran out) left its ranks DIRTY: the
  // sync failed there, whatever the others committed.
  for (size_t i = 0; i < addresses.size(); ++i)
    if (!committed[i].ok()) {
      spdlog::warn("sync {}: commit on node \"{}\" failed: {}", id, daemons[i].node(), committed[i].error_message());
      return sync_failed(fromGrpc(committed[i], strCat("sync ", id, ": commit on node \"", daemons[i].node(), "\"")));
    }
  progress_.update(id, [&](v1::SyncProgress& p) {
    p.set_state("committed");
    p.set_seconds(std::chrono::duration<double>(Clock::now() - start).count());
  });

  const auto& stats = (*plan)->plan.stats;
  out->set_sync_id(id);
  out->set_version(req->version());
  out->set_network_bytes(static_cast<uint64_t>(stats.network_bytes));
  out->set_local_bytes(static_cast<uint64_t>(stats.local_bytes));
  out->set_bytes_needed(static_cast<uint64_t>(stats.bytes_needed));
  out->set_seconds(std::chrono::duration<double>(Clock::now() - start).count());
  out->set_plan_cached(cached);
  out->set_bytes_landed_direct(landed_direct);
  out->set_waves(static_cast<uint32_t>((*plan)->waves));
  out->set_plan_summary_json(planner::renderJson((*plan)->plan, (*plan)->nodes, planner::CostModel{}));
  spdlog::info("sync {}: {} -> {} version {} committed in {:.3f} s", id, req->src_group(), req->dst_group(), req->version(),
               out->seconds());
  return grpc::Status::OK;
}

grpc::Status ShardcastService::Watch(grpc::ServerContext* context, const v1::WatchRequest* req,
                                     grpc::ServerWriter<v1::SyncProgress>* writer) {
  const auto caller = access_.client(*context);
  if (!caller.ok()) return toGrpc(caller.status());
  if (auto sized = planner::checkStringLengths(*req); !sized.ok()) return toGrpc(sized);
  const bool known = progress_.watch(req->sync_id(), std::chrono::seconds(5), [&](const v1::SyncProgress& p) {
    return !context->IsCancelled() && writer->Write(p);
  });
  if (!known)
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        strCat("sync \"", req->sync_id(), "\" is not coordinated by node \"", config_.node, "\""));
  return grpc::Status::OK;
}

grpc::Status ShardcastService::WaitVersion(grpc::ServerContext* ctx, const v1::WaitVersionRequest* req, v1::WaitVersionResponse* out) {
  const auto caller = access_.client(*ctx);
  if (!caller.ok()) return toGrpc(caller.status());
  if (auto sized = planner::checkStringLengths(*req); !sized.ok()) return toGrpc(sized);
  auto r = registry_.waitVersion(req->group(), req->version(), std::chrono::milliseconds(req->timeout_ms()));
  if (!r.ok()) return toGrpc(r.status());
  *out = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status ShardcastService::Acquire(grpc::ServerContext* context, const v1::AcquireRequest* req, v1::AcquireResponse* out) {
  const auto caller = access_.client(*context);
  if (!caller.ok()) return toGrpc(caller.status());
  if (auto sized = planner::checkStringLengths(*req); !sized.ok()) return toGrpc(sized);
  auto r = registry_.acquire(req->group(), req->rank(), caller->memory(access_.insecure()), std::chrono::milliseconds(req->timeout_ms() ? req->timeout_ms() : 30000),
                             [context] { return context->IsCancelled(); });
  if (!r.ok()) return toGrpc(r.status());
  *out->mutable_status() = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status ShardcastService::Release(grpc::ServerContext* ctx, const v1::ReleaseRequest* req, v1::ReleaseResponse* out) {
  const auto caller = access_.client(*ctx);
  if (!caller.ok()) return toGrpc(caller.status());
  if (auto sized = planner::checkStringLengths(*req); !sized.ok()) return toGrpc(sized);
  auto r = registry_.release(req->group(), req->rank(), req->version(), caller->memory(access_.insecure()));
  if (!r.ok()) return toGrpc(r.status());
  *out->mutable_status() = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status ShardcastService::Session(grpc::ServerContext* context, const v1::SessionRequest* req,
                                       grpc::ServerWriter<v1::SessionEvent>* writer) {
  const auto caller = access_.client(*context);
  if (!caller.ok()) return toGrpc(caller.status());
  if (auto sized = planner::checkStringLengths(*req); !sized.ok()) return toGrpc(sized);
  const std::string session = registry_.openSession(req->client());
  v1::SessionEvent ev;
  ev.set_session_id(session);
  ev.set_node(config_.node);
  if (writer->Write(ev)) {
    // Until the client goes (its process ends: the connection closes) or the daemon stops.
    // IsCancelled has no wake-up of its own in the synchronous API: look every 100 ms.
    std::unique_lock<std::mutex> lock(sessions_mu_);
    while (!sessions_cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stopping_ || context->IsCancelled(); })) {
    }
  }
  bool stopping;
  {
    std::lock_guard<std::mutex> lock(sessions_mu_);
    stopping = stopping_;
  }
  if (stopping) return grpc::Status(grpc::StatusCode::UNAVAILABLE, strCat("shardcastd on node \"", config_.node, "\" is stopping"));
  registry_.closeSession(session);
  ++metrics_.sessions_ended;
  return grpc::Status::OK;
}

void ShardcastService::stop() {
  {
    std::lock_guard<std::mutex> lock(sessions_mu_);
    stopping_ = true;
  }
  sessions_cv_.notify_all();
}

grpc::Status PeerService::Describe(grpc::ServerContext* ctx, const v1::DescribeRequest*, v1::DescribeResponse* out) {
  if (auto allowed = access_.peer(*ctx); !allowed.ok()) return toGrpc(allowed);
  *out = registry_.describe();
  for (auto& [address, node] : peers_.knownNodes()) (*out->mutable_peer_nodes())[address] = node;
  return grpc::Status::OK;
}

grpc::Status PeerService::Prepare(grpc::ServerContext* ctx, const v1::PrepareRequest* req, v1::PrepareResponse* out) {
  if (auto allowed = access_.peer(*ctx); !allowed.ok()) return toGrpc(allowed);
  if (auto sized = planner::checkStringLengths(*req); !sized.ok()) return toGrpc(sized);
  auto r = engine_.prepare(*req);
  if (!r.ok()) return toGrpc(r.status());
  *out = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status PeerService::Execute(grpc::ServerContext* ctx, const v1::ExecuteRequest* req, v1::ExecuteResponse* out) {
  if (auto allowed = access_.peer(*ctx); !allowed.ok()) return toGrpc(allowed);
  if (auto sized = planner::checkStringLengths(*req); !sized.ok()) return toGrpc(sized);
  auto r = engine_.execute(*req);
  if (!r.ok()) return toGrpc(r.status());
  *out = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status PeerService::Progress(grpc::ServerContext* ctx, const v1::ProgressRequest* req, v1::ProgressResponse* out) {
  if (auto allowed = access_.peer(*ctx); !allowed.ok()) return toGrpc(allowed);
  if (auto sized = planner::checkStringLengths(*req); !sized.ok()) return toGrpc(sized);
  auto r = engine_.progress(req->sync_id(), req->fence());
  if (!r.ok()) return toGrpc(r.status());
  *out = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status PeerService::Finish(grpc::ServerContext* ctx, const v1::FinishRequest* req, v1::FinishResponse* out) {
  if (auto allowed = access_.peer(*ctx); !allowed.ok()) return toGrpc(allowed);
  if (auto sized = planner::checkStringLengths(*req); !sized.ok()) return toGrpc(sized);
  auto r = engine_.finish(*req);
  if (!r.ok()) return toGrpc(r.status());
  *out = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status ShardcastService::Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req, v1::RegisterResponse* out) {
  const auto caller = access_.client(*ctx);
  if (!caller.ok()) return toGrpc(caller.status());
  if (auto sized = planner::checkStringLengths(*req); !sized.ok()) return toGrpc(sized);
  if (!caller->local && !access_.insecure())
    return toGrpc(absl::PermissionDeniedError(strCat(
        caller->who, ": ranks register over the Unix socket (the daemon checks that the memory is the caller's own)")));
  auto r = registry_.registerRank(*req, caller->memory(access_.insecure()));
  if (!r.ok()) {
    spdlog::warn("register refused: {}", std::string(r.status().message()));
    return toGrpc(r.status());
  }
  *out = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status ShardcastService::Unregister(grpc::ServerContext* ctx, const v1::UnregisterRequest* req, v1::UnregisterResponse*) {
  const auto caller = access_.client(*ctx);
  if (!caller.ok()) return toGrpc(caller.status());
  if (auto sized = planner::checkStringLengths(*req); !sized.ok()) return toGrpc(sized);
  return toGrpc(registry_.unregisterRank(req->group(), req->rank(), caller->memory(access_.insecure())));
}

StatusOr<ClusterView> ShardcastService::cluster() {
  SC_ASSIGN_OR_RETURN(auto c, clusterWithAddresses());
  return std::move(c.first);
}

grpc::Status ShardcastService::List(grpc::ServerContext* ctx, const v1::ListRequest* req, v1::ListResponse* out) {
  const auto caller = access_.client(*ctx);
  if (!caller.ok()) return toGrpc(caller.status());
  if (auto sized = planner::checkStringLengths(*req); !sized.ok()) return toGrpc(sized);
  for (auto& r : registry_.list()) *out->add_ranks() = std::move(r);
  if (!req->all_nodes()) return grpc::Status::OK;
  auto peers = peers_.describeAll();
  if (!peers.ok()) return toGrpc(peers.status());
  for (const auto& p : *peers) {
    if (!p.described.ok()) return toGrpc(p.described.status());
    for (const auto& r : p.described->ranks()) {
      auto* reg = out->add_ranks();
      reg->set_group(r.group());
      reg->set_rank(r.rank());
      reg->set_node(p.described->node());
      reg->set_layout_digest(r.layout_digest());
      reg->set_version(r.version());
      reg->set_state(r.state());
      reg->set_role(r.role());
      reg->set_held(r.held());
      uint64_t bytes = 0;
      for (const auto& b : r.buffers()) {
        bytes += b.size();
        reg->add_buffers(b.buffer());
      }
      reg->set_registered_bytes(bytes);
      for (const auto& l : p.described->layouts())
        if (l.group() == r.group()) {
          int64_t world = 1;
          for (int64_t s : l.mesh().shape()) world *= s;
          reg->set_world_size(static_cast<int32_t>(world));
        }
    }
  }
  return grpc::Status::OK;
}

grpc::Status ShardcastService::Plan(grpc::ServerContext* ctx, const v1::PlanRequest* req, v1::PlanResponse* out) {
  const auto caller = access_.client(*ctx);
  if (!caller.ok()) return toGrpc(caller.status());
  if (auto sized = planner::checkStringLengths(*req); !sized.ok()) return toGrpc(sized);
  auto view = cluster();
  if (!view.ok()) return toGrpc(view.status());
  auto src = view->completeGroup(req->src_group());
  if (!src.ok()) return toGrpc(src.status());
  auto dst = view->completeGroup(req->dst_group());
  if (!dst.ok()) return toGrpc(dst.status());
  planner::NodeTable nodes;
  auto rs = planner::resolveLayout(*src, nodes);
  if (!rs.ok()) return toGrpc(rs.status());
  auto rd = planner::resolveLayout(*dst, nodes);
  if (!rd.ok()) return toGrpc(rd.status());
  auto plan = planner::makePlan(*rs, *rd, nodes);
  if (!plan.ok()) return toGrpc(plan.status());
  planner::CostModel model;
  if (req->nic_gbps() < 0 || req->local_gbps() < 0)
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "nic_gbps and local_gbps must not be negative");
  if (req->nic_gbps() > 0) model.nic_gbps = req->nic_gbps();
  if (req->local_gbps() > 0) model.local_gbps = req->local_gbps();
  out->set_summary_json(planner::renderJson(*plan, nodes, model));
  out->set_summary_text(planner::renderText(*plan, nodes, model, rs->group, rd->group));
  return grpc::Status::OK;
}

grpc::Status ShardcastService::Status(grpc::ServerContext* ctx, const v1::StatusRequest*, v1::StatusResponse* out) {
  const auto caller = access_.client(*ctx);
  if (!caller.ok()) return toGrpc(caller.status());
  out->set_node(config_.node);
  out->set_version(kShardcastVersion);
  out->set_transport(transport_);
  out->set_registered_bytes(registry_.registeredBytes());
  out->set_registered_ranks(registry_.registeredRanks());
  out->set_uptime_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
  for (auto& g : registry_.groups()) *out->add_groups() = std::move(g);
  auto addrs = peers_.addresses();
  if (!addrs.ok()) {
    auto* p = out->add_peers();
    p->set_address(config_.peer_dns);
    p->set_error(std::string(addrs.status().message()));
    return grpc::Status::OK;
  }
  auto views = peers_.describeAll();
  for (const auto& a : *addrs) {
    auto* p = out->add_peers();
    p->set_address(a);
    bool found = false;
    if (views.ok())
      for (const auto& v : *views)
        if (v.address == a) {
          found = true;
          p->set_reachable(v.described.ok());
          if (v.described.ok()) p->set_node(v.described->node());
          else p->set_error(std::string(v.described.status().message()));
        }
    if (!found) {  // the address is this daemon itself
      p->set_reachable(true);
      p->set_node(config_.node);
    }
  }
  return grpc::Status::OK;
}

}  // namespace shardcast::daemon
