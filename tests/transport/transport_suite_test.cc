// The shared backend suite: every test runs against every backend and protocol (loopback; UCX
// with its default transports, with tcp (active messages, and put), with posix/sysv shared memory
// (put, and active messages), and tcp with UCX's own segment size). Every byte written is verified.
#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <future>
#include <mutex>
#include <random>
#include <thread>

#include "tests/support/skip.h"
#include "tests/transport/process.h"
#include "transport/transport.h"
#include "transport/ucx/ucx_options.h"

using namespace shardcast;
using namespace shardcast::transport;
using namespace shardcast::testing;

namespace {

struct Loopback {
  static TransportOptions options() {
    TransportOptions o;
    o.backend = "loopback";
    return o;
  }
};
struct UcxDefault {
  static TransportOptions options() { return TransportOptions{}; }
};
struct UcxTcpAm {
  static TransportOptions options() {
    TransportOptions o;
    o.settings["ucx.tls"] = "tcp";  // auto -> am
    return o;
  }
};
struct UcxTcpAmUcxSegment {  // UCX's own 64 KiB TCP segments instead of the 1 MiB default
  static TransportOptions options() {
    TransportOptions o;
    o.settings["ucx.tls"] = "tcp";
    o.settings["ucx.tcp_segment_bytes"] = "0";
    return o;
  }
};
struct UcxTcpPut {
  static TransportOptions options() {
    TransportOptions o;
    o.settings["ucx.tls"] = "tcp";
    o.settings["ucx.protocol"] = "put";
    return o;
  }
};
struct UcxShmPut {
  static TransportOptions options() {
    TransportOptions o;
    o.settings["ucx.tls"] = "posix,sysv,self";  // auto -> put
    return o;
  }
};
struct UcxShmAm {
  static TransportOptions options() {
    TransportOptions o;
    o.settings["ucx.tls"] = "posix,sysv,self";
    o.settings["ucx.protocol"] = "am";
    return o;
  }
};

// What a context of these options can do, asked of one made for the purpose (nothing asserted:
// a test may still skip after asking). Default capabilities where none can be made.
template <typename B>
Capabilities capabilitiesOf() {
  auto c = createContext(B::options());
  return c.ok() ? (*c)->capabilities() : Capabilities{};
}

Status await(const std::function<void(Completion)>& start, std::chrono::seconds limit = std::chrono::seconds(120)) {
  auto p = std::make_shared<std::promise<Status>>();
  auto f = p->get_future();
  start([p](Status st) { p->set_value(st); });
  if (f.wait_for(limit) != std::future_status::ready)
    return absl::DeadlineExceededError("test: operation did not complete");
  return f.get();
}

std::shared_ptr<MemoryRegion> reg(Context& c, std::vector<unsigned char>& buf) {
  auto r = c.registerMemory(buf.data(), buf.size(), MemoryKind::kHost);
  INFO((r.ok() ? "" : std::string(r.status().message())));
  REQUIRE(r.ok());
  return *r;
}

// Two contexts of one backend: A writes into B, under a key B holds open over the memory it
// offers as landing memory (landing()).
template <typename B>
struct Pair {
  std::unique_ptr<Context> a, b;
  std::shared_ptr<Endpoint> ep;
  WriteKey key = WriteKey::random();
  std::vector<LandingRange> ranges;
  // Registers `buf` with B and opens the key over it too.
  std::shared_ptr<MemoryRegion> landing(std::vector<unsigned char>& buf) { return land(reg(*b, buf)); }
  std::shared_ptr<MemoryRegion> land(std::shared_ptr<MemoryRegion> r) {
    ranges.push_back({r->remote().base, r->size()});
    REQUIRE(b->closeFence(key, std::chrono::seconds(0)));  // opened again with every range so far
    REQUIRE(b->openFence(key, ranges));
    return r;
  }
  explicit Pair() {
    auto oa = B::options(), ob = B::options();
    oa.name = "sender";
    ob.name = "receiver";
    auto ca = createContext(oa);
    auto cb = createContext(ob);
    REQUIRE(ca.ok());
    REQUIRE(cb.ok());
    a = std::move(*ca);
    b = std::move(*cb);
    auto e = a->connect(b->address(), "receiver");
    INFO((e.ok() ? "" : std::string(e.status().message())));
    REQUIRE(e.ok());
    ep = *e;
  }
};

}  // namespace

#define BACKENDS Loopback, UcxDefault, UcxTcpAm, UcxTcpAmUcxSegment, UcxTcpPut, UcxShmPut, UcxShmAm

TEMPLATE_TEST_CASE("writes of 1 byte to 256 MiB at unaligned offsets arrive intact", "[transport][slow]", BACKENDS) {
  Pair<TestType> p;
  INFO(p.a->describe());
  const size_t kMax = size_t{256} << 20;
  std::vector<unsigned char> src(kMax + 64), dst(kMax + 64);
  fillPattern(src.data(), src.size(), 42);
  auto rs = reg(*p.a, src);
  auto rd = p.landing(dst);
  for (size_t size : {size_t{1}, size_t{7}, size_t{4099}, (size_t{1} << 20) + 5, size_t{64} << 20, kMax}) {
    const size_t so = size % 61, doff = (size * 7 + 3) % 59;
    std::memset(dst.data(), 0, dst.size());
    const Status st = await([&](Completion done) {
      p.ep->write({rs, so, rd->remote(), doff, size, p.key}, std::move(done));
    });
    INFO("size " << size);
    REQUIRE(st.ok());
    CHECK(checkPattern(dst.data() + doff, size, 42, so) == size);
    // Nothing outside the target range was touched.
    CHECK(std::all_of(dst.begin(), dst.begin() + doff, [](unsigned char c) { return c == 0; }));
    CHECK(std::all_of(dst.begin() + doff + size, dst.end(), [](unsigned char c) { return c == 0; }));
  }
}

TEMPLATE_TEST_CASE("many concurrent writes to disjoint ranges from several threads", "[transport]", BACKENDS) {
  Pair<TestType> p;
  const size_t kSlot = 40000;
  const int kThreads = 4, kPerThread = 100;
  std::vector<unsigned char> src(kSlot * kThreads * kPerThread), dst(src.size());
  fillPattern(src.data(), src.size(), 7);
  auto rs = reg(*p.a, src);
  auto rd = p.landing(dst);
  std::atomic<int> ok{0}, failed{0};
  std::vector<std::thread> threads;
  std::promise<void> all_done;
  std::atomic<int> left{kThreads * kPerThread};
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int i = 0; i < kPerThread; ++i) {
        const size_t slot = static_cast<size_t>(t * kPerThread + i) * kSlot;
        const size_t len = 1 + rng() % (kSlot - 1);  // each slot's bytes come from the same offset
        p.ep->write({rs, slot, rd->remote(), slot, len, p.key}, [&, len](Status st) {
          (st.ok() ? ok : failed)++;
          if (--left == 0) all_done.set_value();
        });
        (void)len;
      }
    });
  for (auto& th : threads) th.join();
  REQUIRE(all_done.get_future().wait_for(std::chrono::seconds(120)) == std::future_status::ready);
  CHECK(failed == 0);
  CHECK(ok == kThreads * kPerThread);
  // Every written byte equals the source; the rest of each slot is untouched (zero).
  for (int t = 0; t < kThreads; ++t) {
    std::mt19937 rng(t);
    for (int i = 0; i < kPerThread; ++i) {
      const size_t slot = static_cast<size_t>(t * kPerThread + i) * kSlot;
      const size_t len = 1 + rng() % (kSlot - 1);
      REQUIRE(checkPattern(dst.data() + slot, len, 7, slot) == len);
      REQUIRE(
          std::all_of(dst.begin() + slot + len, dst.begin() + slot + kSlot, [](unsigned char c) { return c == 0; }));
    }
  }
}

TEMPLATE_TEST_CASE("a batch of writes completes once, after all of them", "[transport]", BACKENDS) {
  Pair<TestType> p;
  std::vector<unsigned char> src(1 << 22), dst(1 << 22);
  fillPattern(src.data(), src.size(), 3);
  auto rs = reg(*p.a, src);
  auto rd = p.landing(dst);
  std::vector<WriteOp> ops;
  for (size_t off = 0; off < src.size(); off += 16384) ops.push_back({rs, off, rd->remote(), off, 16384 - 1, p.key});
  REQUIRE(await([&](Completion done) { p.ep->writeBatch(ops, std::move(done)); }).ok());
  for (size_t off = 0; off < src.size(); off += 16384) {
    REQUIRE(checkPattern(dst.data() + off, 16383, 3, off) == 16383);
    REQUIRE(dst[off + 16383] == 0);
  }
}

TEMPLATE_TEST_CASE("notifications are delivered after the data written before them", "[transport]", BACKENDS) {
  Pair<TestType> p;
  const size_t kSize = size_t{8} << 20;
  std::vector<unsigned char> src(kSize), dst(kSize);
  auto rs = reg(*p.a, src);
  auto rd = p.landing(dst);
  std::mutex mu;
  std::vector<std::string> seen;
  std::atomic<int> good{0}, bad{0};
  p.b->setNotificationHandler([&](std::string payload, const WriteKey&) {
    // Runs on B's progress thread: the data of round k must already be in place.
    const uint64_t seed = std::stoull(payload);
    (checkPattern(dst.data(), kSize, seed) == kSize ? good : bad)++;
    std::lock_guard<std::mutex> lock(mu);
    seen.push_back(payload);
  });
  for (uint64_t round = 1; round <= 10; ++round) {
    fillPattern(src.data(), kSize, round);
    // Two halves, then the notification, without waiting in between.
    std::promise<void> w1, w2;
    p.ep->write({rs, 0, rd->remote(), 0, kSize / 2, p.key}, [&](Status st) {
      CHECK(st.ok());
      w1.set_value();
    });
    p.ep->write({rs, kSize / 2, rd->remote(), kSize / 2, kSize / 2, p.key}, [&](Status st) {
      CHECK(st.ok());
      w2.set_value();
    });
    REQUIRE(await([&](Completion done) { p.ep->notify(std::to_string(round), p.key, std::move(done)); }).ok());
    w1.get_future().wait();
    w2.get_future().wait();
    // Wait for the handler to run before the source changes.
    for (int i = 0; i < 20000; ++i) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (seen.size() == round) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  CHECK(good == 10);
  CHECK(bad == 0);
  std::lock_guard<std::mutex> lock(mu);
  CHECK(seen == std::vector<std::string>{"1", "2", "3", "4", "5", "6", "7", "8", "9", "10"});
}

TEMPLATE_TEST_CASE("a write's notice reaches the handler once that write's bytes are in place", "[transport]",
                   BACKENDS) {
  Pair<TestType> p;
  constexpr size_t kPart = size_t{512} << 10;
  // Notices that ride in the write's header, and ones too long for it (UCX: 8 KiB headers)
  // that follow it; an empty write's notice; up to the largest notification taken.
  const std::vector<size_t> notice_bytes{1, 100, 7000, 16000, kMaxNotifyBytes, 40};
  const std::vector<size_t> lengths{kPart, kPart, kPart, kPart, kPart, 0};
  std::vector<unsigned char> src(kPart * lengths.size()), dst(src.size());
  auto rs = reg(*p.a, src);
  auto rd = p.landing(dst);
  std::mutex mu;
  std::vector<int> seen;
  int bad = 0;
  p.b->setNotificationHandler([&](std::string payload, const WriteKey&) {
    const int i = payload[0] - 'a';
    const bool in_place = checkPattern(dst.data() + i * kPart, lengths[i], 100 + i) == lengths[i];
    std::lock_guard<std::mutex> lock(mu);
    bad += !in_place || payload.size() != notice_bytes[i];
    seen.push_back(i);
  });
  for (int round = 0; round < 3; ++round) {
    std::fill(dst.begin(), dst.end(), 0);
    {
      std::lock_guard<std::mutex> lock(mu);
      seen.clear();
    }
    std::vector<std::future<Status>> writes;
    for (size_t i = 0; i < lengths.size(); ++i) {
      fillPattern(src.data() + i * kPart, lengths[i], 100 + i);
      WriteOp op{rs, i * kPart, rd->remote(), i * kPart, lengths[i], p.key};
      op.notice = std::string(notice_bytes[i], static_cast<char>('a' + i));
      auto done = std::make_shared<std::promise<Status>>();
      writes.push_back(done->get_future());
      p.ep->write(std::move(op), [done](Status st) { done->set_value(st); });
    }
    for (auto& w : writes) {
      REQUIRE(w.wait_for(std::chrono::seconds(60)) == std::future_status::ready);
      CHECK(w.get().ok());
    }
    for (int k = 0; k < 20000; ++k) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (seen.size() >= lengths.size()) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::lock_guard<std::mutex> lock(mu);
    std::sort(seen.begin(), seen.end());
    CHECK(seen == std::vector<int>{0, 1, 2, 3, 4, 5});  // each notice once
    CHECK(bad == 0);
  }
  WriteOp too_long{rs, 0, rd->remote(), 0, 8, p.key};
  too_long.notice = std::string(kMaxNotifyBytes + 1, 'x');
  const Status st = await([&](Completion done) { p.ep->write(std::move(too_long), std::move(done)); });
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
}

TEMPLATE_TEST_CASE("registration is reused for the same range and released with its region", "[transport]", BACKENDS) {
  Pair<TestType> p;
  std::vector<unsigned char> buf(1 << 20);
  auto r1 = reg(*p.b, buf);
  auto r2 = reg(*p.b, buf);
  CHECK(r1.get() == r2.get());
  auto r3 = p.b->registerMemory(buf.data() + 4096, 4096, MemoryKind::kHost);
  REQUIRE(r3.ok());
  CHECK(r3->get() != r1.get());
  CHECK_FALSE(p.b->registerMemory(nullptr, 10, MemoryKind::kHost).ok());
  CHECK(p.b->canAccess(MemoryKind::kHost));
}

TEMPLATE_TEST_CASE("bad ranges and closed endpoints fail with a clear error - connect replaces a closed endpoint",
                   "[transport]", BACKENDS) {
  Pair<TestType> p;
  std::vector<unsigned char> src(4096), dst(4096);
  auto rs = reg(*p.a, src);
  auto rd = p.landing(dst);
  Status st = await([&](Completion done) { p.ep->write({rs, 4000, rd->remote(), 0, 200, p.key}, std::move(done)); });
  CHECK(st.code() == absl::StatusCode::kOutOfRange);
  CHECK_THAT(std::string(st.message()), Catch::Contains("source range") && Catch::Contains("receiver"));
  st = await([&](Completion done) { p.ep->write({rs, 0, rd->remote(), 4000, 200, p.key}, std::move(done)); });
  CHECK_FALSE(st.ok());
  if (p.b->capabilities().target_checks_writes) {
    // A forged descriptor claiming more than was registered: the receiver refuses the range.
    RemoteRegion forged = rd->remote();
    forged.size = 1 << 20;
    st = await([&](Completion done) { p.ep->write({rs, 0, forged, 8192, 100, p.key}, std::move(done)); });
    CHECK(st.code() == absl::StatusCode::kAborted);
    CHECK_THAT(std::string(st.message()), Catch::Contains("write refused by the peer"));
  }
  CHECK(p.ep->open());
  p.ep->close();
  CHECK_FALSE(p.ep->open());
  st = await([&](Completion done) { p.ep->write({rs, 0, rd->remote(), 0, 100, p.key}, std::move(done)); });
  CHECK(st.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(st.message()), Catch::Contains("closed"));
  // The same peer again: a new endpoint, not the closed one, and it writes.
  auto again = p.a->connect(p.b->address(), "receiver");
  REQUIRE(again.ok());
  CHECK(again->get() != p.ep.get());
  CHECK((*again)->open());
  std::fill(src.begin(), src.end(), 0xab);
  st = await([&](Completion done) { (*again)->write({rs, 0, rd->remote(), 0, 100, p.key}, std::move(done)); });
  CHECK(st.ok());
  CHECK(dst[99] == 0xab);
  auto same = p.a->connect(p.b->address(), "receiver");
  REQUIRE(same.ok());
  CHECK(same->get() == again->get());  // an open endpoint is reused
}

TEMPLATE_TEST_CASE("a write lands only under a key open there, inside its ranges, and every refusal looks the same",
                   "[transport][security]", BACKENDS) {
  if (!capabilitiesOf<TestType>().target_checks_writes) {
    SHARDCAST_SKIP("writes land by remote key (put), without the target's check (docs/transport.md)");
  }
  Pair<TestType> p;
  std::vector<unsigned char> src(8192, 0x5a), offered(4096), private_memory(4096);
  auto rs = reg(*p.a, src);
  auto rd = p.landing(offered);
  auto rp = reg(*p.b, private_memory);  // registered, but no landing range of any key
  std::atomic<int> delivered{0};
  std::mutex mu;
  std::vector<std::string> names;  // of the notifications delivered, in order
  const WriteKey control = WriteKey::random();
  p.b->setNotificationHandler([&](std::string name, const WriteKey& key) {
    CHECK((key == p.key || key == control));
    std::lock_guard<std::mutex> lock(mu);
    names.push_back(std::move(name));
    ++delivered;
  });
  auto write = [&](const WriteOp& op) { return await([&](Completion done) { p.ep->write(op, std::move(done)); }); };
  const WriteKey guessed = WriteKey::random();
  std::vector<Status> refusals;
  refusals.push_back(write({rs, 0, rd->remote(), 0, 100, guessed}));  // a guessed key, an offered range
  refusals.push_back(write({rs, 0, rp->remote(), 0, 100, p.key}));    // the key, memory it does not open
  RemoteRegion beyond = rd->remote();
  beyond.size = 1 << 20;
  refusals.push_back(write({rs, 0, beyond, 4000, 200, p.key}));  // past the range (and the region)
  for (const Status& st : refusals) {
    CHECK(st.code() == absl::StatusCode::kAborted);
    // One answer: nothing says whether the range or the key was wrong.
    CHECK(st.message() == refusals.front().message());
  }
  CHECK(std::all_of(offered.begin(), offered.end(), [](unsigned char c) { return c == 0; }));
  CHECK(std::all_of(private_memory.begin(), private_memory.end(), [](unsigned char c) { return c == 0; }));
  // No key at all is refused before anything travels.
  CHECK(write({rs, 0, rd->remote(), 0, 100, WriteKey{}}).code() == absl::StatusCode::kInvalidArgument);
  // Under the key, inside its range: lands. Notifications: only under the open key.
  REQUIRE(write({rs, 0, rd->remote(), 0, 100, p.key}).ok());
  CHECK(offered[99] == 0x5a);
  REQUIRE(await([&](Completion done) { p.ep->notify("under the key", p.key, std::move(done)); }).ok());
  REQUIRE(await([&](Completion done) { p.ep->notify("guessed", guessed, std::move(done)); }).ok());
  for (int i = 0; i < 2000 && delivered < 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // Closed: the same write is refused with the same answer.
  CHECK(p.b->closeFence(p.key, std::chrono::seconds(5)));
  const Status closed = write({rs, 0, rd->remote(), 100, 100, p.key});
  CHECK(closed.code() == absl::StatusCode::kAborted);
  CHECK(closed.message() == refusals.front().message());
  CHECK(offered[100] == 0);
  REQUIRE(await([&](Completion done) { p.ep->notify("after close", p.key, std::move(done)); }).ok());
  // A positive control: a notification under a key still open, sent after it on the same
  // endpoint, is delivered; by then the one under the closed key would have been.
  REQUIRE(p.b->openFence(control, {}));
  REQUIRE(await([&](Completion done) { p.ep->notify("control", control, std::move(done)); }).ok());
  for (int i = 0; i < 10000 && delivered < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::lock_guard<std::mutex> lock(mu);
  CHECK(names == std::vector<std::string>{"under the key", "control"});  // not "after close" nor "guessed"
}

TEST_CASE("write keys: 128 random bits, parsed strictly", "[transport][security]") {
  const WriteKey a = WriteKey::random(), b = WriteKey::random();
  CHECK_FALSE(a.empty());
  CHECK(a != b);
  auto back = WriteKey::fromBytes(a.view());
  REQUIRE(back.ok());
  CHECK(*back == a);
  CHECK_FALSE(WriteKey::fromBytes(std::string(15, 'x')).ok());
  CHECK_FALSE(WriteKey::fromBytes(std::string(17, 'x')).ok());
  CHECK_FALSE(WriteKey::fromBytes(std::string(16, '\0')).ok());  // the old "fence 0": no key
}

TEST_CASE("remote region descriptors round-trip and reject garbage", "[transport]") {
  RemoteRegion r{0x1234, 99, std::string("rk\0ey", 5)};
  auto back = RemoteRegion::parse(r.serialize());
  REQUIRE(back.ok());
  CHECK(back->base == r.base);
  CHECK(back->size == r.size);
  CHECK(back->rkey == r.rkey);
  CHECK_FALSE(RemoteRegion::parse("nonsense").ok());
  std::string truncated = r.serialize();
  truncated.pop_back();
  CHECK_FALSE(RemoteRegion::parse(truncated).ok());
}

TEST_CASE("context options are validated, each backend's settings by that backend", "[transport]") {
  auto refusal = [](const TransportOptions& o) {
    const Status checked = checkOptions(o);
    auto c = createContext(o);
    CHECK_FALSE(c.ok());
    CHECK(checked.code() == absl::StatusCode::kInvalidArgument);
    CHECK(c.status() == checked);  // createContext refuses what checkOptions does, with its words
    return std::string(checked.message());
  };
  TransportOptions o;
  o.backend = "carrier-pigeon";
  CHECK_THAT(refusal(o), Catch::Contains("unknown transport backend \"carrier-pigeon\""));
  o = {};
  o.op_timeout = std::chrono::milliseconds(0);
  CHECK_THAT(refusal(o), Catch::Contains("op_timeout"));
  o = {};
  o.settings["tls"] = "tcp";
  CHECK_THAT(refusal(o), Catch::Contains("\"tls\" names no backend"));
  o = {};
  o.settings["ib.tls"] = "tcp";
  CHECK_THAT(refusal(o), Catch::Contains("\"ib.tls\" names no backend"));
  o = {};
  o.settings["ucx.tsl"] = "tcp";
  CHECK_THAT(refusal(o), Catch::Contains("unknown transport setting \"ucx.tsl\""));
  o.settings = {{"ucx.protocol", "telepathy"}};
  CHECK_THAT(refusal(o), Catch::Contains("ucx.protocol") && Catch::Contains("expected auto, put or am"));
  o.settings = {{"ucx.tcp_segment_bytes", "1M"}};
  CHECK_THAT(refusal(o), Catch::Contains("ucx.tcp_segment_bytes=\"1M\""));
  o.settings = {{"ucx.tcp_segment_bytes", "-1"}};
  CHECK_THAT(refusal(o), Catch::Contains("ucx.tcp_segment_bytes"));
  // A backend ignores the others' settings, and checks its own.
  o = Loopback::options();
  o.settings = {{"ucx.tls", "tcp"}, {"ucx.protocol", "put"}};
  o.bounded_writes_only = true;
  CHECK(checkOptions(o).ok());
  o.settings["loopback.speed"] = "fast";
  CHECK_THAT(refusal(o), Catch::Contains("\"loopback.speed\""));
  // An explicit put over transports that cannot bound it, where writes must be bounded.
  o = {};
  o.settings = {{"ucx.tls", "tcp"}, {"ucx.protocol", "put"}};
  CHECK(checkOptions(o).ok());
  o.bounded_writes_only = true;
  CHECK_THAT(refusal(o), Catch::Contains("cannot bound a peer's writes"));
  o.settings["ucx.tls"] = "rc_x,self";  // hardware RDMA bounds a put by its remote key
  CHECK(checkOptions(o).ok());
}

TEST_CASE("protocol names", "[transport]") {
  CHECK_THAT(std::string(parseProtocol("telepathy").status().message()), Catch::Contains("expected auto, put or am"));
  for (const Protocol p : {Protocol::kAuto, Protocol::kPut, Protocol::kAm}) CHECK(*parseProtocol(protocolName(p)) == p);
}

TEST_CASE("UCX refuses a transport list naming none it has", "[transport]") {
  TransportOptions o;
  o.settings["ucx.tls"] = "no_such_transport";
  auto u = createContext(o);
  if (u.ok()) {
    SHARDCAST_SKIP("this UCX accepts an unknown transport name when the context is made (connect fails instead)");
  }
  CHECK_THAT(std::string(u.status().message()), Catch::Contains("no_such_transport"));
}

TEST_CASE("loopback: connecting to an unknown address fails", "[transport]") {
  auto c = createContext(Loopback::options());
  REQUIRE(c.ok());
  auto ep = (*c)->connect("loopback:999999", "ghost");
  REQUIRE_FALSE(ep.ok());
  CHECK_THAT(std::string(ep.status().message()), Catch::Contains("ghost"));
}

TEST_CASE("auto protocol: active messages on TCP only, put elsewhere", "[transport]") {
  for (const char* tls : {"tcp", "tcp,self", "self,tcp"}) {
    TransportOptions o;
    o.settings["ucx.tls"] = tls;
    auto c = createContext(o);
    REQUIRE(c.ok());
    CHECK_THAT((*c)->describe(), Catch::Contains("protocol=am"));
  }
  for (const char* tls : {"posix,sysv,self", "tcp,posix", "all"}) {
    TransportOptions o;
    o.settings["ucx.tls"] = tls;
    auto c = createContext(o);
    REQUIRE(c.ok());
    CHECK_THAT((*c)->describe(), Catch::Contains("protocol=put"));
  }
}

TEST_CASE("TCP segment size: 1 MiB by default, UCX's own when 0, the environment's when set", "[transport]") {
  auto describe = [](const std::string& tls, size_t segment) {
    TransportOptions o;
    o.settings = {{"ucx.tls", tls}, {"ucx.tcp_segment_bytes", std::to_string(segment)}};
    auto c = createContext(o);
    INFO(tls << ": " << (c.ok() ? "" : std::string(c.status().message())));
    REQUIRE(c.ok());
    return (*c)->describe();
  };
  ::unsetenv("UCX_TCP_RX_SEG_SIZE");
  CHECK_THAT(describe("tcp", UcxOptions{}.tcp_segment_bytes), Catch::Contains("tcp_segment=1M"));
  CHECK_THAT(describe("tcp", 256 << 10), Catch::Contains("tcp_segment=256K"));
  CHECK_THAT(describe("tcp", 0), Catch::Contains("tcp_segment=64K"));
  CHECK_THAT(describe("", size_t{1} << 20), Catch::Contains("tcp_segment=1M"));  // UCX's default includes tcp
  // Without tcp nothing is set (UCX would warn that no transport took the setting).
  CHECK_THAT(describe("posix,sysv,self", size_t{1} << 20), !Catch::Contains("tcp_segment"));
  CHECK_THAT(describe("^tcp,posix", size_t{1} << 20), !Catch::Contains("tcp_segment"));
  ::setenv("UCX_TCP_RX_SEG_SIZE", "128k", 1);
  CHECK_THAT(describe("tcp", size_t{1} << 20), Catch::Contains("tcp_segment=128k"));
  ::unsetenv("UCX_TCP_RX_SEG_SIZE");
}

TEST_CASE("the UCX loaded is the one a run names", "[transport]") {
  // SHARDCAST_EXPECT_UCX: the version a run put first on the library path (tests/CMakeLists.txt
  // runs this suite again against NVIDIA's CUDA-aware UCX). The context says which one it runs.
  // SHARDCAST_EXPECT_UCX_CUDA=1 (the device check, whose bundle carries that UCX to a GPU
  // machine): its CUDA transports load there, and a context reaches device memory.
  const char* expected = std::getenv("SHARDCAST_EXPECT_UCX");
  if (expected == nullptr || *expected == '\0')
    SHARDCAST_SKIP("no UCX named (SHARDCAST_EXPECT_UCX): the build's own runs");
  const char* cuda = std::getenv("SHARDCAST_EXPECT_UCX_CUDA");
  const bool want_cuda = cuda != nullptr && std::string(cuda) == "1";
  TransportOptions o;
  o.settings["ucx.tls"] = want_cuda ? "tcp,cuda_copy,cuda_ipc" : "tcp";
  auto c = createContext(o);
  INFO((c.ok() ? "" : std::string(c.status().message())));
  REQUIRE(c.ok());
  WARN("transport: " << (*c)->describe());
  CHECK_THAT((*c)->describe(), Catch::StartsWith(std::string("ucx ") + expected + " ("));
  if (want_cuda)
    CHECK((*c)->canAccess(MemoryKind::kCuda));
  else if (!std::filesystem::exists("/dev/nvidiactl"))  // no driver: its CUDA module does not load
    CHECK_FALSE((*c)->canAccess(MemoryKind::kCuda));
}

TEMPLATE_TEST_CASE("backend-allocated landing buffers receive writes", "[transport]", BACKENDS) {
  Pair<TestType> p;
  const size_t kSize = (size_t{16} << 20) + 3;
  auto landing = p.b->allocateMemory(kSize);
  REQUIRE(landing.ok());
  p.land(*landing);
  REQUIRE((*landing)->size() == kSize);
  std::memset((*landing)->data(), 0, kSize);
  std::vector<unsigned char> src(kSize);
  fillPattern(src.data(), kSize, 11);
  auto rs = reg(*p.a, src);
  REQUIRE(await([&](Completion done) {
            p.ep->write({rs, 0, (*landing)->remote(), 0, kSize, p.key}, std::move(done));
          }).ok());
  CHECK(checkPattern(static_cast<unsigned char*>((*landing)->data()), kSize, 11) == kSize);
  CHECK_FALSE(p.b->allocateMemory(0).ok());
}

TEST_CASE("capabilities: who checks writes, whose host memory faults are contained", "[transport]") {
  auto loop = createContext(Loopback::options());
  REQUIRE(loop.ok());
  CHECK((*loop)->capabilities().target_checks_writes);
  CHECK((*loop)->capabilities().host_faults_contained);
  CHECK_FALSE((*loop)->canAccess(MemoryKind::kCuda));
  auto am = createContext(UcxTcpAm::options());  // auto: active messages, checked by the target
  REQUIRE(am.ok());
  CHECK((*am)->capabilities().target_checks_writes);
  CHECK_FALSE((*am)->capabilities().host_faults_contained);  // the kernel reads and writes it (tcp)
  TransportOptions put = UcxShmPut::options();               // auto: put, which shared memory cannot bound
  auto p = createContext(put);
  REQUIRE(p.ok());
  CHECK_FALSE((*p)->capabilities().target_checks_writes);
  put.bounded_writes_only = true;  // as a daemon without --insecure: am instead
  auto bounded = createContext(put);
  REQUIRE(bounded.ok());
  CHECK((*bounded)->capabilities().target_checks_writes);
  CHECK_THAT((*bounded)->describe(), Catch::Contains("protocol=am"));
  std::vector<std::string> names;
  for (const auto& b : backends()) names.push_back(b.name);
  CHECK(names == std::vector<std::string>{"ucx", "loopback"});
}
