// Two daemons (n0: trainer ranks, n1: inference ranks) with ranks registered through
// shardcast::Client, for the client library and CLI tests.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "client/lib/client.h"
#include "planner/layout.h"
#include "tests/daemon/daemon_harness.h"

namespace shardcast::testing {

inline const char* kClientTrainer = R"({"group":"trainer","mesh":{"shape":[2]},"nodes":["n0","n0"],"tensors":[
  {"name":"w","shape":[16,8],"dtype":"int32","placements":[{"shard":{"dim":0}}]},
  {"name":"o","shape":[8,16],"dtype":"int32","placements":[{"shard":{"dim":0}}]}]})";
inline const char* kClientInference = R"({"group":"infer","mesh":{"shape":[2]},"nodes":["n1","n1"],"tensors":[
  {"name":"w","shape":[16,8],"dtype":"int32","placements":[{"shard":{"dim":1}}]},
  {"name":"o","shape":[8,16],"dtype":"int32","placements":[{"shard":{"dim":1}}]}]})";

struct ClientCluster {
  std::vector<std::unique_ptr<Daemon>> daemons;
  v1::Layout trainer_layout, inference_layout;
  planner::NodeTable nodes;
  planner::ResolvedLayout trainer, inference;
  std::vector<HostTensors> trainer_mem, inference_mem;

  explicit ClientCluster(bool register_ranks = true) {
    const std::vector<int> ports{freePort(), freePort()};
    std::vector<std::string> peers;
    for (int p : ports) peers.push_back("127.0.0.1:" + std::to_string(p));
    for (int i = 0; i < 2; ++i) {
      daemons.push_back(std::make_unique<Daemon>("n" + std::to_string(i), ports[static_cast<size_t>(i)], peers));
      REQUIRE(daemons.back()->ready());
    }
    trainer_layout = *planner::parseLayoutJson(kClientTrainer, "trainer");
    inference_layout = *planner::parseLayoutJson(kClientInference, "infer");
    trainer = *planner::resolveLayout(trainer_layout, nodes);
    inference = *planner::resolveLayout(inference_layout, nodes);
    if (!register_ranks) return;
    registerAll(*daemons[0], trainer_layout, trainer_mem, RegisterOptions::source());
    registerAll(*daemons[1], inference_layout, inference_mem);
  }

  static void registerAll(const Daemon& d, const v1::Layout& layout, std::vector<HostTensors>& mem,
                          const RegisterOptions& options = {}) {
    auto client = Client::connect("unix:" + d.socketPath());
    REQUIRE(client.ok());
    for (int32_t r = 0; r < 2; ++r) {
      auto t = HostTensors::forRank(layout, r);
      REQUIRE(t.ok());
      mem.push_back(std::move(*t));
      auto reg = client->registerRank(layout, r, mem.back(), options);
      INFO(reg.status().message());
      REQUIRE(reg.ok());
    }
  }

  static int32_t valueOf(size_t tensor, int64_t flat, int version) {
    return static_cast<int32_t>(tensor * 100000 + flat * 10 + version);
  }

  // Walks every element a rank holds: fn(element pointer, tensor index, global flat index).
  template <typename Fn>
  static void visit(const planner::ResolvedLayout& l, int32_t rank, const HostTensors& m, Fn&& fn) {
    planner::forEachElement(l, rank, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
      fn(m.as<int32_t>(l.buffer_names[static_cast<size_t>(p.buffer)]).data() + off, t, flat);
    });
  }

  // A trainer step: acquire the source ranks (waits for syncs reading them), write `version`'s
  // values, publish it.
  void fillSource(int version) {
    auto client = Client::connect("unix:" + daemons[0]->socketPath());
    REQUIRE(client.ok());
    for (int32_t r = 0; r < 2; ++r) {
      auto held = client->acquire("trainer", r);
      INFO(held.status().message());
      REQUIRE(held.ok());
    }
    for (int32_t r = 0; r < 2; ++r)
      visit(trainer, r, trainer_mem[static_cast<size_t>(r)],
            [&](int32_t* e, size_t t, int64_t flat) { *e = valueOf(t, flat, version); });
    for (int32_t r = 0; r < 2; ++r) {
      auto published = client->publish("trainer", r, static_cast<uint64_t>(version));
      INFO(published.status().message());
      REQUIRE(published.ok());
    }
  }

  int64_t badDestinationElements(int version) {
    int64_t bad = 0;
    for (int32_t r = 0; r < 2; ++r)
      visit(inference, r, inference_mem[static_cast<size_t>(r)],
            [&](int32_t* e, size_t t, int64_t flat) { bad += *e != valueOf(t, flat, version); });
    return bad;
  }
};

}  // namespace shardcast::testing
