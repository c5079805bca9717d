// shardcastd processes on this machine standing for the nodes of a cluster: each started on
// loopback with its own node name, TCP port and Unix socket, with mutual TLS between them
// (certificates minted once per process by shardcast-certs, scripts/certs.sh), stopped (SIGTERM) on
// destruction. Used by the local-cluster demo and by the integration tests.
#pragma once

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/tls.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "shardcast/v1/service.grpc.pb.h"
#include "tests/support/binaries.h"
#include "tests/support/subprocess.h"

#ifndef SHARDCASTD_PATH
#define SHARDCASTD_PATH "shardcastd"
#endif

namespace shardcast::examples {

// Whether `port` on 127.0.0.1 can be bound right now.
inline bool portFree(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// The ports tests hand to daemons: [20000, 32768), below the kernel's ephemeral range.
inline constexpr int kTestPortsBegin = 20000, kTestPortsEnd = 32768;

// A TCP port free right now on 127.0.0.1, for a daemon started next. Not the kernel's pick: that
// is an ephemeral port, and between this call and the daemon's bind any process's outgoing
// connection or UCX listener could take it (a loaded CI run saw "Address already in use"). Below
// the ephemeral range only daemons bind, and each process walks the range from a start of its
// own, so tests running side by side do not pick the same port.
inline int freePort() {
  static std::atomic<int> next{static_cast<int>((static_cast<unsigned>(::getpid()) * 2654435761u) %
                                                static_cast<unsigned>(kTestPortsEnd - kTestPortsBegin))};
  for (int tries = 0; tries < kTestPortsEnd - kTestPortsBegin; ++tries) {
    const int port = kTestPortsBegin + next.fetch_add(1) % (kTestPortsEnd - kTestPortsBegin);
    if (portFree(port)) return port;
  }
  return 0;  // every one taken: the daemon given it fails to start, and says so
}

// `count` TCP ports free on 127.0.0.1 right now, consecutive from a pseudo-random start below the
// kernel's ephemeral range (32768+): many daemons started one after another cannot then take
// each other's ports with the ephemeral ports they bind themselves (metrics, UCX).
inline std::vector<int> freePortsBelowEphemeral(int count) {
  std::vector<int> out;
  for (int port = kTestPortsBegin + static_cast<int>(::getpid() % 500) * 20;
       port < kTestPortsEnd && static_cast<int>(out.size()) < count; ++port)
    if (portFree(port)) out.push_back(port);
  return out;
}

// The local cluster's CA, one daemon identity and one client identity, minted on first use into
// a directory of this process (removed at exit) by shardcast-certs found beside `binary`.
class LocalCerts {
 public:
  static const LocalCerts& get(const std::string& binary = testBinary(SHARDCASTD_PATH)) {
    static const LocalCerts certs(binary);
    return certs;
  }
  ~LocalCerts() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  bool ok() const { return ok_; }
  const std::string& dir() const { return dir_; }
  const std::string& script() const { return script_; }
  // What a daemon presents (to clients and to other daemons) and what a TCP client presents.
  TlsFiles daemon() const { return {dir_ + "/daemon.pem", dir_ + "/daemon.key", dir_ + "/ca.pem"}; }
  TlsFiles client() const { return {dir_ + "/client.pem", dir_ + "/client.key", dir_ + "/ca.pem"}; }

 private:
  explicit LocalCerts(const std::string& binary) {
    dir_ = "/tmp/shardcast-certs-" + std::to_string(::getpid());
    const auto beside = std::filesystem::path(Child::findExecutable(binary)).parent_path() / "shardcast-certs";
    script_ = std::filesystem::exists(beside) ? beside.string() : Child::findExecutable("shardcast-certs");
    Child mint = Child::spawn({"bash", script_, dir_});
    ok_ = mint.wait() == 0;
  }
  std::string dir_;
  std::string script_;
  bool ok_ = false;
};

class Daemon {
 public:
  // `extra` flags come last; without --ucx-tls among them the daemon uses UCX_TLS=tcp, and without
  // --insecure or --tls-cert among them mutual TLS with LocalCerts.
  // `host`: the address it listens on (127.0.0.1, or its network namespace's); `launcher`: a
  // command prefix it runs under (e.g. {"ip", "netns", "exec", "sc-n0"}).
  Daemon(std::string node, int port, std::vector<std::string> peers, std::vector<std::string> extra = {},
         std::string binary = testBinary(SHARDCASTD_PATH), std::string host = "127.0.0.1",
         std::vector<std::string> launcher = {})
      : node_(std::move(node)), host_(std::move(host)), port_(port) {
    socket_ = "/tmp/shardcast-test-" + std::to_string(::getpid()) + "-" + node_ + ".sock";
    std::vector<std::string> argv = {binary,  "--node",      node_,  "--listen",  address(),    "--socket",
                                     socket_, "--log-level", "warn", "--metrics", "127.0.0.1:0"};
    insecure_ = std::find(extra.begin(), extra.end(), "--insecure") != extra.end();
    const bool own_tls = std::find(extra.begin(), extra.end(), "--tls-cert") != extra.end();
    if (!insecure_ && !own_tls) {
      const TlsFiles tls = LocalCerts::get(binary).daemon();
      argv.insert(argv.end(), {"--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca});
    }
    if (std::find(extra.begin(), extra.end(), "--ucx-tls") == extra.end()) {
      argv.push_back("--ucx-tls");  // separate hosts talk TCP; tests default to it
      argv.push_back("tcp");
    }
    if (!peers.empty()) {
      std::string list;
      for (const auto& p : peers) list += (list.empty() ? "" : ",") + p;
      argv.push_back("--peers");
      argv.push_back(list);
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    argv.insert(argv.begin(), launcher.begin(), launcher.end());
    child_ = Child::spawn(argv);
    ready_line_ = child_.readLine(std::chrono::seconds(30));
  }
  ~Daemon() {
    stop();
    removeFiles();
  }

  bool ready() const { return ready_line_.rfind("shardcastd ready", 0) == 0; }
  int metricsPort() const {
    const auto at = ready_line_.find("metrics_port=");
    return at == std::string::npos ? 0 : std::stoi(ready_line_.substr(at + 13));
  }
  const std::string& readyLine() const { return ready_line_; }
  std::string address() const { return host_ + ":" + std::to_string(port_); }
  const std::string& socketPath() const { return socket_; }
  const std::string& node() const { return node_; }
  void kill() {
    child_.kill();
    child_.wait();
  }
  pid_t pid() const { return child_.pid(); }
  void reap() { child_.wait(); }
  int stop() {
    child_.kill(SIGTERM);
    return child_.wait();
  }

  // Each on a connection of its own (no subchannel shared with earlier channels, which may still
  // hold a connection to a daemon that was restarted since). TCP channels present the client
  // certificate; peerChannel the daemon certificate (what another daemon would present).
  std::unique_ptr<v1::Shardcast::Stub> client() const { return v1::Shardcast::NewStub(channel("unix:" + socket_)); }
  std::unique_ptr<v1::Shardcast::Stub> tcpClient() const {
    return v1::Shardcast::NewStub(channel(address(), tls(LocalCerts::get().client())));
  }
  std::unique_ptr<v1::Peer::Stub> peer() const {
    return v1::Peer::NewStub(channel(address(), tls(LocalCerts::get().daemon())));
  }
  static std::shared_ptr<grpc::Channel> channel(const std::string& target, const TlsFiles& tls = {}) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return grpc::CreateCustomChannel(target, channelCredentials(tls, &args), args);
  }
  // Waits until sync `id`, coordinated here, is under way, in phase `at_least` or a later one
  // before it ends (its Watch reports); false when it ended first, or after `timeout`. An event a
  // test starts on a running sync waits for this. (Watch, not Status: Status asks every peer,
  // and waits on a frozen one.)
  bool waitForSync(const std::string& id, v1::SyncPhase at_least = v1::SYNC_PHASE_UNSPECIFIED,
                   std::chrono::milliseconds timeout = std::chrono::seconds(10)) const {
    const auto stub = client();
    v1::WatchRequest request;
    request.set_sync_id(id);
    for (const auto until = std::chrono::steady_clock::now() + timeout; std::chrono::steady_clock::now() < until;) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(6));
      auto reader = stub->Watch(&context, request);
      v1::SyncProgress p;
      bool read = false;
      while (reader->Read(&p)) {
        read = true;
        if (p.phase() == v1::SYNC_COMMITTED || p.phase() == v1::SYNC_FAILED || p.phase() >= at_least) break;
      }
      if (read) {
        context.TryCancel();
        reader->Finish();
        return p.phase() != v1::SYNC_COMMITTED && p.phase() != v1::SYNC_FAILED && p.phase() >= at_least;
      }
      reader->Finish();  // NOT_FOUND: not started within the daemon's 5 s; ask again
    }
    return false;
  }
  std::unique_ptr<grpc::health::v1::Health::Stub> health() const {
    return grpc::health::v1::Health::NewStub(channel(address(), tls(LocalCerts::get().client())));
  }
  // `files`, or none for an --insecure daemon.
  TlsFiles tls(const TlsFiles& files) const { return insecure_ ? TlsFiles{} : files; }

 private:
  // What a daemon leaves beside its socket once it has ended (all of it when killed, its lock file
  // and group owners when stopped), unless another daemon of this test already serves that socket:
  // a test run leaves nothing in /tmp.
  void removeFiles() const {
    const std::string lock = socket_ + ".lock";
    const int fd = ::open(lock.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return;
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0)
      for (const char* suffix : {"", ".fds", ".owners", ".lock"}) ::unlink((socket_ + suffix).c_str());
    ::close(fd);
  }

  std::string node_;
  std::string host_;
  int port_;
  bool insecure_ = false;
  std::string socket_;
  Child child_;
  std::string ready_line_;
};

}  // namespace shardcast::examples
