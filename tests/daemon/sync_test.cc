// End-to-end syncs between real daemons on loopback: trainer ranks in shared memory, inference
// ranks in another layout (colocated on one node, remote on others), every destination byte checked.
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <httplib.h>

#include <catch2/catch.hpp>
#include <future>
#include <map>
#include <thread>

#include "daemon/coordinator/cluster.h"
#include "daemon/coordinator/relay.h"
#include "daemon/coordinator/repeat_cache.h"
#include "daemon/server/config.h"
#include "planner/layout.h"
#include "tests/daemon/daemon_harness.h"
#include "tests/daemon/rank_memory.h"
#include "tests/support/device_buffer.h"
#include "tests/support/gpu.h"
#include "transport/cuda/cuda_support.h"
#include "transport/shm.h"

using namespace shardcast;
using namespace shardcast::testing;

namespace {

const char* kTrainer = R"({"group":"trainer","mesh":{"shape":[4]},"nodes":["n0","n0","n1","n1"],"tensors":[
  {"name":"w","shape":[16,8],"dtype":"int32","placements":[{"shard":{"dim":0}}]},
  {"name":"o","shape":[8,16],"dtype":"int32","placements":[{"shard":{"dim":0}}]},
  {"name":"norm","shape":[8],"dtype":"int32","placements":[{"shard":{"dim":0}}]}]})";
// vLLM-like: dp=2 x tp=2; replica 0 on n2, replica 1 colocated with trainer ranks on n0.
const char* kInference = R"({"group":"infer","mesh":{"shape":[2,2]},"nodes":["n2","n2","n0","n0"],"tensors":[
  {"name":"w","shape":[16,8],"dtype":"int32","placements":[{"replicate":{}},{"shard":{"dim":0}}]},
  {"name":"o","shape":[8,16],"dtype":"int32","placements":[{"replicate":{}},{"shard":{"dim":1}}]},
  {"name":"norm","shape":[8],"dtype":"int32"}]})";

int32_t valueOf(size_t tensor, int64_t flat, int version) {
  return static_cast<int32_t>(tensor * 100000 + flat * 10 + version);
}

RankMemory allocate(const planner::ResolvedLayout& l, int32_t rank, const std::string& tag) {
  return allocateRank(l, rank, "sync-" + tag);
}

v1::RegisterRequest request(const v1::Layout& layout, int32_t rank, int32_t world, const RankMemory& m) {
  return registerRequest(layout, rank, world, m);
}

// A source rank (a trainer's), READY at `version` when given.
v1::RegisterRequest source(const v1::Layout& layout, int32_t rank, int32_t world, const RankMemory& m,
                           uint64_t version = 0) {
  return registerRequest(layout, rank, world, m, v1::ROLE_SOURCE, version);
}

// kTrainer and kInference resolved, every rank's memory allocated (names tagged with `tag`), and
// the trainer's values of a version written and the inference ranks' checked.
struct TrainerAndInference {
  v1::Layout src_proto, dst_proto;
  planner::NodeTable nodes;
  planner::ResolvedLayout src, dst;
  std::vector<RankMemory> smem, dmem;
  explicit TrainerAndInference(const std::string& tag, const char* trainer = kTrainer,
                               const char* inference = kInference)
      : src_proto(*planner::parseLayoutJson(trainer, "trainer")),
        dst_proto(*planner::parseLayoutJson(inference, "infer")),
        src(*planner::resolveLayout(src_proto, nodes)),
        dst(*planner::resolveLayout(dst_proto, nodes)) {
    for (int32_t r = 0; r < src.world(); ++r) smem.push_back(allocate(src, r, tag + "t" + std::to_string(r)));
    for (int32_t r = 0; r < dst.world(); ++r) dmem.push_back(allocate(dst, r, tag + "i" + std::to_string(r)));
  }
  void fill(int version) {
    for (int32_t r = 0; r < src.world(); ++r)
      forEachElement(src, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
        *smem[r].at<int32_t>(p, off) = valueOf(t, flat, version);
      });
  }
  int64_t wrong(int version) {
    int64_t bad = 0;
    for (int32_t r = 0; r < dst.world(); ++r)
      forEachElement(dst, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
        bad += *dmem[r].at<int32_t>(p, off) != valueOf(t, flat, version);
      });
    return bad;
  }
};

struct Cluster {
  std::vector<int> ports;
  std::vector<std::unique_ptr<Daemon>> daemons;
  std::vector<std::string> extra;  // flags of every daemon
  explicit Cluster(std::vector<std::string> flags = {}) : extra(std::move(flags)) {
    for (int i = 0; i < 3; ++i) ports.push_back(freePort());
    for (int i = 0; i < 3; ++i) start(i);
  }
  void start(int i) {
    std::vector<std::string> peers;
    for (int p : ports) peers.push_back("127.0.0.1:" + std::to_string(p));
    if (daemons.size() <= static_cast<size_t>(i)) daemons.resize(i + 1);
    daemons[i] = std::make_unique<Daemon>("n" + std::to_string(i), ports[i], peers, extra);
    REQUIRE(daemons[i]->ready());
  }
  Daemon& node(const std::string& name) { return *daemons[name[1] - '0']; }

  // As a trainer steps: every source rank is acquired (waiting for syncs reading it), written by
  // `write`, and published at `version`.
  template <typename Write>
  void step(const planner::ResolvedLayout& src, const planner::NodeTable& nodes, uint64_t version, Write&& write) {
    for (int32_t r = 0; r < src.world(); ++r) {
      v1::AcquireRequest a;
      a.set_group(src.group);
      a.set_rank(r);
      v1::AcquireResponse ar;
      const auto st = node(nodes.name(src.rank_node[r])).client()->Acquire(ctx().get(), a, &ar);
      INFO(st.error_message());
      REQUIRE(st.ok());
    }
    write();
    for (int32_t r = 0; r < src.world(); ++r) {
      v1::ReleaseRequest p;
      p.set_group(src.group);
      p.set_rank(r);
      p.set_version(version);
      v1::ReleaseResponse pr;
      const auto st = node(nodes.name(src.rank_node[r])).client()->Release(ctx().get(), p, &pr);
      INFO(st.error_message());
      REQUIRE(st.ok());
      REQUIRE(pr.status().state() == v1::RANK_READY);
    }
  }
};

// Registers g's trainer and inference ranks on their nodes; the inference ranks' registration ids.
std::vector<uint64_t> registerBoth(Cluster& cluster, const TrainerAndInference& g) {
  std::vector<uint64_t> registration(4);
  for (int32_t r = 0; r < 4; ++r) {
    v1::RegisterResponse resp;
    REQUIRE(cluster.node(g.nodes.name(g.src.rank_node[r]))
                .client()
                ->Register(ctx().get(), source(g.src_proto, r, 4, g.smem[r]), &resp)
                .ok());
    REQUIRE(cluster.node(g.nodes.name(g.dst.rank_node[r]))
                .client()
                ->Register(ctx().get(), request(g.dst_proto, r, 4, g.dmem[r]), &resp)
                .ok());
    registration[static_cast<size_t>(r)] = resp.registration();
  }
  return registration;
}

// A sync after a frozen daemon was thawed: tried again every 250 ms (5 s at most) while that
// daemon finishes what it was doing; the last status.
template <typename Sync>
grpc::Status untilCommitted(Sync&& sync) {
  grpc::Status st;
  for (int attempt = 0; attempt < 20; ++attempt) {
    st = sync();
    if (st.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  return st;
}

// The Prepare time of the view a coordinator keeps for the next sync of two groups, read from
// the responses: a full sync keeps its own, a folded one the view's it repeated. Whether the next
// sync may repeat that view depends on it (RepeatView::quickEnough), so on the machine's load.
class KeptPrepare {
 public:
  explicit KeptPrepare(int peer_timeout_ms) : peer_timeout_ms_(peer_timeout_ms) {}
  void after(const v1::SyncResponse& out) {
    if (!out.folded()) seconds_ = out.prepare_seconds();
  }
  bool quick() const { return daemon::RepeatView::quickEnough(seconds_, peer_timeout_ms_); }

 private:
  int peer_timeout_ms_;
  double seconds_ = 0;
};

}  // namespace

TEST_CASE("syncs move every byte into the destination layout, version after version", "[daemon][sync]") {
  Cluster cluster({"--metrics-names"});  // the scrape below reads groups and peers by name
  TrainerAndInference g("");
  const auto& src_proto = g.src_proto;
  const auto& dst_proto = g.dst_proto;
  const auto& nodes = g.nodes;
  const auto& src = g.src;
  const auto& dst = g.dst;
  auto& smem = g.smem;
  auto& dmem = g.dmem;
  const auto fill = [&](int version) { g.fill(version); };
  const auto wrong = [&](int version) { return g.wrong(version); };
  for (int32_t r = 0; r < 4; ++r) {
    v1::RegisterResponse resp;
    REQUIRE(cluster.node(nodes.name(src.rank_node[r]))
                .client()
                ->Register(ctx().get(), source(src_proto, r, 4, smem[r]), &resp)
                .ok());
  }
  // The inference group is still incomplete: the sync fails fast and names the missing ranks.
  v1::SyncRequest sync;
  sync.set_src_group("trainer");
  sync.set_dst_group("infer");
  sync.set_version(1);
  v1::SyncResponse out;
  grpc::Status st = cluster.node("n2").client()->Sync(ctx().get(), sync, &out);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("group \"infer\" has no registered ranks"));
  for (int32_t r = 0; r < 4; ++r) {
    v1::RegisterResponse resp;
    REQUIRE(cluster.node(nodes.name(dst.rank_node[r]))
                .client()
                ->Register(ctx().get(), request(dst_proto, r, 4, dmem[r]), &resp)
                .ok());
  }

  for (int version = 1; version <= 3; ++version) {
    cluster.step(src, nodes, version, [&] { fill(version); });
    sync.set_version(version);
    sync.mutable_options()->set_verify(version == 2);
    // Coordinated by a different daemon each time; the client names the sync and watches it.
    Daemon& coordinator = *cluster.daemons[version % 3];
    sync.set_sync_id("watched-" + std::to_string(version));
    std::vector<v1::SyncProgress> seen;
    std::thread watcher([&] {
      v1::WatchRequest w;
      w.set_sync_id(sync.sync_id());
      auto c = ctx();
      auto reader = coordinator.client()->Watch(c.get(), w);
      v1::SyncProgress p;
      while (reader->Read(&p)) seen.push_back(p);
      reader->Finish();
    });
    st = coordinator.client()->Sync(ctx().get(), sync, &out);
    watcher.join();
    REQUIRE_FALSE(seen.empty());
    CHECK(seen.back().state() == "committed");
    CHECK(seen.back().bytes_done() == seen.back().bytes_total());
    CHECK(seen.back().bytes_total() == out.network_bytes());
    CHECK(seen.back().nodes_size() == 3);
    for (const auto& n : seen.back().nodes()) {
      CHECK(n.state() == "done");
      // The destination ranks each node holds, as the sync left them: ready at this version.
      CHECK(n.ranks_size() == (n.node() == "n1" ? 0 : 2));
      for (const auto& r : n.ranks()) {
        CHECK(r.state() == v1::RANK_READY);
        CHECK(r.version() == static_cast<uint64_t>(version));
      }
    }
    for (size_t i = 1; i < seen.size(); ++i)
      CHECK(seen[i].bytes_done() >= seen[i - 1].bytes_done());  // never goes back
    // Each node's bytes in the stream are what the plan lands on it.
    google::protobuf::Struct summary;
    REQUIRE(google::protobuf::util::JsonStringToMessage(out.plan_summary_json(), &summary).ok());
    const auto& ingress = summary.fields().at("node_ingress_bytes").struct_value().fields();
    for (const auto& n : seen.back().nodes())
      CHECK(n.bytes_received() == static_cast<uint64_t>(ingress.at(n.node()).number_value()));
    INFO("version " << version << ": " << st.error_message());
    REQUIRE(st.ok());
    CHECK(wrong(version) == 0);
    CHECK(out.version() == static_cast<uint64_t>(version));
    CHECK(out.network_bytes() > 0);
    CHECK(out.bytes_landed_direct() == 0);  // every fragment is small: all travel in buckets, via arenas
    CHECK(out.plan_cached() == (version > 1 && coordinator.node() != "n1"));
  }
  // Prometheus metrics of a coordinator: committed syncs and bytes moved.
  httplib::Client http("127.0.0.1", cluster.daemons[1]->metricsPort());
  auto scrape = http.Get("/metrics");
  REQUIRE(scrape);
  CHECK(scrape->status == 200);
  CHECK_THAT(scrape->body, Catch::Contains("shardcast_syncs_total{result=\"committed\"} 1"));
  CHECK_THAT(scrape->body, Catch::Contains("shardcast_registered_ranks 2"));
  CHECK_THAT(scrape->body, Catch::Contains("shardcast_bytes_sent_total"));
  CHECK_THAT(scrape->body, Catch::Contains("shardcast_sync_duration_seconds_count{result=\"committed\"} 1"));
  for (const char* phase : {"gather", "plan", "prepare", "execute", "finish"})
    CHECK_THAT(scrape->body, Catch::Contains(std::string("shardcast_sync_phase_duration_seconds_count{phase=\"") +
                                             phase + "\",result=\"committed\"} 1"));
  CHECK_THAT(scrape->body,
             Catch::Contains("shardcast_group_ranks{group=\"trainer\",role=\"source\",state=\"ready\"} 2"));
  CHECK_THAT(scrape->body, Catch::Contains("shardcast_group_version{group=\"trainer\",role=\"source\"} 3"));
  CHECK_THAT(scrape->body, Catch::Contains("shardcast_peer_up{peer=\"n0\"} 1"));
  CHECK_THAT(scrape->body, Catch::Contains("shardcast_peer_up{peer=\"n2\"} 1"));
  CHECK_THAT(scrape->body, Catch::Contains("shardcast_syncs_in_flight 0"));
  // Status names every node's syncs: the three committed ones and the refused first one, each
  // with its groups, version and coordinator.
  v1::StatusRequest everywhere;
  everywhere.set_all_nodes(true);
  v1::StatusResponse status;
  REQUIRE(cluster.daemons[1]->client()->Status(ctx().get(), everywhere, &status).ok());
  std::map<std::string, v1::SyncProgress> by_id;
  for (const auto& p : status.syncs()) by_id[p.sync_id()] = p;
  for (int version = 1; version <= 3; ++version) {
    const auto it = by_id.find("watched-" + std::to_string(version));
    REQUIRE(it != by_id.end());
    CHECK(it->second.state() == "committed");
    CHECK(it->second.version() == static_cast<uint64_t>(version));
    CHECK((it->second.src_group() == "trainer" && it->second.dst_group() == "infer"));
    CHECK(it->second.coordinator() == cluster.daemons[version % 3]->node());
    CHECK(it->second.started_unix_seconds() > 0);
  }
  CHECK(std::count_if(status.syncs().begin(), status.syncs().end(), [](const v1::SyncProgress& p) {
          return p.state() == "failed" && p.coordinator() == "n2" &&
                 p.error().find("has no registered ranks") != std::string::npos;
        }) == 1);
  sync.clear_sync_id();
  // Inference ranks see the committed version on their nodes.
  v1::WaitVersionRequest wv;
  wv.set_group("infer");
  wv.set_version(3);
  wv.set_timeout_ms(1000);
  v1::WaitVersionResponse wvr;
  REQUIRE(cluster.node("n2").client()->WaitVersion(ctx().get(), wv, &wvr).ok());
  CHECK(wvr.version() == 3);
  // An old version is refused and nothing changes.
  sync.set_version(2);
  st = cluster.node("n0").client()->Sync(ctx().get(), sync, &out);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("is not newer"));
  CHECK(wrong(3) == 0);
  // A client's sync id travels in the daemons' notifications: only a short, plain one is taken.
  sync.set_version(4);
  for (const std::string& bad : {std::string("two words"), std::string("line\nbreak"), std::string(129, 'x')}) {
    sync.set_sync_id(bad);
    st = cluster.node("n0").client()->Sync(ctx().get(), sync, &out);
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(st.error_message(), Catch::Contains("sync_id"));
  }
  sync.clear_sync_id();
  CHECK(wrong(3) == 0);
  // Watching a sync nobody runs: NOT_FOUND after a short wait.
  {
    v1::WatchRequest w;
    w.set_sync_id("no-such-sync");
    auto c = ctx();
    auto reader = cluster.node("n0").client()->Watch(c.get(), w);
    v1::SyncProgress p;
    CHECK_FALSE(reader->Read(&p));
    CHECK(reader->Finish().error_code() == grpc::StatusCode::NOT_FOUND);
  }

  // A daemon that dies: the sync fails naming it, no version moves; after a restart and
  // re-registration the next sync succeeds.
  cluster.step(src, nodes, 4, [&] { fill(4); });
  cluster.daemons[1]->kill();
  sync.set_version(4);
  st = cluster.node("n0").client()->Sync(ctx().get(), sync, &out);
  CHECK(st.error_code() == grpc::StatusCode::UNAVAILABLE);
  REQUIRE(cluster.node("n2").client()->WaitVersion(ctx().get(), wv, &wvr).ok());
  CHECK(wvr.version() == 3);
  cluster.start(1);
  for (int32_t r = 2; r < 4; ++r) {
    v1::RegisterResponse resp;
    REQUIRE(cluster.node("n1").client()->Register(ctx().get(), source(src_proto, r, 4, smem[r], 4), &resp).ok());
  }
  st = cluster.node("n0").client()->Sync(ctx().get(), sync, &out);
  INFO(st.error_message());
  REQUIRE(st.ok());
  CHECK(wrong(4) == 0);
}

TEST_CASE("a sync that repeats the last one skips the gather - changed registrations and refusals bring it back",
          "[daemon][sync]") {
  // Directly, and through a relay tree: with --relay-fanout 2 the coordinator's calls to its 3
  // daemons go out as 2 (a Relay to the first two in address order, and the third's own),
  // refusals included.
  const int fanout = GENERATE(16, 2);
  CAPTURE(fanout);
  Cluster cluster({"--relay-fanout", std::to_string(fanout)});
  KeptPrepare kept(daemon::DaemonConfig().peer_timeout_ms);  // the daemons' default
  TrainerAndInference g(fanout == 2 ? "rr" : "r");
  const auto& src_proto = g.src_proto;
  const auto& dst_proto = g.dst_proto;
  const auto& nodes = g.nodes;
  const auto& src = g.src;
  const auto& dst = g.dst;
  auto& dmem = g.dmem;
  const auto fill = [&](int version) { g.fill(version); };
  const auto wrong = [&](int version) { return g.wrong(version); };
  const std::vector<uint64_t> registration = registerBoth(cluster, g);
  // Syncs coordinated by n1 (holding no destination rank), each checked byte for byte, and its
  // progress as Watch ends it: every node once (an attempt run again in full has its own), done,
  // and the bytes its attempt moved.
  const auto sync = [&](int version) {
    v1::SyncRequest req;
    req.set_src_group("trainer");
    req.set_dst_group("infer");
    req.set_version(static_cast<uint64_t>(version));
    req.set_sync_id("repeats-" + std::to_string(version));
    v1::SyncResponse out;
    const auto st = cluster.node("n1").client()->Sync(ctx().get(), req, &out);
    INFO("version " << version << ": " << st.error_message());
    REQUIRE(st.ok());
    CHECK(wrong(version) == 0);
    CHECK(out.coordinator_calls() == (fanout == 2 ? 2u : 3u));
    v1::WatchRequest w;
    w.set_sync_id(req.sync_id());
    auto c = ctx();
    auto reader = cluster.node("n1").client()->Watch(c.get(), w);
    v1::SyncProgress p, last;
    while (reader->Read(&p)) last = p;
    CHECK(reader->Finish().ok());
    CHECK(last.state() == "committed");
    // An attempt refused and run again in full leaves no error behind ("stale view" was shown for
    // a sync that then committed).
    CHECK(last.error().empty());
    CHECK(last.nodes_size() == 3);
    for (const auto& n : last.nodes()) CHECK(n.state() == "done");
    CHECK(last.bytes_done() == out.network_bytes());
    kept.after(out);
    return out.repeated();
  };
  // Whether a sync repeats the last one's view: when that view's Prepare was quick (KeptPrepare).
  const auto repeats = [&](int version) {
    const bool quick = kept.quick();
    return sync(version) == quick;
  };
  cluster.step(src, nodes, 1, [&] { fill(1); });
  CHECK_FALSE(sync(1));  // nothing seen yet: a full gather
  for (int version = 2; version <= 3; ++version) {
    cluster.step(src, nodes, static_cast<uint64_t>(version), [&] { fill(version); });
    CHECK(repeats(version));  // the same cluster and layouts: no gather
  }
  // Version 4 is not published: the repeated attempt's Prepare is refused, and the full gather
  // that follows names the rank as a sync always did.
  v1::SyncRequest ahead;
  ahead.set_src_group("trainer");
  ahead.set_dst_group("infer");
  ahead.set_version(4);
  v1::SyncResponse out;
  const auto refused = cluster.node("n1").client()->Sync(ctx().get(), ahead, &out);
  CHECK(refused.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(refused.error_message(), Catch::Contains("sync: group \"trainer\" rank "));
  CHECK_THAT(refused.error_message(), Catch::Contains("published version 3, not 4"));
  CHECK(wrong(3) == 0);  // nothing was written
  cluster.step(src, nodes, 4, [&] { fill(4); });
  CHECK_FALSE(sync(4));  // a failed sync's view is not reused
  cluster.step(src, nodes, 5, [&] { fill(5); });
  CHECK(repeats(5));
  // A destination rank registered again (new memory): n2's registrations changed, its Prepare
  // refuses the kept view, and the sync runs with a full gather into the new memory.
  {
    v1::UnregisterRequest un;
    un.set_group("infer");
    un.set_rank(1);
    un.set_registration(registration[1]);
    v1::UnregisterResponse ur;
    REQUIRE(cluster.node("n2").client()->Unregister(ctx().get(), un, &ur).ok());
    dmem[1] = allocate(dst, 1, "ri1-again");
    v1::RegisterResponse resp;
    REQUIRE(cluster.node("n2").client()->Register(ctx().get(), request(dst_proto, 1, 4, dmem[1]), &resp).ok());
  }
  cluster.step(src, nodes, 6, [&] { fill(6); });
  CHECK_FALSE(sync(6));
  cluster.step(src, nodes, 7, [&] { fill(7); });
  CHECK(repeats(7));
  // A registration of another group on the coordinator's own node changes its generation too.
  RankMemory other = allocate(src, 0, "rt-other");
  auto other_layout = src_proto;
  other_layout.set_group("other");
  for (auto& n : *other_layout.mutable_nodes()) n = "n1";
  v1::RegisterResponse resp;
  REQUIRE(cluster.node("n1").client()->Register(ctx().get(), source(other_layout, 0, 4, other), &resp).ok());
  cluster.step(src, nodes, 8, [&] { fill(8); });
  CHECK_FALSE(sync(8));
  cluster.step(src, nodes, 9, [&] { fill(9); });
  CHECK(repeats(9));
}

TEST_CASE(
    "a repeated sync into double-buffered ranks folds its Prepare into its first wave - refusals and a silent "
    "daemon leave every rank its version",
    "[daemon][sync]") {
  // on: peers land in the ranks' buffers directly, in the set not in use, so where they land
  // alternates with every commit (PrepareResponse.next_targets); off: in each node's arena.
  const std::string zero_copy = GENERATE("off", "on");
  // 2: the coordinator's calls to its 3 daemons go as a Relay to two of them and a call to the third.
  const std::string fanout = GENERATE("64", "2");
  CAPTURE(zero_copy, fanout);
  Cluster cluster({"--host-zero-copy", zero_copy, "--peer-timeout-ms", "1500", "--relay-fanout", fanout});
  // One tensor in rows, one fragment per transfer: it can land in place (not bucketed in an arena).
  const char* trainer = R"({"group":"trainer","mesh":{"shape":[2]},"nodes":["n0","n1"],"tensors":[
    {"name":"w","shape":[64,32],"dtype":"int32","placements":[{"shard":{"dim":0}}]}]})";
  const char* inference = R"({"group":"infer","mesh":{"shape":[2]},"nodes":["n2","n0"],"tensors":[
    {"name":"w","shape":[64,32],"dtype":"int32","placements":[{"shard":{"dim":0}}]}]})";
  TrainerAndInference g("fold-" + zero_copy + fanout, trainer, inference);
  std::vector<RankMemory> shadow;
  for (int32_t r = 0; r < g.dst.world(); ++r)
    shadow.push_back(allocate(g.dst, r, "fold-" + zero_copy + fanout + "-s" + std::to_string(r)));
  const auto node_of = [&](int32_t r) { return g.nodes.name(g.dst.rank_node[r]); };
  const auto register_destination = [&](int32_t r) {
    v1::RegisterRequest doubled = request(g.dst_proto, r, g.dst.world(), g.dmem[r]);
    const v1::RegisterRequest other = request(g.dst_proto, r, g.dst.world(), shadow[r]);
    *doubled.mutable_shadow_buffers() = other.buffers();
    v1::RegisterResponse resp;
    const grpc::Status st = cluster.node(node_of(r)).client()->Register(ctx().get(), doubled, &resp);
    INFO(st.error_message());
    REQUIRE(st.ok());
    return resp.registration();
  };
  std::vector<uint64_t> registration(2);
  for (int32_t r = 0; r < 2; ++r) {
    v1::RegisterResponse resp;
    REQUIRE(cluster.node(g.nodes.name(g.src.rank_node[r]))
                .client()
                ->Register(ctx().get(), source(g.src_proto, r, 2, g.smem[r]), &resp)
                .ok());
    registration[static_cast<size_t>(r)] = register_destination(r);
  }
  // Each destination rank's state and the set it reads (the one the last commit wrote).
  const auto rank_status = [&](int32_t r) {
    v1::StatusResponse st;
    REQUIRE(cluster.node(node_of(r)).client()->Status(ctx().get(), v1::StatusRequest(), &st).ok());
    for (const auto& group : st.groups())
      if (group.group() == "infer")
        for (const auto& rs : group.rank_states())
          if (rs.rank() == r) return rs;
    FAIL("rank " << r << " of infer is not on node " << node_of(r));
    return v1::RankStatus();
  };
  // Every rank READY at `version`, the set it reads holding exactly that version.
  const auto holds = [&](int version) {
    int64_t bad = 0;
    for (int32_t r = 0; r < 2; ++r) {
      const v1::RankStatus st = rank_status(r);
      CHECK(st.state() == v1::RANK_READY);
      CHECK(st.version() == static_cast<uint64_t>(version));
      RankMemory& set = st.active_set() == 0 ? g.dmem[r] : shadow[r];
      forEachElement(g.dst, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
        bad += *set.at<int32_t>(p, off) != valueOf(t, flat, version);
      });
    }
    return bad;
  };
  v1::SyncRequest req;
  req.set_src_group("trainer");
  req.set_dst_group("infer");
  const auto sync = [&](int version, v1::SyncResponse* out) {
    req.set_version(static_cast<uint64_t>(version));
    return cluster.node("n1").client()->Sync(ctx(60).get(), req, out);
  };
  // The kept view's Prepare, as the responses tell it: a repeat needs it quick (under half the
  // peer timeout), which a loaded machine's may not be; the sync then gathers, as it should.
  KeptPrepare kept(1500);
  const auto synced = [&](int version) {
    cluster.step(g.src, g.nodes, static_cast<uint64_t>(version), [&] { g.fill(version); });
    v1::SyncResponse out;
    // The first sync connects the daemons: on a loaded machine (CI runs the vLLM tests beside
    // these) a peer's first answer may take longer than the 1.5 s peer timeout, so it is tried
    // until it commits.
    const grpc::Status st = version == 1 ? untilCommitted([&] { return sync(version, &out); }) : sync(version, &out);
    INFO("version " << version << ": " << st.error_message());
    REQUIRE(st.ok());
    CHECK(holds(version) == 0);
    CHECK(out.folded() == out.repeated());  // every repeated sync folds (the ranks are double-buffered)
    CHECK((out.bytes_landed_direct() > 0) == (zero_copy == "on"));
    CHECK(out.coordinator_calls() == (fanout == "2" ? 2u : 3u));
    kept.after(out);
    return out.folded();
  };
  CHECK_FALSE(synced(1));                // a full gather
  const auto folds = [&](int version) {  // when the kept view's Prepare was quick (KeptPrepare)
    const bool quick = kept.quick();
    return synced(version) == quick;
  };
  for (int version = 2; version <= 5; ++version) CHECK(folds(version));

  // A destination rank registered again: its daemon refuses the folded Prepare (a stale view), and
  // the sync runs again in full within the same call.
  {
    v1::UnregisterRequest un;
    un.set_group("infer");
    un.set_rank(1);
    un.set_registration(registration[1]);
    v1::UnregisterResponse ur;
    REQUIRE(cluster.node(node_of(1)).client()->Unregister(ctx().get(), un, &ur).ok());
    registration[1] = register_destination(1);
  }
  CHECK_FALSE(synced(6));
  CHECK(folds(7));

  // Version 8 is not published: the trainer's daemons refuse it in the first wave; the sync runs
  // again in full, which names the rank; every destination rank still reads version 7.
  v1::SyncResponse out;
  grpc::Status st = sync(8, &out);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("published version 7, not 8"));
  CHECK(holds(7) == 0);
  CHECK(synced(8) == false);  // the failed sync's view was not kept
  CHECK(folds(9));
  int last = 9;

  // A delta sync is never folded: its Prepare round reports the ranks' base (the set in use). The
  // next dense repeat folds all the same where it plans the same (packed: without zero copy);
  // the view it keeps serves folded Prepares, which report none.
  if (zero_copy == "off") {
    req.mutable_options()->set_delta(v1::DELTA_AUTO);
    cluster.step(g.src, g.nodes, 10, [&] { g.fill(10); });
    v1::SyncResponse with_deltas;  // a new plan (packed) on every daemon: as slow as a first sync
    const grpc::Status ds = untilCommitted([&] { return sync(10, &with_deltas); });
    INFO(ds.error_message());
    REQUIRE(ds.ok());
    CHECK(holds(10) == 0);
    CHECK_FALSE(with_deltas.folded());
    kept.after(with_deltas);
    req.mutable_options()->set_delta(v1::DELTA_OFF);
    CHECK(folds(11));
    last = 11;
  }

  // A daemon silent at the folded wave (frozen): found within the peer timeout, as a Prepare
  // round would have found it, named; the others' ranks still read the last version.
  const int frozen = last + 1;
  cluster.step(g.src, g.nodes, static_cast<uint64_t>(frozen), [&] { g.fill(frozen); });
  const pid_t stopped = cluster.node("n2").pid();
  freezeProcess(stopped);
  const auto began = std::chrono::steady_clock::now();
  st = sync(frozen, &out);
  const auto took = std::chrono::steady_clock::now() - began;
  ::kill(stopped, SIGCONT);
  CHECK_FALSE(st.ok());
  CHECK_THAT(st.error_message(), Catch::Contains("node \"n2\""));
  CHECK(took < std::chrono::seconds(8));  // the peer timeout (1.5 s), not the sync's lease (10 s)
  const v1::RankStatus on_n0 = rank_status(1);
  CHECK(on_n0.state() == v1::RANK_READY);
  CHECK(on_n0.version() == static_cast<uint64_t>(last));
  const grpc::Status again = untilCommitted([&] { return sync(frozen, &out); });
  INFO(again.error_message());
  REQUIRE(again.ok());
  CHECK(holds(frozen) == 0);
}

TEST_CASE("fold policy: always folds single-buffered destinations too - never folds none", "[daemon][sync]") {
  const std::string policy = GENERATE("always", "never");
  CAPTURE(policy);
  Cluster cluster({"--fold-prepare", policy, "--peer-timeout-ms", "1500"});
  TrainerAndInference g("policy-" + policy);
  registerBoth(cluster, g);
  v1::SyncRequest req;
  req.set_src_group("trainer");
  req.set_dst_group("infer");
  KeptPrepare kept(1500);
  for (int version = 1; version <= 3; ++version) {
    cluster.step(g.src, g.nodes, static_cast<uint64_t>(version), [&] { g.fill(version); });
    req.set_version(static_cast<uint64_t>(version));
    const bool repeats = version > 1 && kept.quick();
    v1::SyncResponse out;
    const grpc::Status st = cluster.node("n1").client()->Sync(ctx().get(), req, &out);
    INFO("version " << version << ": " << st.error_message());
    REQUIRE(st.ok());
    CHECK(g.wrong(version) == 0);
    CHECK(out.repeated() == repeats);
    CHECK(out.folded() == (repeats && policy == "always"));
    kept.after(out);
  }
  if (policy == "never") return;
  // The price of "always": a daemon silent at the folded wave fails the sync after the others
  // may have written part of it. Those ranks are DIRTY (never reported at version 3 or 4), named.
  cluster.step(g.src, g.nodes, 4, [&] { g.fill(4); });
  const pid_t stopped = cluster.node("n2").pid();
  freezeProcess(stopped);
  req.set_version(4);
  v1::SyncResponse out;
  const grpc::Status st = cluster.node("n1").client()->Sync(ctx(60).get(), req, &out);
  ::kill(stopped, SIGCONT);
  CHECK_FALSE(st.ok());
  CHECK_THAT(st.error_message(), Catch::Contains("node \"n2\""));
  v1::WaitVersionRequest wv;
  wv.set_group("infer");
  v1::WaitVersionResponse wvr;
  const grpc::Status waited = cluster.node("n0").client()->WaitVersion(ctx().get(), wv, &wvr);
  if (waited.ok()) {
    CHECK(wvr.version() == 3);  // nothing reached n0's ranks before the sync was given up
  } else {
    CHECK_THAT(waited.error_message(), Catch::Contains("is DIRTY"));
  }
  const grpc::Status again =
      untilCommitted([&] { return cluster.node("n1").client()->Sync(ctx(60).get(), req, &out); });
  INFO(again.error_message());
  REQUIRE(again.ok());
  CHECK(g.wrong(4) == 0);
}

TEST_CASE("through a relay tree, a daemon silent below its relay is named (not the relay) and the next sync repairs",
          "[daemon][sync]") {
  // --relay-fanout 2 over 3 daemons: the coordinator's calls go as a Relay to the first daemon in
  // address order (for itself and the second) and a call to the third. The third coordinates;
  // the second, below the relay, is frozen.
  Cluster cluster({"--relay-fanout", "2", "--peer-timeout-ms", "1500"});
  std::vector<int> order = {0, 1, 2};
  const auto address = [&](int i) { return "127.0.0.1:" + std::to_string(cluster.ports[static_cast<size_t>(i)]); };
  std::sort(order.begin(), order.end(), [&](int a, int b) { return address(a) < address(b); });
  const std::string relay_node = "n" + std::to_string(order[0]), frozen = "n" + std::to_string(order[1]),
                    coordinator = "n" + std::to_string(order[2]);
  CAPTURE(relay_node, frozen, coordinator);
  TrainerAndInference g("rs");
  registerBoth(cluster, g);
  v1::SyncRequest req;
  req.set_src_group("trainer");
  req.set_dst_group("infer");
  const auto sync = [&](int version, v1::SyncResponse* out) {
    req.set_version(static_cast<uint64_t>(version));
    return cluster.node(coordinator).client()->Sync(ctx(60).get(), req, out);
  };
  v1::SyncResponse out;
  cluster.step(g.src, g.nodes, 1, [&] { g.fill(1); });
  REQUIRE(sync(1, &out).ok());
  CHECK(out.coordinator_calls() == 2);
  CHECK(g.wrong(1) == 0);

  cluster.step(g.src, g.nodes, 2, [&] { g.fill(2); });
  const pid_t stopped = cluster.node(frozen).pid();
  freezeProcess(stopped);
  const grpc::Status st = sync(2, &out);
  ::kill(stopped, SIGCONT);
  CHECK_FALSE(st.ok());
  INFO(st.error_message());
  CHECK_THAT(st.error_message(), Catch::Contains("node \"" + frozen + "\""));
  CHECK_THAT(st.error_message(), !Catch::Contains("node \"" + relay_node + "\""));
  v1::WaitVersionRequest wv;
  wv.set_group("infer");
  v1::WaitVersionResponse wvr;
  const grpc::Status waited = cluster.node("n0").client()->WaitVersion(ctx().get(), wv, &wvr);
  INFO("WaitVersion: " << waited.error_message());
  REQUIRE(waited.ok());
  CHECK(wvr.version() == 1);  // no rank reports the version the sync did not finish

  // Awake again: the sync goes through the tree and every byte lands.
  const grpc::Status again = untilCommitted([&] { return sync(2, &out); });
  INFO(again.error_message());
  REQUIRE(again.ok());
  CHECK(g.wrong(2) == 0);
}

TEST_CASE(
    "Peer.Relay refuses methods it does not relay, a fanout below 2 and addresses outside the cluster - a frozen "
    "daemon comes back in time",
    "[daemon][sync][security]") {
  Cluster cluster({"--relay-fanout", "2"});
  auto peer = cluster.daemons[0]->peer();
  const auto relay = [&](const std::string& method, uint32_t fanout, const std::string& address) {
    v1::RelayRequest r;
    r.set_method(method);
    r.set_fanout(fanout);
    auto* c = r.add_calls();
    c->set_address(address);
    c->set_timeout_ms(1000);
    v1::RelayResponse out;
    return std::make_pair(peer->Relay(ctx().get(), r, &out), out);
  };
  const std::string n1 = "127.0.0.1:" + std::to_string(cluster.ports[1]);
  auto [describe, _d] = relay("Describe", 2, n1);
  CHECK(describe.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(describe.error_message(), Catch::Contains("no Peer method \"Describe\" is relayed"));
  auto [chain, _c] = relay("Finish", 1, n1);
  CHECK(chain.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  // Not a proxy: an address that is not one of the cluster's daemons is refused, nothing called.
  auto [outside, _o] = relay("Finish", 2, "127.0.0.1:" + std::to_string(freePort()));
  CHECK(outside.error_code() == grpc::StatusCode::PERMISSION_DENIED);
  CHECK_THAT(outside.error_message(), Catch::Contains("is not a peer of this daemon"));
  // A daemon named twice, or a Relay without a deadline: refused, nothing called.
  {
    v1::RelayRequest twice;
    twice.set_method("Finish");
    twice.set_fanout(2);
    for (int k = 0; k < 2; ++k) {
      auto* c = twice.add_calls();
      c->set_address(n1);
      c->set_timeout_ms(1000);
    }
    v1::RelayResponse out;
    const auto st = peer->Relay(ctx().get(), twice, &out);
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(st.error_message(), Catch::Contains("is called more than once"));
    twice.mutable_calls()->RemoveLast();
    grpc::ClientContext endless;  // no deadline
    const auto no_deadline = peer->Relay(&endless, twice, &out);
    CHECK(no_deadline.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(no_deadline.error_message(), Catch::Contains("a Relay needs a deadline"));
  }
  // A peer's call through it: Finish of a sync n1 does not know answers NOT_FOUND, as directly.
  v1::FinishRequest f;
  f.set_sync_id("nothing-here");
  v1::RelayRequest r;
  r.set_method("Finish");
  r.set_fanout(2);
  auto* c = r.add_calls();
  c->set_address(n1);
  // The relay's first call to n1 opens a channel (a TLS handshake): a CI run with the vLLM tests
  // beside it once took over 2 s for it.
  c->set_timeout_ms(10000);
  f.SerializeToString(c->mutable_request());
  v1::RelayResponse out;
  REQUIRE(peer->Relay(ctx().get(), r, &out).ok());
  REQUIRE(out.results_size() == 1);
  v1::FinishResponse direct;
  const auto st = cluster.daemons[1]->peer()->Finish(ctx().get(), f, &direct);
  CHECK(out.results(0).code() == static_cast<int32_t>(st.error_code()));
  CHECK(out.results(0).message() == st.error_message());

  // A lease renewal through the relay, one daemon frozen: the relay answers within its own
  // deadline, the frozen daemon DEADLINE_EXCEEDED, the others as they would directly (NOT_FOUND:
  // no such sync), and the request common to all travels once.
  v1::ProgressRequest progress;
  progress.set_sync_id("nothing-here");
  v1::RelayRequest poll;
  poll.set_method("Progress");
  poll.set_fanout(2);
  progress.SerializeToString(poll.mutable_common_request());
  // The frozen daemon's call times out after 400 ms; the live ones may take up to 8 s to answer (a
  // loaded machine's once took over 400 ms; a channel's first call over 2 s), inside the caller's 10 s.
  for (int i : {0, 1, 2}) {
    auto* call = poll.add_calls();
    call->set_address("127.0.0.1:" + std::to_string(cluster.ports[static_cast<size_t>(i)]));
    call->set_timeout_ms(i == 2 ? 400 : 8000);
  }
  const pid_t frozen = cluster.daemons[2]->pid();
  freezeProcess(frozen);
  v1::RelayResponse polled;
  auto c2 = ctx();
  c2->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(10000));
  const auto started = std::chrono::steady_clock::now();
  const grpc::Status relayed = peer->Relay(c2.get(), poll, &polled);
  const auto took = std::chrono::steady_clock::now() - started;
  ::kill(frozen, SIGCONT);
  INFO(relayed.error_message());
  REQUIRE(relayed.ok());
  CHECK(took < std::chrono::milliseconds(10000));
  REQUIRE(polled.results_size() == 3);
  CHECK(polled.results(0).code() == static_cast<int32_t>(grpc::StatusCode::NOT_FOUND));
  CHECK(polled.results(1).code() == static_cast<int32_t>(grpc::StatusCode::NOT_FOUND));
  CHECK(polled.results(2).code() == static_cast<int32_t>(grpc::StatusCode::DEADLINE_EXCEEDED));
}

TEST_CASE(
    "relayed calls: each call's own part merges into the common request - and a call every daemon must get (the "
    "commit) reaches the daemons below a silent relay directly",
    "[daemon][sync]") {
  Cluster cluster({"--insecure"});
  std::vector<std::string> addresses;
  for (int p : cluster.ports) addresses.push_back("127.0.0.1:" + std::to_string(p));
  std::sort(addresses.begin(), addresses.end());
  daemon::DaemonConfig config;
  config.peers = addresses;
  config.insecure = true;
  const daemon::PeerSet peers(config, "coordinator");
  // Finish of an attempt no daemon knows: each answers NOT_FOUND when reached.
  v1::FinishRequest f;
  f.set_sync_id("nothing-here");
  f.set_fence(7);
  f.set_commit(true);
  daemon::TreeOptions options;
  options.method = "Finish";
  options.fanout = 2;  // addresses[0] relays for itself and addresses[1]
  f.SerializeToString(&options.common_request);
  std::vector<daemon::RawCall> calls;
  for (const auto& a : addresses) calls.push_back({a, {}, std::chrono::milliseconds(500)});
  size_t again = 0;
  auto results = daemon::callTreeReachingAll(peers, calls, options, std::chrono::milliseconds(500), &again);
  CHECK(again == 0);
  for (const auto& r : results) CHECK(r.status.error_code() == grpc::StatusCode::NOT_FOUND);

  // A call's own part follows the common request, through the relay as directly: the daemon gets
  // the two merged. A Prepare with the common key and a lease below the minimum, and each
  // daemon's own sync id: refused for the lease, naming the daemon's own sync (the common part
  // alone has no id, the own part alone no key).
  {
    v1::PrepareRequest common;
    common.set_write_key(std::string(transport::WriteKey::random().view()));
    common.set_lease_ms(1);
    daemon::TreeOptions prepare = options;
    prepare.method = "Prepare";
    common.SerializeToString(&prepare.common_request);
    std::vector<daemon::RawCall> own = calls;
    for (size_t i = 0; i < own.size(); ++i) {
      v1::PrepareRequest part;
      part.set_sync_id("own-" + std::to_string(i));
      part.SerializeToString(&own[i].request);
    }
    results = daemon::callTreeReachingAll(peers, own, prepare, std::chrono::milliseconds(500), &again);
    for (size_t i = 0; i < results.size(); ++i) {
      INFO(results[i].status.error_message());
      CHECK(results[i].status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
      CHECK_THAT(results[i].status.error_message(),
                 Catch::Contains("prepare of sync own-" + std::to_string(i) + ": a lease of 1 ms"));
    }
  }

  // The relay frozen: its subtree is called again directly; it is named for its own call, and
  // the daemon below it answers.
  Daemon* relay = nullptr;
  for (auto& d : cluster.daemons)
    if (d->address() == addresses[0]) relay = d.get();
  REQUIRE(relay != nullptr);
  freezeProcess(relay->pid());
  results = daemon::callTreeReachingAll(peers, calls, options, std::chrono::milliseconds(500), &again);
  ::kill(relay->pid(), SIGCONT);
  CHECK(again == 2);  // the relay's own call too: it may have reached itself before it froze
  CHECK(results[0].status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
  INFO(results[1].status.error_message());
  CHECK(results[1].status.error_code() == grpc::StatusCode::NOT_FOUND);
  CHECK(results[2].status.error_code() == grpc::StatusCode::NOT_FOUND);
}

TEST_CASE(
    "Peer.Describe names layouts by digest when asked, and sends only the layouts asked for - a gather then "
    "syncs every byte",
    "[daemon][sync]") {
  Cluster cluster;
  TrainerAndInference g("ld");
  registerBoth(cluster, g);
  const std::string trainer = planner::layoutDigest(g.src_proto), infer = planner::layoutDigest(g.dst_proto);
  auto peer = cluster.node("n0").peer();  // (trainer ranks 0, 1 and inference ranks 2, 3)

  v1::DescribeRequest by_digest;
  by_digest.set_layout_digests(true);
  v1::DescribeResponse named;
  REQUIRE(peer->Describe(ctx().get(), by_digest, &named).ok());
  CHECK(named.layouts_size() == 0);
  CHECK(named.layout_digests().size() == 2);
  CHECK(named.layout_digests().at("trainer") == trainer);
  CHECK(named.layout_digests().at("infer") == infer);
  CHECK(named.ranks_size() == 4);
  for (const auto& r : named.ranks()) CHECK(r.layout_digest() == named.layout_digests().at(r.group()));
  CHECK(named.access_size() == 2);

  v1::DescribeResponse whole;  // (as before: every layout, no digests named)
  REQUIRE(peer->Describe(ctx().get(), v1::DescribeRequest(), &whole).ok());
  CHECK(whole.layouts_size() == 2);
  CHECK(whole.layout_digests().empty());

  v1::DescribeRequest fetch;
  fetch.add_layouts(infer);
  fetch.add_layouts("0123456789abcdef");  // held by nobody: left out
  v1::DescribeResponse fetched;
  REQUIRE(peer->Describe(ctx().get(), fetch, &fetched).ok());
  REQUIRE(fetched.layouts_size() == 1);
  CHECK(planner::layoutDigest(fetched.layouts(0)) == infer);
  CHECK(fetched.node() == "n0");
  CHECK(fetched.ranks_size() == 0);  // the layouts alone
  CHECK(fetched.access_size() == 0);
  CHECK(fetched.peer_nodes().empty());
  CHECK(fetched.transport_address().empty());

  // n1 holds trainer ranks only: it has no inference layout to send.
  v1::DescribeResponse none;
  REQUIRE(cluster.node("n1").peer()->Describe(ctx().get(), fetch, &none).ok());
  CHECK(none.layouts_size() == 0);

  // n1 coordinates: its gather names both layouts by digest and fetches the inference one.
  cluster.step(g.src, g.nodes, 1, [&] { g.fill(1); });
  v1::SyncRequest req;
  req.set_src_group("trainer");
  req.set_dst_group("infer");
  req.set_version(1);
  v1::SyncResponse out;
  const grpc::Status st = cluster.node("n1").client()->Sync(ctx(60).get(), req, &out);
  INFO(st.error_message());
  REQUIRE(st.ok());
  CHECK(g.wrong(1) == 0);
}

TEST_CASE("relay groups: contiguous subtrees of near-equal size, and their depth", "[daemon][sync]") {
  using Groups = std::vector<std::pair<size_t, size_t>>;
  using daemon::relayDepth;
  using daemon::relayGroups;
  CHECK(relayGroups(3, 16) == Groups{{0, 1}, {1, 2}, {2, 3}});
  CHECK(relayGroups(3, 0) == Groups{{0, 1}, {1, 2}, {2, 3}});
  CHECK(relayGroups(3, 2) == Groups{{0, 2}, {2, 3}});
  CHECK(relayGroups(10, 4) == Groups{{0, 3}, {3, 6}, {6, 8}, {8, 10}});
  CHECK(relayGroups(0, 4).empty());
  CHECK(relayDepth(1, 2) == 0);
  CHECK(relayDepth(3, 2) == 0);  // a relay's own call and two direct ones
  CHECK(relayDepth(4, 2) == 1);  // 3 left: a Relay for 2 of them
  CHECK(relayDepth(17, 16) == 0);
  CHECK(relayDepth(64, 16) == 1);
  CHECK(relayDepth(1024, 32) == 1);
  CHECK(relayDepth(1024, 4) == 4);
  // Every call is in exactly one group, for any count and fanout.
  for (size_t n = 1; n < 200; ++n)
    for (uint32_t f : {2u, 3u, 16u}) {
      size_t next = 0;
      for (const auto& [b, e] : relayGroups(n, f)) {
        CHECK(b == next);
        CHECK(e > b);
        next = e;
      }
      CHECK(next == n);
      CHECK(relayGroups(n, f).size() == std::min<size_t>(n, f));
    }
}

TEST_CASE("concurrent syncs: same group refused, different groups together - a stuck then killed daemon fails the sync",
          "[daemon][sync]") {
  Cluster cluster;
  const auto src_proto = *planner::parseLayoutJson(kTrainer, "trainer");
  const auto dst_proto = *planner::parseLayoutJson(kInference, "infer");
  std::string second_json = kInference;
  second_json.replace(second_json.find("\"infer\""), 7, "\"infer2\"");
  const auto dst2_proto = *planner::parseLayoutJson(second_json, "infer2");
  planner::NodeTable nodes;
  const auto src = *planner::resolveLayout(src_proto, nodes);
  const auto dst = *planner::resolveLayout(dst_proto, nodes);
  std::vector<RankMemory> smem, dmem, dmem2;
  for (int32_t r = 0; r < 4; ++r) smem.push_back(allocate(src, r, "u" + std::to_string(r)));
  for (int32_t r = 0; r < 4; ++r) dmem.push_back(allocate(dst, r, "v" + std::to_string(r)));
  for (int32_t r = 0; r < 4; ++r) dmem2.push_back(allocate(dst, r, "w" + std::to_string(r)));
  for (int32_t r = 0; r < 4; ++r) {
    v1::RegisterResponse resp;
    REQUIRE(cluster.node(nodes.name(src.rank_node[r]))
                .client()
                ->Register(ctx().get(), source(src_proto, r, 4, smem[r], 1), &resp)
                .ok());
    REQUIRE(cluster.node(nodes.name(dst.rank_node[r]))
                .client()
                ->Register(ctx().get(), request(dst_proto, r, 4, dmem[r]), &resp)
                .ok());
    REQUIRE(cluster.node(nodes.name(dst.rank_node[r]))
                .client()
                ->Register(ctx().get(), request(dst2_proto, r, 4, dmem2[r]), &resp)
                .ok());
  }
  for (int32_t r = 0; r < 4; ++r)
    forEachElement(src, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
      *smem[r].at<int32_t>(p, off) = valueOf(t, flat, 1);
    });

  // A sync holds its destination group on every daemon from prepare to finish.
  auto peer = cluster.daemons[0]->peer();
  v1::PrepareRequest prep;
  prep.set_sync_id("held");
  *prep.mutable_src() = src_proto;
  *prep.mutable_dst() = dst_proto;
  prep.set_version(1);
  prep.set_staging_bytes(uint64_t{1} << 30);
  prep.set_chunk_bytes(uint64_t{64} << 20);
  prep.set_write_key(std::string(transport::WriteKey::random().view()));
  prep.set_packed(true);  // clients' segments over tcp (as the coordinator plans it)
  v1::PrepareResponse presp;
  REQUIRE(peer->Prepare(ctx().get(), prep, &presp).ok());
  v1::SyncRequest sync;
  sync.set_src_group("trainer");
  sync.set_dst_group("infer");
  sync.set_version(1);
  v1::SyncResponse out;
  grpc::Status st = cluster.node("n1").client()->Sync(ctx().get(), sync, &out);
  CHECK(st.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(st.error_message(), Catch::Contains("a sync into group \"infer\" (held) is in progress"));
  v1::FinishRequest fin;
  fin.set_sync_id("held");
  v1::FinishResponse finr;
  REQUIRE(peer->Finish(ctx().get(), fin, &finr).ok());

  // Two syncs into different groups at the same time, coordinated by different daemons.
  std::vector<grpc::Status> results(2);
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i)
    threads.emplace_back([&, i] {
      v1::SyncRequest s = sync;
      s.set_dst_group(i == 0 ? "infer" : "infer2");
      v1::SyncResponse o;
      results[i] = cluster.daemons[i]->client()->Sync(ctx(60).get(), s, &o);
    });
  for (auto& t : threads) t.join();
  for (const auto& r : results) {
    INFO(r.error_message());
    CHECK(r.ok());
  }
  int64_t bad = 0;
  for (auto* mem : {&dmem, &dmem2})
    for (int32_t r = 0; r < 4; ++r)
      forEachElement(dst, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
        bad += *(*mem)[r].at<int32_t>(p, off) != valueOf(t, flat, 1);
      });
  CHECK(bad == 0);

  // A daemon that hangs (SIGSTOP) and then dies while a sync waits on it: the sync fails with the
  // daemon named, no rank moves to the new version, and after a restart the next sync succeeds.
  cluster.step(src, nodes, 2, [] {});
  const pid_t n2 = cluster.daemons[2]->pid();
  freezeProcess(n2);
  std::promise<grpc::Status> pending;
  std::thread t([&] {
    v1::SyncRequest s = sync;
    s.set_version(2);
    s.set_sync_id("waits-on-n2");
    v1::SyncResponse o;
    pending.set_value(cluster.node("n0").client()->Sync(ctx(60).get(), s, &o));
  });
  CHECK(cluster.node("n0").waitForSync("waits-on-n2", v1::SYNC_PREPARING));  // (n2's Prepare is out)
  ::kill(n2, SIGKILL);
  auto f = pending.get_future();
  REQUIRE(f.wait_for(std::chrono::seconds(60)) == std::future_status::ready);
  t.join();
  st = f.get();
  CHECK_FALSE(st.ok());
  CHECK_THAT(st.error_message(), Catch::Contains("127.0.0.1:" + std::to_string(cluster.ports[2])));
  v1::WaitVersionRequest wv;
  wv.set_group("infer");
  v1::WaitVersionResponse wvr;
  REQUIRE(cluster.node("n0").client()->WaitVersion(ctx().get(), wv, &wvr).ok());
  CHECK(wvr.version() == 1);
  cluster.daemons[2]->reap();
  cluster.start(2);
  for (int32_t r = 0; r < 2; ++r) {
    v1::RegisterResponse resp;
    REQUIRE(cluster.node("n2").client()->Register(ctx().get(), request(dst_proto, r, 4, dmem[r]), &resp).ok());
  }
  sync.set_version(2);
  st = cluster.node("n1").client()->Sync(ctx().get(), sync, &out);
  INFO(st.error_message());
  CHECK(st.ok());
}

namespace {

// Registers both layouts' ranks with their nodes' daemons, syncs `versions` times and returns the
// number of wrong destination elements after the last one.
int64_t syncAndCount(Cluster& cluster, const std::string& src_json, const std::string& dst_json, int versions,
                     std::vector<v1::SyncResponse>* responses = nullptr) {
  const auto src_proto = *planner::parseLayoutJson(src_json, "src");
  const auto dst_proto = *planner::parseLayoutJson(dst_json, "dst");
  planner::NodeTable nodes;
  auto src = planner::resolveLayout(src_proto, nodes);
  auto dst = planner::resolveLayout(dst_proto, nodes);
  REQUIRE(src.ok());
  REQUIRE(dst.ok());
  std::vector<RankMemory> smem, dmem;
  for (int32_t r = 0; r < src->world(); ++r) smem.push_back(allocate(*src, r, src->group + std::to_string(r)));
  for (int32_t r = 0; r < dst->world(); ++r) dmem.push_back(allocate(*dst, r, dst->group + std::to_string(r)));
  for (int32_t r = 0; r < src->world(); ++r) {
    v1::RegisterResponse resp;
    REQUIRE(cluster.node(nodes.name(src->rank_node[r]))
                .client()
                ->Register(ctx().get(), source(src_proto, r, src->world(), smem[r]), &resp)
                .ok());
  }
  for (int32_t r = 0; r < dst->world(); ++r) {
    v1::RegisterResponse resp;
    REQUIRE(cluster.node(nodes.name(dst->rank_node[r]))
                .client()
                ->Register(ctx().get(), request(dst_proto, r, dst->world(), dmem[r]), &resp)
                .ok());
  }
  int64_t bad = 0;
  for (int v = 1; v <= versions; ++v) {
    cluster.step(*src, nodes, static_cast<uint64_t>(v), [&] {
      for (int32_t r = 0; r < src->world(); ++r)
        forEachElement(*src, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
          *smem[r].at<int32_t>(p, off) = valueOf(t, flat, v);
        });
    });
    v1::SyncRequest sync;
    sync.set_src_group(src->group);
    sync.set_dst_group(dst->group);
    sync.set_version(static_cast<uint64_t>(v));
    sync.mutable_options()->set_verify(true);
    v1::SyncResponse out;
    const grpc::Status st = cluster.daemons[v % 3]->client()->Sync(ctx().get(), sync, &out);
    INFO(st.error_message());
    REQUIRE(st.ok());
    if (responses) responses->push_back(out);
    // Tensor indices match between the layouts here (same tensors in the same order).
    bad = 0;
    for (int32_t r = 0; r < dst->world(); ++r)
      forEachElement(*dst, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
        bad += *dmem[r].at<int32_t>(p, off) != valueOf(t, flat, v);
      });
  }
  return bad;
}

}  // namespace

TEST_CASE("transfers land straight in a rank's buffer when one rank holds them whole and contiguously",
          "[daemon][sync]") {
  // Over tcp only with --host-zero-copy on (by default clients' segments travel packed there).
  Cluster cluster({"--host-zero-copy", "on"});
  // FSDP=2 on n0; TP=2 on n1 and on n2 (two replicas, so one node relays to the other).
  // "col" is cut by rows on both sides: each trainer half lies whole and contiguous in one
  // inference rank and lands straight there (also where it is relayed from). "row" is cut by
  // columns on the inference side: each trainer half is split per inference rank, packed at the
  // source, and each part lands straight in its rank. "strided" is cut by columns on the trainer
  // and by rows on the inference side: every fragment is strided in its inference rank, so it
  // lands in the arena (in a bucket: 512 KiB each) and is unpacked.
  const std::string src = R"({"group":"dl-trainer","mesh":{"shape":[2]},"nodes":["n0","n0"],"tensors":[
    {"name":"col","shape":[512,1024],"dtype":"int32","placements":[{"shard":{"dim":0}}]},
    {"name":"row","shape":[512,1024],"dtype":"int32","placements":[{"shard":{"dim":0}}]},
    {"name":"strided","shape":[512,1024],"dtype":"int32","placements":[{"shard":{"dim":1}}]}]})";
  const std::string dst = R"({"group":"dl-infer","mesh":{"shape":[2,2]},"nodes":["n1","n1","n2","n2"],"tensors":[
    {"name":"col","shape":[512,1024],"dtype":"int32","placements":[{"replicate":{}},{"shard":{"dim":0}}]},
    {"name":"row","shape":[512,1024],"dtype":"int32","placements":[{"replicate":{}},{"shard":{"dim":1}}]},
    {"name":"strided","shape":[512,1024],"dtype":"int32","placements":[{"replicate":{}},{"shard":{"dim":0}}]}]})";
  std::vector<v1::SyncResponse> out;
  CHECK(syncAndCount(cluster, src, dst, 2, &out) == 0);  // verified end to end (checksums), every element checked
  const uint64_t mib = uint64_t{1} << 20;
  for (const auto& o : out) {
    CHECK(o.network_bytes() == 2 * 6 * mib);        // each inference node needs all three tensors
    CHECK(o.bytes_landed_direct() == 2 * 4 * mib);  // "col" and "row" on both nodes
  }
  httplib::Client http("127.0.0.1", cluster.node("n2").metricsPort());
  auto scrape = http.Get("/metrics");
  REQUIRE(scrape);
  CHECK_THAT(scrape->body, Catch::Contains("shardcast_bytes_landed_direct_total " + std::to_string(2 * 4 * mib)));
}

TEST_CASE("whole experts (uneven) into expert-stacked w13, and uneven torch.chunk shards", "[daemon][sync]") {
  Cluster cluster;
  // 6 experts on 4 trainer ranks: 2, 2, 1, 1 (FlexShard-like); inference EP=3 on n2 with each
  // rank's experts stacked as w13 = [w1_e; w3_e; ...]; plus a [7, 3] tensor cut 2,2,2,1 by
  // torch.chunk on the trainer and 3,3,1 on the inference side.
  const int owner[6] = {0, 0, 1, 1, 2, 3};
  std::string src_t, dst_t, members;
  for (int e = 0; e < 6; ++e)
    for (const char* w : {"w1", "w3"}) {
      const std::string name = "e" + std::to_string(e) + "." + w;
      const std::string sep = src_t.empty() ? "" : ",";
      src_t += sep + R"({"name":")" + name + R"(","shape":[6,4],"dtype":"int32","pieces":[{"rank":)" +
               std::to_string(owner[e]) + R"(,"offsets":[0,0],"sizes":[6,4]}]})";
      dst_t += sep + R"({"name":")" + name + R"(","shape":[6,4],"dtype":"int32","pieces":[{"rank":)" +
               std::to_string(e / 2) + R"(,"offsets":[0,0],"sizes":[6,4]}]})";
      members += sep + "\"" + name + "\"";
    }
  src_t += R"(,{"name":"odd","shape":[7,3],"dtype":"int32","placements":[{"shard":{"dim":0}}]})";
  dst_t += R"(,{"name":"odd","shape":[7,3],"dtype":"int32","placements":[{"shard":{"dim":0}}]})";
  const std::string src =
      R"({"group":"moe-trainer","mesh":{"shape":[4]},"nodes":["n0","n0","n1","n1"],"tensors":[)" + src_t + "]}";
  const std::string dst = R"({"group":"moe-infer","mesh":{"shape":[3]},"nodes":["n2","n2","n0"],"tensors":[)" + dst_t +
                          R"(],"fused":[{"name":"w13","dim":0,"tensors":[)" + members + "]}]}";
  CHECK(syncAndCount(cluster, src, dst, 2) == 0);
}

TEST_CASE("Peer.Progress: a daemon's bytes while its part of a sync runs, cumulative, gone after finish",
          "[daemon][sync]") {
  // n0 holds the trainer; n1 and n2 each need half of it (no relay), so n1's part is done once n0
  // has sent, whatever n2 does: the coordinator's Watch stream shows the same counters mid-sync.
  Cluster cluster({"--host-zero-copy", "on"});  // the direct landings are counted too
  const char* trainer = R"({"group":"trainer","mesh":{"shape":[1]},"nodes":["n0"],"tensors":[
    {"name":"w","shape":[64,32],"dtype":"int32"}]})";
  const char* halves = R"({"group":"halves","mesh":{"shape":[2]},"nodes":["n1","n2"],"tensors":[
    {"name":"w","shape":[64,32],"dtype":"int32","placements":[{"shard":{"dim":0}}]}]})";
  const auto src_proto = *planner::parseLayoutJson(trainer, "trainer");
  const auto dst_proto = *planner::parseLayoutJson(halves, "halves");
  planner::NodeTable nodes;
  const auto src = *planner::resolveLayout(src_proto, nodes);
  const auto dst = *planner::resolveLayout(dst_proto, nodes);
  RankMemory s0 = allocate(src, 0, "p-s0");
  std::vector<RankMemory> d;
  for (int32_t r = 0; r < 2; ++r) d.push_back(allocate(dst, r, "p-d" + std::to_string(r)));
  v1::RegisterResponse resp;
  REQUIRE(cluster.node("n0").client()->Register(ctx().get(), source(src_proto, 0, 1, s0, 1), &resp).ok());
  for (int32_t r = 0; r < 2; ++r)
    REQUIRE(
        cluster.node(r == 0 ? "n1" : "n2").client()->Register(ctx().get(), request(dst_proto, r, 2, d[r]), &resp).ok());
  forEachElement(src, 0, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
    *s0.at<int32_t>(p, off) = valueOf(t, flat, 1);
  });

  // Drive the phases by hand, as a coordinator would.
  std::vector<std::unique_ptr<v1::Peer::Stub>> peers;
  v1::ExecuteRequest exec;
  exec.set_sync_id("by-hand");
  exec.set_timeout_ms(30000);
  const std::string key(transport::WriteKey::random().view());  // one attempt: one key on every daemon
  for (int i = 0; i < 3; ++i) {
    peers.push_back(cluster.daemons[i]->peer());
    v1::DescribeResponse described;
    REQUIRE(peers[i]->Describe(ctx().get(), v1::DescribeRequest(), &described).ok());
    v1::PrepareRequest prep;
    prep.set_sync_id("by-hand");
    *prep.mutable_src() = src_proto;
    *prep.mutable_dst() = dst_proto;
    prep.set_version(1);
    prep.set_staging_bytes(uint64_t{1} << 30);
    prep.set_chunk_bytes(uint64_t{64} << 20);
    prep.set_write_key(key);
    v1::PrepareResponse presp;
    REQUIRE(peers[i]->Prepare(ctx().get(), prep, &presp).ok());
    auto* n = exec.add_nodes();
    n->set_node(described.node());
    n->set_transport_address(described.transport_address());
    *n->mutable_targets() = presp.targets();
  }
  auto progress = [&](int i) {
    v1::ProgressRequest pr;
    pr.set_sync_id("by-hand");
    v1::ProgressResponse r;
    const grpc::Status st = peers[i]->Progress(ctx().get(), pr, &r);
    return std::make_pair(st, r);
  };
  const uint64_t half = 32 * 32 * 4;
  CHECK(progress(1).second.bytes_received() == 0);  // prepared, nothing moved yet

  std::vector<v1::ExecuteResponse> parts(3);
  grpc::Status n1_result;
  std::thread n1([&] { n1_result = peers[1]->Execute(ctx().get(), exec, &parts[1]); });  // waits for its half
  REQUIRE(peers[0]->Execute(ctx().get(), exec, &parts[0]).ok());                         // n0 sends both halves
  n1.join();
  REQUIRE(n1_result.ok());
  // n1 finished its part; n2 has not run yet. Progress is there while the sync is still open.
  auto [st1, p1] = progress(1);
  REQUIRE(st1.ok());
  CHECK(p1.bytes_received() == half);
  // Its half is contiguous in its one rank: n0 wrote it straight there, nothing to copy locally.
  CHECK(p1.bytes_landed_direct() == half);
  CHECK(p1.local_bytes() == 0);
  CHECK(progress(0).second.bytes_sent() == 2 * half);
  CHECK(progress(2).second.local_bytes() == 0);
  REQUIRE(peers[2]->Execute(ctx().get(), exec, &parts[2]).ok());
  CHECK(progress(2).second.bytes_received() == half);

  for (int i = 0; i < 3; ++i) {
    v1::FinishRequest fin;
    fin.set_sync_id("by-hand");
    fin.set_commit(true);
    v1::FinishResponse fr;
    REQUIRE(peers[i]->Finish(ctx().get(), fin, &fr).ok());
  }
  CHECK(progress(1).first.error_code() == grpc::StatusCode::NOT_FOUND);
  int64_t bad = 0;
  for (int32_t r = 0; r < 2; ++r)
    forEachElement(dst, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
      bad += *d[r].at<int32_t>(p, off) != valueOf(t, flat, 1);
    });
  CHECK(bad == 0);
}

TEST_CASE("CUDA buffers: device sources and destinations sync byte-exact", "[daemon][sync][gpu]") {
  SHARDCAST_SKIP_WITHOUT_GPU();
  Cluster cluster;
  // w: contiguous shards (sent straight from device memory with a CUDA-aware UCX, else packed
  // through host staging like every staged buffer); o: column shards (packed on the GPU).
  const char* trainer = R"({"group":"gtrainer","mesh":{"shape":[2]},"nodes":["n0","n0"],"tensors":[
    {"name":"w","shape":[256,64],"dtype":"int32","placements":[{"shard":{"dim":0}}]},
    {"name":"o","shape":[64,256],"dtype":"int32","placements":[{"shard":{"dim":1}}]}]})";
  // Both destination ranks on n1 (one GPU): replicas, so w (contiguous in both) crosses into the
  // GPU once and is copied device to device into the second; else one rank per node.
  const bool replicas = GENERATE(false, true);
  const char* inference = replicas ? R"({"group":"ginfer","mesh":{"shape":[2]},"nodes":["n1","n1"],"tensors":[
    {"name":"w","shape":[256,64],"dtype":"int32","placements":[{"replicate":{}}]},
    {"name":"o","shape":[64,256],"dtype":"int32","placements":[{"replicate":{}}]}]})"
                                   : R"({"group":"ginfer","mesh":{"shape":[2]},"nodes":["n1","n2"],"tensors":[
    {"name":"w","shape":[256,64],"dtype":"int32","placements":[{"shard":{"dim":1}}]},
    {"name":"o","shape":[64,256],"dtype":"int32","placements":[{"shard":{"dim":0}}]}]})";
  const auto src_proto = *planner::parseLayoutJson(trainer, "gtrainer");
  const auto dst_proto = *planner::parseLayoutJson(inference, "ginfer");
  planner::NodeTable nodes;
  const auto src = *planner::resolveLayout(src_proto, nodes);
  const auto dst = *planner::resolveLayout(dst_proto, nodes);
  struct DeviceRank {
    std::vector<std::unique_ptr<DeviceBuffer>> buffers;  // by buffer id
    std::vector<std::vector<int32_t>> host;
  };
  auto make = [&](const planner::ResolvedLayout& l, const v1::Layout& proto, int32_t r, const std::string& node,
                  DeviceRank& m, int version) {
    v1::RegisterRequest req;
    req.set_group(proto.group());
    req.set_rank(r);
    if (version > 0) {
      req.set_role(v1::ROLE_SOURCE);
      req.set_version(static_cast<uint64_t>(version));
    }
    req.set_world_size(l.world());
    *req.mutable_layout() = proto;
    m.buffers.resize(l.buffer_names.size());
    m.host.resize(l.buffer_names.size());
    for (const auto& [b, bytes] : l.rankBuffers(r)) {
      auto dev = allocateDevice(static_cast<size_t>(bytes), 0);
      REQUIRE(dev.ok());
      m.host[b].assign(static_cast<size_t>(bytes) / 4, 0);
      auto* h = req.add_buffers();
      h->set_buffer(l.buffer_names[b]);
      h->mutable_cuda()->set_handle(*(*dev)->ipcHandle());
      h->mutable_cuda()->set_size(static_cast<uint64_t>(bytes));
      m.buffers[b] = std::move(*dev);
    }
    if (version > 0) {
      forEachElement(l, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
        m.host[p.buffer][off] = valueOf(t, flat, version);
      });
      for (size_t b = 0; b < m.buffers.size(); ++b)
        if (m.buffers[b]) REQUIRE(copyToDevice(m.buffers[b]->data(), m.host[b].data(), m.host[b].size() * 4).ok());
    }
    v1::RegisterResponse resp;
    const auto st = cluster.node(node).client()->Register(ctx().get(), req, &resp);
    INFO(st.error_message());
    REQUIRE(st.ok());
  };
  std::vector<DeviceRank> s(2), dm(2);
  for (int32_t r = 0; r < 2; ++r) make(src, src_proto, r, "n0", s[r], 1);
  for (int32_t r = 0; r < 2; ++r) make(dst, dst_proto, r, r == 0 || replicas ? "n1" : "n2", dm[r], 0);
  v1::SyncRequest sync;
  sync.set_src_group("gtrainer");
  sync.set_dst_group("ginfer");
  sync.set_version(1);
  sync.mutable_options()->set_verify(true);
  v1::SyncResponse out;
  const auto st = cluster.node("n0").client()->Sync(ctx(120).get(), sync, &out);
  INFO(st.error_message());
  REQUIRE(st.ok());
  int64_t bad = 0;
  for (int32_t r = 0; r < 2; ++r) {
    for (size_t b = 0; b < dm[r].buffers.size(); ++b)
      if (dm[r].buffers[b])
        REQUIRE(copyFromDevice(dm[r].host[b].data(), dm[r].buffers[b]->data(), dm[r].host[b].size() * 4).ok());
    forEachElement(dst, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
      bad += dm[r].host[p.buffer][off] != valueOf(t, flat, 1);
    });
  }
  CHECK(bad == 0);
  CHECK(out.device_fanout_bytes() == (replicas ? 256 * 64 * 4 : 0));  // o's column blocks are strided
}
