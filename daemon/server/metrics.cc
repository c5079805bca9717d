#include "daemon/server/metrics.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <prometheus/text_serializer.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <string_view>
#include <thread>

#include "common/defaults.h"
#include "common/fd_passing.h"
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

Metrics::Metrics(bool names)
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
                     .Add({})),
      waiting_(prometheus::BuildGauge()
                   .Name("shardcast_waits_in_flight")
                   .Help("Client calls waiting on this daemon now (WaitVersion, Acquire; syncs are "
                         "shardcast_syncs_in_flight).")
                   .Register(*registry_)
                   .Add({})),
      names_(names) {
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

std::string Metrics::label(const std::string& name) const {
  if (names_) return name;
  return fmt::format("h{:016x}", XXH64(name.data(), name.size(), 0));
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

void Metrics::peerFailed(const std::string& node) { peer_failures_->Add({{"peer", label(node)}}).Increment(); }

void Metrics::replicaSetSynced(const std::string& set, size_t committed, size_t cut) {
  set_replicas_->Add({{"set", label(set)}}).Set(static_cast<double>(committed));
  replicas_cut_->Add({{"set", label(set)}}).Increment(static_cast<double>(cut));
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

namespace {

// A family of one value, without labels.
void addCounter(std::vector<prometheus::MetricFamily>& families, const char* name, const char* help, double value) {
  families.push_back(family(name, help, prometheus::MetricType::Counter));
  add(families.back(), value);
}
void addGauge(std::vector<prometheus::MetricFamily>& families, const char* name, const char* help, double value) {
  families.push_back(family(name, help, prometheus::MetricType::Gauge));
  add(families.back(), value);
}

// A figure read at scrape time (0 while nothing provides it).
double readNow(const std::function<uint64_t()>& f) { return f ? static_cast<double>(f()) : 0.0; }

// What the syncs that ran here moved, and what they reused: delta bases and cached plans.
void addTrafficFamilies(std::vector<prometheus::MetricFamily>& families, const Metrics& metrics) {
  const SyncCounters m = metrics.moved.load();
  addCounter(families, "shardcast_bytes_sent_total", "Bytes this daemon sent over the network (sources and relays).",
             static_cast<double>(m.bytes_sent));
  addCounter(families, "shardcast_bytes_received_total", "Bytes that landed on this daemon over the network.",
             static_cast<double>(m.bytes_received));
  addCounter(families, "shardcast_bytes_landed_direct_total",
             "Of the bytes received: written by peers straight into destination rank buffers (no unpack copy).",
             static_cast<double>(m.bytes_landed_direct));
  addCounter(families, "shardcast_local_bytes_total", "Bytes copied node-locally into destination ranks.",
             static_cast<double>(m.local_bytes));
  addCounter(families, "shardcast_device_fanout_bytes_total",
             "Of the local bytes: copied GPU to GPU from a local rank that received the same box first.",
             static_cast<double>(m.device_fanout_bytes));
  families.push_back(family("shardcast_chunks_landed_total",
                            "Chunks that landed on this daemon, by encoding (docs/delta.md).",
                            prometheus::MetricType::Counter));
  add(families.back(), static_cast<double>(m.dense_chunks), {{"encoding", "dense"}});
  add(families.back(), static_cast<double>(m.delta_chunks), {{"encoding", "delta"}});
  addGauge(families, "shardcast_delta_base_bytes",
           "Host memory holding the bytes this daemon last sent, as bases of delta syncs (at most --delta-cache-mib).",
           readNow(metrics.delta_base_bytes));
  addGauge(families, "shardcast_delta_base_capacity_bytes", "--delta-cache-mib, in bytes.",
           readNow(metrics.delta_base_capacity));
  addCounter(families, "shardcast_plan_cache_hits_total", "Syncs whose plan came from the cache.",
             readNow(metrics.plan_cache_hits));
  addCounter(families, "shardcast_plan_cache_misses_total",
             "Syncs that planned (no cached plan of their layouts and key).", readNow(metrics.plan_cache_misses));
}

// What is registered here: bytes, ranks by state, and per group its version and ranks by state.
void addRegistryFamilies(std::vector<prometheus::MetricFamily>& families, const Metrics& metrics,
                         const std::map<std::string, Metrics::GroupFigures>& by_group) {
  using prometheus::MetricType;
  addGauge(families, "shardcast_registered_bytes", "Bytes of rank memory registered with this daemon.",
           readNow(metrics.registered_bytes));
  addGauge(families, "shardcast_registered_ranks", "Ranks registered with this daemon.",
           readNow(metrics.registered_ranks));
  families.push_back(
      family("shardcast_ranks", "Ranks registered with this daemon, by state (docs/daemon.md).", MetricType::Gauge));
  std::map<std::string, uint64_t> states{{"empty", 0}, {"updating", 0}, {"ready", 0}, {"dirty", 0}};
  if (metrics.rank_states)
    for (const auto& [state, n] : metrics.rank_states()) states[state] = n;
  for (const auto& [state, n] : states) add(families.back(), static_cast<double>(n), {{"state", state}});
  families.push_back(family("shardcast_group_version",
                            "Per group registered here: the version its ranks here last committed (destination) or "
                            "published (source); the lowest of them, 0 when one has none yet.",
                            MetricType::Gauge));
  for (const auto& [group, g] : by_group)
    add(families.back(), static_cast<double>(g.version), {{"group", metrics.label(group)}, {"role", g.role}});
  families.push_back(
      family("shardcast_group_ranks", "Per group registered here: its ranks here by state.", MetricType::Gauge));
  for (const auto& [group, g] : by_group)
    for (const char* state : {"empty", "updating", "ready", "dirty"}) {
      const auto it = g.ranks.find(state);
      add(families.back(), static_cast<double>(it == g.ranks.end() ? 0 : it->second),
          {{"group", metrics.label(group)}, {"role", g.role}, {"state", state}});
    }
}

// Client sessions, the TLS certificate's expiry, and what ended here without a sync's end.
void addSessionFamilies(std::vector<prometheus::MetricFamily>& families, const Metrics& metrics) {
  addGauge(families, "shardcast_sessions_active",
           "Client sessions open on this daemon (their ranks live as long as they do).",
           readNow(metrics.sessions_active));
  if (metrics.certificate_expiry)
    if (const auto expiry = metrics.certificate_expiry(); expiry.ok())
      addGauge(families, "shardcast_tls_certificate_expiry_timestamp_seconds",
               "When this daemon's TLS certificate (--tls-cert) expires, in Unix seconds.",
               static_cast<double>(*expiry));
  addCounter(families, "shardcast_syncs_expired_total",
             "Syncs aborted here because their coordinator went silent (lease).",
             static_cast<double>(metrics.syncs_expired.load()));
  addCounter(families, "shardcast_sessions_ended_total", "Client sessions that ended, their ranks unregistered.",
             static_cast<double>(metrics.sessions_ended.load()));
}

}  // namespace

std::string Metrics::render() const {
  auto families = registry_->Collect();
  addTrafficFamilies(families, *this);
  const auto by_group = groups ? groups() : std::map<std::string, GroupFigures>{};
  addRegistryFamilies(families, *this, by_group);
  families.push_back(family("shardcast_group_version_lag",
                            "Per destination group registered here that a sync has reached: how many versions its "
                            "committed version here is behind its source: the version of the latest sync prepared "
                            "here into it (failed ones too), or the source's published version when its ranks are "
                            "registered here and newer.",
                            prometheus::MetricType::Gauge));
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
          {{"group", label(group)}, {"source", label(seen.source)}});
    }
  }
  families.push_back(family("shardcast_peer_up",
                            "Per peer node this daemon has reached: 1 while it is reachable (its connection up or "
                            "connectable, its last answer a success), 0 otherwise.",
                            prometheus::MetricType::Gauge));
  if (peers_up)
    for (const auto& [peer, up] : peers_up()) {
      add(families.back(), up ? 1 : 0, {{"peer", label(peer)}});
      peer_failures_->Add({{"peer", label(peer)}});  // at 0 from the start: increase() sees its first failure
    }
  addSessionFamilies(families, *this);
  return prometheus::TextSerializer().Serialize(families);
}

// ---- MetricsServer ----

struct MetricsServer::Connection {
  OwnedFd fd;           // closed as the connection is forgotten
  std::string request;  // the bytes read so far (request line and headers)
  std::string answer;   // to send; empty while reading or waiting for a render
  size_t sent = 0;
  bool head = false;       // a HEAD request: the answer's headers only
  bool rendering = false;  // waiting for the render thread
  std::chrono::steady_clock::time_point deadline;
};

namespace {

std::string httpAnswer(int code, const char* reason, const std::string& type, const std::string& body, bool head) {
  std::string out = strCat("HTTP/1.1 ", code, " ", reason, "\r\nContent-Type: ", type,
                           "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n");
  if (!head) out += body;
  return out;
}

std::string plain(int code, const char* reason, const std::string& body) {
  return httpAnswer(code, reason, "text/plain", body, false);
}

// Case-insensitive: does header line `line` name header `name` (lower case)?
bool isHeader(std::string_view line, std::string_view name) {
  if (line.size() <= name.size() || line[name.size()] != ':') return false;
  for (size_t i = 0; i < name.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(line[i])) != name[i]) return false;
  return true;
}

// A whole request's method and path (its query cut off), or the answer that refuses it: a
// malformed request line, or a body announced (no request here has one; it is refused before a
// byte of it is read).
struct HttpRequest {
  std::string_view method, path;
  std::string refusal;
};
HttpRequest parseRequest(std::string_view req) {
  const size_t line_end = req.find("\r\n");
  const std::string_view line = req.substr(0, line_end);
  const size_t sp1 = line.find(' '), sp2 = line.rfind(' ');
  if (sp1 == std::string_view::npos || sp2 == sp1 || line.substr(sp2 + 1).rfind("HTTP/1.", 0) != 0)
    return {{}, {}, plain(400, "Bad Request", "bad request line\n")};
  HttpRequest out{line.substr(0, sp1), line.substr(sp1 + 1, sp2 - sp1 - 1), {}};
  out.path = out.path.substr(0, out.path.find('?'));
  for (size_t at = line_end + 2; at < req.size();) {
    const size_t end = req.find("\r\n", at);
    const std::string_view header = req.substr(at, end - at);
    if (header.empty()) break;
    if ((isHeader(header, "content-length") && header.find_first_not_of("0 \t", 15) != std::string_view::npos) ||
        isHeader(header, "transfer-encoding"))
      return {{}, {}, plain(413, "Payload Too Large", "requests here carry no body\n")};
    at = end + 2;
  }
  return out;
}

}  // namespace

StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::start(const std::string& host, int port,
                                                              const Metrics& metrics) {
  return start(host, port, metrics, Limits{});
}

StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::start(const std::string& host, int port, const Metrics& metrics,
                                                              Limits limits) {
  std::unique_ptr<MetricsServer> s(new MetricsServer(metrics, limits));
  const std::string where = strCat("metrics: cannot listen on ", host, ":", port, ": ");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), std::to_string(port).c_str(), &hints, &found);
      rc != 0)
    return absl::UnavailableError(strCat(where, ::gai_strerror(rc)));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> addresses(found, &::freeaddrinfo);
  // SO_REUSEADDR only, never SO_REUSEPORT: a second daemon on a taken port fails here instead of
  // sharing it (scrapes would go to either at random).
  s->listener_ = ::socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (s->listener_ < 0) return absl::UnavailableError(strCat(where, std::strerror(errno)));
  const int yes = 1;
  ::setsockopt(s->listener_, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  if (::bind(s->listener_, found->ai_addr, found->ai_addrlen) != 0 || ::listen(s->listener_, 128) != 0)
    return absl::UnavailableError(strCat(where, std::strerror(errno)));
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(s->listener_, reinterpret_cast<sockaddr*>(&bound), &len);
  s->port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                               : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  s->wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (s->wake_fd_ < 0) return absl::UnavailableError(strCat("metrics: eventfd: ", std::strerror(errno)));
  s->serve_thread_ = std::thread([m = s.get()] { m->serve(); });
  s->render_thread_ = std::thread([m = s.get()] { m->render(); });
  return s;
}

MetricsServer::~MetricsServer() {
  stopping_ = true;
  { std::lock_guard<std::mutex> lock(render_mu_); }
  render_cv_.notify_all();
  if (wake_fd_ >= 0) wake();
  if (serve_thread_.joinable()) serve_thread_.join();
  if (render_thread_.joinable()) render_thread_.join();
  if (listener_ >= 0) ::close(listener_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void MetricsServer::wake() const {
  const uint64_t one = 1;
  if (::write(wake_fd_, &one, sizeof(one)) < 0) {
    // The counter is full (EAGAIN): the poll thread is woken already.
  }
}

void MetricsServer::render() {
  std::unique_lock<std::mutex> lock(render_mu_);
  while (true) {
    render_cv_.wait(lock, [&] { return stopping_ || !to_render_.empty(); });
    if (stopping_) return;
    // Every scrape waiting now gets this one render: concurrent scrapes cost one.
    std::vector<uint64_t> ids;
    ids.swap(to_render_);
    lock.unlock();
    const std::string text = metrics_.render();
    lock.lock();
    for (uint64_t id : ids) rendered_[id] = text;
    wake();
  }
}

void MetricsServer::answer(uint64_t id, Connection& c) {
  const HttpRequest req = parseRequest(c.request);
  if (!req.refusal.empty()) {
    c.answer = req.refusal;
    return;
  }
  c.head = req.method == "HEAD";
  if (req.method != "GET" && !c.head) {
    c.answer = plain(405, "Method Not Allowed", "GET /metrics or /healthz\n");
  } else if (req.path == "/healthz") {
    const bool up = metrics_.serving.load();
    c.answer = httpAnswer(up ? 200 : 503, up ? "OK" : "Service Unavailable", "text/plain",
                          up ? "SERVING\n" : "NOT_SERVING\n", c.head);
  } else if (req.path == "/metrics") {
    c.rendering = true;
    {
      std::lock_guard<std::mutex> lock(render_mu_);
      to_render_.push_back(id);
    }
    render_cv_.notify_one();
  } else {
    c.answer = plain(404, "Not Found", "GET /metrics or /healthz\n");
  }
}

void MetricsServer::takeRendered(Connections& connections) {
  std::lock_guard<std::mutex> lock(render_mu_);
  for (auto& [id, text] : rendered_)
    if (const auto it = connections.find(id); it != connections.end() && it->second.rendering) {
      it->second.rendering = false;
      it->second.answer = httpAnswer(200, "OK", "text/plain; version=0.0.4", text, it->second.head);
    }
  rendered_.clear();
}

bool MetricsServer::exchange(uint64_t id, Connection& c) {
  if (!c.answer.empty()) {  // sending
    const ssize_t n = ::send(c.fd.get(), c.answer.data() + c.sent, c.answer.size() - c.sent, MSG_NOSIGNAL);
    if (n > 0) c.sent += static_cast<size_t>(n);
    return !((n < 0 && errno != EAGAIN && errno != EINTR) || c.sent == c.answer.size());
  }
  // Reading the request line and headers, never more than the limit.
  char buf[4096];
  const size_t room = limits_.max_request_bytes + 1 - c.request.size();
  const ssize_t n = ::recv(c.fd.get(), buf, std::min(sizeof(buf), room), 0);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return false;
  if (n < 0) return true;
  const size_t before = c.request.size();
  c.request.append(buf, static_cast<size_t>(n));
  const size_t from = before >= 3 ? before - 3 : 0;
  if (const size_t end = c.request.find("\r\n\r\n", from); end != std::string::npos) {
    c.request.resize(end + 4);
    c.deadline = std::chrono::steady_clock::now() + limits_.answer_time;
    answer(id, c);
  } else if (c.request.size() > limits_.max_request_bytes) {
    c.answer = plain(431, "Request Header Fields Too Large",
                     strCat("request line and headers are limited to ", limits_.max_request_bytes, " bytes\n"));
    c.deadline = std::chrono::steady_clock::now() + limits_.answer_time;
  }
  return true;
}

void MetricsServer::acceptConnections(Connections& connections, uint64_t& next_id) {
  while (true) {
    const int fd = ::accept4(listener_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE)
        spdlog::warn("metrics: cannot accept a connection: {}", std::strerror(errno));
      break;  // EAGAIN: all accepted
    }
    // At the limit the oldest connection makes room: silent ones cannot keep a probe out.
    if (connections.size() >= limits_.max_connections) connections.erase(connections.begin());
    Connection c;
    c.fd = OwnedFd(fd);
    c.deadline = std::chrono::steady_clock::now() + limits_.request_time;
    connections.emplace(next_id++, std::move(c));
  }
}

void MetricsServer::serve() {
  using Clock = std::chrono::steady_clock;
  Connections connections;
  uint64_t next_id = 1;
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;  // fds[i + 2]'s connection
  while (!stopping_) {
    takeRendered(connections);
    // Connections past their time are closed: a slow or silent client costs a slot for that long.
    const auto now = Clock::now();
    for (auto it = connections.begin(); it != connections.end();)
      it = now >= it->second.deadline ? connections.erase(it) : ++it;
    fds.clear();
    ids.clear();
    fds.push_back({listener_, POLLIN, 0});
    fds.push_back({wake_fd_, POLLIN, 0});
    auto next = now + std::chrono::seconds(1);
    for (const auto& [id, c] : connections) {
      const short events = c.rendering ? 0 : c.answer.empty() ? POLLIN : POLLOUT;
      fds.push_back({c.fd.get(), events, 0});
      ids.push_back(id);
      next = std::min(next, c.deadline);
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
    if (::poll(fds.data(), fds.size(), static_cast<int>(wait)) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("metrics: poll: {}", std::strerror(errno));
      break;
    }
    if (fds[1].revents) {
      uint64_t count = 0;
      if (::read(wake_fd_, &count, sizeof(count)) < 0) {
        // EAGAIN: woken already.
      }
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      if (fds[i + 2].revents == 0) continue;
      const auto it = connections.find(ids[i]);
      if (!exchange(it->first, it->second)) connections.erase(it);
    }
    if (fds[0].revents & POLLIN) acceptConnections(connections, next_id);
  }
}

}  // namespace shardcast::daemon
