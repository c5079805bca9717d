// The coordinator's fan-out at hundreds to a thousand daemons, over real gRPC: a child process
// serves N simulated daemons' Peer services (one gRPC server per daemon, each on its own port;
// Finish answers at once, Relay is the daemon's own relay code), and this process calls Finish on
// all N the way a coordinator does (daemon/coordinator/relay.h): directly, or through a tree of
// Relays. Per fanout it prints the best and median time of a round and this process's CPU per
// round: the coordinator's cost, apart from the daemons'. (The rest of a sync's coordinator work,
// planning and building each daemon's requests, is not in it: bench/cluster.sh --control-plane
// measures whole syncs of real daemons.)
//
//   build/bin/relay_bench [--daemons "64 256 1024"] [--fanouts "0 16 32 64"] [--rounds 30]
#include <fmt/format.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "daemon/coordinator/cluster.h"
#include "daemon/coordinator/relay.h"
#include "daemon/server/config.h"
#include "shardcast/v1/service.grpc.pb.h"

using namespace shardcast;
using namespace shardcast::daemon;

namespace {

// One simulated daemon: Finish answers at once; Relay relays, as a daemon does. The cluster's
// PeerSet exists once every server has its port.
class SimulatedPeer final : public v1::Peer::Service {
 public:
  explicit SimulatedPeer(const std::unique_ptr<PeerSet>& peers) : peers_(peers) {}
  grpc::Status Finish(grpc::ServerContext*, const v1::FinishRequest*, v1::FinishResponse*) override {
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
};

std::vector<int> numbers(const std::string& s) {
  std::vector<int> out;
  std::istringstream in(s);
  for (int v; in >> v;) out.push_back(v);
  return out;
}

double cpuSeconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

DaemonConfig clusterConfig(const std::vector<std::string>& addresses) {
  DaemonConfig config;
  config.peers = addresses;
  config.peer_timeout_ms = 10000;
  config.insecure = true;
  return config;
}

// Serves n simulated daemons; writes their ports to `fd` (one line), then serves until killed.
[[noreturn]] void serve(int n, int fd) {
  std::unique_ptr<PeerSet> peers;
  std::vector<std::unique_ptr<SimulatedPeer>> services;
  std::vector<std::unique_ptr<grpc::Server>> servers;
  std::vector<std::string> addresses;
  for (int i = 0; i < n; ++i) {
    int port = 0;
    services.push_back(std::make_unique<SimulatedPeer>(peers));
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
  peers = std::make_unique<PeerSet>(clusterConfig(addresses), "simulated");
  std::string line;
  for (const auto& a : addresses) line += a + " ";
  line += "\n";
  if (::write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) std::_Exit(1);
  ::close(fd);
  while (true) ::pause();
}

}  // namespace

int main(int argc, char** argv) {
  std::string daemons = "64 256 1024", fanouts = "0 16 32 64";
  int rounds = 30;
  // The simulated daemons run in a process of their own, started anew (exec: no gRPC state
  // across a fork): relay_bench --serve N FD.
  if (argc == 4 && !std::strcmp(argv[1], "--serve")) serve(std::atoi(argv[2]), std::atoi(argv[3]));
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--daemons"))
      daemons = argv[i + 1];
    else if (!std::strcmp(argv[i], "--fanouts"))
      fanouts = argv[i + 1];
    else if (!std::strcmp(argv[i], "--rounds"))
      rounds = std::max(2, std::atoi(argv[i + 1]));
    else {
      fmt::print(stderr, "usage: relay_bench [--daemons \"64 256 1024\"] [--fanouts \"0 16 32 64\"] [--rounds 30]\n");
      return 2;
    }
  }
  rlimit files{};  // a thousand daemons' listeners and connections
  ::getrlimit(RLIMIT_NOFILE, &files);
  files.rlim_cur = files.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &files);
  fmt::print(
      "| daemons | fanout | coordinator calls | round, best | median | coordinator CPU per round | per daemon |\n");
  fmt::print("| --- | --- | --- | --- | --- | --- | --- |\n");
  for (const int n : numbers(daemons)) {
    int pipefd[2];
    if (::pipe(pipefd) != 0) return 1;
    const pid_t child = ::fork();
    if (child == 0) {
      ::close(pipefd[0]);
      const std::string count = std::to_string(n), fd = std::to_string(pipefd[1]);
      ::execl("/proc/self/exe", argv[0], "--serve", count.c_str(), fd.c_str(), static_cast<char*>(nullptr));
      std::_Exit(127);
    }
    ::close(pipefd[1]);
    std::string got;
    char buf[4096];
    for (ssize_t r; (r = ::read(pipefd[0], buf, sizeof(buf))) > 0;) got.append(buf, static_cast<size_t>(r));
    ::close(pipefd[0]);
    std::vector<std::string> addresses;
    std::istringstream in(got);
    for (std::string a; in >> a;) addresses.push_back(a);
    if (addresses.size() != static_cast<size_t>(n)) {
      fmt::print(stderr, "relay_bench: {} simulated daemons did not start\n", n);
      ::kill(child, SIGKILL);
      return 1;
    }
    const PeerSet peers(clusterConfig(addresses), "coordinator");
    v1::FinishRequest finish;
    finish.set_sync_id("bench");
    finish.set_commit(true);
    std::vector<RawCall> calls;
    for (const auto& a : addresses) {
      calls.push_back({a, {}, std::chrono::milliseconds(10000)});
      finish.SerializeToString(&calls.back().request);
    }
    for (const int fanout : numbers(fanouts)) {
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
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
  }
  return 0;
}
