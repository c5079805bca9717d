// A gather's layouts (PeerSet::layoutsOf, snapshotCluster): every daemon names its groups' layouts
// by digest, and each layout is fetched once, from one daemon, against peers that answer as this
// build does, as an older build does (layouts whole), or wrongly (a layout they no longer hold, or
// another one under the digest asked for).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "daemon/coordinator/cluster.h"
#include "planner/layout.h"
#include "tests/support/local_daemon.h"

using namespace shardcast;
using namespace std::chrono_literals;

namespace {

// Three inference ranks, one per peer node (n1, n2, n3); the coordinator's node n0 holds none.
const char* kInference = R"({"group":"infer","mesh":{"shape":[3]},"nodes":["n1","n2","n3"],"tensors":[
  {"name":"w","shape":[6,4],"dtype":"float32","placements":[{"shard":{"dim":0}}]}]})";

enum class Answers {
  kCurrent,    // as this build: digests when asked, the layouts asked for alone
  kOlder,      // as a build that predates layout digests: every layout whole, whatever is asked
  kForgetful,  // names the layout, but has none to send when asked for it (re-registered since)
  kLiar,       // names the layout, and sends another one when asked for it
  kOther,      // as this build, and names the layout's digest for a group "other" too (rank 0)
  kFailing,    // names the layout, and fails the call that asks for it
  kLate,       // names the layout, sends nothing the first time it is asked, then sends it
};

// A peer daemon's Describe: inference rank `rank` on its node.
class LayoutPeer final : public v1::Peer::Service {
 public:
  LayoutPeer(std::string node, int32_t rank, Answers answers)
      : node_(std::move(node)),
        rank_(rank),
        answers_(answers),
        layout_(*planner::parseLayoutJson(kInference, "infer")) {}

  grpc::Status Describe(grpc::ServerContext*, const v1::DescribeRequest* req, v1::DescribeResponse* out) override {
    out->set_node(node_);
    out->set_instance(node_ + "-instance");
    out->set_generation(1);
    const std::string digest = planner::layoutDigest(layout_);
    if (answers_ != Answers::kOlder && req->layouts_size() > 0) {
      fetches_++;
      {
        std::lock_guard<std::mutex> lock(mu_);
        asked_.insert(asked_.end(), req->layouts().begin(), req->layouts().end());
      }
      const bool asked = std::find(req->layouts().begin(), req->layouts().end(), digest) != req->layouts().end();
      if (answers_ == Answers::kFailing) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "going away");
      if (answers_ == Answers::kLiar) {
        v1::Layout other = layout_;
        other.mutable_tensors(0)->set_dtype("bfloat16");
        *out->add_layouts() = other;
      } else if (asked && (answers_ == Answers::kCurrent || answers_ == Answers::kOther ||
                           (answers_ == Answers::kLate && fetches_ > 1))) {
        *out->add_layouts() = layout_;  // (kOther: "infer"'s, whichever group it was asked for)
      }
      return grpc::Status::OK;
    }
    if (answers_ == Answers::kOlder && req->layouts_size() > 0) fetches_++;
    out->set_transport_address(node_ + "-transport");
    if (req->layout_digests() && answers_ != Answers::kOlder)
      (*out->mutable_layout_digests())["infer"] = digest;
    else
      *out->add_layouts() = layout_;
    if (answers_ == Answers::kOther) {
      (*out->mutable_layout_digests())["other"] = digest;
      auto* other = out->add_ranks();
      other->set_group("other");
      other->set_layout_digest(digest);
      other->set_role(v1::ROLE_DESTINATION);
    }
    auto* r = out->add_ranks();
    r->set_group("infer");
    r->set_rank(rank_);
    r->set_layout_digest(digest);
    r->set_role(v1::ROLE_DESTINATION);
    return grpc::Status::OK;
  }
  int fetches() const { return fetches_; }
  std::vector<std::string> asked() const {
    std::lock_guard<std::mutex> lock(mu_);
    return asked_;
  }

 private:
  const std::string node_;
  const int32_t rank_;
  const Answers answers_;
  const v1::Layout layout_;
  std::atomic<int> fetches_{0};
  mutable std::mutex mu_;
  std::vector<std::string> asked_;  // every digest a fetch asked for
};

// Three peers (ranks 0-2 of "infer") on 127.0.0.1, behaving as `answers` says in the order a
// gather asks them (by address), and a PeerSet of node n0 that holds no ranks.
struct Peers {
  explicit Peers(const std::vector<Answers>& answers) {
    // The addresses first, sorted: a peer's node, rank and answers are its place in the order a
    // gather asks them.
    std::vector<std::string> addresses;
    for (size_t i = 0; i < answers.size(); ++i)
      addresses.push_back("127.0.0.1:" + std::to_string(examples::freePort()));
    std::sort(addresses.begin(), addresses.end());
    for (size_t i = 0; i < answers.size(); ++i) {
      peers.push_back(std::make_unique<LayoutPeer>("n" + std::to_string(i + 1), static_cast<int32_t>(i), answers[i]));
      grpc::ServerBuilder builder;
      builder.AddListeningPort(addresses[i], grpc::InsecureServerCredentials());
      builder.RegisterService(peers.back().get());
      servers.push_back(builder.BuildAndStart());
      REQUIRE(servers.back());
    }
    config.node = "n0";
    config.peers = addresses;
    config.peer_timeout_ms = 10000;
    set = std::make_unique<daemon::PeerSet>(config, "n0-instance");
    self.set_node("n0");
    self.set_instance("n0-instance");
  }
  ~Peers() {
    for (auto& s : servers) s->Shutdown(std::chrono::system_clock::now() + 100ms);
  }
  StatusOr<daemon::ClusterSnapshot> gather() const { return daemon::snapshotCluster(*set, self, "127.0.0.1:1"); }
  // A gather that succeeds (its view may still fail groups).
  daemon::ClusterSnapshot gathered() const {
    auto snapshot = gather();
    INFO(snapshot.status().message());
    REQUIRE(snapshot.ok());
    return std::move(*snapshot);
  }
  int fetches() const {
    int n = 0;
    for (const auto& p : peers) n += p->fetches();
    return n;
  }

  std::vector<std::unique_ptr<LayoutPeer>> peers;
  std::vector<std::unique_ptr<grpc::Server>> servers;
  daemon::DaemonConfig config;
  std::unique_ptr<daemon::PeerSet> set;
  v1::DescribeResponse self;
};

const std::string& inferDigest() {
  static const std::string digest = planner::layoutDigest(*planner::parseLayoutJson(kInference, "infer"));
  return digest;
}

// "infer" complete in `view`, with kInference's layout (digest and all); that layout.
v1::Layout inferWhole(const daemon::ClusterView& view) {
  auto layout = view.completeGroup("infer");
  INFO(layout.status().message());
  REQUIRE(layout.ok());
  CHECK(planner::layoutDigest(*layout) == inferDigest());
  return *layout;
}

}  // namespace

TEST_CASE("gather: each layout is fetched once, from the first daemon naming it, and kept for the next gather",
          "[daemon][peers]") {
  Peers cluster({Answers::kCurrent, Answers::kCurrent, Answers::kCurrent});
  const auto first = cluster.gathered();
  inferWhole(first.view);
  CHECK(first.view.daemons().size() == 4);
  for (const auto& d : first.view.daemons()) CHECK(d.layouts_size() == 0);  // (no copy per daemon)
  CHECK(cluster.peers[0]->fetches() == 1);
  CHECK(cluster.peers[0]->asked() == std::vector<std::string>{inferDigest()});
  CHECK(cluster.peers[1]->fetches() == 0);
  CHECK(cluster.peers[2]->fetches() == 0);

  // The next gather names the same digest: nothing is fetched.
  inferWhole(cluster.gathered().view);
  CHECK(cluster.fetches() == 1);
}

TEST_CASE("gather: a daemon that predates layout digests sends its layouts whole, and they are taken from there",
          "[daemon][peers]") {
  Peers cluster({Answers::kOlder, Answers::kCurrent, Answers::kOlder});
  inferWhole(cluster.gathered().view);
  CHECK(cluster.fetches() == 0);  // the older daemons' whole layouts held the digest n2 named
}

TEST_CASE(
    "gather: a daemon that no longer holds the layout it named, or fails the fetch, is passed over for the "
    "next naming it",
    "[daemon][peers]") {
  const Answers first = GENERATE(Answers::kForgetful, Answers::kFailing);
  Peers cluster({first, Answers::kCurrent, Answers::kCurrent});
  inferWhole(cluster.gathered().view);
  CHECK(cluster.peers[0]->fetches() == 1);
  CHECK(cluster.peers[1]->fetches() == 1);
  CHECK(cluster.peers[2]->fetches() == 0);
}

TEST_CASE(
    "gather: another layout sent under the digest asked for is not taken - with no honest daemon left, the "
    "group fails its syncs, naming the group and node",
    "[daemon][peers]") {
  SECTION("an honest daemon names it too") {
    Peers cluster({Answers::kLiar, Answers::kCurrent, Answers::kLiar});
    CHECK(inferWhole(cluster.gathered().view).tensors(0).dtype() == "float32");  // the honest one's
    CHECK(cluster.peers[1]->fetches() == 1);
  }
  SECTION("none does") {
    Peers cluster({Answers::kLiar, Answers::kForgetful, Answers::kLiar});
    const auto snapshot = cluster.gathered();
    auto layout = snapshot.view.completeGroup("infer");
    REQUIRE_FALSE(layout.ok());
    CHECK(layout.status().code() == absl::StatusCode::kFailedPrecondition);
    const std::string message(layout.status().message());
    CHECK_THAT(message, Catch::Contains("the layout of group \"infer\" (digest " + inferDigest() + ") on node \"n1\""));
    CHECK_THAT(message, Catch::Contains("from any of the 3 daemons naming it (3 asked)"));
    CHECK_THAT(message, Catch::Contains("2 gathers in a row"));
    CHECK(snapshot.view.missingLayouts() == std::vector<std::string>{message});
    CHECK(cluster.peers[0]->fetches() == 2);  // once per gather, each daemon naming it asked in turn
    CHECK(cluster.peers[1]->fetches() == 2);
    CHECK(cluster.peers[2]->fetches() == 2);
  }
}

TEST_CASE("gather: a digest named for a group whose layout is another group's fails that group, not the view",
          "[daemon][peers]") {
  // n2 names the inference layout's digest for a group "other" as well: what it sends under that
  // digest is group "infer"'s layout, never taken as "other"'s.
  Peers cluster({Answers::kCurrent, Answers::kOther, Answers::kCurrent});
  const auto snapshot = cluster.gathered();
  inferWhole(snapshot.view);
  auto other = snapshot.view.completeGroup("other");
  REQUIRE_FALSE(other.ok());
  CHECK_THAT(std::string(other.status().message()),
             Catch::Contains("the layout of group \"other\" (digest " + inferDigest() + ") on node \"n2\""));
  CHECK(cluster.peers[1]->fetches() == 2);  // asked for "other"'s at each of the two gathers
  CHECK(cluster.peers[1]->asked() == std::vector<std::string>{inferDigest(), inferDigest()});
}

TEST_CASE("gather: a layout no daemon sent is asked for again with a new gather, and then found", "[daemon][peers]") {
  Peers cluster({Answers::kLate});  // (its one holder: nobody else to ask)
  const auto snapshot = cluster.gathered();
  // (rank 0 of three: the layout is there, the group incomplete)
  CHECK_THAT(std::string(snapshot.view.completeGroup("infer").status().message()),
             Catch::Contains("ranks 1-2 of 3 are not registered"));
  CHECK(snapshot.view.missingLayouts().empty());
  CHECK(cluster.peers[0]->fetches() == 2);
}

namespace {

// A peer daemon holding one rank of each of `ranks` (a layout, whole, and the rank's role), as
// this build answers; the layouts in `withheld` it names by digest but never sends when asked.
class GroupPeer final : public v1::Peer::Service {
 public:
  struct Held {
    v1::Layout layout;
    v1::Role role;
  };
  GroupPeer(std::string node, std::vector<Held> ranks, std::set<std::string> withheld = {})
      : node_(std::move(node)), ranks_(std::move(ranks)), withheld_(std::move(withheld)) {}

  grpc::Status Describe(grpc::ServerContext*, const v1::DescribeRequest* req, v1::DescribeResponse* out) override {
    out->set_node(node_);
    out->set_instance(node_ + "-instance");
    out->set_generation(1);
    for (const auto& held : ranks_) {
      const std::string digest = planner::layoutDigest(held.layout);
      if (req->layouts_size() > 0) {
        if (!withheld_.count(held.layout.group()) &&
            std::find(req->layouts().begin(), req->layouts().end(), digest) != req->layouts().end())
          *out->add_layouts() = held.layout;
        continue;
      }
      if (req->layout_digests())
        (*out->mutable_layout_digests())[held.layout.group()] = digest;
      else
        *out->add_layouts() = held.layout;
      auto* r = out->add_ranks();
      r->set_group(held.layout.group());
      r->set_layout_digest(digest);
      r->set_role(held.role);
      r->set_state(held.role == v1::ROLE_SOURCE ? v1::RANK_READY : v1::RANK_EMPTY);
      r->set_version(held.role == v1::ROLE_SOURCE ? 1 : 0);
    }
    if (req->layouts_size() == 0) out->set_transport_address(node_ + "-transport");
    return grpc::Status::OK;
  }

 private:
  const std::string node_;
  const std::vector<Held> ranks_;
  const std::set<std::string> withheld_;
};

v1::Layout oneRank(const std::string& group, const std::string& node, const std::string& set = "", int replica = 0) {
  auto layout = *planner::parseLayoutJson(R"({"group":")" + group + R"(","mesh":{"shape":[1]},"nodes":[")" + node +
                                              R"("],"tensors":[{"name":"w","shape":[6,4],"dtype":"float32"}]})",
                                          group);
  layout.set_replica_set(set);
  layout.set_replica(replica);
  return layout;
}

}  // namespace

TEST_CASE(
    "gather: a replica set's sync fails naming a layout no daemon sent (it may be a replica) - a plain sync of "
    "other groups goes on",
    "[daemon][peers][sync]") {
  // n1: the trainer; n2: replica 0 of set "rollout"; n3: replica 1, whose layout n3 never sends.
  GroupPeer n1("n1", {{oneRank("trainer", "n1"), v1::ROLE_SOURCE}});
  GroupPeer n2("n2", {{oneRank("rollout.r0", "n2", "rollout", 0), v1::ROLE_DESTINATION}});
  GroupPeer n3("n3", {{oneRank("rollout.r1", "n3", "rollout", 1), v1::ROLE_DESTINATION}}, {"rollout.r1"});
  std::vector<std::unique_ptr<grpc::Server>> servers;
  std::vector<std::string> addresses;
  for (GroupPeer* peer : {&n1, &n2, &n3}) {
    addresses.push_back("127.0.0.1:" + std::to_string(examples::freePort()));
    grpc::ServerBuilder builder;
    builder.AddListeningPort(addresses.back(), grpc::InsecureServerCredentials());
    builder.RegisterService(peer);
    servers.push_back(builder.BuildAndStart());
    REQUIRE(servers.back());
  }
  const int port = examples::freePort();
  addresses.push_back("127.0.0.1:" + std::to_string(port));
  examples::Daemon coordinator("n0", port, addresses, {"--insecure", "--peer-timeout-ms", "3000"});
  REQUIRE(coordinator.ready());

  v1::SyncRequest req;
  req.set_src_group("trainer");
  req.set_dst_group("rollout");
  req.set_version(1);
  v1::SyncResponse out;
  grpc::ClientContext set_context;
  set_context.set_deadline(std::chrono::system_clock::now() + 60s);
  const grpc::Status set = coordinator.client()->Sync(&set_context, req, &out);
  INFO(set.error_message());
  CHECK(set.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK_THAT(set.error_message(), Catch::Contains("sync into \"rollout\": the layout of group \"rollout.r1\""));
  CHECK_THAT(set.error_message(), Catch::Contains("on node \"n3\" could not be fetched from the daemon naming it"));

  // Into replica 0 alone, a plain group: the gather passes (the sync then fails at these fake
  // daemons' Prepare, which they do not serve), never on the layout missing elsewhere.
  req.set_dst_group("rollout.r0");
  grpc::ClientContext plain_context;
  plain_context.set_deadline(std::chrono::system_clock::now() + 60s);
  const grpc::Status plain = coordinator.client()->Sync(&plain_context, req, &out);
  INFO(plain.error_message());
  CHECK_FALSE(plain.ok());
  CHECK_THAT(plain.error_message(), !Catch::Contains("rollout.r1"));
  CHECK_THAT(plain.error_message(), Catch::Contains("prepare"));
  for (auto& s : servers) s->Shutdown(std::chrono::system_clock::now() + 100ms);
}
