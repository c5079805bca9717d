// The pack/unpack stage (daemon/stage.h): the copy stage moves bytes unchanged and refuses dtype
// mismatches by name; and a sync between two in-process engines runs every packed and every
// unpacked byte through the stage it was given (a stage that scrambles the wire bytes on pack
// and restores them on unpack still delivers every byte; one that only scrambles does not).
#include "daemon/stage.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <cstring>
#include <future>
#include <numeric>

#include "daemon/metrics.h"
#include "daemon/registry.h"
#include "daemon/sync_engine.h"
#include "planner/layout.h"
#include "tests/daemon/rank_memory.h"
#include "transport/transport.h"

using namespace shardcast;
using namespace shardcast::daemon;
using namespace shardcast::testing;

TEST_CASE("copy stage: strided boxes unchanged, a dtype mismatch refused naming the tensor", "[daemon][stage]") {
  auto stage = makeCopyStage();
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
  TypedView as_bf16 = memory;
  as_bf16.dtype = planner::DType::kBFloat16;
  const Status st = stage->pack(as_bf16, as_float, {6, 4}, {name, box});
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(st.message()), Catch::Contains("\"layers.0.w\"") && Catch::Contains("float32 -> bfloat16"));
}

namespace {

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
  std::unique_ptr<Stage> copy_ = makeCopyStage();
};

// A daemon's data plane in this process: a loopback transport, a registry and a sync engine.
struct InProcessNode {
  InProcessNode(const std::string& name, std::unique_ptr<Stage> stage)
      : context(makeContext(name)),
        registry(name, *context),
        engine(name, registry, *context, metrics, 1 << 20, std::move(stage)) {}
  static std::unique_ptr<transport::Context> makeContext(const std::string& name) {
    transport::TransportOptions options;
    options.backend = "loopback";
    options.name = name;
    auto c = transport::createContext(options);
    if (!c.ok()) throw std::runtime_error(std::string(c.status().message()));
    return std::move(*c);
  }
  std::unique_ptr<transport::Context> context;
  Metrics metrics;
  Registry registry;
  SyncEngine engine;
};

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
  const v1::PrepareRequest prep = prepareRequest(tag, src_proto, dst_proto, 1, 7);
  auto pa = a.engine.prepare(prep);
  auto pb = b.engine.prepare(prep);
  REQUIRE(pa.ok());
  REQUIRE(pb.ok());
  v1::ExecuteRequest exec;
  exec.set_sync_id(tag);
  exec.set_fence(7);
  exec.set_timeout_ms(10000);
  for (auto [node, targets] : {std::pair{&a, &*pa}, std::pair{&b, &*pb}}) {
    auto* n = exec.add_nodes();
    n->set_node(node == &a ? "a" : "b");
    n->set_transport_address(node->context->address());
    *n->mutable_targets() = targets->targets();
  }
  auto ea = std::async(std::launch::async, [&] { return a.engine.execute(exec); });
  auto eb = b.engine.execute(exec);
  REQUIRE(ea.get().ok());
  REQUIRE(eb.ok());
  CHECK(eb->bytes_landed_direct() == 0);
  v1::FinishRequest fin;
  fin.set_sync_id(tag);
  fin.set_fence(7);
  fin.set_commit(true);
  REQUIRE(a.engine.finish(fin).ok());
  REQUIRE(b.engine.finish(fin).ok());
  bool exact = true;
  for (int32_t r = 0; r < 2; ++r)
    forEachElement(dst, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
      exact = exact && *d[r].at<int32_t>(p, off) == static_cast<int32_t>(t * 1000 + flat);
    });
  return exact;
}

}  // namespace

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
    CHECK(syncThroughStages([] { return makeCopyStage(); }, "stage-copy"));
  }
}
