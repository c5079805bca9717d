// The daemon's metrics on prometheus-cpp: what a committed and a failed sync leave in the
// histograms and counters, the values read at scrape time, and names as Prometheus wants them.
// A scrape of a real daemon after real syncs is in sync_test.cc ("metrics").
#include "daemon/server/metrics.h"

#include <catch2/catch.hpp>

#include "common/defaults.h"

using namespace shardcast;
using namespace shardcast::daemon;
using Catch::Matchers::Contains;

TEST_CASE("metrics: syncs feed histograms by result and phase, scrape-time values by label", "[daemon][metrics]") {
  Metrics m;
  const std::string empty = m.render();
  // Every family is there from the first scrape, at zero, and the release is named.
  CHECK_THAT(empty, Contains("shardcast_syncs_total{result=\"committed\"} 0"));
  CHECK_THAT(empty, Contains("shardcast_syncs_total{result=\"failed\"} 0"));
  CHECK_THAT(empty, Contains(std::string("shardcast_build_info{version=\"") + kShardcastVersion + "\"} 1"));
  CHECK_THAT(empty, Contains("shardcast_syncs_in_flight 0"));
  CHECK_THAT(empty, Contains("# TYPE shardcast_sync_duration_seconds histogram"));

  v1::SyncResponse figures;
  figures.set_seconds(1.5);
  figures.set_gather_seconds(0.02);
  figures.set_plan_seconds(0.001);
  figures.set_prepare_seconds(0.3);
  figures.set_execute_seconds(1.1);
  figures.set_finish_seconds(0.004);
  {
    Metrics::InFlight running(m);
    CHECK_THAT(m.render(), Contains("shardcast_syncs_in_flight 1"));
  }
  m.syncCommitted(figures);
  // A failed sync: gathered and planned, then failed in prepare after 39 s.
  v1::SyncResponse failed;
  failed.set_gather_seconds(0.5);
  failed.set_plan_seconds(0.2);
  failed.set_prepare_seconds(39);
  m.syncFailed(40, failed);
  // A delta sync: 1000 bytes of plan, 300 on the wire.
  v1::SyncResponse delta = figures;
  delta.set_delta(v1::DELTA_AUTO);
  delta.set_network_bytes(1000);
  delta.set_wire_bytes(300);
  m.syncCommitted(delta);
  m.peerFailed("n3");
  m.moved.bytes_sent += 1000;
  m.moved.dense_chunks += 3;
  m.syncs_expired += 2;
  m.plan_cache_hits = [] { return uint64_t{5}; };
  m.plan_cache_misses = [] { return uint64_t{1}; };
  m.rank_states = [] { return std::map<std::string, uint64_t>{{"ready", 4}, {"dirty", 1}}; };
  m.groups = [] {
    return std::map<std::string, Metrics::GroupFigures>{{"infer", {"destination", 7, {{"ready", 3}, {"dirty", 1}}}},
                                                        {"trainer", {"source", 8, {{"ready", 1}}}},
                                                        {"rollout", {"destination", 0, {{"empty", 2}}}}};
  };
  // Syncs reached "infer" (from "trainer", at 7 then 9: 9 failed) and "rollout" (at 3); "gone"
  // is no longer registered here.
  m.sourceVersionSeen("infer", "trainer", 7);
  m.sourceVersionSeen("infer", "trainer", 9);
  m.sourceVersionSeen("rollout", "other", 3);
  m.sourceVersionSeen("gone", "trainer", 9);
  m.sessions_active = [] { return uint64_t{2}; };
  m.peers_up = [] { return std::map<std::string, bool>{{"n1", true}, {"n2", false}}; };
  const std::string out = m.render();
  CHECK_THAT(out, Contains("shardcast_syncs_in_flight 0"));
  CHECK_THAT(out, Contains("shardcast_syncs_total{result=\"committed\"} 2"));
  CHECK_THAT(out, Contains("shardcast_syncs_total{result=\"failed\"} 1"));
  // 1.5 s: above the 1 s bucket, within 2.5 s; the failed one's 40 s only in 60 s and above.
  CHECK_THAT(out, Contains("shardcast_sync_duration_seconds_bucket{result=\"committed\",le=\"1\"} 0"));
  CHECK_THAT(out, Contains("shardcast_sync_duration_seconds_bucket{result=\"committed\",le=\"2.5\"} 2"));
  CHECK_THAT(out, Contains("shardcast_sync_duration_seconds_bucket{result=\"failed\",le=\"30\"} 0"));
  CHECK_THAT(out, Contains("shardcast_sync_duration_seconds_bucket{result=\"failed\",le=\"60\"} 1"));
  CHECK_THAT(out, Contains("shardcast_sync_duration_seconds_sum{result=\"failed\"} 40"));
  for (const char* phase : {"gather", "plan", "prepare", "execute", "finish"})
    CHECK_THAT(out, Contains(std::string("shardcast_sync_phase_duration_seconds_count{phase=\"") + phase +
                             "\",result=\"committed\"} 2"));
  CHECK_THAT(
      out, Contains("shardcast_sync_phase_duration_seconds_bucket{phase=\"execute\",result=\"committed\",le=\"1\"} 0"));
  CHECK_THAT(
      out,
      Contains("shardcast_sync_phase_duration_seconds_bucket{phase=\"prepare\",result=\"committed\",le=\"0.5\"} 2"));
  // The failed sync: the phases it ran, the one it failed in (prepare) last; none after it.
  CHECK_THAT(out, Contains("shardcast_sync_phase_duration_seconds_count{phase=\"plan\",result=\"failed\"} 1"));
  CHECK_THAT(out, Contains("shardcast_sync_phase_duration_seconds_sum{phase=\"prepare\",result=\"failed\"} 39"));
  CHECK_THAT(out, !Contains("phase=\"execute\",result=\"failed\""));
  CHECK_THAT(out, Contains("shardcast_delta_saved_bytes_total 700"));
  CHECK_THAT(out, Contains("shardcast_peer_failures_total{peer=\"n3\"} 1"));
  CHECK_THAT(out, Contains("shardcast_bytes_sent_total 1000"));
  CHECK_THAT(out, Contains("shardcast_chunks_landed_total{encoding=\"dense\"} 3"));
  CHECK_THAT(out, Contains("shardcast_chunks_landed_total{encoding=\"delta\"} 0"));
  CHECK_THAT(out, Contains("shardcast_syncs_expired_total 2"));
  CHECK_THAT(out, Contains("shardcast_plan_cache_hits_total 5"));
  CHECK_THAT(out, Contains("shardcast_plan_cache_misses_total 1"));
  CHECK_THAT(out, Contains("shardcast_ranks{state=\"ready\"} 4"));
  CHECK_THAT(out, Contains("shardcast_ranks{state=\"updating\"} 0"));  // every state, even at zero
  CHECK_THAT(out, Contains("shardcast_group_version{group=\"infer\",role=\"destination\"} 7"));
  CHECK_THAT(out, Contains("shardcast_group_version{group=\"trainer\",role=\"source\"} 8"));
  CHECK_THAT(out, Contains("shardcast_group_ranks{group=\"infer\",role=\"destination\",state=\"dirty\"} 1"));
  CHECK_THAT(out, Contains("shardcast_group_ranks{group=\"infer\",role=\"destination\",state=\"ready\"} 3"));
  CHECK_THAT(out, Contains("shardcast_group_ranks{group=\"trainer\",role=\"source\",state=\"updating\"} 0"));
  // Lag: "infer" holds 7, its source is known at 9 (a sync seen here); "rollout" holds nothing
  // of the 3 a sync brought; no series for a source, a group never synced into, or one gone.
  CHECK_THAT(out, Contains("shardcast_group_version_lag{group=\"infer\",source=\"trainer\"} 2"));
  CHECK_THAT(out, Contains("shardcast_group_version_lag{group=\"rollout\",source=\"other\"} 3"));
  CHECK_THAT(out, !Contains("shardcast_group_version_lag{group=\"trainer\""));
  CHECK_THAT(out, !Contains("shardcast_group_version_lag{group=\"gone\""));
  CHECK_THAT(out, Contains("shardcast_peer_up{peer=\"n1\"} 1"));
  CHECK_THAT(out, Contains("shardcast_peer_up{peer=\"n2\"} 0"));
  CHECK_THAT(out, Contains("shardcast_sessions_active 2"));
  m.replicaSetSynced("rollout", 3, 1);
  m.replicaSetSynced("rollout", 2, 2);
  const std::string sets = m.render();
  CHECK_THAT(sets, Contains("shardcast_replica_set_replicas{set=\"rollout\"} 2"));
  CHECK_THAT(sets, Contains("shardcast_replicas_cut_total{set=\"rollout\"} 3"));
  // Counters end in _total, and no family is rendered twice.
  CHECK_THAT(out, Contains("# TYPE shardcast_bytes_sent_total counter"));
  size_t at = 0, helps = 0;
  while ((at = out.find("# TYPE shardcast_ranks ", at)) != std::string::npos) ++helps, ++at;
  CHECK(helps == 1);
}

TEST_CASE("metrics: a source registered here at a newer version sets the lag without a sync", "[daemon][metrics]") {
  Metrics m;
  m.groups = [] {
    return std::map<std::string, Metrics::GroupFigures>{{"infer", {"destination", 4, {{"ready", 1}}}},
                                                        {"trainer", {"source", 6, {{"ready", 1}}}}};
  };
  m.sourceVersionSeen("infer", "trainer", 4);  // the last sync, committed
  CHECK_THAT(m.render(), Contains("shardcast_group_version_lag{group=\"infer\",source=\"trainer\"} 2"));
}

TEST_CASE("metrics: the lag follows the latest sync, and forgets a group that left", "[daemon][metrics]") {
  Metrics m;
  std::map<std::string, Metrics::GroupFigures> groups{{"infer", {"destination", 500, {{"ready", 1}}}}};
  m.groups = [&] { return groups; };
  m.sourceVersionSeen("infer", "trainer", 502);  // failed
  CHECK_THAT(m.render(), Contains("shardcast_group_version_lag{group=\"infer\",source=\"trainer\"} 2"));
  // The job restarts from an older checkpoint: its engines register again and sync from v401.
  groups.clear();
  CHECK_THAT(m.render(), !Contains("shardcast_group_version_lag{"));
  groups = {{"infer", {"destination", 401, {{"ready", 1}}}}};
  m.sourceVersionSeen("infer", "trainer", 401);
  CHECK_THAT(m.render(), Contains("shardcast_group_version_lag{group=\"infer\",source=\"trainer\"} 0"));
}

TEST_CASE("metrics: without --metrics-names every group, source, set and peer label is the hash of its name",
          "[daemon][metrics]") {
  Metrics m(/*names=*/false);
  m.groups = [] {
    return std::map<std::string, Metrics::GroupFigures>{{"infer", {"destination", 4, {{"ready", 1}}}},
                                                        {"trainer", {"source", 6, {{"ready", 1}}}}};
  };
  m.peers_up = [] { return std::map<std::string, bool>{{"node-a", true}}; };
  m.sourceVersionSeen("infer", "trainer", 4);
  m.peerFailed("node-b");
  m.replicaSetSynced("rollout", 2, 1);
  const std::string out = m.render();
  for (const char* name : {"infer", "trainer", "node-a", "node-b", "rollout"}) CHECK_THAT(out, !Contains(name));
  // "h" and XXH64 (seed 0) in hex, as docs/daemon.md says to compute it.
  CHECK(m.label("infer") == "h6f4da01c6929962b");
  CHECK(m.label("infer") != m.label("trainer"));
  CHECK_THAT(out, Contains("shardcast_group_version{group=\"" + m.label("trainer") + "\",role=\"source\"} 6"));
  CHECK_THAT(out, Contains("shardcast_group_version_lag{group=\"" + m.label("infer") + "\",source=\"" +
                           m.label("trainer") + "\"} 2"));
  CHECK_THAT(out, Contains("shardcast_peer_up{peer=\"" + m.label("node-a") + "\"} 1"));
  CHECK_THAT(out, Contains("shardcast_replica_set_replicas{set=\"" + m.label("rollout") + "\"} 2"));
  CHECK(Metrics(/*names=*/true).label("infer") == "infer");
}
