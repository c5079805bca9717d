// The descriptor side channel's two ends (common/fd_passing.h) and the one-time tokens the daemon
// keeps the descriptors under (daemon/registry/handed_fds.h).
#include "daemon/registry/handed_fds.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <csignal>
#include <cstring>

#include "common/fd_passing.h"
#include "tests/support/skip.h"

using namespace shardcast;

namespace {
// Whether `fd` is still an open descriptor of this process.
bool open(int fd) {
  struct stat st {};
  return ::fstat(fd, &st) == 0;
}
}  // namespace

TEST_CASE("handed descriptors: a token is its sender's, good once", "[daemon][fd-channel]") {
  daemon::HandedFds handed;
  OwnedFd memfd(::memfd_create("shardcast-test-handed", MFD_CLOEXEC));
  REQUIRE(memfd.get() >= 0);
  std::vector<OwnedFd> fds;
  fds.emplace_back(::dup(memfd.get()));
  const int kept = fds.back().get();
  const auto token = handed.put(1000, std::move(fds));
  REQUIRE(token.ok());
  CHECK(token->size() == 32);
  CHECK(handed.pending() == 1);
  SECTION("another uid is refused, and the token stays its sender's") {
    const auto other = handed.take(*token, 1001, false);
    CHECK(other.status().code() == absl::StatusCode::kPermissionDenied);
    CHECK_THAT(std::string(other.status().message()), Catch::Contains("handed over by uid 1000, not by uid 1001"));
    CHECK(handed.take(*token, 1000, false).ok());
  }
  SECTION("its sender takes the descriptors once") {
    auto taken = handed.take(*token, 1000, false);
    REQUIRE(taken.ok());
    REQUIRE(taken->size() == 1);
    CHECK((*taken)[0].get() == kept);
    CHECK(handed.take(*token, 1000, false).status().code() == absl::StatusCode::kNotFound);
  }
  SECTION("root takes any uid's") { CHECK(handed.take(*token, 0, true).ok()); }
  CHECK(handed.pending() == 0);
}

TEST_CASE("handed descriptors: a uid's oldest unclaimed token is closed past the cap", "[daemon][fd-channel]") {
  daemon::HandedFds handed;
  std::vector<std::string> tokens;
  int first = -1;
  for (size_t i = 0; i <= daemon::HandedFds::kPerUid; ++i) {
    std::vector<OwnedFd> fds;
    fds.emplace_back(::memfd_create("shardcast-test-cap", MFD_CLOEXEC));
    if (i == 0) first = fds.back().get();
    tokens.push_back(*handed.put(1000, std::move(fds)));
  }
  CHECK(handed.pending() == daemon::HandedFds::kPerUid);
  CHECK_FALSE(open(first));
  CHECK(handed.take(tokens.front(), 1000, false).status().code() == absl::StatusCode::kNotFound);
  CHECK(handed.take(tokens.back(), 1000, false).ok());
  std::vector<OwnedFd> other;
  other.emplace_back(::memfd_create("shardcast-test-cap", MFD_CLOEXEC));
  CHECK(handed.put(1001, std::move(other)).ok());  // another uid's cap is its own
  CHECK(handed.pending() == daemon::HandedFds::kPerUid);
}

TEST_CASE("handed descriptors: a sweep closes tokens unclaimed for too long, and only those", "[daemon][fd-channel]") {
  daemon::HandedFds handed;
  std::vector<OwnedFd> fds;
  fds.emplace_back(::memfd_create("shardcast-test-sweep", MFD_CLOEXEC));
  const int fd = fds.back().get();
  const auto token = handed.put(1000, std::move(fds));
  REQUIRE(token.ok());
  const auto now = std::chrono::steady_clock::now();
  handed.sweep(now);  // not yet expired
  CHECK(handed.pending() == 1);
  CHECK(open(fd));
  handed.sweep(now + daemon::HandedFds::kUnclaimedFor + std::chrono::seconds(1));
  CHECK(handed.pending() == 0);
  CHECK_FALSE(open(fd));
  CHECK(handed.take(*token, 1000, false).status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("handed descriptors: a message whose count disagrees with its descriptors is refused, none kept open",
          "[daemon][fd-channel]") {
  int pair[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
  OwnedFd client(pair[0]), daemon_end(pair[1]);
  OwnedFd memfd(::memfd_create("shardcast-test-count", MFD_CLOEXEC));
  // The header says 2, one descriptor travels.
  char header[8] = {'S', 'C', 'F', 'D', 1, 2, 0, 0};
  iovec iov{header, sizeof(header)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  const int fd = memfd.get();
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  REQUIRE(::sendmsg(client.get(), &msg, 0) == sizeof(header));
  const int next = ::dup(0);  // the lowest free descriptor number now: the received one must be closed again
  ::close(next);
  const auto got = receiveHandedFds(daemon_end.get());
  CHECK(got.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(got.status().message()), Catch::Contains("counts 2 descriptors but carries 1"));
  CHECK_FALSE(open(next));
  answerHandedFds(daemon_end.get(), got.status());
  char line[256] = {};
  CHECK(::read(client.get(), line, sizeof(line) - 1) > 0);
  CHECK_THAT(std::string(line), Catch::StartsWith("error the message counts 2"));
}

TEST_CASE("handed descriptors: counted by descriptor, per uid and in all", "[daemon][fd-channel][security]") {
  daemon::HandedFds handed;
  const auto many = [](size_t n) {
    std::vector<OwnedFd> fds;
    for (size_t i = 0; i < n; ++i) fds.emplace_back(::memfd_create("shardcast-test-fds", MFD_CLOEXEC));
    return fds;
  };
  // One uid: 64 descriptors a token. Its descriptors stay at most kFdsPerUid, its oldest closed.
  // (Closed: their numbers are reused by the descriptors made after them.)
  std::vector<std::string> tokens;
  for (size_t i = 0; i < daemon::HandedFds::kFdsPerUid / 64 + 4; ++i) tokens.push_back(*handed.put(1000, many(64)));
  CHECK(handed.pending() == daemon::HandedFds::kFdsPerUid / 64);
  CHECK(handed.take(tokens.front(), 1000, false).status().code() == absl::StatusCode::kNotFound);
  // Every uid together: at most kFdsTotal; past it a hand-over is refused (no other uid's closed).
  uid_t uid = 2000;
  size_t held = daemon::HandedFds::kFdsPerUid;
  while (held + daemon::HandedFds::kFdsPerUid <= daemon::HandedFds::kFdsTotal) {
    for (size_t i = 0; i < daemon::HandedFds::kFdsPerUid / 64; ++i) REQUIRE(handed.put(uid, many(64)).ok());
    held += daemon::HandedFds::kFdsPerUid;
    ++uid;
  }
  const size_t pending = handed.pending();
  const auto refused = handed.put(uid, many(64));
  CHECK(refused.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(refused.status().message()), Catch::Contains("handed-over descriptors not yet registered"));
  CHECK(handed.pending() == pending);
  CHECK(handed.take(tokens.back(), 1000, false).ok());  // the first uid's newest is still there
}

TEST_CASE("handed descriptors: a socket handed over with a long linger is closed at once",
          "[daemon][fd-channel][security]") {
  int pair[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
  OwnedFd client(pair[0]), daemon_end(pair[1]);
  OwnedFd lingering(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const linger forever{1, 100000};
  REQUIRE(::setsockopt(lingering.get(), SOL_SOCKET, SO_LINGER, &forever, sizeof(forever)) == 0);
  char header[8] = {'S', 'C', 'F', 'D', 1, 1, 0, 0};
  iovec iov{header, sizeof(header)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  const int fd = lingering.get();
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  REQUIRE(::sendmsg(client.get(), &msg, 0) == sizeof(header));
  auto got = receiveHandedFds(daemon_end.get());
  REQUIRE(got.ok());
  REQUIRE(got->size() == 1);
  linger now{};
  socklen_t len = sizeof(now);
  REQUIRE(::getsockopt((*got)[0].get(), SOL_SOCKET, SO_LINGER, &now, &len) == 0);
  CHECK(now.l_onoff == 1);
  CHECK(now.l_linger == 0);  // the received descriptor's close never waits
}

TEST_CASE("handed descriptors: a channel served by another uid gets none (the client reads SO_PEERCRED first)",
          "[daemon][fd-channel][security]") {
  if (::geteuid() != 0) SHARDCAST_SKIP("needs root (to run the squatter as uid 65534)");
  char dir_template[] = "/tmp/shardcast-squat-XXXXXX";
  REQUIRE(::mkdtemp(dir_template) != nullptr);
  REQUIRE(::chmod(dir_template, 0777) == 0);
  const std::string path = fdChannelPath(std::string(dir_template) + "/d.sock");
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  // uid 65534 in the daemon's place: it binds the channel's path and takes whatever comes.
  const pid_t squatter = ::fork();
  REQUIRE(squatter >= 0);
  if (squatter == 0) {  // only system calls until _exit
    ::close(ready[0]);
    if (::setresgid(65534, 65534, 65534) != 0 || ::setresuid(65534, 65534, 65534) != 0) ::_exit(2);
    const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    if (::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(s, 4) != 0) ::_exit(3);
    const char up = 1;
    if (::write(ready[1], &up, 1) != 1) ::_exit(4);
    for (;;) {
      const int c = ::accept(s, nullptr, nullptr);
      char buf[64];
      if (c >= 0 && ::read(c, buf, sizeof(buf)) >= 0) ::close(c);  // the message read, no answer
    }
  }
  ::close(ready[1]);
  char up = 0;
  CHECK(::read(ready[0], &up, 1) == 1);
  ::close(ready[0]);
  OwnedFd memfd(::memfd_create("shardcast-test-squat", MFD_CLOEXEC));
  const auto refused = handOverFds(path, {memfd.get()});
  CHECK(refused.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK_THAT(std::string(refused.status().message()), Catch::Contains("is served by uid 65534"));
  // Named as a daemon uid (a DaemonSet's non-root daemon), it is believed: the descriptors go, and
  // it answers nothing.
  CHECK(handOverFds(path, {memfd.get()}, {65534}).status().code() == absl::StatusCode::kUnavailable);
  ::kill(squatter, SIGKILL);
  ::waitpid(squatter, nullptr, 0);
  ::unlink(path.c_str());
  ::rmdir(dir_template);
}
