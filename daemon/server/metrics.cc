#include "daemon/server/metrics.h"

#include <httplib.h>

#include <cerrno>
#include <cstring>
#include <sstream>

#include "common/strings.h"

namespace shardcast::daemon {

std::string Metrics::render() const {
  std::ostringstream o;
  auto metric = [&](const char* name, const char* type, const char* help) {
    o << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n";
  };
  metric("shardcast_syncs_total", "counter", "Syncs coordinated by this daemon, by outcome.");
  o << "shardcast_syncs_total{outcome=\"committed\"} " << syncs_ok << "\n";
  o << "shardcast_syncs_total{outcome=\"failed\"} " << syncs_failed << "\n";
  metric("shardcast_sync_duration_seconds", "summary", "Duration of committed syncs coordinated by this daemon.");
  o << "shardcast_sync_duration_seconds_sum " << static_cast<double>(sync_micros_sum) / 1e6 << "\n";
  o << "shardcast_sync_duration_seconds_count " << syncs_ok << "\n";
  metric("shardcast_bytes_sent_total", "counter", "Bytes this daemon sent over the network (sources and relays).");
  o << "shardcast_bytes_sent_total " << moved.bytes_sent << "\n";
  metric("shardcast_bytes_received_total", "counter", "Bytes that landed on this daemon over the network.");
  o << "shardcast_bytes_received_total " << moved.bytes_received << "\n";
  metric("shardcast_bytes_landed_direct_total", "counter",
         "Of the bytes received: written by peers straight into destination rank buffers (no unpack copy).");
  o << "shardcast_bytes_landed_direct_total " << moved.bytes_landed_direct << "\n";
  metric("shardcast_local_bytes_total", "counter", "Bytes copied node-locally into destination ranks.");
  o << "shardcast_local_bytes_total " << moved.local_bytes << "\n";
  metric("shardcast_device_fanout_bytes_total", "counter",
         "Of the local bytes: copied GPU to GPU from a local rank that received the same box first.");
  o << "shardcast_device_fanout_bytes_total " << moved.device_fanout_bytes << "\n";
  metric("shardcast_chunks_landed_total", "counter", "Chunks that landed on this daemon, by encoding (docs/delta.md).");
  o << "shardcast_chunks_landed_total{encoding=\"dense\"} " << moved.dense_chunks << "\n";
  o << "shardcast_chunks_landed_total{encoding=\"delta\"} " << moved.delta_chunks << "\n";
  metric("shardcast_delta_base_bytes", "gauge",
         "Host memory holding the bytes this daemon last sent, as bases of delta syncs (at most --delta-cache-mib).");
  o << "shardcast_delta_base_bytes " << (delta_base_bytes ? delta_base_bytes() : 0) << "\n";
  metric("shardcast_delta_base_capacity_bytes", "gauge", "--delta-cache-mib, in bytes.");
  o << "shardcast_delta_base_capacity_bytes " << (delta_base_capacity ? delta_base_capacity() : 0) << "\n";
  metric("shardcast_plan_cache_hits_total", "counter", "Syncs whose plan came from the cache.");
  o << "shardcast_plan_cache_hits_total " << (plan_cache_hits ? plan_cache_hits() : 0) << "\n";
  metric("shardcast_registered_bytes", "gauge", "Bytes of rank memory registered with this daemon.");
  o << "shardcast_registered_bytes " << (registered_bytes ? registered_bytes() : 0) << "\n";
  metric("shardcast_registered_ranks", "gauge", "Ranks registered with this daemon.");
  o << "shardcast_registered_ranks " << (registered_ranks ? registered_ranks() : 0) << "\n";
  metric("shardcast_ranks", "gauge", "Ranks registered with this daemon, by state (see docs/daemon.md).");
  std::map<std::string, uint64_t> states{{"empty", 0}, {"updating", 0}, {"ready", 0}, {"dirty", 0}};
  if (rank_states)
    for (const auto& [state, n] : rank_states()) states[state] = n;
  for (const auto& [state, n] : states) o << "shardcast_ranks{state=\"" << state << "\"} " << n << "\n";
  metric("shardcast_syncs_expired_total", "counter",
         "Syncs aborted here because their coordinator went silent (lease).");
  o << "shardcast_syncs_expired_total " << syncs_expired << "\n";
  metric("shardcast_sessions_ended_total", "counter", "Client sessions that ended, their ranks unregistered.");
  o << "shardcast_sessions_ended_total " << sessions_ended << "\n";
  return o.str();
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
  s->thread_ = std::thread([srv = s->server_.get()] { srv->listen_after_bind(); });
  return s;
}

MetricsServer::~MetricsServer() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace shardcast::daemon
