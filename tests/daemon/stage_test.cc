// The pack/unpack stage (daemon/stage/stage.h): the standard stage moves same-dtype bytes unchanged,
// converts float32 -> bfloat16 bit-exactly (against an independent reference) and refuses other
// pairs by name; a sync between two in-process engines runs every packed and every unpacked byte
// through the stage it was given (a stage that scrambles the wire bytes on pack and restores them
// on unpack still delivers every byte; one that only scrambles does not), and a declared
// float32 -> bfloat16 destination receives exactly the rounded values, half the bytes on the wire.
#include "daemon/stage/stage.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>

#include "common/refusal.h"
#include "common/strings.h"
#include "daemon/engine/sync_engine.h"
#include "daemon/registry/registry.h"
#include "daemon/server/metrics.h"
#include "daemon/stage/convert.h"
#include "planner/layout.h"
#include "tests/daemon/in_process_node.h"
#include "tests/daemon/rank_memory.h"
#include "transport/transport.h"

using namespace shardcast;
using namespace shardcast::daemon;
using namespace shardcast::testing;

TEST_CASE("standard stage: strided boxes unchanged, an unconvertible pair refused naming the tensor",
          "[daemon][stage]") {
  auto stage = makeStandardStage();
  std::vector<int32_t> src(6 * 8), dst(6 * 4, -1);
  std::iota(src.begin(), src.end(), 0);
  // Columns 2..5 of a 6x8 row-major tensor, packed dense.
  const TypedView memory{{reinterpret_cast<std::byte*>(src.data()), transport::MemoryKind::kHost, 2, {8, 1}},
                         planner::DType::kInt32};
  const TypedView wire{{reinterpret_cast<std::byte*>(dst.data()), transport::MemoryKind::kHost, 0, {4, 1}},
                       planner::DType::kInt32};
  planner::Box box;
  box.ndim = 2;
  box.lo = {0, 2};
  box.hi = {6, 6};
  const std::string name = "layers.0.w";
  REQUIRE(stage->pack(wire, memory, {6, 4}, {name, box}).ok());
  for (int r = 0; r < 6; ++r)
    for (int c = 0; c < 4; ++c) CHECK(dst[r * 4 + c] == r * 8 + c + 2);
  std::vector<int32_t> back(6 * 8, -1);
  const TypedView into{{reinterpret_cast<std::byte*>(back.data()), transport::MemoryKind::kHost, 2, {8, 1}},
                       planner::DType::kInt32};
  REQUIRE(stage->unpack(into, wire, {6, 4}, {name, box}).ok());
  for (int r = 0; r < 6; ++r)
    for (int c = 0; c < 8; ++c) CHECK(back[r * 8 + c] == (c >= 2 && c < 6 ? r * 8 + c : -1));
  TypedView as_float = wire;
  as_float.dtype = planner::DType::kFloat32;
  const Status st = stage->pack(as_float, memory, {6, 4}, {name, box});  // int32 -> float32: not declared
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(st.message()),
             Catch::Contains("\"layers.0.w\"") && Catch::Contains("no conversion from int32 to float32"));
}

namespace {

// The bfloat16 nearest to `f` by an independent route: the two candidates around it compared in
// double precision, ties to the even one; NaN the quiet NaN torch writes.
uint16_t referenceBfloat16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t toward_zero = static_cast<uint16_t>(u >> 16);
  if ((u & 0xffffu) == 0) return toward_zero;                    // exact (infinities included)
  const uint16_t away = static_cast<uint16_t>(toward_zero + 1);  // the next magnitude, same sign
  const double x = std::fabs(static_cast<double>(f)),
               a = std::fabs(static_cast<double>(floatFromBfloat16(toward_zero)));
  // Past the largest finite bfloat16 the next value is infinity: its distance is that of the
  // next step had the exponent range gone on (2^120 above the largest, 0x7f7f).
  const double b =
      (away & 0x7fff) == 0x7f80 ? a + std::ldexp(1.0, 120) : std::fabs(static_cast<double>(floatFromBfloat16(away)));
  if (x - a < b - x) return toward_zero;
  if (b - x < x - a) return away;
  return (toward_zero & 1) == 0 ? toward_zero : away;
}

// Flips every wire byte with `key` on pack; on unpack too when `restore`. Counts its calls.
class ScramblingStage final : public Stage {
 public:
  ScramblingStage(std::atomic<int>& packs, std::atomic<int>& unpacks, bool restore)
      : packs_(packs), unpacks_(unpacks), restore_(restore) {}
  const char* name() const override { return "scramble"; }
  Status pack(const TypedView& wire, const TypedView& memory, const std::vector<int64_t>& extent,
              const StageSite& site) override {
    ++packs_;
    SC_RETURN_IF_ERROR(copy_->pack(wire, memory, extent, site));
    flip(wire, extent);
    return absl::OkStatus();
  }
  Status unpack(const TypedView& memory, const TypedView& wire, const std::vector<int64_t>& extent,
                const StageSite& site) override {
    ++unpacks_;
    SC_RETURN_IF_ERROR(copy_->unpack(memory, wire, extent, site));
    if (restore_) flip(memory, extent);
    return absl::OkStatus();
  }
  Status copyLocal(const TypedView& dst, const TypedView& src, const std::vector<int64_t>& extent,
                   const StageSite& site) override {
    return copy_->copyLocal(dst, src, extent, site);
  }

 private:
  // Every byte of the box `extent` in view `v`.
  static void flip(const TypedView& v, const std::vector<int64_t>& extent) {
    const int64_t elem = planner::dtypeBytes(v.dtype);
    std::vector<int64_t> idx(extent.size(), 0);
    int64_t count = 1;
    for (int64_t e : extent) count *= e;
    for (int64_t i = 0; i < count; ++i) {
      int64_t off = v.view.offset, rest = i;
      for (size_t d = extent.size(); d-- > 0;) {
        off += (rest % extent[d]) * v.view.strides[d];
        rest /= extent[d];
      }
      for (int64_t b = 0; b < elem; ++b) v.view.base[off * elem + b] ^= std::byte{0x5a};
    }
  }
  std::atomic<int>& packs_;
  std::atomic<int>& unpacks_;
  const bool restore_;
  std::unique_ptr<Stage> copy_ = makeStandardStage();
};

// Syncs version 1 from `a`'s source ranks into the destination ranks of `a` and `b` as a
// coordinator would: prepare on both, execute on both at once, commit. The two execute replies.
std::pair<v1::ExecuteResponse, v1::ExecuteResponse> syncByHand(InProcessNode& a, InProcessNode& b,
                                                               const std::string& id, const v1::Layout& src,
                                                               const v1::Layout& dst, uint64_t fence, bool verify) {
  v1::PrepareRequest prep = prepareRequest(id, src, dst, 1, fence);
  prep.set_packed(false);  // loopback: plain copies in this process, so zero-copy plans are allowed
  auto pa = a.engine.prepare(prep);
  auto pb = b.engine.prepare(prep);
  REQUIRE(pa.ok());
  REQUIRE(pb.ok());
  v1::ExecuteRequest exec;
  exec.set_sync_id(id);
  exec.set_fence(fence);
  exec.set_timeout_ms(10000);
  exec.set_verify(verify);
  for (auto [node, targets] : {std::pair{&a, &*pa}, std::pair{&b, &*pb}}) {
    auto* n = exec.add_nodes();
    n->set_node(node->name);
    n->set_transport_address(node->context->address());
    *n->mutable_targets() = targets->targets();
  }
  auto ea = std::async(std::launch::async, [&] { return a.engine.execute(exec); });
  auto eb = b.engine.execute(exec);
  auto ra = ea.get();
  INFO((ra.ok() ? "" : std::string(ra.status().message())) << (eb.ok() ? "" : std::string(eb.status().message())));
  REQUIRE(ra.ok());
  REQUIRE(eb.ok());
  v1::FinishRequest fin;
  fin.set_sync_id(id);
  fin.set_fence(fence);
  fin.set_commit(true);
  REQUIRE(a.engine.finish(fin).ok());
  REQUIRE(b.engine.finish(fin).ok());
  return {*ra, *eb};
}

// Syncs version 1 of the source rank on node "a" into the two destination ranks on node "b", as a
// coordinator would (prepare everywhere, execute everywhere at once, commit), every stage given by
// `stage`; returns whether every destination element holds its source value.
bool syncThroughStages(const std::function<std::unique_ptr<Stage>()>& stage, const std::string& tag) {
  // Two small tensors travel in one bucket (packed on "a", unpacked on "b": nothing direct).
  const auto src_proto = *planner::parseLayoutJson(R"({"group":"s","mesh":{"shape":[1]},"nodes":["a"],"tensors":[
    {"name":"w","shape":[16,8],"dtype":"int32"},{"name":"b","shape":[8],"dtype":"float32"}]})",
                                                   "s");
  const auto dst_proto = *planner::parseLayoutJson(R"({"group":"d","mesh":{"shape":[2]},"nodes":["b","b"],"tensors":[
    {"name":"w","shape":[16,8],"dtype":"int32","placements":[{"shard":{"dim":1}}]},
    {"name":"b","shape":[8],"dtype":"float32","placements":[{"shard":{"dim":0}}]}]})",
                                                   "d");
  planner::NodeTable nodes;
  const auto src = *planner::resolveLayout(src_proto, nodes);
  const auto dst = *planner::resolveLayout(dst_proto, nodes);
  InProcessNode a("a", stage()), b("b", stage());
  const MemoryCaller root{0, true, true};
  RankMemory s0 = allocateRank(src, 0, tag + "-s0");
  forEachElement(src, 0, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
    *s0.at<int32_t>(p, off) = static_cast<int32_t>(t * 1000 + flat);
  });
  REQUIRE(a.registry.registerRank(registerRequest(src_proto, 0, 1, s0, v1::ROLE_SOURCE, 1), root).ok());
  std::vector<RankMemory> d;
  for (int32_t r = 0; r < 2; ++r) {
    d.push_back(allocateRank(dst, r, tag + "-d" + std::to_string(r)));
    REQUIRE(b.registry.registerRank(registerRequest(dst_proto, r, 2, d.back()), root).ok());
  }
  const auto [ea, eb] = syncByHand(a, b, tag, src_proto, dst_proto, 7, false);
  CHECK(eb.bytes_landed_direct() == 0);
  bool exact = true;
  for (int32_t r = 0; r < 2; ++r)
    forEachElement(dst, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
      exact = exact && *d[r].at<int32_t>(p, off) == static_cast<int32_t>(t * 1000 + flat);
    });
  return exact;
}

}  // namespace

TEST_CASE("float32 -> bfloat16: round to nearest even, NaN quiet, against an independent reference",
          "[daemon][stage]") {
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               -1.0f,
                               1.00390625f,
                               1.01171875f,
                               1.0078125f,
                               3.14159265f,
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN(),
                               std::numeric_limits<float>::max(),
                               std::numeric_limits<float>::lowest(),
                               std::numeric_limits<float>::min(),
                               std::numeric_limits<float>::denorm_min(),
                               3.3895313892515355e38f,
                               3.3961e38f};
  std::mt19937 rng(3);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t u = static_cast<uint32_t>(rng());
    float f;
    std::memcpy(&f, &u, 4);
    values.push_back(f);
  }
  for (float f : values) {
    INFO("float bits " << std::hex << [&] {
      uint32_t u;
      std::memcpy(&u, &f, 4);
      return u;
    }());
    CHECK(bfloat16FromFloat(f) == referenceBfloat16(f));
  }
  // Through the stage on a strided box (columns 1..3 of a 4 x 5 row-major float tensor).
  std::vector<float> src(20);
  for (size_t i = 0; i < src.size(); ++i) src[i] = 0.1f * static_cast<float>(i) - 0.7f;
  std::vector<uint16_t> wire(12, 0);
  auto stage = makeStandardStage();
  planner::Box box;
  box.ndim = 2;
  box.lo = {0, 1};
  box.hi = {4, 4};
  const std::string name = "w";
  REQUIRE(stage
              ->pack({{reinterpret_cast<std::byte*>(wire.data()), transport::MemoryKind::kHost, 0, {3, 1}},
                      planner::DType::kBFloat16},
                     {{reinterpret_cast<std::byte*>(src.data()), transport::MemoryKind::kHost, 1, {5, 1}},
                      planner::DType::kFloat32},
                     {4, 3}, {name, box})
              .ok());
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 3; ++c)
      CHECK(wire[static_cast<size_t>(r * 3 + c)] == referenceBfloat16(src[static_cast<size_t>(r * 5 + c + 1)]));
}

TEST_CASE("a sync packs and unpacks every byte through its engines' stage", "[daemon][stage]") {
  std::atomic<int> packs{0}, unpacks{0};
  SECTION("scrambled on pack, restored on unpack: every byte arrives") {
    CHECK(syncThroughStages([&] { return std::make_unique<ScramblingStage>(packs, unpacks, true); }, "stage-restore"));
    CHECK(packs > 0);
    CHECK(unpacks >= 2);  // both destination ranks need part of the bucket
  }
  SECTION("scrambled on pack only: the destination holds the scrambled bytes") {
    CHECK_FALSE(
        syncThroughStages([&] { return std::make_unique<ScramblingStage>(packs, unpacks, false); }, "stage-scrambled"));
  }
  SECTION("the copy stage") {
    CHECK(syncThroughStages([] { return makeStandardStage(); }, "stage-copy"));
  }
}

TEST_CASE("a float32 source syncs into a bfloat16 destination: rounded values, half the bytes on the wire",
          "[daemon][stage]") {
  // w: rows 0..255 to a rank on the source's own node (a converting local copy), rows 256..511
  // to a rank on "b" (packed and converted at the source, landed straight in the rank); b: a
  // small replicated tensor (to both ranks: one converting local copy, one converted send).
  const auto src_proto = *planner::parseLayoutJson(R"({"group":"s","mesh":{"shape":[1]},"nodes":["a"],"tensors":[
    {"name":"w","shape":[512,256],"dtype":"float32"},{"name":"b","shape":[8],"dtype":"float32"}]})",
                                                   "s");
  const auto dst_proto = *planner::parseLayoutJson(R"({"group":"d","mesh":{"shape":[2]},"nodes":["a","b"],"tensors":[
    {"name":"w","shape":[512,256],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]},
    {"name":"b","shape":[8],"dtype":"bfloat16"}]})",
                                                   "d");
  planner::NodeTable nodes;
  const auto src = *planner::resolveLayout(src_proto, nodes);
  const auto dst = *planner::resolveLayout(dst_proto, nodes);
  InProcessNode a("a", nullptr), b("b", nullptr);
  const MemoryCaller root{0, true, true};
  RankMemory s0 = allocateRank(src, 0, "convert-s0");
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 0.02f);
  std::map<std::pair<size_t, int64_t>, float> value;  // (tensor, flat index) -> source value
  forEachElement(src, 0, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
    const float v = normal(rng);
    *s0.at<float>(p, off) = v;
    value[{t, flat}] = v;
  });
  REQUIRE(a.registry.registerRank(registerRequest(src_proto, 0, 1, s0, v1::ROLE_SOURCE, 1), root).ok());
  RankMemory d0 = allocateRank(dst, 0, "convert-d0"), d1 = allocateRank(dst, 1, "convert-d1");
  REQUIRE(a.registry.registerRank(registerRequest(dst_proto, 0, 2, d0), root).ok());
  REQUIRE(b.registry.registerRank(registerRequest(dst_proto, 1, 2, d1), root).ok());
  const auto [ra, eb] = syncByHand(a, b, "convert", src_proto, dst_proto, 9, true);
  // On the wire, bfloat16: half of what the float32 rows and the bias would be.
  CHECK(eb.bytes_received() == 256 * 256 * 2 + 8 * 2);
  CHECK(eb.bytes_landed_direct() == 256 * 256 * 2 + 8 * 2);  // both land straight in rank 1
  CHECK(ra.local_bytes() == 256 * 256 * 2 + 8 * 2);
  int64_t wrong = 0, checked = 0;
  for (auto* m : {&d0, &d1}) {
    const int32_t r = m == &d0 ? 0 : 1;
    forEachElement(dst, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
      ++checked;
      wrong += *m->at<uint16_t>(p, off) != referenceBfloat16(value.at({t, flat}));
    });
  }
  CHECK(checked == 512 * 256 + 2 * 8);
  CHECK(wrong == 0);
}

namespace {

// The standard stage, whose first unpack (`local`: first local copy) waits for `gate`, telling
// `entered` it got there: an execute stuck in a device wait, as far as the sync engine can tell.
class GatedStage final : public Stage {
 public:
  GatedStage(std::shared_future<void> gate, std::promise<void>& entered, bool local = false)
      : gate_(std::move(gate)), entered_(entered), local_(local) {}
  const char* name() const override { return "gated"; }
  Status pack(const TypedView& wire, const TypedView& memory, const std::vector<int64_t>& extent,
              const StageSite& site) override {
    return copy_->pack(wire, memory, extent, site);
  }
  Status unpack(const TypedView& memory, const TypedView& wire, const std::vector<int64_t>& extent,
                const StageSite& site) override {
    if (!local_) waitIfFirst();
    return copy_->unpack(memory, wire, extent, site);
  }
  Status copyLocal(const TypedView& dst, const TypedView& src, const std::vector<int64_t>& extent,
                   const StageSite& site) override {
    if (local_) waitIfFirst();
    return copy_->copyLocal(dst, src, extent, site);
  }

 private:
  void waitIfFirst() {
    if (entered_once_.exchange(true)) return;
    entered_.set_value();
    gate_.wait();
  }
  std::shared_future<void> gate_;
  std::promise<void>& entered_;
  const bool local_;
  std::atomic<bool> entered_once_{false};
  std::unique_ptr<Stage> copy_ = makeStandardStage();
};

// A sync whose execute gets stuck: version 1 of source "s" (one rank, on node "a") into group "d"
// (two ranks, on node `dst_node`: "a" or "b"). The node holding "d" runs a GatedStage (`local`: its
// first local copy waits, else its first unpack) and waits 200 ms for its own work at a close.
// The gate opens at the latest when the fixture goes, before the executes it runs are joined.
// `in_session`: the group ("s" or "d") registered under a session of its node's (`session`).
struct StuckSync {
  StuckSync(const std::string& tag, const std::string& dst_node, bool local, const std::string& in_session = "")
      : id(tag),
        src_proto(*planner::parseLayoutJson(R"({"group":"s","mesh":{"shape":[1]},"nodes":["a"],"tensors":[
          {"name":"w","shape":[16,8],"dtype":"int32"}]})",
                                            "s")),
        dst_proto(*planner::parseLayoutJson(
            strCat(R"({"group":"d","mesh":{"shape":[2]},"nodes":[")", dst_node, R"(",")", dst_node, R"("],"tensors":[
          {"name":"w","shape":[16,8],"dtype":"int32","placements":[{"shard":{"dim":1}}]}]})"),
            "d")),
        src(*planner::resolveLayout(src_proto, nodes)),
        dst(*planner::resolveLayout(dst_proto, nodes)) {
    auto gated = std::make_unique<GatedStage>(open.get_future().share(), entered, local);
    if (dst_node == "a") {
      a = std::make_unique<InProcessNode>("a", std::move(gated));
    } else {
      a = std::make_unique<InProcessNode>("a");
      b = std::make_unique<InProcessNode>(dst_node, std::move(gated));
    }
    receiver().engine.setOwnWorkWait(std::chrono::milliseconds(200));
    s0 = allocateRank(src, 0, tag + "-s0");
    forEachElement(src, 0, [&](size_t, const planner::PieceRef& p, int64_t off, int64_t flat) {
      *s0.at<int32_t>(p, off) = static_cast<int32_t>(flat);
    });
    InProcessNode& in_session_node = in_session == "s" ? *a : receiver();
    if (!in_session.empty()) session = in_session_node.registry.openSession(tag);
    v1::RegisterRequest source = registerRequest(src_proto, 0, 1, s0, v1::ROLE_SOURCE, 1);
    if (in_session == "s") source.set_session_id(session);
    REQUIRE(a->registry.registerRank(source, root).ok());
    for (int32_t r = 0; r < 2; ++r) {
      d.push_back(allocateRank(dst, r, strCat(tag, "-d", r)));
      v1::RegisterRequest req = registerRequest(dst_proto, r, 2, d.back());
      if (in_session == "d") req.set_session_id(session);
      REQUIRE(receiver().registry.registerRank(req, root).ok());
    }
  }
  ~StuckSync() { openGate(); }
  InProcessNode& receiver() { return b ? *b : *a; }
  std::vector<InProcessNode*> nodes_of_sync() { return b ? std::vector{a.get(), b.get()} : std::vector{a.get()}; }

  // Prepares attempt `fence` everywhere (superseding `supersedes`, if not 0) and starts its
  // executes; returns the index of the first in `executes`.
  size_t start(uint64_t fence, uint64_t supersedes = 0) {
    v1::PrepareRequest prep = prepareRequest(id, src_proto, dst_proto, 1, fence);
    prep.set_packed(false);  // loopback: plain copies in this process
    if (supersedes != 0) prep.add_supersedes(supersedes);
    v1::ExecuteRequest exec;
    exec.set_sync_id(id);
    exec.set_fence(fence);
    exec.set_timeout_ms(10000);
    for (InProcessNode* node : nodes_of_sync()) {
      const auto prepared = node->engine.prepare(prep);
      INFO((prepared.ok() ? "" : std::string(prepared.status().message())));
      REQUIRE(prepared.ok());
      auto* n = exec.add_nodes();
      n->set_node(node->name);
      n->set_transport_address(node->context->address());
      *n->mutable_targets() = prepared->targets();
    }
    const size_t first = executes.size();
    for (InProcessNode* node : nodes_of_sync())
      executes.push_back(std::async(std::launch::async, [node, exec] { return node->engine.execute(exec); }));
    return first;
  }
  // Attempt `fence`'s Finish on every node; the receiver's answer.
  StatusOr<v1::FinishResponse> finish(uint64_t fence, bool commit) {
    v1::FinishRequest fin;
    fin.set_sync_id(id);
    fin.set_fence(fence);
    fin.set_commit(commit);
    fin.set_executed(true);
    if (!commit) fin.set_reason("given up by the test");
    if (b) (void)a->engine.finish(fin);
    return receiver().engine.finish(fin);
  }
  // Waits for the executes of the attempt whose first is `executes[first]`; true when each succeeded.
  bool executed(size_t first) {
    bool ok = true;
    for (size_t i = first; i < first + nodes_of_sync().size(); ++i) ok = executes.at(i).get().ok() && ok;
    return ok;
  }
  void openGate() {
    std::call_once(opened, [&] { open.set_value(); });
  }
  // Whether every element of "d" holds its source value.
  bool exact() {
    bool same = true;
    for (int32_t r = 0; r < 2; ++r)
      forEachElement(dst, r, [&](size_t, const planner::PieceRef& p, int64_t off, int64_t flat) {
        same = same && *d[static_cast<size_t>(r)].at<int32_t>(p, off) == static_cast<int32_t>(flat);
      });
    return same;
  }

  const std::string id;
  const MemoryCaller root{0, true, true};
  planner::NodeTable nodes;
  const v1::Layout src_proto, dst_proto;
  const planner::ResolvedLayout src, dst;
  std::promise<void> open, entered;
  std::once_flag opened;
  std::unique_ptr<InProcessNode> a, b;
  RankMemory s0;
  std::vector<RankMemory> d;
  std::string session;
  // (last: the first members destroyed, after the destructor opened the gate)
  std::vector<std::future<StatusOr<v1::ExecuteResponse>>> executes;
};

}  // namespace

TEST_CASE("an execute still unpacking when its attempt is aborted keeps the ranks held until it returns",
          "[daemon][stage][attempt]") {
  // Without that, the abort released the ranks after its wait, a later sync could commit them,
  // and the stuck unpack then wrote the aborted attempt's bytes over the committed ones.
  StuckSync sync("stuck", "b", /*local=*/false);
  const size_t first = sync.start(7);
  REQUIRE(sync.entered.get_future().wait_for(std::chrono::seconds(10)) == std::future_status::ready);

  // The coordinator gives the attempt up while b's execute is still in its unpack.
  const auto ended = sync.finish(7, false);
  REQUIRE_FALSE(ended.ok());
  CHECK(ended.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(ended.status().message()), Catch::Contains("its own writes or executes still running"));
  // The ranks stay held: a later sync cannot take them while the unpack may still write.
  v1::PrepareRequest next = prepareRequest("next", sync.src_proto, sync.dst_proto, 1, 8);
  next.set_packed(false);
  const auto refused = sync.b->engine.prepare(next);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(refused.status().message()), Catch::Contains("stuck"));

  const auto held = [&] {
    for (const auto& g : sync.b->registry.groups())
      for (const auto& st : g.rank_states())
        if (st.detail().find("still landing") != std::string::npos) return true;
    return false;
  };
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the reaper polls every 100 ms
  CHECK(held());

  // The unpack returns; the reaper then frees the ranks (dirty), and the next sync commits them.
  sync.openGate();
  (void)sync.executed(first);  // (its attempt was given up: they fail)
  for (int i = 0; i < 200 && held(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  REQUIRE_FALSE(held());
  for (const auto& m : sync.d) std::memset(m.seg->data(), 0xff, m.seg->size());
  syncByHand(*sync.a, *sync.b, "after", sync.src_proto, sync.dst_proto, 9, true);
  CHECK(sync.exact());
}

TEST_CASE("a local copy stuck past its attempt's end keeps the source read, through a retry's commit",
          "[daemon][stage][attempt]") {
  // The source and the destination on one node: the first attempt's local copy reads the source
  // and is stuck (a device wait); the coordinator gives that attempt up and runs the sync again,
  // whose attempt takes the destination ranks over and commits them. Without holding the source
  // until the stuck copy returned, the trainer could acquire it at once and write the next version,
  // which the copy then landed in ranks that say they hold this one.
  StuckSync sync("read", "a", /*local=*/true);
  const size_t first = sync.start(7);
  REQUIRE(sync.entered.get_future().wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  const auto ended = sync.finish(7, false);
  REQUIRE_FALSE(ended.ok());
  CHECK_THAT(std::string(ended.status().message()), Catch::Contains("its own writes or executes still running"));

  // The retry (same sync, next fence, superseding the first) takes the ranks over and commits.
  REQUIRE(sync.executed(sync.start(8, 7)));
  REQUIRE(sync.finish(8, true).ok());

  // The source stays read while the first attempt's copy may still read it: its writer waits,
  // and is told which sync uses it.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the reaper polls every 100 ms
  const auto refused = sync.a->registry.acquire("s", 0, sync.root, std::chrono::milliseconds(200));
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_THAT(std::string(refused.status().message()), Catch::Contains("sync read still uses it"));

  // The copy returns; the reaper lets go of the source, and its writer takes it.
  sync.openGate();
  (void)sync.executed(first);  // (its attempt was given up: it fails)
  const auto taken = sync.a->registry.acquire("s", 0, sync.root, std::chrono::seconds(10));
  INFO((taken.ok() ? "" : std::string(taken.status().message())));
  REQUIRE(taken.ok());
  CHECK(sync.exact());
}

TEST_CASE("registrations of other groups during a sync leave it alone, and its own groups' fail it, named",
          "[daemon][stage][attempt]") {
  // A client of another group coming or going on a node (a short-lived script, a replica joining
  // the set, an adapter registered) failed every sync running there ("registrations on node ...
  // changed during the sync"), leaving its destination dirty.
  const bool own = GENERATE(false, true);
  CAPTURE(own);
  StuckSync sync(own ? "own" : "others", "b", /*local=*/false, /*in_session=*/own ? "d" : "");
  const size_t first = sync.start(7);
  REQUIRE(sync.entered.get_future().wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  if (own) {
    // Its client gone: "d"'s ranks leave mid-sync (one chunk: its pieces were resolved before the
    // gated unpack, so the execute ends at the stamps' check, not at a missing rank).
    sync.b->registry.closeSession(sync.session);
  } else {
    auto other_proto = sync.dst_proto;
    other_proto.set_group("other");
    RankMemory other = allocateRank(sync.dst, 0, "others-o0");
    REQUIRE(sync.b->registry.registerRank(registerRequest(other_proto, 0, 2, other), sync.root).ok());
    REQUIRE(sync.b->registry.unregisterRank("other", 0, sync.root).ok());
  }
  sync.openGate();
  if (own) {
    auto& on_b = sync.executes.at(first + 1);
    const auto failed = on_b.get();
    REQUIRE_FALSE(failed.ok());
    CHECK(failed.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(refusingGroup(failed.status()) == "d");  // a replica's would be cut alone
    CHECK_THAT(std::string(failed.status().message()),
               Catch::Contains("registrations of group(s) \"d\" on node \"b\" changed during the sync"));
    // What changed there since the sync began, for the user.
    CHECK_THAT(std::string(failed.status().message()),
               Catch::EndsWith("(\"d\": rank 0 left with its client's session, rank 1 left with its client's "
                               "session)"));
    (void)sync.executes.at(first).get();
    return;
  }
  REQUIRE(sync.executed(first));
  REQUIRE(sync.finish(7, true).ok());
  CHECK(sync.exact());
}

TEST_CASE("a source whose client left while a stuck copy read it stays read and refused until the copy returns",
          "[daemon][stage][attempt]") {
  // The trainer's client went (closed, or its process died) while the first attempt's local copy
  // was stuck reading its rank. Unregistered at once, the rank could be registered again over the
  // same memory, acquired and written, while the copy then landed those bytes in ranks that say
  // they hold the version synced.
  StuckSync sync("left", "a", /*local=*/true, /*in_session=*/"s");
  const size_t first = sync.start(7);
  REQUIRE(sync.entered.get_future().wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  REQUIRE_FALSE(sync.finish(7, false).ok());
  sync.a->registry.closeSession(sync.session);

  // Still there, and refused to everyone: a registration over it, its owner's acquire, a sync.
  const std::string again = sync.a->registry.openSession("again");
  v1::RegisterRequest source = registerRequest(sync.src_proto, 0, 1, sync.s0, v1::ROLE_SOURCE, 1);
  source.set_session_id(again);
  source.set_replace(true);
  const auto registered = sync.a->registry.registerRank(source, sync.root);
  REQUIRE_FALSE(registered.ok());
  CHECK(registered.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(registered.status().message()),
             Catch::Contains("its client's session ended while sync left used it"));
  const auto acquired = sync.a->registry.acquire("s", 0, sync.root, std::chrono::milliseconds(100));
  REQUIRE_FALSE(acquired.ok());
  CHECK(acquired.status().code() == absl::StatusCode::kFailedPrecondition);
  const Status read =
      sync.a->registry.beginSync("next", "s", Registry::Destination{}, 1, planner::layoutDigest(sync.src_proto), 9);
  REQUIRE_FALSE(read.ok());
  CHECK_THAT(std::string(read.message()), Catch::Contains("is left by its client"));

  // The copy returns: the rank goes with the attempt, and a new one may take its place.
  sync.openGate();
  (void)sync.executed(first);  // (its attempt was given up: it fails)
  const auto listed = [&] {
    for (const auto& r : sync.a->registry.list())
      if (r.group() == "s") return true;
    return false;
  };
  for (int i = 0; i < 200 && listed(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  REQUIRE_FALSE(listed());
  RankMemory fresh = allocateRank(sync.src, 0, "left-s0-again");
  v1::RegisterRequest anew = registerRequest(sync.src_proto, 0, 1, fresh, v1::ROLE_SOURCE, 1);
  anew.set_session_id(again);
  const auto taken = sync.a->registry.registerRank(anew, sync.root);
  INFO((taken.ok() ? "" : std::string(taken.status().message())));
  CHECK(taken.ok());
}

TEST_CASE("what changed in a group's registrations since a sync began is named, the oldest elided past 8",
          "[daemon][stage][attempt]") {
  InProcessNode node("a");
  const MemoryCaller root{0, true, true};
  const auto proto = *planner::parseLayoutJson(R"({"group":"g","mesh":{"shape":[2]},"nodes":["a","a"],"tensors":[
    {"name":"w","shape":[16,8],"dtype":"int32","placements":[{"shard":{"dim":0}}]}]})",
                                               "g");
  planner::NodeTable nodes;
  const auto layout = *planner::resolveLayout(proto, nodes);
  std::vector<RankMemory> mem;
  for (int32_t r = 0; r < 2; ++r) mem.push_back(allocateRank(layout, r, strCat("changes-", r)));
  REQUIRE(node.registry.registerRank(registerRequest(proto, 1, 2, mem[1]), root).ok());
  const uint64_t stamp = node.registry.stamps({"g"}).front();
  CHECK(node.registry.changesSince("g", stamp).empty());
  auto replace = registerRequest(proto, 1, 2, mem[1]);
  replace.set_replace(true);
  REQUIRE(node.registry.registerRank(registerRequest(proto, 0, 2, mem[0]), root).ok());
  REQUIRE(node.registry.registerRank(replace, root).ok());
  CHECK(node.registry.changesSince("g", stamp) == "rank 0 registered, rank 1 registered again");
  for (int i = 0; i < 4; ++i) {
    REQUIRE(node.registry.unregisterRank("g", 0, root).ok());
    REQUIRE(node.registry.registerRank(registerRequest(proto, 0, 2, mem[0]), root).ok());
  }
  // 10 changes since the stamp: the 8 newest named, the others elided.
  CHECK(node.registry.changesSince("g", stamp) ==
        "..., rank 0 unregistered, rank 0 registered, rank 0 unregistered, rank 0 registered, rank 0 unregistered, "
        "rank 0 registered, rank 0 unregistered, rank 0 registered");
  REQUIRE(node.registry.unregisterRank("g", 0, root).ok());
  REQUIRE(node.registry.unregisterRank("g", 1, root).ok());
  CHECK(node.registry.changesSince("g", stamp) == "no rank of it is registered here any more");
}
