// A local client of another uid, for security_test.cc (run there through setpriv): registers a
// rank of its own, then tries to take what belongs to another user. Prints one line per attempt,
// "<step> <status code name>", and exits 0 once every attempt was made.
//   foreign_caller SOCKET LAYOUT_JSON VICTIM_SEGMENT VICTIM_GROUP
//   foreign_caller sync SOCKET LAYOUT_JSON VICTIM_SOURCE VICTIM_DESTINATION
//       registers a source "mine-src" (version 1) and a destination "mine-dst" of its own with the
//       layout, then syncs the victim's source into its destination ("read") and its source into
//       the victim's destination as version 100 ("write")
//   foreign_caller replica SOCKET LAYOUT_JSON GROUP SET ID VERSION
//       registers a source "GROUP-src" of its own at VERSION (every byte 0x07) and a destination
//       GROUP; with SET non-empty GROUP is replica ID of set SET, and GROUP-src is synced into it
//       (its own: allowed), so it reports ready(VERSION) with 0x07 bytes. Prints "ready <code>",
//       then holds its ranks until EOF on stdin
//   foreign_caller rank SOCKET LAYOUT_JSON GROUP RANK VERSION
//       registers rank RANK of GROUP (the layout's group renamed) in memory of its own, every byte
//       0x07: a source at VERSION when VERSION > 0, else a destination. Prints "registered <code>",
//       holds the rank until EOF on stdin, then prints "untouched 1" when its memory still holds
//       only 0x07 (no sync wrote it), "untouched 0" otherwise
//   foreign_caller torch SOCKET LAYOUT_JSON GROUP SEGMENT
//       in a session, registers rank 0 of GROUP (a destination; one buffer "w" of 64 bytes) in a
//       segment SEGMENT it makes, named as torch names its own. Prints "registered <code>", holds
//       the rank until EOF on stdin, then exits leaving the segment linked: what a torch process
//       killed with its torch_shm_manager leaves
//   foreign_caller flood SOCKET N
//       opens N connections to the socket and keeps them; prints "held K" (those the daemon did not
//       close), then waits for EOF on stdin
//   foreign_caller churn SOCKET THREADS
//       connects and closes again in a loop on THREADS threads, as fast as the socket takes them;
//       prints "churning", then stops at EOF on stdin and prints "connects K refused R served S":
//       of the K connections the socket took, R the daemon closed at once and S it served (gRPC's
//       server preface arrived)
//   foreign_caller hang SOCKET GROUP N TIMEOUT_MS
//       starts N Syncs of a source nobody registers into GROUP (waiting for its ranks) and N
//       WaitVersions of GROUP at a version it never reaches, each with TIMEOUT_MS; prints
//       "calling N" and waits for the kill that ends it (its calls end with it, unanswered)
#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <thread>

#include "client/lib/client.h"
#include "planner/layout.h"
#include "transport/shm.h"

using namespace shardcast;

namespace {

void report(const char* step, const Status& st) {
  std::printf("%s %s\n", step, absl::StatusCodeToString(st.code()).c_str());
  if (!st.ok()) std::fprintf(stderr, "%s: %s\n", step, std::string(st.message()).c_str());
}

}  // namespace

// The sync attempts across uids.
int syncs(const std::string& socket, const char* json, const std::string& victim_src, const std::string& victim_dst) {
  auto client = Client::connect("unix:" + socket);
  if (!client.ok()) return 1;
  auto layout = planner::parseLayoutJson(json, "mine");
  if (!layout.ok()) return 1;
  auto src_memory = HostTensors::forRank(*layout, 0), dst_memory = HostTensors::forRank(*layout, 0);
  if (!src_memory.ok() || !dst_memory.ok()) return 1;
  layout->set_group("mine-src");
  RegisterOptions source = RegisterOptions::source(100), destination;
  source.replace = destination.replace = true;  // its own, from an earlier run
  report("own-source", client->registerRank(*layout, 0, *src_memory, source).status());
  layout->set_group("mine-dst");
  report("own-destination", client->registerRank(*layout, 0, *dst_memory, destination).status());
  report("read", client->sync(victim_src, "mine-dst", 1).status());
  report("write", client->sync("mine-src", victim_dst, 100).status());
  return 0;
}

// A replica (or a plain group) of its own in someone else's replica set, holding its own bytes.
int replica(const std::string& socket, const char* json, const std::string& group, const std::string& set, int id,
            uint64_t version) {
  auto client = Client::connect("unix:" + socket);
  if (!client.ok()) return 1;
  auto layout = planner::parseLayoutJson(json, "mine");
  if (!layout.ok()) return 1;
  auto src_memory = HostTensors::forRank(*layout, 0), dst_memory = HostTensors::forRank(*layout, 0);
  if (!src_memory.ok() || !dst_memory.ok()) return 1;
  for (const auto& [name, slot] : src_memory->buffers()) {
    const auto bytes = src_memory->bytes(name);
    std::memset(bytes.data(), 0x07, bytes.size());
  }
  const std::string own_source = group + "-src";
  layout->set_group(own_source);
  RegisterOptions source = RegisterOptions::source(version);
  Status st = client->registerRank(*layout, 0, *src_memory, source).status();
  layout->set_group(group);
  if (!set.empty()) {
    layout->set_replica_set(set);
    layout->set_replica(id);
  }
  if (st.ok()) st = client->registerRank(*layout, 0, *dst_memory).status();
  if (st.ok() && !set.empty()) st = client->sync(own_source, group, version).status();
  report("ready", st);
  std::fflush(stdout);
  for (std::string line; std::getline(std::cin, line);) {
  }
  return 0;
}

// One rank of a group, in memory of its own: another node's missing rank of someone's group, say.
int rank(const std::string& socket, const char* json, const std::string& group, int32_t r, uint64_t version) {
  auto client = Client::connect("unix:" + socket);
  if (!client.ok()) return 1;
  auto layout = planner::parseLayoutJson(json, group);
  if (!layout.ok()) return 1;
  layout->set_group(group);
  auto memory = HostTensors::forRank(*layout, r);
  if (!memory.ok()) return 1;
  for (const auto& [name, slot] : memory->buffers()) {
    const auto bytes = memory->bytes(name);
    std::memset(bytes.data(), 0x07, bytes.size());
  }
  const RegisterOptions options = version > 0 ? RegisterOptions::source(version) : RegisterOptions{};
  report("registered", client->registerRank(*layout, r, *memory, options).status());
  std::fflush(stdout);
  for (std::string line; std::getline(std::cin, line);) {
  }
  bool untouched = true;
  for (const auto& [name, slot] : memory->buffers())
    for (const std::byte b : memory->bytes(name)) untouched = untouched && b == std::byte{0x07};
  std::printf("untouched %d\n", untouched ? 1 : 0);
  return 0;
}

// A segment named as torch's, registered in a session and left linked when it exits.
int torchSegment(const std::string& socket, const char* json, const std::string& group, const std::string& segment) {
  auto client = Client::connect("unix:" + socket);
  if (!client.ok() || !client->startSession().ok()) return 1;
  auto layout = planner::parseLayoutJson(json, group);
  if (!layout.ok()) return 1;
  layout->set_group(group);
  auto memory = transport::ShmSegment::create(segment, 4096, /*unlink_on_close=*/false);
  if (!memory.ok()) return 1;
  v1::MemoryHandle h;
  h.set_buffer("w");
  h.mutable_shm()->set_name(segment);
  h.mutable_shm()->set_size(64);
  report("registered", client->registerRank(*layout, 0, std::vector<v1::MemoryHandle>{h}).status());
  std::fflush(stdout);
  for (std::string line; std::getline(std::cin, line);) {
  }
  return 0;
}

// Idle connections, as many as it can hold.
int flood(const std::string& socket, int n) {
  std::vector<int> fds;
  for (int i = 0; i < n; ++i) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, socket.c_str(), sizeof(addr.sun_path) - 1);
    if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return 1;
    fds.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  int held = 0;
  for (const int fd : fds) {
    pollfd p{fd, POLLIN, 0};
    char c;
    // Closed by the daemon: readable with EOF. Held: nothing to read (gRPC waits for the preface).
    const bool closed = ::poll(&p, 1, 0) > 0 && ::recv(fd, &c, 1, MSG_DONTWAIT | MSG_PEEK) == 0;
    held += !closed;
  }
  std::printf("held %d\n", held);
  std::fflush(stdout);
  for (std::string line; std::getline(std::cin, line);) {
  }
  for (const int fd : fds) ::close(fd);
  return 0;
}

// Connections made and dropped as fast as the socket takes them, until EOF on stdin; each one
// the socket took is read first: EOF (the daemon closed it at accept) or gRPC's preface (served).
int churn(const std::string& socket, int threads) {
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> connects{0}, refused{0}, served{0};
  std::vector<std::thread> loops;
  for (int t = 0; t < threads; ++t)
    loops.emplace_back([&] {
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      std::strncpy(addr.sun_path, socket.c_str(), sizeof(addr.sun_path) - 1);
      while (!stop) {
        const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) continue;
        if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
          ++connects;
          pollfd p{fd, POLLIN, 0};
          char c;
          if (::poll(&p, 1, 2000) > 0) {
            const ssize_t n = ::recv(fd, &c, 1, MSG_DONTWAIT);
            if (n == 0) ++refused;
            if (n > 0) ++served;
          }
        }
        ::close(fd);
      }
    });
  std::printf("churning\n");
  std::fflush(stdout);
  for (std::string line; std::getline(std::cin, line);) {
  }
  stop = true;
  for (auto& l : loops) l.join();
  std::printf("connects %llu refused %llu served %llu\n", static_cast<unsigned long long>(connects.load()),
              static_cast<unsigned long long>(refused.load()), static_cast<unsigned long long>(served.load()));
  return 0;
}

// Calls that wait for what never comes, until this process is killed.
int hang(const std::string& socket, const std::string& group, int n, uint32_t timeout_ms) {
  auto stub = v1::Shardcast::NewStub(grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  std::vector<std::thread> calls;
  for (int i = 0; i < n; ++i) {
    calls.emplace_back([&] {
      v1::SyncRequest s;
      s.set_src_group("never-registered");
      s.set_dst_group(group);
      s.set_version(1);
      s.mutable_options()->set_wait_for_ranks(true);
      s.mutable_options()->set_timeout_ms(timeout_ms);
      grpc::ClientContext ctx;
      v1::SyncResponse out;
      const grpc::Status st = stub->Sync(&ctx, s, &out);
      std::fprintf(stderr, "sync ended: %s\n", st.error_message().c_str());
    });
    calls.emplace_back([&] {
      v1::WaitVersionRequest w;
      w.set_group(group);
      w.set_version(1000);
      w.set_timeout_ms(timeout_ms);
      grpc::ClientContext ctx;
      v1::WaitVersionResponse out;
      const grpc::Status st = stub->WaitVersion(&ctx, w, &out);
      std::fprintf(stderr, "wait ended: %s\n", st.error_message().c_str());
    });
  }
  std::printf("calling %d\n", n);
  std::fflush(stdout);
  for (auto& t : calls) t.join();
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 6 && std::string(argv[1]) == "hang")
    return hang(argv[2], argv[3], std::stoi(argv[4]), static_cast<uint32_t>(std::stoul(argv[5])));
  if (argc == 4 && std::string(argv[1]) == "flood") return flood(argv[2], std::stoi(argv[3]));
  if (argc == 4 && std::string(argv[1]) == "churn") return churn(argv[2], std::stoi(argv[3]));
  if (argc == 6 && std::string(argv[1]) == "sync") return syncs(argv[2], argv[3], argv[4], argv[5]);
  if (argc == 6 && std::string(argv[1]) == "torch") return torchSegment(argv[2], argv[3], argv[4], argv[5]);
  if (argc == 7 && std::string(argv[1]) == "rank")
    return rank(argv[2], argv[3], argv[4], std::stoi(argv[5]), std::stoull(argv[6]));
  if (argc == 8 && std::string(argv[1]) == "replica")
    return replica(argv[2], argv[3], argv[4], argv[5], std::stoi(argv[6]), std::stoull(argv[7]));
  if (argc != 5) {
    std::fprintf(stderr, "usage: foreign_caller SOCKET LAYOUT_JSON VICTIM_SEGMENT VICTIM_GROUP\n");
    return 2;
  }
  const std::string victim_segment = argv[3], victim_group = argv[4];
  auto client = Client::connect(std::string("unix:") + argv[1]);
  if (!client.ok()) {
    std::fprintf(stderr, "%s\n", std::string(client.status().message()).c_str());
    return 1;
  }
  auto layout = planner::parseLayoutJson(argv[2], "mine");
  if (!layout.ok()) return 1;
  layout->set_group("mine");
  // Its own memory: fine.
  auto own = HostTensors::forRank(*layout, 0);
  if (!own.ok()) return 1;
  report("own", client->registerRank(*layout, 0, *own).status());
  // Someone else's segment (which it cannot open itself) named in a rank of its own: the daemon
  // must not open it on its behalf.
  std::vector<v1::MemoryHandle> handles = own->handles();
  for (auto& h : handles) h.mutable_shm()->set_name(victim_segment);
  layout->set_group("stolen");
  report("theirs", client->registerRank(*layout, 0, handles).status());
  // Someone else's rank: not its to re-register, unregister, acquire, publish or release.
  layout->set_group(victim_group);
  report("reregister", client->registerRank(*layout, 0, *own).status());
  auto own1 = HostTensors::forRank(*layout, 1);  // a rank of the victim's group it has not registered
  if (!own1.ok()) return 1;
  report("join", client->registerRank(*layout, 1, *own1).status());
  report("unregister", client->unregisterRank(victim_group, 0));
  report("acquire", client->acquire(victim_group, 0, std::chrono::milliseconds(100)).status());
  report("publish", client->publish(victim_group, 0, 1000).status());
  return 0;
}
