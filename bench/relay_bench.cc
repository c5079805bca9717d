// The coordinator at hundreds to a thousand daemons, over real gRPC. A child process serves N
// simulated daemons' Peer services (one gRPC server each, on its own port), and this process
// measures two things against them:
//
// - the fan-out (the default): it calls Finish on all N the way a coordinator does
//   (daemon/coordinator/relay.h), directly or through a tree of Relays (the daemons' own relay
//   code), and prints the best and median round and this process's CPU per round;
// - whole syncs (--whole-syncs): a real coordinating daemon (ShardcastService, SyncEngine and
//   Registry on the loopback transport, holding no ranks) runs Sync("trainer", "infer", V) over the
//   simulated daemons: the trainer's one rank on the first, one inference rank on each of the
//   others. The simulated daemons answer Describe with their ranks and layouts, Prepare with the
//   plan their own plan cache makes (every daemon plans the same plan; one cache in the child
//   plans it once), Execute, Progress and Finish at once: no bytes move. What is measured is the
//   coordinator's part of a sync: the gather, planning, each daemon's requests, every call round
//   and the lease renewals, its wall time and this process's CPU per sync.
//
// The simulated daemons share this machine's cores in one process: round times include their
// work, queued behind each other; the CPU figure is the coordinator's alone.
//
//   build/bin/relay_bench [--daemons "64 256 1024"] [--fanouts "0 16 32 64"] [--rounds 30]
//                         [--whole-syncs [--fold "auto never"] [--layouts DIR]]
// (--fold: the coordinator's --fold-prepare per row; the simulated inference ranks are double-
// buffered, so "auto" folds each repeated sync's Prepare into its first wave)
//
// --layouts DIR: whole syncs of the two layouts `plan_bench --write-layouts DIR` writes (a Kimi-K2-
// like MoE: DIR/trainer.json into DIR/inference.json) instead of the small model, one simulated
// daemon per node those layouts name, each describing its ranks with the buffers each holds; the
// daemon count is the layouts' (--daemons is ignored). Rows add the first sync's gather and
// prepare, and this process's peak RSS (the coordinator's memory, plus the bench's own few MB).
#include <absl/synchronization/mutex.h>
#include <arpa/inet.h>
#include <fmt/format.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "daemon/coordinator/cluster.h"
#include "daemon/coordinator/progress.h"
#include "daemon/coordinator/relay.h"
#include "daemon/engine/plan_cache.h"
#include "daemon/engine/sync_engine.h"
#include "daemon/registry/registry.h"
#include "daemon/server/access.h"
#include "daemon/server/config.h"
#include "daemon/server/metrics.h"
#include "daemon/server/service.h"
#include "planner/layout.h"
#include "shardcast/v1/service.grpc.pb.h"
#include "transport/transport.h"

using namespace shardcast;
using namespace shardcast::daemon;

namespace {

// One rank as a simulated daemon describes it: its group (0: the source, 1: the destination), its
// rank, and its buffers (name, bytes).
struct SimulatedRank {
  int group = 0;
  int32_t rank = 0;
  std::vector<std::pair<std::string, uint64_t>> buffers;
};

// What the simulated daemons of the child share: the two groups, each daemon's node and ranks, the
// version the destination ranks hold, and one plan cache.
struct SimulatedCluster {
  v1::Layout trainer, infer;
  std::string trainer_digest, infer_digest;
  std::vector<std::string> nodes;                 // per daemon
  std::vector<std::vector<SimulatedRank>> ranks;  // per daemon
  std::atomic<uint64_t> committed{0};             // the version the inference ranks hold (0: none yet)
  std::mutex mu;
  std::map<uint64_t, uint64_t> version_of;  // attempt fence -> the version it syncs
  PlanCache plans;
  std::mutex planning;  // held while a simulated daemon's Prepare asks `plans`

  // The small model: the trainer's one rank on daemon 0, inference rank i - 1 on daemon i.
  explicit SimulatedCluster(int n) {
    // A small model of a few tensors, every inference rank holding all of it (data parallel):
    // the plan is one source into n - 1 nodes, chains and all.
    trainer.set_group("trainer");
    trainer.mutable_mesh()->add_shape(1);
    trainer.add_nodes("sim-0");
    for (int t = 0; t < 8; ++t) {
      auto* tensor = trainer.add_tensors();
      tensor->set_name(fmt::format("layers.{}.weight", t));
      tensor->add_shape(256);
      tensor->add_shape(64);
      tensor->set_dtype("float32");
    }
    infer = trainer;
    infer.set_group("infer");
    infer.mutable_mesh()->set_shape(0, n - 1);
    infer.clear_nodes();
    for (int i = 1; i < n; ++i) infer.add_nodes(fmt::format("sim-{}", i));
    trainer_digest = planner::layoutDigest(trainer);
    infer_digest = planner::layoutDigest(infer);
    for (int i = 0; i < n; ++i) {
      nodes.push_back(fmt::format("sim-{}", i));
      SimulatedRank r{i == 0 ? 0 : 1, i == 0 ? 0 : i - 1, {}};
      for (const auto& t : trainer.tensors()) r.buffers.emplace_back(t.name(), 256 * 64 * 4);
      ranks.push_back({std::move(r)});
    }
  }

  // Two layouts (--layouts): a daemon per node they name, each with the ranks there and the
  // buffers each rank holds.
  SimulatedCluster(v1::Layout src, v1::Layout dst) : trainer(std::move(src)), infer(std::move(dst)) {
    trainer_digest = planner::layoutDigest(trainer);
    infer_digest = planner::layoutDigest(infer);
    planner::NodeTable table;
    const v1::Layout* layouts[2] = {&trainer, &infer};
    std::map<int32_t, size_t> daemon_of;  // node id -> daemon index
    for (int g = 0; g < 2; ++g) {
      auto resolved = planner::resolveLayout(*layouts[g], table);
      if (!resolved.ok()) {
        fmt::print(stderr, "relay_bench: {}\n", std::string(resolved.status().message()));
        std::_Exit(1);
      }
      for (int32_t rank = 0; rank < resolved->world(); ++rank) {
        const int32_t node = resolved->rank_node[rank];
        auto [it, added] = daemon_of.emplace(node, nodes.size());
        if (added) {
          nodes.push_back(table.name(node));
          ranks.emplace_back();
        }
        SimulatedRank r{g, rank, {}};
        for (const auto& [buffer, bytes] : resolved->rankBuffers(rank))
          r.buffers.emplace_back(resolved->buffer_names[buffer], static_cast<uint64_t>(bytes));
        ranks[it->second].push_back(std::move(r));
      }
    }
  }
  int size() const { return static_cast<int>(nodes.size()); }
};

// The cluster the child serves: the small model over `n` daemons, or the layouts in `dir`.
std::unique_ptr<SimulatedCluster> simulatedCluster(int n, const std::string& dir) {
  if (dir.empty()) return std::make_unique<SimulatedCluster>(n);
  v1::Layout layouts[2];
  const char* files[2] = {"trainer.json", "inference.json"};
  for (int g = 0; g < 2; ++g) {
    auto layout = planner::readLayoutFile(dir + "/" + files[g]);
    if (!layout.ok()) {
      fmt::print(stderr, "relay_bench: {} (write them with plan_bench --write-layouts {})\n",
                 std::string(layout.status().message()), dir);
      std::_Exit(1);
    }
    layouts[g] = std::move(*layout);
  }
  return std::make_unique<SimulatedCluster>(std::move(layouts[0]), std::move(layouts[1]));
}

// One simulated daemon: answers as a daemon holding its rank would, moving nothing; Relay relays,
// as a daemon does. The cluster's PeerSet exists once every server has its port.
class SimulatedPeer final : public v1::Peer::Service {
 public:
  SimulatedPeer(const std::unique_ptr<PeerSet>& peers, SimulatedCluster& cluster, int index)
      : peers_(peers), cluster_(cluster), index_(index), node_(cluster.nodes[index]) {}

  // As Registry::describe answers: each group's layout whole or by digest, or the layouts asked for.
  grpc::Status Describe(grpc::ServerContext*, const v1::DescribeRequest* req, v1::DescribeResponse* out) override {
    out->set_node(node_);
    out->set_instance(node_);
    out->set_generation(1);
    const v1::Layout* layouts[2] = {&cluster_.trainer, &cluster_.infer};
    const std::string* digests[2] = {&cluster_.trainer_digest, &cluster_.infer_digest};
    bool has[2] = {false, false};
    for (const auto& sim : cluster_.ranks[index_]) has[sim.group] = true;
    if (req->layouts_size() > 0) {
      for (int g = 0; g < 2; ++g)
        if (has[g] && std::find(req->layouts().begin(), req->layouts().end(), *digests[g]) != req->layouts().end())
          *out->add_layouts() = *layouts[g];
      return grpc::Status::OK;
    }
    out->set_transport_address("simulated");
    out->set_relays_call_parts(true);  // its Relay is the daemons' own code (relay.h)
    for (int g = 0; g < 2; ++g)
      if (has[g] && req->layout_digests())
        (*out->mutable_layout_digests())[layouts[g]->group()] = *digests[g];
      else if (has[g])
        *out->add_layouts() = *layouts[g];  // once per group and daemon
    const uint64_t held = cluster_.committed.load();
    for (const auto& sim : cluster_.ranks[index_]) {
      const bool source = sim.group == 0;
      const v1::Layout& layout = source ? cluster_.trainer : cluster_.infer;
      auto* r = out->add_ranks();
      r->set_group(layout.group());
      r->set_rank(sim.rank);
      r->set_layout_digest(source ? cluster_.trainer_digest : cluster_.infer_digest);
      for (const auto& [name, bytes] : sim.buffers) {
        auto* b = r->add_buffers();
        b->set_buffer(name);
        b->set_size(bytes);
      }
      r->set_role(source ? v1::ROLE_SOURCE : v1::ROLE_DESTINATION);
      r->set_double_buffered(!source);  // a repeated sync may fold its Prepare into its first wave (--fold)
      r->set_state(source || held > 0 ? v1::RANK_READY : v1::RANK_EMPTY);
      r->set_version(source ? held + 1 : held);  // the trainer has published the next version
    }
    return grpc::Status::OK;
  }
  grpc::Status Prepare(grpc::ServerContext*, const v1::PrepareRequest* req, v1::PrepareResponse* out) override {
    return prepare(req, out);
  }
  // As a daemon prepares (and a folded Execute first): the plan its own cache makes.
  grpc::Status prepare(const v1::PrepareRequest* req, v1::PrepareResponse* out) {
    for (const auto& stamp : req->expect())  // a sync that skipped the gather: registrations unchanged
      if (stamp.node() == node_ && (stamp.instance() != node_ || stamp.generation() != 1))
        return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "registrations changed");
    out->set_expect_checked(req->expect_size() > 0);
    const auto strategy = strategyOf(req->strategy(), req->delta());
    if (!strategy.ok())
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(strategy.status().message()));
    const auto key = PlanKey::forSync(req->staging_bytes(), req->chunk_bytes(), req->delta(), req->packed(), *strategy);
    bool hit = false;
    LayoutDigests digests;
    // One plans, the others find its plan: the cache would let every concurrent miss plan anew,
    // which on real daemons runs in parallel on machines of their own, and here on two cores.
    std::unique_lock<std::mutex> planning(cluster_.planning);
    const auto plan = cluster_.plans.forPrepare(*req, key, node_, &hit, &digests);
    planning.unlock();
    if (!plan.ok()) return toGrpc(plan.status());
    out->set_plan_key((*plan)->key);
    std::lock_guard<std::mutex> lock(cluster_.mu);
    cluster_.version_of[req->fence()] = req->version();
    return grpc::Status::OK;
  }
  grpc::Status Execute(grpc::ServerContext*, const v1::ExecuteRequest* req, v1::ExecuteResponse*) override {
    if (!req->has_prepare()) return grpc::Status::OK;
    v1::PrepareResponse prepared;  // its Prepare rode on this wave: as a daemon checks it
    if (grpc::Status st = prepare(&req->prepare(), &prepared); !st.ok()) return st;
    if (prepared.plan_key() != req->plan_key())
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "planned another plan (a stale view)");
    return grpc::Status::OK;
  }
  grpc::Status Progress(grpc::ServerContext*, const v1::ProgressRequest*, v1::ProgressResponse*) override {
    return grpc::Status::OK;
  }
  grpc::Status Finish(grpc::ServerContext*, const v1::FinishRequest* req, v1::FinishResponse*) override {
    if (req->commit()) {  // the inference ranks hold the version now
      std::lock_guard<std::mutex> lock(cluster_.mu);
      if (const auto it = cluster_.version_of.find(req->fence()); it != cluster_.version_of.end()) {
        uint64_t held = cluster_.committed.load();
        while (held < it->second && !cluster_.committed.compare_exchange_weak(held, it->second)) {
        }
      }
    }
    return grpc::Status::OK;
  }
  grpc::Status Relay(grpc::ServerContext* ctx, const v1::RelayRequest* req, v1::RelayResponse* out) override {
    auto r = relay(*peers_, *req, ctx->deadline(), [ctx] { return ctx->IsCancelled(); });
    if (!r.ok()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(r.status().message()));
    *out = std::move(*r);
    return grpc::Status::OK;
  }

 private:
  const std::unique_ptr<PeerSet>& peers_;
  SimulatedCluster& cluster_;
  const int index_;
  const std::string node_;
};

std::vector<int> numbers(const std::string& s) {
  std::vector<int> out;
  std::istringstream in(s);
  for (int v; in >> v;) out.push_back(v);
  return out;
}

std::vector<std::string> words(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

double cpuSeconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// CPU seconds process `pid` has used (user and system, from /proc/<pid>/stat).
double cpuSecondsOf(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::istringstream fields(stat.substr(stat.rfind(')') + 2));  // after "pid (comm) "
  std::string field;
  double ticks = 0;
  for (int i = 3; fields >> field && i <= 15; ++i)
    if (i == 14 || i == 15) ticks += std::stod(field);  // utime, stime
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

// This process's peak resident memory (VmHWM), in MiB; resetPeakRss() starts it anew.
double peakRssMiB() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // "VmHWM:  1234 kB"
  return 0;
}
void resetPeakRss() { std::ofstream("/proc/self/clear_refs") << "5"; }

// A TCP port on 127.0.0.1 that nothing listens on now.
int freePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    fmt::print(stderr, "relay_bench: no free port on 127.0.0.1\n");
    std::exit(1);
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

DaemonConfig clusterConfig(const std::vector<std::string>& addresses) {
  DaemonConfig config;
  config.peers = addresses;
  config.peer_timeout_ms = 10000;
  config.insecure = true;
  return config;
}

// Serves n simulated daemons (or those of the layouts in `dir`); writes the two groups' names and
// the daemons' addresses to `fd` (one line), then serves until killed. `coordinator`: the address
// the coordinating daemon of --whole-syncs listens on ("" for none): one of the cluster's daemons,
// so a relay may call it.
[[noreturn]] void serve(int n, int fd, const std::string& coordinator, const std::string& dir) {
  std::unique_ptr<PeerSet> peers;
  const auto simulated = simulatedCluster(n, dir);
  SimulatedCluster& cluster = *simulated;
  n = cluster.size();
  std::vector<std::unique_ptr<SimulatedPeer>> services;
  std::vector<std::unique_ptr<grpc::Server>> servers;
  std::vector<std::string> addresses;
  for (int i = 0; i < n; ++i) {
    int port = 0;
    services.push_back(std::make_unique<SimulatedPeer>(peers, cluster, i));
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::NUM_CQS, 1);
    b.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MIN_POLLERS, 1);
    b.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, 2);
    b.RegisterService(services.back().get());
    servers.push_back(b.BuildAndStart());
    if (!servers.back() || port == 0) {
      fmt::print(stderr, "relay_bench: simulated daemon {} could not listen\n", i);
      std::_Exit(1);
    }
    addresses.push_back(fmt::format("127.0.0.1:{}", port));
  }
  std::vector<std::string> cluster_addresses = addresses;
  if (!coordinator.empty()) cluster_addresses.push_back(coordinator);
  peers = std::make_unique<PeerSet>(clusterConfig(cluster_addresses), "simulated");
  std::string line = cluster.trainer.group() + " " + cluster.infer.group() + " ";
  for (const auto& a : addresses) line += a + " ";
  line += "\n";
  if (::write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) std::_Exit(1);
  ::close(fd);
  while (true) ::pause();
}

// Calls Finish on every daemon, directly or through a tree, per fanout: one table row each.
void fanOutRows(int n, const std::vector<std::string>& addresses, const std::vector<int>& fanouts, int rounds) {
  const PeerSet peers(clusterConfig(addresses), "coordinator");
  v1::FinishRequest finish;
  finish.set_sync_id("bench");
  finish.set_commit(true);
  std::vector<RawCall> calls;
  for (const auto& a : addresses) {
    calls.push_back({a, {}, std::chrono::milliseconds(10000)});
    finish.SerializeToString(&calls.back().request);
  }
  for (const int fanout : fanouts) {
    TreeOptions options;
    options.method = "Finish";
    options.fanout = static_cast<uint32_t>(fanout);
    std::vector<double> seconds, cpu;
    bool all_ok = true;
    for (int round = 0; round <= rounds; ++round) {  // round 0 connects: not counted
      const double c0 = cpuSeconds();
      const auto t0 = std::chrono::steady_clock::now();
      const auto results = callTree(peers, calls, options);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double c = cpuSeconds() - c0;
      for (const auto& r : results) all_ok = all_ok && r.status.ok();
      if (round == 0) continue;
      seconds.push_back(s);
      cpu.push_back(c);
    }
    if (!all_ok) {
      fmt::print("| {} | {} | failed: a call did not succeed |\n", n, fanout);
      continue;
    }
    std::sort(seconds.begin(), seconds.end());
    double cpu_mean = 0;
    for (double c : cpu) cpu_mean += c / static_cast<double>(cpu.size());
    fmt::print("| {} | {} | {} | {:.1f} ms | {:.1f} ms | {:.1f} ms | {:.1f} us |\n", n,
               fanout == 0 ? std::string("direct") : std::to_string(fanout),
               relayGroups(calls.size(), options.fanout).size(), seconds.front() * 1e3,
               seconds[seconds.size() / 2] * 1e3, cpu_mean * 1e3, cpu_mean * 1e6 / n);
    std::fflush(stdout);
  }
}

// A coordinating daemon holding no ranks, as shardcastd wires one (daemon/server/main.cc), on the
// loopback transport, serving on 127.0.0.1.
class Coordinator {
 public:
  Coordinator(const std::vector<std::string>& peers, const std::string& listen, int fanout, const std::string& fold) {
    config_.node = "coordinator";
    config_.listen = listen;
    config_.peers = peers;  // every daemon of the cluster, itself too (as --peer-dns finds them)
    config_.peers.push_back(listen);
    config_.insecure = true;
    config_.peer_timeout_ms = 10000;
    config_.relay_fanout = fanout;
    config_.fold_prepare = fold;
    transport::TransportOptions topts;
    topts.backend = "loopback";
    topts.name = "coordinator";
    transport_ = std::move(*transport::createContext(topts));
    registry_ = std::make_unique<Registry>(config_.node, *transport_);
    engine_ = std::make_unique<SyncEngine>(config_.node, *registry_, *transport_, metrics_);
    peer_set_ = std::make_unique<PeerSet>(config_, registry_->instance());
    service_ = std::make_unique<ShardcastService>(config_, access_, *registry_, *peer_set_, *engine_, metrics_,
                                                  progress_, transport_->describe());
    peer_ = std::make_unique<PeerService>(access_, *registry_, *peer_set_, *engine_, progress_);
    grpc::ServerBuilder b;
    b.AddListeningPort(listen, grpc::InsecureServerCredentials());
    b.RegisterService(service_.get());
    b.RegisterService(peer_.get());
    server_ = b.BuildAndStart();
    if (!server_) {
      fmt::print(stderr, "relay_bench: the coordinator cannot listen on {}\n", listen);
      std::exit(1);
    }
    stub_ = v1::Shardcast::NewStub(grpc::CreateChannel(config_.listen, grpc::InsecureChannelCredentials()));
  }
  ~Coordinator() {
    service_->stop();
    engine_->abortAll("the bench is over");
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }
  grpc::Status sync(const std::string& src, const std::string& dst, uint64_t version, v1::SyncResponse* out) {
    v1::SyncRequest req;
    req.set_src_group(src);
    req.set_dst_group(dst);
    req.set_version(version);
    req.mutable_options()->set_timeout_ms(120000);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(150));
    return stub_->Sync(&context, req, out);
  }

 private:
  DaemonConfig config_;
  const AccessPolicy access_{true, "", nullptr};
  Metrics metrics_;
  ProgressBoard progress_;
  std::unique_ptr<transport::Context> transport_;
  std::unique_ptr<Registry> registry_;
  std::unique_ptr<SyncEngine> engine_;
  std::unique_ptr<PeerSet> peer_set_;
  std::unique_ptr<ShardcastService> service_;
  std::unique_ptr<PeerService> peer_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Shardcast::Stub> stub_;
};

// Whole syncs through a real coordinator, per fanout: the first (it gathers and plans), then
// `rounds` that repeat it (the next version each).
void wholeSyncRows(int n, pid_t simulated, const std::vector<std::string>& addresses, const std::string& listen,
                   const std::string& src, const std::string& dst, const std::vector<int>& fanouts,
                   const std::vector<std::string>& folds, int rounds, uint64_t& version) {
  for (const int fanout : fanouts)
    for (const std::string& fold : folds) {
      resetPeakRss();
      Coordinator coordinator(addresses, listen, fanout, fold);
      std::vector<double> seconds, cpu, daemons_cpu;
      double first = 0, first_cpu = 0;
      v1::SyncResponse first_resp;
      int repeated = 0, folded = 0;
      std::string failure;
      for (int round = 0; round <= rounds && failure.empty(); ++round) {
        v1::SyncResponse resp;
        const double c0 = cpuSeconds(), d0 = cpuSecondsOf(simulated);
        const auto t0 = std::chrono::steady_clock::now();
        const grpc::Status st = coordinator.sync(src, dst, ++version, &resp);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const double c = cpuSeconds() - c0, d = cpuSecondsOf(simulated) - d0;
        if (!st.ok()) {  // (named by its code too: a message may be empty)
          failure = fmt::format("{} (gRPC code {})", st.error_message(), static_cast<int>(st.error_code()));
          break;
        }
        if (round == 0) {
          first = s;
          first_cpu = c;
          first_resp = resp;
          continue;
        }
        repeated += resp.repeated() ? 1 : 0;
        folded += resp.folded() ? 1 : 0;
        seconds.push_back(s);
        cpu.push_back(c);
        daemons_cpu.push_back(d);
      }
      if (!failure.empty()) {
        fmt::print("| {} | {} | {} | failed: {} |\n", n, fanout, fold, failure);
        std::fflush(stdout);
        continue;
      }
      std::sort(seconds.begin(), seconds.end());
      double cpu_mean = 0, daemons_mean = 0;
      for (double c : cpu) cpu_mean += c / static_cast<double>(cpu.size());
      for (double d : daemons_cpu) daemons_mean += d / static_cast<double>(daemons_cpu.size());
      fmt::print(
          "| {} | {} | {} | {:.1f} ms | {:.1f} ms | {:.1f} ms | {} of {} | {} of {} | {:.1f} ms | {:.1f} us | {:.0f} "
          "ms | {:.2f} / {:.2f} / {:.2f} s | {:.2f} s | {:.0f} MiB |\n",
          n, fanout == 0 ? std::string("direct") : std::to_string(fanout), fold, first * 1e3, seconds.front() * 1e3,
          seconds[seconds.size() / 2] * 1e3, repeated, seconds.size(), folded, seconds.size(), cpu_mean * 1e3,
          cpu_mean * 1e6 / n, daemons_mean * 1e3, first_resp.gather_seconds(), first_resp.plan_seconds(),
          first_resp.prepare_seconds(), first_cpu, peakRssMiB());
      std::fflush(stdout);
    }
}

}  // namespace

int main(int argc, char** argv) {
  // As shardcastd does (daemon/server/main.cc): no lock-order graph on gRPC's abseil mutexes.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  std::string daemons = "64 256 1024", fanouts = "0 16 32 64", folds = "auto", layouts;
  int rounds = 30;
  bool whole_syncs = false;
  // The simulated daemons run in a process of their own, started anew (exec: no gRPC state
  // across a fork): relay_bench --serve N FD.
  if (argc == 6 && !std::strcmp(argv[1], "--serve")) serve(std::atoi(argv[2]), std::atoi(argv[3]), argv[4], argv[5]);
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--whole-syncs")) {
      whole_syncs = true;
    } else if (i + 1 < argc && !std::strcmp(argv[i], "--daemons")) {
      daemons = argv[++i];
    } else if (i + 1 < argc && !std::strcmp(argv[i], "--fanouts")) {
      fanouts = argv[++i];
    } else if (i + 1 < argc && !std::strcmp(argv[i], "--fold")) {
      folds = argv[++i];
    } else if (i + 1 < argc && !std::strcmp(argv[i], "--rounds")) {
      rounds = std::max(2, std::atoi(argv[++i]));
    } else if (i + 1 < argc && !std::strcmp(argv[i], "--layouts")) {
      layouts = argv[++i];
    } else {
      fmt::print(stderr,
                 "usage: relay_bench [--daemons \"64 256 1024\"] [--fanouts \"0 16 32 64\"] [--rounds 30] "
                 "[--whole-syncs [--fold \"auto never\"] [--layouts DIR]]\n");
      return 2;
    }
  }
  if (!layouts.empty() && !whole_syncs) {
    fmt::print(stderr, "relay_bench: --layouts takes --whole-syncs\n");
    return 2;
  }
  if (!layouts.empty()) daemons = "2";  // (the layouts' nodes decide)
  const std::vector<int> counts = numbers(daemons);
  if (counts.empty() || *std::min_element(counts.begin(), counts.end()) < 2) {
    fmt::print(stderr, "relay_bench: --daemons takes counts of at least 2\n");
    return 2;
  }
  spdlog::set_level(spdlog::level::warn);  // not a line per sync
  rlimit files{};                          // a thousand daemons' listeners and connections
  ::getrlimit(RLIMIT_NOFILE, &files);
  files.rlim_cur = files.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &files);
  if (whole_syncs) {
    fmt::print(
        "| daemons | fanout | fold | first sync (gather, plan) | repeated sync, best | median | skipped the gather "
        "| folded | coordinator CPU per sync | per daemon | simulated daemons' CPU per sync | first sync: gather / "
        "plan "
        "/ prepare | first sync: coordinator CPU | coordinator peak RSS |\n");
    fmt::print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  } else {
    fmt::print(
        "| daemons | fanout | coordinator calls | round, best | median | coordinator CPU per round | per daemon |\n");
    fmt::print("| --- | --- | --- | --- | --- | --- | --- |\n");
  }
  uint64_t version = 0;  // the simulated inference ranks keep their version across fanouts
  // The coordinating daemon's address, known to the simulated daemons before it starts (each
  // fanout's coordinator listens on it in turn).
  const std::string coordinator = whole_syncs ? fmt::format("127.0.0.1:{}", freePort()) : std::string();
  for (int n : counts) {
    int pipefd[2];
    if (::pipe(pipefd) != 0) return 1;
    const pid_t child = ::fork();
    if (child == 0) {
      ::close(pipefd[0]);
      const std::string count = std::to_string(n), fd = std::to_string(pipefd[1]);
      ::execl("/proc/self/exe", argv[0], "--serve", count.c_str(), fd.c_str(), coordinator.c_str(), layouts.c_str(),
              static_cast<char*>(nullptr));
      std::_Exit(127);
    }
    ::close(pipefd[1]);
    std::string got;
    char buf[4096];
    for (ssize_t r; (r = ::read(pipefd[0], buf, sizeof(buf))) > 0;) got.append(buf, static_cast<size_t>(r));
    ::close(pipefd[0]);
    std::vector<std::string> addresses;
    std::istringstream in(got);
    std::string src, dst;
    in >> src >> dst;
    for (std::string a; in >> a;) addresses.push_back(a);
    if (!layouts.empty() && !addresses.empty()) n = static_cast<int>(addresses.size());
    if (addresses.size() != static_cast<size_t>(n)) {
      fmt::print(stderr, "relay_bench: {} simulated daemons did not start\n", n);
      ::kill(child, SIGKILL);
      return 1;
    }
    version = 0;  // a new child: its inference ranks hold nothing yet
    if (whole_syncs)
      wholeSyncRows(n, child, addresses, coordinator, src, dst, numbers(fanouts), words(folds), rounds, version);
    else
      fanOutRows(n, addresses, numbers(fanouts), rounds);
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
  }
  return 0;
}
