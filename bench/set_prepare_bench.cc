// What a replica set's Prepare costs one daemon, with its layouts whole and by digest
// (docs/daemon.md, "Replica sets", "Layouts by digest"). The source and one replica's layout are
// those `plan_bench --dst-replicas 1 --write-layouts DIR` writes (a Kimi-K2-like MoE: the trainer
// on 192 nodes, one inference replica of TP 16 on 2 nodes); the set is R copies of that replica,
// each on nodes of its own. For each R it prints the Prepare's serialised size (what the
// coordinator sends every daemon at every sync: R x that through a relay tree's first level) and,
// with the set's plan cached, a daemon's time to parse the request and find its plan: by its
// layouts (PlanCache::getReplicaSet: serialise and fingerprint every layout) and by digest
// (PlanCache::forSetPrepare). The first, planning, sync is timed too.
//
//   build/bin/set_prepare_bench --layouts DIR [--replicas "1 4 8"] [--rounds 5]
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "common/strings.h"
#include "daemon/engine/plan_cache.h"
#include "planner/layout.h"

using namespace shardcast;
using namespace shardcast::daemon;

namespace {

double msSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Replica k of set "rollout": `one` on nodes of its own.
planner::Replica replicaOf(const v1::Layout& one, int k) {
  planner::Replica r{k, one};
  r.layout.set_group(strCat("rollout.r", k));
  r.layout.set_replica_set("rollout");
  r.layout.set_replica(k);
  r.layout.set_node_prefix(strCat("rollout-r", k, "-"));
  return r;
}

struct Row {
  int replicas = 0;
  size_t whole_bytes = 0, digest_bytes = 0;
  double first_ms = 0, whole_ms = 0, digest_ms = 0;  // best of the rounds, parse included
};

Row measure(const v1::Layout& src, const v1::Layout& one, int replicas, int rounds) {
  Row row;
  row.replicas = replicas;
  std::vector<planner::Replica> members;
  for (int k = 0; k < replicas; ++k) members.push_back(replicaOf(one, k));
  const PlanKey key = PlanKey::forSync(uint64_t{256} << 20, uint64_t{8} << 20, v1::DELTA_OFF, false);

  v1::PrepareRequest whole;
  whole.set_sync_id("bench");
  *whole.mutable_src() = src;
  whole.mutable_dst()->set_group("rollout");
  for (const auto& m : members) *whole.add_replicas() = m.layout;
  const std::string whole_wire = whole.SerializeAsString();
  row.whole_bytes = whole_wire.size();

  PlanCache cache;
  bool hit = false;
  // A daemon's Prepare with the layouts: parse, then its plan by them.
  const auto byLayouts = [&] {
    v1::PrepareRequest req;
    req.ParseFromString(whole_wire);
    std::vector<planner::Replica> got;
    for (const auto& r : req.replicas()) got.push_back({r.replica(), r});
    auto plan = cache.getReplicaSet(req.src(), got, key, &hit);
    if (!plan.ok()) throw std::runtime_error(std::string(plan.status().message()));
    return *plan;
  };
  auto t0 = std::chrono::steady_clock::now();
  const auto planned = byLayouts();
  row.first_ms = msSince(t0);

  v1::PrepareRequest named;
  named.set_sync_id("bench");
  named.mutable_src()->set_group(src.group());
  named.set_src_digest(planned->src_digest);
  named.mutable_dst()->set_group("rollout");
  for (const auto& m : planned->members) {
    v1::Layout* l = named.add_replicas();
    l->set_group(m.group);
    l->set_replica_set("rollout");
    l->set_replica(m.replica);
    named.add_replica_digests(m.digest);
  }
  const std::string named_wire = named.SerializeAsString();
  row.digest_bytes = named_wire.size();

  // (Each form's rounds in a row: freeing a parsed layout's millions of small objects makes the
  // allocator's next large request pay for consolidating them, whoever makes it.)
  row.whole_ms = row.digest_ms = 1e300;
  for (int i = 0; i < rounds; ++i) {
    t0 = std::chrono::steady_clock::now();
    if (byLayouts() != planned || !hit) throw std::runtime_error("the set's plan was not the cached one");
    row.whole_ms = std::min(row.whole_ms, msSince(t0));
  }
  for (int i = 0; i < rounds; ++i) {
    t0 = std::chrono::steady_clock::now();
    v1::PrepareRequest req;
    req.ParseFromString(named_wire);
    auto plan = cache.forSetPrepare(req, key, "bench", &hit);
    if (!plan.ok() || *plan != planned) throw std::runtime_error("by digest: not the cached plan");
    row.digest_ms = std::min(row.digest_ms, msSince(t0));
  }
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir, replicas_list = "1 4 8";
  int rounds = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--layouts"))
      dir = argv[i + 1];
    else if (!std::strcmp(argv[i], "--replicas"))
      replicas_list = argv[i + 1];
    else if (!std::strcmp(argv[i], "--rounds"))
      rounds = std::max(1, std::stoi(argv[i + 1]));
    else
      dir.clear(), i = argc;
  }
  if (dir.empty()) {
    fmt::print(stderr,
               "usage: set_prepare_bench --layouts DIR [--replicas \"1 4 8\"] [--rounds 5]\n"
               "  (DIR: plan_bench --dst-replicas 1 --write-layouts DIR)\n");
    return 2;
  }
  auto src = planner::readLayoutFile(dir + "/trainer.json");
  auto one = planner::readLayoutFile(dir + "/inference.json");
  if (!src.ok() || !one.ok()) {
    fmt::print(stderr, "{}\n", std::string((src.ok() ? one.status() : src.status()).message()));
    return 1;
  }
  fmt::print("source {} tensors, one replica {} ranks; a daemon's Prepare of the set, plan cached: best of {}\n",
             src->tensors_size(), one->mesh().shape(0) * one->mesh().shape(1), rounds);
  fmt::print("{:>8} {:>14} {:>14} {:>12} {:>14} {:>14}\n", "replicas", "whole (MB)", "by digest (B)", "first (s)",
             "whole (ms)", "by digest (ms)");
  std::istringstream counts(replicas_list);
  for (int r; counts >> r;) {
    const Row row = measure(*src, *one, r, rounds);
    fmt::print("{:>8} {:>14.1f} {:>14} {:>12.2f} {:>14.0f} {:>14.2f}\n", row.replicas, row.whole_bytes / 1e6,
               row.digest_bytes, row.first_ms / 1e3, row.whole_ms, row.digest_ms);
  }
  return 0;
}
