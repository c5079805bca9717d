// UcxAdmission (daemon/server/ucx_admission.h): who may connect to UCX's own listeners, and the
// attack it stops: a UCX wire-up whose address version UCX does not know aborts the process
// (tests/daemon/ucx_handshake_attack.py), sent from another uid on this host.
#include "daemon/server/ucx_admission.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "tests/daemon/daemon_harness.h"
#include "tests/support/skip.h"

using namespace shardcast;
using namespace shardcast::testing;

namespace {

sockaddr_storage v4(const char* ip, uint16_t port) {
  sockaddr_storage s{};
  auto& a = reinterpret_cast<sockaddr_in&>(s);
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  ::inet_pton(AF_INET, ip, &a.sin_addr);
  return s;
}

// The TCP ports `pid` listens on (its sockets in LISTEN state), from /proc.
std::set<int> listeningPorts(pid_t pid) {
  std::set<std::string> inodes;
  for (const auto& fd : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(fd.path(), ec).string();
    if (!ec && target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
  }
  std::set<int> ports;
  std::ifstream table("/proc/" + std::to_string(pid) + "/net/tcp");
  std::string line;
  std::getline(table, line);
  while (std::getline(table, line)) {
    std::istringstream f(line);
    std::string sl, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
    f >> sl >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode;
    if (state == "0A" && inodes.count(inode)) ports.insert(std::stoi(local.substr(local.find(':') + 1), nullptr, 16));
  }
  return ports;
}

// Runs the attack as nobody against every TCP port the daemon listens on but its gRPC and metrics
// ports (UCX's tcp interface: 127.0.0.1 under UCX_TLS=tcp), with `mode` ({} or {"--burst", "60"}).
// Returns how many attacks it sent.
int attackAsNobody(const Daemon& d, int grpc_port, const std::vector<std::string>& mode = {}) {
  int sent = 0;
  for (const int port : listeningPorts(d.pid())) {
    if (port == grpc_port || port == d.metricsPort()) continue;
    // The script is read by this (root) shell, then run as nobody: the checkout need not be
    // readable by nobody.
    std::vector<std::string> argv = {"sh",
                                     "-c",
                                     "script=$1; shift; exec setpriv --reuid=65534 --regid=65534 --clear-groups "
                                     "/usr/bin/python3 - \"$@\" < \"$script\" 2>&1",
                                     "sh",
                                     UCX_HANDSHAKE_ATTACK_PATH,
                                     "127.0.0.1",
                                     std::to_string(port)};
    argv.insert(argv.end(), mode.begin(), mode.end());
    Child attack = Child::spawn(argv);
    while (!attack.readLine(std::chrono::seconds(10)).empty()) {
    }
    attack.wait();
    ++sent;
  }
  return sent;
}

// Whether `d` is still running `seconds` after the attack (UCX prints its backtrace before it
// aborts, which takes a moment).
bool aliveAfter(const Daemon& d, int seconds) {
  for (int i = 0; i < seconds * 10; ++i) {
    int status = 0;
    if (::waitpid(d.pid(), &status, WNOHANG) == d.pid()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return ::kill(d.pid(), 0) == 0;
}

}  // namespace

TEST_CASE("UCX admission: address ranges and gRPC peers are read exactly", "[daemon][security]") {
  const auto range = daemon::parseIpRange("10.1.0.0/16");
  REQUIRE(range.ok());
  CHECK(range->contains(*daemon::ipOf(v4("10.1.200.3", 1))));
  CHECK_FALSE(range->contains(*daemon::ipOf(v4("10.2.0.1", 1))));
  CHECK(daemon::parseIpRange("fd00::/8")->contains(*daemon::ipOfGrpcPeer("ipv6:[fd12::1]:7070")));
  CHECK(daemon::parseIpRange("192.0.2.7")->contains(*daemon::ipOfGrpcPeer("ipv4:192.0.2.7:40000")));
  CHECK_FALSE(daemon::parseIpRange("192.0.2.7")->contains(*daemon::ipOfGrpcPeer("ipv4:192.0.2.8:40000")));
  CHECK(daemon::parseIpRange("10.0.0.0/33").status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(daemon::parseIpRange("host.example/8").status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_FALSE(daemon::ipOfGrpcPeer("unix:/run/shardcast/shardcastd.sock"));
  CHECK(daemon::toString(*daemon::ipOfGrpcPeer("ipv4:127.0.0.1:1")) == "127.0.0.1");
}

TEST_CASE("UCX admission: the kernel names a local socket's state and owner, and a closed one's owner as no one",
          "[daemon][security]") {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_storage at = v4("127.0.0.1", 0);
  socklen_t len = sizeof(sockaddr_in);
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&at), len) == 0);
  REQUIRE(::listen(listener, 4) == 0);
  REQUIRE(::getsockname(listener, reinterpret_cast<sockaddr*>(&at), &len) == 0);
  const int client = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(::connect(client, reinterpret_cast<sockaddr*>(&at), len) == 0);
  sockaddr_storage from{};
  socklen_t from_len = sizeof(from);
  REQUIRE(::getsockname(client, reinterpret_cast<sockaddr*>(&from), &from_len) == 0);
  const int served = ::accept(listener, nullptr, nullptr);
  REQUIRE(served >= 0);

  const auto open = daemon::findLocalSocket(from, at);
  REQUIRE(open);
  CHECK(open->state == daemon::kTcpEstablished);
  CHECK(open->uid == ::geteuid());
  CHECK(open->inode != 0);
  daemon::UcxAdmission& admission = daemon::UcxAdmission::instance();
  admission.configure(true, {});
  std::string why;
  CHECK(admission.admit(from, at, &why));

  // Closed by its owner (FIN_WAIT2 until the other side closes): the kernel keeps the connection
  // but names no owner (uid 0, inode 0), and it is refused.
  ::close(client);
  const auto closed = daemon::findLocalSocket(from, at);
  CHECK((!closed || closed->inode == 0));
  CHECK_FALSE(admission.admit(from, at, &why));
  CHECK_THAT(why, Catch::Contains("no open socket there names its owner"));
  CHECK_FALSE(daemon::findLocalSocket(v4("127.0.0.1", 1), v4("127.0.0.1", 2)));  // none
  admission.configure(false, {});
  ::close(served);
  ::close(listener);
}

TEST_CASE("UCX admission: an address of this host is decided by the socket's owner, any other by the peers",
          "[daemon][security]") {
  daemon::UcxAdmission& admission = daemon::UcxAdmission::instance();
  admission.configure(true, {*daemon::parseIpRange("198.51.100.0/24")});
  std::string why;
  // Not a socket of this host's (none has that port): another host's connection, refused until a
  // daemon of the cluster spoke from its address.
  CHECK_FALSE(admission.admit(v4("203.0.113.9", 1234), v4("203.0.113.1", 5000), &why));
  CHECK_THAT(why, Catch::Contains("203.0.113.9:1234 is not an address a daemon of the cluster spoke from"));
  admission.notePeer(std::string("ipv4:203.0.113.9:7070"));
  CHECK(admission.admit(v4("203.0.113.9", 1234), v4("203.0.113.1", 5000), &why));
  CHECK(admission.admit(v4("198.51.100.77", 1234), v4("203.0.113.1", 5000), &why));  // --ucx-allow-from
  // Loopback is this host: a connection whose socket is gone names no owner, whatever the
  // peers said (a local user cannot pass as a daemon that spoke from 127.0.0.1).
  admission.notePeer(std::string("ipv4:127.0.0.1:7070"));
  CHECK_FALSE(admission.admit(v4("127.0.0.1", 1), v4("127.0.0.1", 2), &why));
  CHECK_THAT(why, Catch::Contains("is an address of this host, and no open socket there names its owner"));
  admission.configure(false, {});
  CHECK(admission.admit(v4("127.0.0.1", 1), v4("127.0.0.1", 2), &why));  // --ucx-accept any
}

TEST_CASE("UCX admission: another uid's malformed UCX handshake is closed before UCX reads it, the daemon serves on",
          "[daemon][security]") {
  if (::geteuid() != 0) {
    SHARDCAST_SKIP("needs root to run the attack as another uid (setpriv)");
  }
  const int port = freePort();
  Daemon d("n0", port, {});
  REQUIRE(d.ready());
  REQUIRE(attackAsNobody(d, port) >= 1);
  // Each connection closed at once, so that most are accepted as remnants of closed sockets.
  REQUIRE(attackAsNobody(d, port, {"--burst", "60"}) >= 1);
  CHECK(aliveAfter(d, 10));  // UCX prints its backtrace for a few seconds before it aborts
  v1::StatusResponse status;
  CHECK(d.client()->Status(ctx(10).get(), v1::StatusRequest(), &status).ok());

  // The attack itself, with the check off (--ucx-accept any): UCX aborts the daemon.
  const int open_port = freePort();
  Daemon open("n1", open_port, {}, {"--ucx-accept", "any"});
  REQUIRE(open.ready());
  REQUIRE(attackAsNobody(open, open_port) >= 1);
  CHECK_FALSE(aliveAfter(open, 10));
}
