// Transport benchmark: moves N bytes between two processes through shardcast's transport (not raw
// UCX) and prints GB/s; then the node-local copy engine against plain memcpy, and the time to
// register 1,000 regions of 1 MiB. bench/transport.sh runs it beside ucx_perftest.
//
//   build/bin/transport_bench [--tls T] [--protocol auto|put|am] [--sizes 64,256,1024] [--iters N]
//                             [--window N] [--pairs N] [--memory transport|shm]
//   sizes in MiB, or KiB with a k suffix (256k); --window: writes in flight (default 2);
//   --pairs N: N sender/receiver pairs write at once (2N processes), the figure is their sum;
//   --memory shm: both ends in POSIX shared memory, as ranks are. The child receiver is this
//   binary started with --role recv.
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <future>
#include <sstream>
#include <vector>

#include "tests/transport/process.h"
#include "transport/copy_engine.h"
#include "transport/shm.h"
#include "transport/transport.h"

using namespace shardcast;
using namespace shardcast::transport;
using namespace shardcast::testing;
using Clock = std::chrono::steady_clock;

namespace {

std::string arg(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == name) return argv[i + 1];
  return fallback;
}

std::string label(size_t bytes) {
  return bytes % (1 << 20) ? fmt::format("{} KiB", bytes >> 10) : fmt::format("{} MiB", bytes >> 20);
}

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

int receiver(const TransportOptions& o, size_t size, bool shm) {
  auto ctx = createContext(o);
  if (!ctx.ok()) {
    std::printf("ERROR %s\n", std::string(ctx.status().message()).c_str());
    return 1;
  }
  // A landing buffer as the daemon allocates it (shareable with same-host peers), or a rank's
  // POSIX shared memory as clients register it.
  StatusOr<ShmSegment> segment = absl::UnavailableError("not used");
  if (shm) segment = ShmSegment::create(fmt::format("/shardcast-bench-{}", getpid()), size);
  auto region =
      shm ? (segment.ok() ? (*ctx)->registerMemory(segment->data(), size, MemoryKind::kHost) : segment.status())
          : (*ctx)->allocateMemory(size);
  if (!region.ok()) return 1;
  std::memset((*region)->data(), 0, size);  // fault the pages in before timing starts
  const WriteKey key = WriteKey::random();  // as a sync attempt opens its landing memory
  if (!(*ctx)->openFence(key, {{(*region)->remote().base, size}})) return 1;
  std::printf("ADDRESS %s\nREGION %s\nKEY %s\n", toHex((*ctx)->address()).c_str(),
              toHex((*region)->remote().serialize()).c_str(), toHex(std::string(key.view())).c_str());
  std::fflush(stdout);
  char line[64];
  while (std::fgets(line, sizeof(line), stdin)) {
  }
  return 0;
}

struct Span {
  Clock::time_point start, end;
  double gbs(size_t bytes) const { return static_cast<double>(bytes) / seconds(start, end) / 1e9; }
};

int64_t nanos(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}
Clock::time_point fromNanos(int64_t ns) { return Clock::time_point(std::chrono::nanoseconds(ns)); }

// Moves `iters` messages of `size` bytes with up to `window` in flight; returns when it started and ended.
Span measure(Endpoint& ep, const std::shared_ptr<MemoryRegion>& src, const RemoteRegion& dst, const WriteKey& key,
             size_t size, int iters, int window) {
  std::mutex mu;
  std::condition_variable cv;
  int in_flight = 0, failed = 0;
  auto one = [&] {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return in_flight < window; });
    ++in_flight;
    lock.unlock();
    ep.write({src, 0, dst, 0, size, key}, [&](Status st) {
      std::lock_guard<std::mutex> l(mu);
      --in_flight;
      if (!st.ok()) ++failed;
      cv.notify_all();
    });
  };
  one();  // warm-up (connection, rkey, protocol selection)
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return in_flight == 0; });
  }
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) one();
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return in_flight == 0; });
  const auto t1 = Clock::now();
  if (failed) fmt::print("  {} writes failed\n", failed);
  return {t0, t1};
}

// --pairs N: N sender processes (each with its own receiver) write at once, as the daemons of a
// sync share the machine; the figure is all their bytes over the span from the first start to
// the last end. Each sender runs this binary with --role pair and measures when told to.
int concurrentPairs(int pairs, const std::vector<std::string>& args, const std::vector<size_t>& sizes, int iters,
                    int window) {
  std::vector<Child> senders;
  for (int i = 0; i < pairs; ++i) {
    std::vector<std::string> argv{"/proc/self/exe"};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.insert(argv.end(), {"--role", "pair"});
    senders.push_back(Child::spawn(argv));
    if (senders.back().readLine(std::chrono::seconds(60)) != "READY") {
      fmt::print(stderr, "sender {} did not start\n", i);
      return 1;
    }
  }
  for (size_t size : sizes) {
    for (auto& s : senders) s.writeLine("GO");
    int64_t first = INT64_MAX, last = 0;
    for (auto& s : senders) {
      std::istringstream line(s.readLine(std::chrono::minutes(10)));
      std::string tag;
      int64_t a = 0, b = 0;
      if (!(line >> tag >> a >> b) || tag != "SPAN") {
        fmt::print(stderr, "a sender failed\n");
        return 1;
      }
      first = std::min(first, a);
      last = std::max(last, b);
    }
    const double gbs =
        Span{fromNanos(first), fromNanos(last)}.gbs(size * static_cast<size_t>(iters) * static_cast<size_t>(pairs));
    fmt::print("  write {:>9} x {:>2} ({} in flight) on {} pairs at once: {:6.2f} GB/s in all\n", label(size), iters,
               window, pairs, gbs);
    fmt::print("RESULT transport_pairs {} {} {:.3f}\n", pairs, size, gbs);
  }
  for (auto& s : senders) {
    s.closeStdin();
    s.wait();
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  TransportOptions o;
  const std::string tls = arg(argc, argv, "--tls", "");
  const std::string protocol = arg(argc, argv, "--protocol", "auto");
  o.settings = {{"ucx.tls", tls}, {"ucx.protocol", protocol}};
  if (const Status checked = checkOptions(o); !checked.ok()) {
    fmt::print(stderr, "{}\n", std::string(checked.message()));
    return 2;
  }
  o.name = "bench";
  std::vector<size_t> sizes;
  std::stringstream ss(arg(argc, argv, "--sizes", "64,256,1024"));
  for (std::string s; std::getline(ss, s, ',');) {
    const bool kib = !s.empty() && (s.back() == 'k' || s.back() == 'K');
    sizes.push_back(std::stoull(s) << (kib ? 10 : 20));
  }
  const size_t max_size = *std::max_element(sizes.begin(), sizes.end());
  const int iters = std::stoi(arg(argc, argv, "--iters", "8"));
  const int window = std::max(1, std::stoi(arg(argc, argv, "--window", "2")));
  const std::string memory = arg(argc, argv, "--memory", "transport");
  if (memory != "transport" && memory != "shm") {
    fmt::print(stderr, "--memory must be transport or shm\n");
    return 2;
  }
  const std::string role = arg(argc, argv, "--role", "send");
  if (role == "recv") return receiver(o, max_size, memory == "shm");
  const int pairs = std::max(1, std::stoi(arg(argc, argv, "--pairs", "1")));
  if (role == "send" && pairs > 1) {
    return concurrentPairs(pairs,
                           {"--tls", tls, "--protocol", protocol, "--sizes", arg(argc, argv, "--sizes", "64,256,1024"),
                            "--iters", std::to_string(iters), "--window", std::to_string(window), "--memory", memory},
                           sizes, iters, window);
  }

  Child child = Child::spawn({"/proc/self/exe", "--role", "recv", "--tls", tls, "--protocol", protocol, "--sizes",
                              std::to_string(max_size >> 10) + "k", "--memory", memory});
  const std::string a = child.readLine(std::chrono::seconds(60)), g = child.readLine(std::chrono::seconds(60)),
                    k = child.readLine(std::chrono::seconds(60));
  if (a.rfind("ADDRESS ", 0) != 0 || g.rfind("REGION ", 0) != 0 || k.rfind("KEY ", 0) != 0) {
    fmt::print(stderr, "receiver did not start: {} {} {}\n", a, g, k);
    return 1;
  }
  auto ctx = createContext(o);
  if (!ctx.ok()) return 1;
  std::vector<unsigned char> src(max_size);
  fillPattern(src.data(), src.size(), 1);
  StatusOr<ShmSegment> segment = absl::UnavailableError("not used");
  if (memory == "shm") {
    segment = ShmSegment::create(fmt::format("/shardcast-bench-{}", getpid()), max_size);
    if (!segment.ok()) return 1;
    std::memcpy(segment->data(), src.data(), max_size);
  }
  auto region = (*ctx)->registerMemory(memory == "shm" ? segment->data() : src.data(), src.size(), MemoryKind::kHost);
  auto remote = RemoteRegion::parse(fromHex(g.substr(7)));
  auto key = WriteKey::fromBytes(fromHex(k.substr(4)));
  auto ep = (*ctx)->connect(fromHex(a.substr(8)), "bench-receiver");
  if (!region.ok() || !remote.ok() || !ep.ok() || !key.ok()) {
    fmt::print(stderr, "setup failed\n");
    return 1;
  }
  if (role == "pair") {  // one of --pairs: measure each size when the parent says so
    std::printf("READY\n");
    std::fflush(stdout);
    char line[64];
    for (size_t size : sizes) {
      if (!std::fgets(line, sizeof(line), stdin)) return 1;
      const Span span = measure(**ep, *region, *remote, *key, size, iters, window);
      std::printf("SPAN %lld %lld\n", static_cast<long long>(nanos(span.start)),
                  static_cast<long long>(nanos(span.end)));
      std::fflush(stdout);
    }
    child.closeStdin();
    child.wait();
    return 0;
  }
  fmt::print("transport {} (UCX_TLS={})\n", (*ctx)->describe(), tls.empty() ? "default" : tls);
  for (size_t size : sizes) {
    const double gbs =
        measure(**ep, *region, *remote, *key, size, iters, window).gbs(size * static_cast<size_t>(iters));
    fmt::print("  write {:>9} x {:>2} ({} in flight): {:6.2f} GB/s\n", label(size), iters, window, gbs);
    fmt::print("RESULT transport {} {:.3f}\n", size, gbs);
  }
  child.closeStdin();
  child.wait();

  // Node-local copy engine against memcpy, same size, pages already faulted in.
  auto engine = makeHostCopyEngine();
  std::vector<unsigned char> dst(max_size, 0);
  for (size_t size : sizes) {
    const int n = std::max(2, iters);
    std::memcpy(dst.data(), src.data(), size);  // warm-up: pages and caches as for the engine
    auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) std::memcpy(dst.data(), src.data(), size);
    auto t1 = Clock::now();
    StridedView d{reinterpret_cast<std::byte*>(dst.data()), MemoryKind::kHost, 0, {1}};
    StridedView s{reinterpret_cast<std::byte*>(src.data()), MemoryKind::kHost, 0, {1}};
    // A 2-D box of rows of 1 KiB: the shape fan-out copies have.
    const std::vector<int64_t> extent{static_cast<int64_t>(size >> 10), int64_t{1} << 10};
    d.strides = s.strides = {int64_t{1} << 10, 1};
    auto t2 = Clock::now();
    for (int i = 0; i < n; ++i) (void)engine->copy(d, s, extent, 1);
    auto t3 = Clock::now();
    const double mem = static_cast<double>(size) * n / seconds(t0, t1) / 1e9;
    const double eng = static_cast<double>(size) * n / seconds(t2, t3) / 1e9;
    fmt::print("  local copy {:>9}: engine {:6.2f} GB/s, memcpy {:6.2f} GB/s ({:.0f}%)\n", label(size), eng, mem,
               100 * eng / mem);
    fmt::print("RESULT copy {} {:.3f} {:.3f}\n", size, eng, mem);
  }

  // Registration: 1,000 regions of 1 MiB (each registered once; the daemon never registers per sync).
  std::vector<std::vector<unsigned char>> bufs(1000, std::vector<unsigned char>(1 << 20, 1));
  std::vector<std::shared_ptr<MemoryRegion>> regions;
  auto t0 = Clock::now();
  for (auto& b : bufs) {
    auto r = (*ctx)->registerMemory(b.data(), b.size(), MemoryKind::kHost);
    if (r.ok()) regions.push_back(*r);
  }
  auto t1 = Clock::now();
  fmt::print("  register 1000 x 1 MiB: {:.1f} ms ({:.1f} us each)\n", seconds(t0, t1) * 1e3, seconds(t0, t1) * 1e3);
  fmt::print("RESULT register_ms {:.3f}\n", seconds(t0, t1) * 1e3);
  return 0;
}
