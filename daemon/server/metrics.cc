#include "daemon/server/metrics.h"

#include <httplib.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "common/defaults.h"
#include "common/strings.h"

namespace shardcast::daemon {

namespace {

// Syncs take from milliseconds (a cached plan of a small model) to minutes (a 1T model's first).
const prometheus::Histogram::BucketBoundaries& durationBuckets() {
  static const prometheus::Histogram::BucketBoundaries b{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                                         2.5,   5,    10,    30,   60,  120,  300, 600};
  return b;
}

// A family of values read at scrape time: one metric per label value (or one without labels).
prometheus::MetricFamily family(std::string name, std::string help, prometheus::MetricType type) {
  return {std::move(name), std::move(help), type, {}};
}
void add(prometheus::MetricFamily& f, double value, std::vector<prometheus::ClientMetric::Label> labels = {}) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  if (f.type == prometheus::MetricType::Counter)
    m.counter.value = value;
  else
    m.gauge.value = value;
  f.metric.push_back(std::move(m));
}

}  // namespace

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      syncs_(&prometheus::BuildCounter()
                  .Name("shardcast_syncs_total")
                  .Help("Syncs coordinated by this daemon, by result (committed, failed).")
                  .Register(*registry_)),
      duration_(&prometheus::BuildHistogram()
                     .Name("shardcast_sync_duration_seconds")
                     .Help("Duration of syncs coordinated by this daemon, by result.")
                     .Register(*registry_)),
      phase_duration_(&prometheus::BuildHistogram()
                           .Name("shardcast_sync_phase_duration_seconds")
                           .Help("Duration of each phase of the syncs coordinated by this daemon, by phase (gather: "
                                 "describe the cluster; plan; prepare; execute: every wave; finish: the commit) and "
                                 "result (a failed sync: the phases it finished and the one it failed in).")
                           .Register(*registry_)),
      peer_failures_(&prometheus::BuildCounter()
                          .Name("shardcast_peer_failures_total")
                          .Help("Syncs coordinated by this daemon that failed at a node, by the node the failure "
                                "names (a peer, or this daemon's own).")
                          .Register(*registry_)),
      delta_saved_(prometheus::BuildCounter()
                       .Name("shardcast_delta_saved_bytes_total")
                       .Help("Network bytes the delta syncs coordinated by this daemon did not send: the dense "
                             "bytes of their plans less what crossed the wire (docs/delta.md).")
                       .Register(*registry_)
                       .Add({})),
      set_replicas_(&prometheus::BuildGauge()
                         .Name("shardcast_replica_set_replicas")
                         .Help("Per replica set this daemon synced into: the replicas its last committed sync "
                               "wrote.")
                         .Register(*registry_)),
      replicas_cut_(&prometheus::BuildCounter()
                         .Name("shardcast_replicas_cut_total")
                         .Help("Per replica set: replicas the syncs coordinated here left out (dead, silent, held, "
                               "incomplete or unlike the others; docs/daemon.md, \"Replica sets\").")
                         .Register(*registry_)),
      in_flight_(prometheus::BuildGauge()
                     .Name("shardcast_syncs_in_flight")
                     .Help("Syncs this daemon is coordinating now.")
                     .Register(*registry_)
                     .Add({})) {
  prometheus::BuildGauge()
      .Name("shardcast_build_info")
      .Help("The daemon's release (1 per daemon).")
      .Register(*registry_)
      .Add({{"version", kShardcastVersion}})
      .Set(1);
  for (const char* result : {"committed", "failed"}) {  // present from the first scrape, at zero
    syncs_->Add({{"result", result}});
    duration_->Add({{"result", result}}, durationBuckets());
  }
}

void Metrics::observePhases(const v1::SyncResponse& figures, const std::string& result, bool every) {
  const std::pair<const char*, double> phases[] = {{"gather", figures.gather_seconds()},
                                                   {"plan", figures.plan_seconds()},
                                                   {"prepare", figures.prepare_seconds()},
                                                   {"execute", figures.execute_seconds()},
                                                   {"finish", figures.finish_seconds()}};
  for (const auto& [phase, seconds] : phases)
    if (every || seconds > 0)
      phase_duration_->Add({{"phase", phase}, {"result", result}}, durationBuckets()).Observe(seconds);
}

void Metrics::syncCommitted(const v1::SyncResponse& figures) {
  syncs_->Add({{"result", "committed"}}).Increment();
  duration_->Add({{"result", "committed"}}, durationBuckets()).Observe(figures.seconds());
  observePhases(figures, "committed", true);
  if (figures.delta() != v1::DELTA_OFF && figures.network_bytes() > figures.wire_bytes())
    delta_saved_.Increment(static_cast<double>(figures.network_bytes() - figures.wire_bytes()));
}

void Metrics::peerFailed(const std::string& node) { peer_failures_->Add({{"peer", node}}).Increment(); }

void Metrics::replicaSetSynced(const std::string& set, size_t committed, size_t cut) {
  set_replicas_->Add({{"set", set}}).Set(static_cast<double>(committed));
  replicas_cut_->Add({{"set", set}}).Increment(static_cast<double>(cut));
}

void Metrics::syncFailed(double seconds, const v1::SyncResponse& figures) {
  syncs_->Add({{"result", "failed"}}).Increment();
  duration_->Add({{"result", "failed"}}, durationBuckets()).Observe(seconds);
  observePhases(figures, "failed", false);
}

void Metrics::sourceVersionSeen(const std::string& group, const std::string& source, uint64_t version) {
  // The latest, not the highest: a job restarted from an older checkpoint syncs lower versions.
  std::lock_guard<std::mutex> lock(sources_mu_);
  sources_[group] = {source, version};
}

std::string Metrics::render() const {
  using prometheus::MetricType;
  auto families = registry_->Collect();
  auto read = [](const std::function<uint64_t()>& f) { return f ? static_cast<double>(f()) : 0.0; };
  const SyncCounters m = moved.load();
  auto counter = [&](const char* name, const char* help, double value) {
    families.push_back(family(name, help, MetricType::Counter));
    add(families.back(), value);
  };
  auto gauge = [&](const char* name, const char* help, double value) {
    families.push_back(family(name, help, MetricType::Gauge));
    add(families.back(), value);
  };
  counter("shardcast_bytes_sent_total", "Bytes this daemon sent over the network (sources and relays).",
          static_cast<double>(m.bytes_sent));
  counter("shardcast_bytes_received_total", "Bytes that landed on this daemon over the network.",
          static_cast<double>(m.bytes_received));
  counter("shardcast_bytes_landed_direct_total",
          "Of the bytes received: written by peers straight into destination rank buffers (no unpack copy).",
          static_cast<double>(m.bytes_landed_direct));
  counter("shardcast_local_bytes_total", "Bytes copied node-locally into destination ranks.",
          static_cast<double>(m.local_bytes));
  counter("shardcast_device_fanout_bytes_total",
          "Of the local bytes: copied GPU to GPU from a local rank that received the same box first.",
          static_cast<double>(m.device_fanout_bytes));
  families.push_back(family("shardcast_chunks_landed_total",
                            "Chunks that landed on this daemon, by encoding (docs/delta.md).", MetricType::Counter));
  add(families.back(), static_cast<double>(m.dense_chunks), {{"encoding", "dense"}});
  add(families.back(), static_cast<double>(m.delta_chunks), {{"encoding", "delta"}});
  gauge("shardcast_delta_base_bytes",
        "Host memory holding the bytes this daemon last sent, as bases of delta syncs (at most --delta-cache-mib).",
        read(delta_base_bytes));
  gauge("shardcast_delta_base_capacity_bytes", "--delta-cache-mib, in bytes.", read(delta_base_capacity));
  counter("shardcast_plan_cache_hits_total", "Syncs whose plan came from the cache.", read(plan_cache_hits));
  counter("shardcast_plan_cache_misses_total", "Syncs that planned (no cached plan of their layouts and key).",
          read(plan_cache_misses));
  gauge("shardcast_registered_bytes", "Bytes of rank memory registered with this daemon.", read(registered_bytes));
  gauge("shardcast_registered_ranks", "Ranks registered with this daemon.", read(registered_ranks));
  families.push_back(
      family("shardcast_ranks", "Ranks registered with this daemon, by state (docs/daemon.md).", MetricType::Gauge));
  std::map<std::string, uint64_t> states{{"empty", 0}, {"updating", 0}, {"ready", 0}, {"dirty", 0}};
  if (rank_states)
    for (const auto& [state, n] : rank_states()) states[state] = n;
  for (const auto& [state, n] : states) add(families.back(), static_cast<double>(n), {{"state", state}});
  const auto by_group = groups ? groups() : std::map<std::string, GroupFigures>{};
  families.push_back(family("shardcast_group_version",
                            "Per group registered here: the version its ranks here last committed (destination) or "
                            "published (source); the lowest of them, 0 when one has none yet.",
                            MetricType::Gauge));
  for (const auto& [group, g] : by_group)
    add(families.back(), static_cast<double>(g.version), {{"group", group}, {"role", g.role}});
  families.push_back(
      family("shardcast_group_ranks", "Per group registered here: its ranks here by state.", MetricType::Gauge));
  for (const auto& [group, g] : by_group)
    for (const char* state : {"empty", "updating", "ready", "dirty"}) {
      const auto it = g.ranks.find(state);
      add(families.back(), static_cast<double>(it == g.ranks.end() ? 0 : it->second),
          {{"group", group}, {"role", g.role}, {"state", state}});
    }
  families.push_back(family("shardcast_group_version_lag",
                            "Per destination group registered here that a sync has reached: how many versions its "
                            "committed version here is behind its source: the version of the latest sync prepared "
                            "here into it (failed ones too), or the source's published version when its ranks are "
                            "registered here and newer.",
                            MetricType::Gauge));
  {
    std::lock_guard<std::mutex> lock(sources_mu_);
    for (auto it = sources_.begin(); it != sources_.end();) {  // groups gone from here are forgotten
      if (by_group.count(it->first))
        ++it;
      else
        it = sources_.erase(it);
    }
    for (const auto& [group, seen] : sources_) {
      const auto dst = by_group.find(group);
      if (dst->second.role != "destination") continue;
      uint64_t newest = seen.version;
      if (const auto src = by_group.find(seen.source); src != by_group.end() && src->second.role == "source")
        newest = std::max(newest, src->second.version);
      add(families.back(), static_cast<double>(newest > dst->second.version ? newest - dst->second.version : 0),
          {{"group", group}, {"source", seen.source}});
    }
  }
  families.push_back(family("shardcast_peer_up",
                            "Per peer node this daemon has reached: 1 while it is reachable (its connection up or "
                            "connectable, its last answer a success), 0 otherwise.",
                            MetricType::Gauge));
  if (peers_up)
    for (const auto& [peer, up] : peers_up()) {
      add(families.back(), up ? 1 : 0, {{"peer", peer}});
      peer_failures_->Add({{"peer", peer}});  // at 0 from the start: increase() sees its first failure
    }
  gauge("shardcast_sessions_active", "Client sessions open on this daemon (their ranks live as long as they do).",
        read(sessions_active));
  if (certificate_expiry)
    if (const auto expiry = certificate_expiry(); expiry.ok())
      gauge("shardcast_tls_certificate_expiry_timestamp_seconds",
            "When this daemon's TLS certificate (--tls-cert) expires, in Unix seconds.", static_cast<double>(*expiry));
  counter("shardcast_syncs_expired_total", "Syncs aborted here because their coordinator went silent (lease).",
          static_cast<double>(syncs_expired.load()));
  counter("shardcast_sessions_ended_total", "Client sessions that ended, their ranks unregistered.",
          static_cast<double>(sessions_ended.load()));
  return prometheus::TextSerializer().Serialize(families);
}

StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::start(const std::string& host, int port,
                                                              const Metrics& metrics) {
  std::unique_ptr<MetricsServer> s(new MetricsServer());
  s->server_ = std::make_unique<httplib::Server>();
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, with which a second daemon on a taken
  // port bound it too and scrapes went to either at random.
  s->server_->set_socket_options([](socket_t sock) {
    const int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  s->server_->Get("/metrics", [&metrics](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics.render(), "text/plain; version=0.0.4");
  });
  s->server_->Get("/healthz", [&metrics](const httplib::Request&, httplib::Response& res) {
    const bool up = metrics.serving.load();
    res.status = up ? 200 : 503;
    res.set_content(up ? "SERVING\n" : "NOT_SERVING\n", "text/plain");
  });
  s->port_ = port == 0 ? s->server_->bind_to_any_port(host) : (s->server_->bind_to_port(host, port) ? port : -1);
  if (s->port_ <= 0)  // errno: of the bind or listen that failed (httplib closes the socket after it)
    return absl::UnavailableError(strCat("metrics: cannot listen on ", host, ":", port, ": ", std::strerror(errno)));
  s->thread_ = std::thread([srv = s->server_.get(), done = &s->listened_] {
    srv->listen_after_bind();
    *done = true;
  });
  return s;
}

MetricsServer::~MetricsServer() {
  if (server_ && thread_.joinable()) {
    // httplib's stop() does nothing until the listening thread has marked the server running: a
    // daemon that stopped right after starting (its gRPC port taken) hung in the join below.
    while (!listened_ && !server_->is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    server_->stop();
  }
  if (thread_.joinable()) thread_.join();
}

}  // namespace shardcast::daemon
