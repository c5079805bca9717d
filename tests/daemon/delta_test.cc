// Delta chunks (daemon/engine/delta.h): the encoding rebuilds the new bytes exactly from the old ones, is
// as small as its format says, refuses what does not fit; a peer's malformed delta is refused; the
// bases a source keeps are bounded, belong to one attempt at a time, and count only once it
// committed. What DELTA_AUTO runs, as delta and dense syncs measure (delta_choice.h).
#include "daemon/engine/delta.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <random>
#include <vector>

#include "daemon/coordinator/delta_choice.h"
#include "daemon/engine/sync_attempt.h"
#include "transport/emulated_gpus.h"

using namespace shardcast::daemon;
namespace v1 = shardcast::v1;

namespace {

std::vector<std::byte> randomBytes(size_t n, std::mt19937_64& rng) {
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

// The size the format gives for these changed units (see daemon/engine/delta.h).
size_t expectedSize(const std::vector<size_t>& changed, size_t unit) {
  size_t size = 0, next = 0;
  for (const size_t u : changed) {
    size += (u - next) / kDeltaSkip + 1 + unit;
    next = u + 1;
  }
  return size;
}

}  // namespace

TEST_CASE("delta: every change is rebuilt exactly, in the format's size, for every unit and density",
          "[daemon][delta]") {
  std::mt19937_64 rng(7);
  for (const size_t unit : {1, 2, 4, 8})
    for (const double density : {0.0, 0.001, 0.02, 0.3, 1.0}) {
      const size_t units = 1 + rng() % 20000;
      const auto before = randomBytes(units * unit, rng);
      auto now = before;
      std::vector<size_t> changed;
      std::bernoulli_distribution change(density);
      for (size_t u = 0; u < units; ++u)
        if (change(rng)) {
          const size_t byte = rng() % unit;  // one byte of the unit differs: a unit is compared whole
          now[u * unit + byte] = ~now[u * unit + byte];
          changed.push_back(u);
        }
      auto base = before;
      std::vector<std::byte> out(units * (unit + 1) + units / kDeltaSkip + 1);
      const auto size = encodeDelta(now.data(), base.data(), now.size(), unit, out.data(), out.size());
      INFO("unit " << unit << ", density " << density << ", " << units << " units, " << changed.size() << " changed");
      REQUIRE(size.has_value());
      CHECK(*size == expectedSize(changed, unit));
      CHECK(base == now);  // the base now holds what was sent
      auto rebuilt = before;
      REQUIRE(applyDelta(rebuilt.data(), rebuilt.size(), unit, out.data(), *size).ok());
      CHECK(rebuilt == now);
    }
}

TEST_CASE("delta: nothing changed is an empty delta, long unchanged runs are skips of 255", "[daemon][delta]") {
  std::vector<std::byte> before(2000 * 2, std::byte{1});
  auto now = before;
  std::vector<std::byte> out(64);
  auto base = before;
  auto size = encodeDelta(now.data(), base.data(), now.size(), 2, out.data(), out.size());
  REQUIRE(size.has_value());
  CHECK(*size == 0);
  // Units 600 and 1999 changed: skips of 255, 255, then 90 and the value; then 255 x5, 113, value.
  now[600 * 2] = std::byte{9};
  now[1999 * 2 + 1] = std::byte{9};
  base = before;
  size = encodeDelta(now.data(), base.data(), now.size(), 2, out.data(), out.size());
  REQUIRE(size.has_value());
  REQUIRE(*size == 3 + 2 + 6 + 2);
  CHECK(static_cast<int>(out[0]) == 255);
  CHECK(static_cast<int>(out[1]) == 255);
  CHECK(static_cast<int>(out[2]) == 90);
  CHECK(static_cast<int>(out[10]) == 1398 - 5 * 255);
  auto rebuilt = before;
  REQUIRE(applyDelta(rebuilt.data(), rebuilt.size(), 2, out.data(), *size).ok());
  CHECK(rebuilt == now);
}

TEST_CASE("delta: an encoding that does not fit, or bytes that are not whole units, are refused", "[daemon][delta]") {
  std::mt19937_64 rng(3);
  const auto before = randomBytes(4096, rng);
  const auto now = randomBytes(4096, rng);
  std::vector<std::byte> out(4096 * 3 / 4);
  auto base = before;
  CHECK_FALSE(encodeDelta(now.data(), base.data(), now.size(), 4, out.data(), out.size()).has_value());
  CHECK_FALSE(encodeDelta(now.data(), base.data(), 4094, 4, out.data(), out.size()).has_value());
  CHECK_FALSE(encodeDelta(now.data(), base.data(), 4096, 3, out.data(), out.size()).has_value());
}

TEST_CASE("delta: a peer's malformed delta is refused, never applied past the base", "[daemon][delta]") {
  std::vector<std::byte> base(10 * 4, std::byte{0});
  const auto apply = [&](std::vector<uint8_t> d) {
    return applyDelta(base.data(), base.size(), 4, reinterpret_cast<const std::byte*>(d.data()), d.size());
  };
  CHECK(apply({9, 1, 2, 3, 4}).ok());  // the last unit
  CHECK(static_cast<int>(base[36]) == 1);
  CHECK_FALSE(apply({10, 1, 2, 3, 4}).ok());                    // a value past the end
  CHECK_FALSE(apply({255}).ok());                               // a skip past the end
  CHECK_FALSE(apply({0, 1, 2}).ok());                           // a value cut short
  CHECK_FALSE(apply({3, 1, 2, 3, 4, 5, 1, 2, 3, 4, 0}).ok());   // 3, then 5 past it: unit 9 ok, 10 not
  CHECK(apply({}).ok());                                        // nothing changed
  CHECK_FALSE(applyDelta(base.data(), 6, 4, nullptr, 0).ok());  // a base that is not whole units
  CHECK(apply({0, 7, 7, 7, 7, 0, 8, 8, 8, 8}).ok());            // units 0 and 1
  CHECK(static_cast<int>(base[0]) == 7);
  CHECK(static_cast<int>(base[4]) == 8);
}

TEST_CASE("delta bases: bounded, one attempt at a time, a base only once its attempt committed", "[daemon][delta]") {
  DeltaBases bases(1000);
  auto p = bases.claim("plan-a", 11);
  REQUIRE(p);
  CHECK_FALSE(bases.claim("plan-a", 12));  // another attempt of the same plan: no bases for it
  CHECK(p->find(0, 0) == nullptr);
  auto* b = p->make(0, 0, 600);
  REQUIRE(b != nullptr);
  b->fence = 11;
  CHECK(p->make(0, 1, 500) == nullptr);  // 1100 > 1000 and the only other plan is this one
  CHECK(bases.bytes() == 600);
  bases.finish("plan-a", 11, true);
  CHECK(p->find(0, 0)->committed);
  CHECK(p->find(0, 0)->fence == 11);

  // A failed attempt's bytes are no base: its fence is cleared.
  p = bases.claim("plan-a", 13);
  REQUIRE(p);
  p->find(0, 0)->fence = 13;
  p->find(0, 0)->committed = false;
  bases.finish("plan-a", 13, false);
  CHECK(p->find(0, 0)->fence == 0);
  CHECK_FALSE(p->find(0, 0)->committed);

  // Another plan evicts the unclaimed one when it needs the room.
  auto q = bases.claim("plan-b", 21);
  REQUIRE(q);
  REQUIRE(q->make(0, 0, 700) != nullptr);
  CHECK(bases.bytes() == 700);
  auto again = bases.claim("plan-a", 22);
  REQUIRE(again);
  CHECK(again->find(0, 0) == nullptr);       // evicted: a new, empty plan
  CHECK(again->make(0, 0, 400) == nullptr);  // plan-b is claimed: not evicted for it
  bases.finish("plan-b", 21, true);
  CHECK(again->make(0, 0, 400) != nullptr);  // now it is
  CHECK(bases.bytes() == 400);

  // A plan dropped while claimed keeps its bases for the attempt; nothing more is kept for it.
  auto* kept = again->find(0, 0);
  bases.drop("plan-a");
  CHECK(bases.bytes() == 0);
  CHECK(again->find(0, 0) == kept);
  kept->bytes[399] = std::byte{1};  // still its memory
  CHECK(again->make(1, 0, 10) == nullptr);
  CHECK(bases.capacity() == 1000);
}

namespace {

// An endpoint that holds every completion until the test runs it, and counts what it was given.
class HeldEndpoint final : public shardcast::transport::Endpoint {
 public:
  void write(shardcast::transport::WriteOp, shardcast::transport::Completion done) override {
    writes.push_back(std::move(done));
  }
  void writeBatch(std::vector<shardcast::transport::WriteOp>, shardcast::transport::Completion done) override {
    writes.push_back(std::move(done));
  }
  void notify(std::string payload, const shardcast::transport::WriteKey&,
              shardcast::transport::Completion done) override {
    announced += parseNotification(payload)->chunks.size();
    done(absl::OkStatus());
  }
  void close() override {}
  bool open() const override { return true; }
  const std::string& peerName() const override { return name; }
  std::vector<shardcast::transport::Completion> writes;
  size_t announced = 0;
  std::string name = "held";
};

}  // namespace

TEST_CASE("delta: empty deltas queued behind a full window are all announced once it drains", "[daemon][delta]") {
  auto a = std::make_shared<SyncAttempt>();
  a->id = std::string("window-test-sync");
  a->window_bytes = 1;  // one write in flight at a time
  auto ep = std::make_shared<HeldEndpoint>();
  const auto chunk = [&](int32_t k, size_t bytes) {
    Outbox::Write out;
    out.op.length = bytes;
    out.landed = LandedChunk{0, 0, 0, k, bytes ? LandedChunk::kDense : LandedChunk::kDelta};
    return out;
  };
  a->publish();
  REQUIRE(a->send(1, ep, chunk(0, 8)).ok());                                      // in flight: the window is full
  for (int32_t k = 1; k <= 3000; ++k) REQUIRE(a->send(1, ep, chunk(k, 0)).ok());  // > one batch
  REQUIRE(a->send(1, ep, chunk(3001, 8)).ok());
  CHECK(ep->announced == 1);
  REQUIRE(ep->writes.size() == 1);
  ep->writes[0](absl::OkStatus());  // the first write completes: everything behind it starts
  CHECK(ep->announced == 3002);     // batches of empty deltas, then the last write, in flight
  REQUIRE(ep->writes.size() == 2);
  ep->writes[1](absl::OkStatus());
  ep->writes.clear();  // as a transport does once it ran them (they hold the attempt)
  CHECK(a->writesPending() == 0);
}

namespace {

// A committed sync's figures as DeltaChoices reads them: `seconds` executing `bytes` (dense, every
// hop), some of its chunks as deltas or none.
v1::SyncResponse measured(v1::DeltaMode mode, double seconds, uint64_t bytes, uint64_t delta_chunks) {
  v1::SyncResponse r;
  r.set_delta(mode);
  r.set_execute_seconds(seconds);
  r.set_network_bytes(bytes);
  r.set_delta_chunks(delta_chunks);
  r.set_dense_chunks(10);
  r.set_plan_cached(true);
  return r;
}

}  // namespace

TEST_CASE("delta choice: auto runs dense while delta syncs measure slower, and tries deltas again less often",
          "[daemon][delta]") {
  DeltaChoices c;
  constexpr uint64_t kBytes = uint64_t{1} << 30;
  // Nothing measured, or only one mode: deltas run (that is how they get measured).
  CHECK(c.choose("t", "v").mode == v1::DELTA_AUTO);
  c.record("t", "v", measured(v1::DELTA_AUTO, 1.0, kBytes, 0));  // the first sync: no bases, dense
  CHECK(c.choose("t", "v").mode == v1::DELTA_AUTO);
  c.record("t", "v", measured(v1::DELTA_AUTO, 1.6, kBytes, 40));  // deltas: 60% slower
  // Now dense, with why; another pair of groups is measured on its own.
  const auto dense = c.choose("t", "v");
  CHECK(dense.mode == v1::DELTA_DENSE);
  CHECK_THAT(dense.why, Catch::Contains("delta syncs of \"t\" -> \"v\" measured slower than dense") &&
                            Catch::Contains("0.67 GB/s against 1.07 GB/s"));
  CHECK(c.choose("t", "other").mode == v1::DELTA_AUTO);
  // Deltas are tried again after kProbeEvery dense syncs, then after twice as many, ...
  int probes = 0, first = -1, second = -1;
  for (int i = 0; i < 1 + DeltaChoices::kProbeEvery + 2 * DeltaChoices::kProbeEvery + 1; ++i) {
    const auto choice = c.choose("t", "v");
    if (choice.mode == v1::DELTA_AUTO) {
      (probes++ == 0 ? first : second) = i;
      c.record("t", "v", measured(v1::DELTA_AUTO, 1.6, kBytes, 40));  // still slower
    } else {
      c.record("t", "v", measured(v1::DELTA_DENSE, 1.0, kBytes, 0));
    }
  }
  CHECK(first == DeltaChoices::kProbeEvery - 1);  // 1 dense sync was chosen above already
  CHECK(second == first + 2 * DeltaChoices::kProbeEvery + 1);
  // ... until they measure faster: then they run, and a loss is tried again after kProbeEvery.
  for (int i = 0; i < 100 && c.choose("t", "v").mode == v1::DELTA_DENSE; ++i) {
  }
  c.record("t", "v", measured(v1::DELTA_AUTO, 0.2, kBytes, 40));
  c.record("t", "v", measured(v1::DELTA_AUTO, 0.2, kBytes, 40));
  for (int i = 0; i < 3; ++i) CHECK(c.choose("t", "v").mode == v1::DELTA_AUTO);
}

TEST_CASE("delta choice: small syncs, noise within the margin, off and always syncs are not decided against",
          "[daemon][delta]") {
  DeltaChoices c;
  // Below kMinMeasuredBytes the fixed costs dominate: not measured, deltas kept.
  c.record("t", "v", measured(v1::DELTA_AUTO, 0.010, 1 << 20, 0));
  c.record("t", "v", measured(v1::DELTA_AUTO, 0.050, 1 << 20, 4));
  CHECK(c.choose("t", "v").mode == v1::DELTA_AUTO);
  // Within the margin: deltas kept.
  constexpr uint64_t kBytes = DeltaChoices::kMinMeasuredBytes;
  c.record("t", "v", measured(v1::DELTA_DENSE, 1.0, kBytes, 0));
  c.record("t", "v", measured(v1::DELTA_AUTO, 1.0 + DeltaChoices::kMargin / 2, kBytes, 4));
  CHECK(c.choose("t", "v").mode == v1::DELTA_AUTO);
  // Syncs without bases (off), unmeasured ones (always) and ones that planned (allocating and
  // connecting too) are no samples.
  DeltaChoices d;
  d.record("t", "v", measured(v1::DELTA_OFF, 0.1, kBytes, 0));
  d.record("t", "v", measured(v1::DELTA_ALWAYS, 9.0, kBytes, 4));
  auto planned = measured(v1::DELTA_AUTO, 0.1, kBytes, 0);
  planned.set_plan_cached(false);
  d.record("t", "v", planned);
  d.record("t", "v", measured(v1::DELTA_AUTO, 1.0, kBytes, 4));
  CHECK(d.choose("t", "v").mode == v1::DELTA_AUTO);  // (no dense sample: the planned one was not taken)
}

TEST_CASE("delta choice: while deltas run, a dense sync now and then measures what they are compared with",
          "[daemon][delta]") {
  DeltaChoices c;
  constexpr uint64_t kBytes = uint64_t{1} << 30;
  c.record("t", "v", measured(v1::DELTA_AUTO, 1.0, kBytes, 40));  // deltas only: never measured dense
  std::vector<int> dense;
  for (int i = 0; i < 2 * DeltaChoices::kProbeEvery; ++i) {
    const auto choice = c.choose("t", "v");
    if (choice.mode == v1::DELTA_DENSE) {
      dense.push_back(i);
      CHECK_THAT(choice.why, Catch::Contains("measuring a dense sync of \"t\" -> \"v\" against its delta syncs"));
      c.record("t", "v", measured(v1::DELTA_DENSE, 2.0, kBytes, 0));  // slower than the deltas
    } else {
      c.record("t", "v", measured(v1::DELTA_AUTO, 1.0, kBytes, 40));
    }
  }
  CHECK(dense == std::vector<int>{DeltaChoices::kProbeEvery});
  // Measured both ways, deltas faster: a dense sync after every kMaxProbeEvery delta syncs.
  dense.clear();
  for (int i = 0; i < 2 * DeltaChoices::kMaxProbeEvery + 2; ++i)
    if (c.choose("t", "v").mode == v1::DELTA_DENSE) dense.push_back(i);
  REQUIRE(dense.size() == 2);
  CHECK(dense[1] - dense[0] == DeltaChoices::kMaxProbeEvery + 1);
}

TEST_CASE("delta bases on GPUs: bounded by their own capacity, a replaced base credited, back to host memory",
          "[daemon][delta][emulated-gpu]") {
  shardcast::transport::EmulatedGpus gpus(1);
  DeltaBases bases(1 << 20, 1000);
  auto a = bases.claim("a", 1);
  REQUIRE(a->makeOnDevice(0, 0, 600, 0, gpus) != nullptr);
  CHECK(bases.device_bytes() == 600);
  auto* grown = a->makeOnDevice(0, 0, 800, 0, gpus);  // the 600 it replaces are credited
  REQUIRE(grown != nullptr);
  CHECK(grown->size() == 800);
  CHECK(bases.device_bytes() == 800);
  CHECK(a->makeOnDevice(0, 1, 300, 0, gpus) == nullptr);  // no room: a plan's own bases stay
  CHECK(a->makeOnDevice(0, 1, 300, 7, gpus) == nullptr);  // no such GPU
  CHECK(bases.device_bytes() == 800);
  auto* host = a->make(0, 0, 100);  // the same chunk kept on the host from now on
  REQUIRE(host != nullptr);
  CHECK((host->device == nullptr && host->size() == 100));
  CHECK((bases.device_bytes() == 0 && bases.bytes() == 100));
  bases.finish("a", 1, true);
  auto b = bases.claim("b", 2);
  REQUIRE(b->makeOnDevice(0, 0, 1000, 0, gpus) != nullptr);
  bases.finish("b", 2, true);
  auto again = bases.claim("a", 3);
  REQUIRE(again->makeOnDevice(0, 0, 500, 0, gpus) != nullptr);  // "b" (unclaimed, older) evicted for it
  CHECK((bases.device_bytes() == 500 && bases.bytes() == 0));
  bases.drop("a");
  CHECK((bases.device_bytes() == 0 && bases.bytes() == 0));
}
