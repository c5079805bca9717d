"""Syncs into a replica set (docs/daemon.md, "Replica sets"): data-parallel inference replicas, each
a group of its own (`rollout.r<k>`, replica_set "rollout") on a node of its own, synced by one
call `sync("trainer", "rollout", V)`. Real daemons: every replica registered when a sync starts
gets every byte of V, the trainer sends each byte once (replicas relay it to each other),
replicas join and leave between syncs, and a replica that cannot take part (its daemon killed, its
ranks held by its engine, a layout unlike the others) is cut and named while the others commit."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
import rank_worker
import shardcast
from google.protobuf import json_format
from shardcast.local import LocalCluster, freeze_process
from shardcast.v1 import layout_pb2, service_pb2, service_pb2_grpc

from conftest import shardcastd_path

# Bytes one replica needs: the whole of w [16, 8] float32 and b [9] int64 on its one node.
REPLICA_BYTES = 16 * 8 * 4 + 9 * 8


def replica_layout(k: int, node: str, columns: int = 8) -> dict:
    layout = json.loads(json.dumps(rank_worker.INFERENCE))
    layout.update(group=f"rollout.r{k}", replica_set="rollout", replica=k, nodes=[node, node])
    layout["tensors"][0]["shape"] = [16, columns]
    return layout


def register_replica(client: shardcast.Client, k: int, node: str):
    """Replica k: two TP ranks on `node`, zero-filled."""
    return [client.register(f"rollout.r{k}", r, 2, rank_worker.zeros(r), replica_layout(k, node)) for r in range(2)]


def step(trainers, version: int) -> None:
    """A training step: both trainer ranks write and publish `version`."""
    for t in trainers:
        with t.writing(version):
            for name, x in t.tensors.items():
                x[...] = rank_worker.shard("trainer", name, t.rank, version)


def holds(replica, version: int) -> bool:
    return all(np.array_equal(reg.tensors[name], rank_worker.shard("infer", name, reg.rank, version))
               for reg in replica for name in rank_worker.SHAPES)


def trainer_and_replicas(cluster: LocalCluster, replicas: int):
    """Clients of every node, n0's, the trainer's two ranks on n0 (at version 1), and replicas
    0..replicas-1 of set "rollout", replica k on node n<k+1>."""
    clients = {n: shardcast.Client(cluster.target(n)) for n in cluster.nodes}
    trainers = rank_worker.register_trainers(clients["n0"])
    return clients, clients["n0"], trainers, [register_replica(clients[f"n{k + 1}"], k, f"n{k + 1}")
                                              for k in range(replicas)]


def whole_tensor(shape):
    """For syncs of many MiB: version V's bytes of one float32 tensor "w" of `shape`, and the layout
    of a group holding it whole on one node (`extra`: replica_set and replica, say)."""
    def weights(version: int) -> np.ndarray:
        return np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape) + version * 7.0

    def layout(group: str, node: str, **extra) -> dict:
        return {"group": group, "mesh": {"shape": [1]}, "nodes": [node], **extra,
                "tensors": [{"name": "w", "shape": list(shape), "dtype": "float32",
                             "placements": [{"replicate": {}}]}]}

    return weights, layout


def outcomes(resp: service_pb2.SyncResponse):
    return {o.group: (o.committed, o.cut) for o in resp.replicas}


def test_a_replica_set_syncs_as_one_while_replicas_join_leave_and_die():
    shardcastd_path()
    with LocalCluster(["n0", "n1", "n2", "n3"], extra=["--metrics-names"]) as c:  # scraped by name below
        clients = {n: shardcast.Client(c.target(n)) for n in c.nodes}
        src = clients["n0"]
        trainers = rank_worker.register_trainers(src)
        r0 = register_replica(clients["n1"], 0, "n1")
        r1 = register_replica(clients["n2"], 1, "n2")

        resp = src.sync("trainer", "rollout", 1)
        assert outcomes(resp) == {"rollout.r0": (True, ""), "rollout.r1": (True, "")}
        assert holds(r0, 1) and holds(r1, 1)
        assert clients["n2"].wait_version("rollout.r1", 1, timeout=5) == 1
        # Status and List show each replica's group with its set and id.
        listed = {(r.group, r.rank): r for r in src.list(all_nodes=True).ranks if r.group.startswith("rollout")}
        assert {(g, r.replica_set, r.replica) for (g, _), r in listed.items()} == {
            ("rollout.r0", "rollout", 0), ("rollout.r1", "rollout", 1)}
        assert [(g.group, g.replica_set, g.replica, g.committed_version) for g in clients["n2"].status().groups] == [
            ("rollout.r1", "rollout", 1, 1)]
        # The trainer sends each byte once; the second replica gets it from the first.
        summary = json.loads(resp.plan_summary_json)
        assert summary["node_egress_bytes"]["n0"] == REPLICA_BYTES, summary
        assert resp.network_bytes == 2 * REPLICA_BYTES

        # A replica joins between syncs: the next sync reaches it.
        r2 = register_replica(clients["n3"], 2, "n3")
        step(trainers, 2)
        # A minimum above the set's size, nothing cut: the error says so, without an empty list.
        with pytest.raises(shardcast.ShardcastError) as few:
            src.sync("trainer", "rollout", 2, min_replicas=4)
        assert few.value.details.endswith('replica set "rollout": 3 of 3 replicas can take part, at least 4 needed'), \
            few.value.details
        assert holds(r0, 1)
        resp = src.sync("trainer", "rollout", 2)
        assert outcomes(resp) == {f"rollout.r{k}": (True, "") for k in range(3)}
        assert holds(r0, 2) and holds(r1, 2) and holds(r2, 2)
        assert json.loads(resp.plan_summary_json)["node_egress_bytes"]["n0"] == REPLICA_BYTES

        # A replica leaves (its ranks unregister): the next sync plans without it.
        for reg in r1:
            reg.close()
        step(trainers, 3)
        resp = src.sync("trainer", "rollout", 3)
        got = outcomes(resp)
        assert got["rollout.r0"] == (True, "") and got["rollout.r2"] == (True, ""), got
        # ... and names it once, as having left (not cut by a fault).
        assert not got["rollout.r1"][0] and got["rollout.r1"][1].startswith("left the set"), got
        assert [o.left for o in resp.replicas] == [False, True, False]
        assert holds(r0, 3) and holds(r2, 3)

        # A replica's daemon dies: the others commit, and the response names it and why.
        os.kill(c.daemons["n3"].proc.pid, signal.SIGKILL)
        c.daemons["n3"].proc.wait()
        step(trainers, 4)
        resp = src.sync("trainer", "rollout", 4)
        got = outcomes(resp)
        assert got["rollout.r0"] == (True, "") and "rollout.r1" not in got, got
        committed, why = got["rollout.r2"]
        assert not committed and 'node(s) "n3"' in why and "do not answer" in why, why
        assert holds(r0, 4)
        assert clients["n1"].wait_version("rollout.r0", 4, timeout=5) == 4
        # The coordinator's metrics count the cut replica and the ones written.
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{c.daemons['n0'].metrics_port}/metrics",
                                        timeout=10).read().decode()
        assert 'shardcast_replica_set_replicas{set="rollout"} 1' in scrape
        assert 'shardcast_replicas_cut_total{set="rollout"} 1' in scrape

        # Too few replicas for the caller's minimum: nothing is written anywhere.
        step(trainers, 5)
        with pytest.raises(shardcast.ShardcastError) as few:
            src.sync("trainer", "rollout", 5, min_replicas=2)
        assert few.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert 'replica set "rollout": 1 of 2 replicas can take part, at least 2 needed' in few.value.details
        assert holds(r0, 4)
        assert shardcast.describe_rank(r0[0].state()) == "ready(4)"

        # A replica whose engine holds its ranks, and one unlike the others, are cut; the rest commit
        # (a replica on replica 0's node among them).
        r1 = register_replica(clients["n2"], 1, "n2")
        odd = [clients["n0"].register("rollout.r9", r, 2, {"w": np.zeros((16, 2), np.float32),
                                                            "b": np.zeros(9, np.int64)},
                                      replica_layout(9, "n0", columns=4)) for r in range(2)]
        shared = register_replica(clients["n1"], 7, "n1")  # on replica 0's node
        with r1[1].reading():
            resp = src.sync("trainer", "rollout", 5)
        got = outcomes(resp)
        assert got["rollout.r7"] == (True, "") and got["rollout.r0"] == (True, ""), got
        assert not got["rollout.r1"][0] and "does not accept updates" in got["rollout.r1"][1], got
        assert not got["rollout.r9"][0] and "rollout.r9" in got["rollout.r9"][1], got
        assert holds(shared, 5)
        assert holds(r0, 5) and all(not reg.tensors[n].any() for reg in r1 for n in rank_worker.SHAPES)
        # The next sync repairs the held one (now released).
        step(trainers, 6)
        resp = src.sync("trainer", "rollout", 6)
        assert outcomes(resp)["rollout.r1"] == (True, "")
        assert holds(r0, 6) and holds(r1, 6)
        for reg in trainers + r0 + r1 + odd + shared:
            reg.close()


def _as_peer(cluster: LocalCluster, node: str) -> service_pb2_grpc.PeerStub:
    """The Peer service of `node`'s daemon, called with the daemons' own identity (as a coordinator)."""
    channel = grpc.secure_channel(cluster.daemons[node].address, cluster.daemon_tls.channel_credentials(),
                                  options=[("grpc.ssl_target_name_override", "shardcast-daemon")])
    return service_pb2_grpc.PeerStub(channel)


def engine_process(target: str, k: int, node: str) -> subprocess.Popen:
    """Replica k's engine, a process of its own: its two TP ranks registered on `node`'s daemon."""
    engine = subprocess.Popen(
        [sys.executable, "-c", (
            "import json, sys, time, numpy as np, shardcast\n"
            "sys.path.insert(0, sys.argv[3])\n"
            "import rank_worker\n"
            "client = shardcast.Client(sys.argv[1])\n"
            "layout = json.loads(sys.argv[2])\n"
            "regs = [client.register(layout['group'], r, 2, rank_worker.zeros(r), layout) for r in range(2)]\n"
            "print('registered', flush=True)\n"
            "time.sleep(600)\n"),
         target, json.dumps(replica_layout(k, node)), os.path.dirname(os.path.abspath(__file__))],
        stdout=subprocess.PIPE, text=True)
    assert engine.stdout.readline().strip() == "registered"
    return engine


def kill(engine: subprocess.Popen) -> None:
    engine.kill()
    engine.wait()


def test_a_set_sync_that_repeats_names_the_layouts_by_digest_and_a_daemon_that_lost_the_plan_gets_them_again():
    """A set's layouts are most of its Prepare (a 1T MoE's source and 8 replicas: 73 MB to
    every daemon). A sync whose gather finds the source, members and daemons of the last committed
    one sends them by digest; a daemon whose plan cache lost the set's plan refuses that as a stale
    view, and the call runs the sync again with the layouts."""
    shardcastd_path()
    with LocalCluster(["n0", "n1", "n2"], extra=["--plan-cache-entries", "1"]) as c:
        clients, src, trainers, (r0, r1) = trainer_and_replicas(c, 2)
        first = src.sync("trainer", "rollout", 1)
        assert not first.layouts_by_digest and holds(r0, 1) and holds(r1, 1)
        step(trainers, 2)
        again = src.sync("trainer", "rollout", 2)
        assert again.layouts_by_digest and again.plan_cached
        assert outcomes(again) == {"rollout.r0": (True, ""), "rollout.r1": (True, "")}
        assert holds(r0, 2) and holds(r1, 2)

        # A plain sync into a group on n1 takes the one place in n1's plan cache.
        solo_layout = {"group": "solo", "mesh": {"shape": [1]}, "nodes": ["n1"],
                       "tensors": [{"name": n, "shape": list(shape), "dtype": np.dtype(rank_worker.DTYPES[n]).name,
                                    "placements": [{"replicate": {}}]} for n, shape in rank_worker.SHAPES.items()]}
        solo = clients["n1"].register("solo", 0, 1, {n: np.zeros(shape, rank_worker.DTYPES[n])
                                                     for n, shape in rank_worker.SHAPES.items()}, solo_layout)
        src.sync("trainer", "solo", 2)
        assert all(np.array_equal(solo.tensors[n], rank_worker.full(n, 2)) for n in rank_worker.SHAPES)
        misses = metric(c, "n1", "shardcast_plan_cache_misses_total")
        step(trainers, 3)
        resp = src.sync("trainer", "rollout", 3)
        # n1 missed twice: the plan named by digest (refused as a stale view), then the layouts.
        assert metric(c, "n1", "shardcast_plan_cache_misses_total") == misses + 2
        assert not resp.layouts_by_digest  # (the attempt that committed had the layouts)
        assert outcomes(resp) == {"rollout.r0": (True, ""), "rollout.r1": (True, "")}
        assert holds(r0, 3) and holds(r1, 3)
        step(trainers, 4)
        assert src.sync("trainer", "rollout", 4).layouts_by_digest  # planned again everywhere: by digest
        assert holds(r0, 4) and holds(r1, 4)

        # A cache too small for what its daemon syncs: after three stale refusals in a row the
        # set's syncs send the layouts (no refused round each time) until the plan key changes.
        for version in (5, 6, 7, 8):
            src.sync("trainer", "solo", version - 1)
            misses = metric(c, "n1", "shardcast_plan_cache_misses_total")
            step(trainers, version)
            resp = src.sync("trainer", "rollout", version)
            assert not resp.layouts_by_digest and holds(r0, version) and holds(r1, version)
            refused_first = version < 8  # (refusals 1, 2, 3; then none tried)
            assert metric(c, "n1", "shardcast_plan_cache_misses_total") == misses + 1 + refused_first, version


def test_a_replica_whose_process_is_killed_between_syncs_is_named_in_the_next_response():
    """A replica's engine process is killed (SIGKILL) between two syncs: its daemon unregisters its
    ranks with the process's session, and the next sync that commits names it as having left
    (ReplicaOutcome.left, with how to tell why), rather than leaving it out of the response; a
    sync that failed before it does not use that up. The sync after names it no more."""
    shardcastd_path()
    with LocalCluster(["n0", "n1", "n2"]) as c:
        clients, src, trainers, (r0,) = trainer_and_replicas(c, 1)
        engine = engine_process(c.target("n2"), 1, "n2")
        try:
            resp = src.sync("trainer", "rollout", 1)
            assert outcomes(resp) == {"rollout.r0": (True, ""), "rollout.r1": (True, "")}
        finally:
            kill(engine)
        deadline = time.monotonic() + 30  # its daemon sees the session end
        while time.monotonic() < deadline and any(r.group == "rollout.r1" for r in clients["n2"].list().ranks):
            time.sleep(0.05)
        step(trainers, 2)
        with pytest.raises(shardcast.ShardcastError, match="at least 3 needed"):
            src.sync("trainer", "rollout", 2, min_replicas=3)
        resp = src.sync("trainer", "rollout", 2)
        got = outcomes(resp)
        assert got["rollout.r0"] == (True, ""), got
        committed, why = got["rollout.r1"]
        assert not committed and "left the set since the last sync" in why and "process that registered them exited" \
            in why, why
        assert [(o.group, o.left) for o in resp.replicas] == [("rollout.r0", False), ("rollout.r1", True)]
        assert holds(r0, 2)
        step(trainers, 3)
        assert outcomes(src.sync("trainer", "rollout", 3)) == {"rollout.r0": (True, "")}
        for reg in trainers + r0:
            reg.close()


def test_a_replica_whose_daemon_restarted_is_cut_not_left_until_it_does_not_come_back():
    """Replica r1's daemon restarts between syncs (its engine gone too, so nothing registers it
    again): the next sync cannot tell a replica that left from one whose client has not registered
    it with the new daemon yet, and cuts it naming the restart; the sync after, still absent, it
    is named as having left; then no more."""
    shardcastd_path()
    with LocalCluster(["n0", "n1", "n2"]) as c:
        clients, src, trainers, (r0,) = trainer_and_replicas(c, 1)
        engine = engine_process(c.target("n2"), 1, "n2")
        try:
            assert outcomes(src.sync("trainer", "rollout", 1))["rollout.r1"] == (True, "")
        finally:
            kill(engine)
        c.daemons["n2"].stop()
        c.restart("n2")
        step(trainers, 2)
        got = outcomes(src.sync("trainer", "rollout", 2))
        assert got["rollout.r0"] == (True, "") and not got["rollout.r1"][0], got
        assert 'the daemon of node(s) "n2" restarted since the last sync' in got["rollout.r1"][1], got
        step(trainers, 3)
        resp = src.sync("trainer", "rollout", 3)
        assert [(o.group, o.left) for o in resp.replicas] == [("rollout.r0", False), ("rollout.r1", True)]
        step(trainers, 4)
        assert outcomes(src.sync("trainer", "rollout", 4)) == {"rollout.r0": (True, "")}
        for reg in trainers + r0:
            reg.close()


def cli_sync(cluster: LocalCluster, version: int, *options: str) -> subprocess.CompletedProcess:
    """`shardcast sync` of the trainer into the set "rollout", through n0's daemon."""
    return subprocess.run([str(shardcastd_path().parent / "shardcast"), "sync", "--daemon", cluster.target("n0"),
                           "--src", "trainer", "--dst", "rollout", "--version", str(version), "--no-progress",
                           *options], capture_output=True, text=True, timeout=60)


def test_the_cli_syncs_a_replica_set_with_its_minimum_and_deadline_and_prints_each_replica():
    """`shardcast sync --min-replicas N --replica-deadline-s S` into a set: the minimum is the
    daemon's (one above the set's size fails, naming it), the deadline too (a frozen replica's node
    costs the gather that deadline, not the 5 s peer timeout), and each replica is printed as
    committed, cut (with why) or left (once, after its ranks unregistered)."""
    shardcastd_path()
    with LocalCluster(["n0", "n1", "n2", "n3"]) as c:
        clients, src, trainers, replicas = trainer_and_replicas(c, 3)
        out = cli_sync(c, 1, "--min-replicas", "3", "--replica-deadline-s", "5")
        assert out.returncode == 0, out.stderr
        assert [line.strip() for line in out.stdout.splitlines() if "replica " in line] == [
            f"replica {k} (rollout.r{k}): committed" for k in range(3)], out.stdout
        step(trainers, 2)
        out = cli_sync(c, 2, "--min-replicas", "4")
        assert out.returncode != 0
        assert 'replica set "rollout": 3 of 3 replicas can take part, at least 4 needed' in out.stderr, out.stderr
        assert holds(replicas[0], 1)

        # Replica 1 leaves, replica 2's node freezes: the others commit within the deadline.
        for reg in replicas[1]:
            reg.close()
        freeze_process(c.daemons["n3"].proc.pid)
        try:
            out = cli_sync(c, 2, "--min-replicas", "1", "--replica-deadline-s", "0.5")
        finally:
            os.kill(c.daemons["n3"].proc.pid, signal.SIGCONT)
        assert out.returncode == 0, out.stderr
        lines = [line.strip() for line in out.stdout.splitlines() if "replica " in line]
        assert lines[0] == "replica 0 (rollout.r0): committed", out.stdout
        assert lines[1].startswith("replica 1 (rollout.r1): left: left the set since the last sync"), out.stdout
        assert lines[2].startswith('replica 2 (rollout.r2): cut: node(s) "n3" holding its ranks do not answer'), \
            out.stdout
        assert len(lines) == 3
        gather = float(re.search(r"gather (\d+\.\d+) s", out.stdout).group(1))
        assert 0.4 < gather < 3.0, out.stdout
        assert holds(replicas[0], 2)

        # The sync after names the replica that left no more.
        step(trainers, 3)
        out = cli_sync(c, 3)
        assert out.returncode == 0, out.stderr
        assert "rollout.r1" not in out.stdout and "replica 2 (rollout.r2): committed" in out.stdout, out.stdout
        for reg in trainers + replicas[0] + replicas[2]:
            reg.close()


def test_a_replica_that_fails_during_the_sync_is_cut_and_the_others_commit_in_the_same_call():
    """Replica r1 looks fine when the sync gathers (complete, ready, not held), but its daemon
    refuses the sync's prepare (it allows leases of 1 s at most: the coordinator asks for 10). The
    sync gives that attempt up everywhere and runs again without r1, within the same call and
    timeout: r0 and r2 commit, r1 is named with its node and reason, and its ranks never report
    the version. Restarted with the usual flags, r1's client registers it again and the next sync
    repairs it with the rest."""
    shardcastd_path()
    with LocalCluster(["n0", "n1", "n2", "n3"]) as c:
        c.daemons["n2"].stop()
        c.restart("n2", [*c.extra, "--sync-lease-ms", "1000", "--max-sync-lease-ms", "1000"])
        clients = {n: shardcast.Client(c.target(n)) for n in c.nodes}
        src = clients["n0"]
        trainers = rank_worker.register_trainers(src)
        replicas = [register_replica(clients[f"n{k + 1}"], k, f"n{k + 1}") for k in range(3)]

        resp = src.sync("trainer", "rollout", 1)
        got = outcomes(resp)
        assert got["rollout.r0"] == (True, "") and got["rollout.r2"] == (True, ""), got
        committed, why = got["rollout.r1"]
        assert not committed and 'node "n2" failed during the sync' in why and "--max-sync-lease-ms" in why, why
        assert holds(replicas[0], 1) and holds(replicas[2], 1)
        assert all(shardcast.describe_rank(reg.state()) != "ready(1)" for reg in replicas[1])

        c.daemons["n2"].stop()
        c.restart("n2")
        deadline = time.monotonic() + 60  # r1's client registers its ranks again by itself
        while time.monotonic() < deadline and len([r for r in clients["n0"].list(all_nodes=True).ranks
                                                   if r.group == "rollout.r1"]) < 2:
            time.sleep(0.1)
        step(trainers, 2)
        resp = src.sync("trainer", "rollout", 2)
        assert all(ok for ok, _ in outcomes(resp).values()), outcomes(resp)
        assert all(holds(r, 2) for r in replicas)
        for reg in trainers + [reg for r in replicas for reg in r]:
            reg.close()


def test_a_trainer_restarted_with_another_world_size_syncs_without_daemon_restarts():
    """The trainer's DP degree changes (2 FSDP ranks, then 4): it registers a new source layout, and
    the next sync into the set plans for it, with the same daemons and replicas. Replica 0 shares
    the trainer's node (colocation: the set is planned whole, not by position)."""
    shardcastd_path()
    with LocalCluster(["n0", "n1"]) as c:
        clients = {n: shardcast.Client(c.target(n)) for n in c.nodes}
        src = clients["n0"]
        trainers = rank_worker.register_trainers(src)
        replicas = [register_replica(clients[f"n{k}"], k, f"n{k}") for k in range(2)]
        src.sync("trainer", "rollout", 1)
        assert all(holds(r, 1) for r in replicas)
        for t in trainers:
            t.close()

        wide = json.loads(json.dumps(rank_worker.TRAINER))
        wide.update(mesh={"shape": [4]}, nodes=["n0"] * 4)
        trainers = [src.register("trainer", r, 4, {n: rank_worker.chunk(rank_worker.full(n, 2), 0, 4, r).copy()
                                                   for n in rank_worker.SHAPES}, wide, role="source", version=2)
                    for r in range(4)]
        resp = src.sync("trainer", "rollout", 2)
        assert all(ok for ok, _ in outcomes(resp).values()), outcomes(resp)
        assert not resp.plan_cached  # a new source layout: planned anew
        assert all(holds(r, 2) for r in replicas)
        for reg in trainers + [reg for r in replicas for reg in r]:
            reg.close()


def sync_with_a_node_frozen(c: LocalCluster, src, trainers, node: str, version: int):
    """The trainer writes `version`, `node`'s daemon freezes, and the set's sync runs with a replica
    deadline of 0.5 s (the daemon thaws afterwards). Returns the response and its outcomes."""
    freeze_process(c.daemons[node].proc.pid)
    try:
        step(trainers, version)
        resp = src.sync("trainer", "rollout", version, replica_deadline_s=0.5)
    finally:
        os.kill(c.daemons[node].proc.pid, signal.SIGCONT)
    return resp, outcomes(resp)


def test_replicas_sharing_a_node_take_part_and_the_node_receives_each_byte_once():
    """Replicas 1 and 2 on one node (data-parallel engines on one machine), replica 0 on its own:
    all three commit, and the shared node receives the set's bytes once for both. Frozen, the
    shared node costs both of its replicas, named, and not the sync; the next sync repairs them."""
    shardcastd_path()
    with LocalCluster(["n0", "n1", "n2"]) as c:
        clients = {n: shardcast.Client(c.target(n)) for n in c.nodes}
        src = clients["n0"]
        trainers = rank_worker.register_trainers(src)
        r0 = register_replica(clients["n1"], 0, "n1")
        r1 = register_replica(clients["n2"], 1, "n2")
        r2 = register_replica(clients["n2"], 2, "n2")
        resp = src.sync("trainer", "rollout", 1)
        assert outcomes(resp) == {f"rollout.r{k}": (True, "") for k in range(3)}, outcomes(resp)
        assert holds(r0, 1) and holds(r1, 1) and holds(r2, 1)
        # Two nodes receive: each replica's bytes once per node, whatever the replicas there.
        assert resp.network_bytes == 2 * REPLICA_BYTES
        assert bytes_received(c, "n2") == REPLICA_BYTES
        # The shared node frozen past the replica deadline: both of its replicas are cut, named.
        resp, got = sync_with_a_node_frozen(c, src, trainers, "n2", 2)
        assert got["rollout.r0"] == (True, ""), got
        for k in (1, 2):
            committed, why = got[f"rollout.r{k}"]
            assert not committed and '"n2"' in why, got
        assert holds(r0, 2) and holds(r1, 1) and holds(r2, 1)
        # Thawed: the next sync repairs both.
        step(trainers, 3)
        resp = src.sync("trainer", "rollout", 3, timeout=60)
        assert outcomes(resp) == {f"rollout.r{k}": (True, "") for k in range(3)}, outcomes(resp)
        assert holds(r0, 3) and holds(r1, 3) and holds(r2, 3)
        for reg in trainers + r0 + r1 + r2:
            reg.close()


def test_a_replica_refusing_the_prepare_on_a_shared_node_is_cut_alone():
    """Replicas 1 and 2 share n2. Replica 1's engine acquires its rank after the sync's gather
    found it writable, so n2 refuses the Prepare for replica 1's ranks. The refusal names replica
    1's group: replica 1 alone is cut, and replica 2 on the same (healthy) node commits in the same
    call. The window: n3 (replica 3) is frozen, so the gather waits out the replica deadline for it
    while the rank is acquired; a gather that saw the rank acquired already cuts replica 1 there,
    which is tried again (the refusal at the Prepare must be reached at least once)."""
    shardcastd_path()
    with LocalCluster(["n0", "n1", "n2", "n3"]) as c:
        clients = {n: shardcast.Client(c.target(n)) for n in c.nodes}
        src = clients["n0"]
        trainers = rank_worker.register_trainers(src)
        r0 = register_replica(clients["n1"], 0, "n1")
        r1 = register_replica(clients["n2"], 1, "n2")
        r2 = register_replica(clients["n2"], 2, "n2")
        r3 = register_replica(clients["n3"], 3, "n3")
        resp = src.sync("trainer", "rollout", 1)
        assert all(committed for committed, _ in outcomes(resp).values()), outcomes(resp)
        at_prepare = False
        for version in range(2, 7):
            step(trainers, version)
            freeze_process(c.daemons["n3"].proc.pid)
            try:
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    sync = pool.submit(src.sync, "trainer", "rollout", version, replica_deadline_s=3.0, timeout=60)
                    time.sleep(1.0)  # the gather has n2's answer, and waits for n3
                    r1[0].acquire()
                    resp = sync.result()
            finally:
                os.kill(c.daemons["n3"].proc.pid, signal.SIGCONT)
            got = outcomes(resp)
            assert got["rollout.r0"] == (True, "") and got["rollout.r2"] == (True, ""), got
            assert not got["rollout.r3"][0] and '"n3"' in got["rollout.r3"][1], got
            committed, why = got["rollout.r1"]
            assert not committed and 'rank 0 on node "n2" does not accept updates (acquired by its client)' in why, got
            assert holds(r0, version) and holds(r2, version) and not holds(r1, version)
            r1[0].release()
            if "its ranks refused the sync" in why:
                at_prepare = True
                break
        assert at_prepare, "the gather saw the acquired rank every time: the Prepare's refusal was not reached"
        # Released: the next sync repairs replicas 1 and 3.
        step(trainers, version + 1)
        resp = src.sync("trainer", "rollout", version + 1, timeout=60)
        assert all(committed for committed, _ in outcomes(resp).values()), outcomes(resp)
        assert holds(r1, version + 1) and holds(r3, version + 1)
        for reg in trainers + r0 + r1 + r2 + r3:
            reg.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_replicas_downstream_of_a_relay_frozen_mid_write_commit_in_the_same_call():
    """Three replicas on 100 Mbit/s links (network namespaces), so a sync's 16 MiB per replica
    takes over a second: the trainer's bytes run through the replicas in relay chains. Each of
    the three replica nodes in turn is frozen once a third of the bytes have moved, while it is
    still writing into the replicas after it. The frozen one is cut; the others commit in the
    same call, with every byte of the version: the retried attempt takes over ranks the frozen
    relay's writes may still land in (those carry the same version's bytes: docs/daemon.md). The
    bytes still hold after the relay thaws and its late writes land, and the next sync repairs it."""
    from shardcast.local import Namespaces

    shardcastd_path()
    nodes = ["n0", "n1", "n2", "n3"]
    shape = (2048, 2048)  # 16 MiB of float32 per replica
    weights, layout = whole_tensor(shape)

    with Namespaces(nodes, rate_mbit=100), LocalCluster(nodes, netns=True,
                                                         extra=["--peer-timeout-ms", "2000"]) as c:
        clients = {n: shardcast.Client(c.target(n), timeout=60) for n in nodes}
        src = clients["n0"]
        trainer = src.register("trainer", 0, 1, {"w": weights(1)}, layout("trainer", "n0"), role="source", version=1)
        replicas = {k: clients[f"n{k + 1}"].register(f"rollout.r{k}", 0, 1, {"w": np.zeros(shape, np.float32)},
                                                     layout(f"rollout.r{k}", f"n{k + 1}", replica_set="rollout",
                                                            replica=k)) for k in range(3)}

        def hold(k: int, version: int) -> bool:
            return np.array_equal(replicas[k].tensors["w"], weights(version))

        resp = src.sync("trainer", "rollout", 1)
        assert all(committed for committed, _ in outcomes(resp).values()), outcomes(resp)
        version = 1
        for frozen in range(3):
            version += 1
            with trainer.writing(version):
                trainer.tensors["w"][...] = weights(version)
            node = f"n{frozen + 1}"
            hit = threading.Event()

            def freeze_a_third_in(p: service_pb2.SyncProgress) -> None:
                if not hit.is_set() and p.bytes_total and 3 * p.bytes_done >= p.bytes_total:
                    freeze_process(c.daemons[node].proc.pid)
                    hit.set()

            try:
                resp = src.sync("trainer", "rollout", version, replica_deadline_s=1.0, progress=freeze_a_third_in)
            finally:
                if hit.is_set():
                    os.kill(c.daemons[node].proc.pid, signal.SIGCONT)
            got = outcomes(resp)
            assert hit.is_set(), f"the sync ended before a third of its bytes had moved: {got}"
            for k in range(3):
                if k == frozen:
                    assert not got[f"rollout.r{k}"][0] and f'"{node}"' in got[f"rollout.r{k}"][1], got
                else:
                    assert got[f"rollout.r{k}"] == (True, ""), (frozen, got)
                    assert hold(k, version), (frozen, k)
            # Thawed, the relay's writes of the first attempt land or fail (the bytes are the same):
            # they have once its own daemon ended that attempt, its rank no longer updating.
            ended = time.monotonic() + 30
            while replicas[frozen].state().state == service_pb2.RANK_UPDATING and time.monotonic() < ended:
                time.sleep(0.05)
            assert replicas[frozen].state().state != service_pb2.RANK_UPDATING, "the thawed relay's attempt never ended"
            for k in range(3):
                if k != frozen:
                    assert hold(k, version), (frozen, k)
            # A later sync repairs the frozen one, once the writes it was in the middle of have
            # ended ("still landing" until then: docs/reliability.md, recovering cuts).
            for _ in range(30):
                version += 1
                with trainer.writing(version):
                    trainer.tensors["w"][...] = weights(version)
                got = outcomes(src.sync("trainer", "rollout", version, timeout=60))
                if all(committed for committed, _ in got.values()):
                    break
                assert all(committed or "still landing" in why or "another sync is writing it" in why
                           for committed, why in got.values()), got
                time.sleep(0.5)
            assert all(committed for committed, _ in got.values()), got
            assert all(hold(k, version) for k in range(3))
        for reg in [trainer, *replicas.values()]:
            reg.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_a_replica_whose_engine_dies_mid_execute_is_cut_alone_and_its_node_neighbour_commits():
    """Replicas 1 and 2 share n2, on 100 Mbit/s links (network namespaces), so a sync's 32 MiB
    per replica takes seconds. Replica 1's engine process is killed (SIGKILL) once the transfer is
    under way: its session ends while the sync still writes its rank. n2's execute fails naming
    replica 1's group, so replica 1 alone is cut (its node is healthy): replicas 0 and 2 commit in
    the same call, with every byte of the version (before, n2 counted as failed and replica 2 was
    cut too). Replica 1's rank is unregistered once that attempt let go of it, so a new engine
    registers it again at once, and the next sync fills it."""
    from shardcast.local import Namespaces

    shardcastd_path()
    nodes = ["n0", "n1", "n2"]
    shape = (2048, 4096)  # 32 MiB of float32 per replica
    weights, layout = whole_tensor(shape)

    def replica(client: shardcast.Client, k: int, node: str):
        return client.register(f"rollout.r{k}", 0, 1, {"w": np.zeros(shape, np.float32)},
                               layout(f"rollout.r{k}", node, replica_set="rollout", replica=k))

    def engine(target: str) -> subprocess.Popen:  # replica 1 on n2, a process of its own
        proc = subprocess.Popen(
            [sys.executable, "-c", (
                "import json, sys, time, numpy as np, shardcast\n"
                "layout = json.loads(sys.argv[2])\n"
                "client = shardcast.Client(sys.argv[1], timeout=60)\n"
                "reg = client.register(layout['group'], 0, 1, {'w': np.zeros(layout['tensors'][0]['shape'], "
                "np.float32)}, layout)\n"
                "print('registered', flush=True)\n"
                "time.sleep(600)\n"),
             target, json.dumps(layout("rollout.r1", "n2", replica_set="rollout", replica=1))],
            stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "registered"
        return proc

    with Namespaces(nodes, rate_mbit=100), LocalCluster(nodes, netns=True) as c:
        clients = {n: shardcast.Client(c.target(n), timeout=60) for n in nodes}
        src = clients["n0"]
        trainer = src.register("trainer", 0, 1, {"w": weights(1)}, layout("trainer", "n0"), role="source", version=1)
        r0, r2 = replica(clients["n1"], 0, "n1"), replica(clients["n2"], 2, "n2")
        at_execute = False
        for version in range(1, 4):
            if version > 1:
                with trainer.writing(version):
                    trainer.tensors["w"][...] = weights(version)
            r1 = engine(c.target("n2"))
            killing = []

            def kill_once_under_way(p: service_pb2.SyncProgress) -> None:
                if not killing and p.bytes_total:  # planned: its bytes are moving, for seconds
                    killing.append(threading.Timer(0.5, kill, (r1,)))
                    killing[0].start()

            try:
                resp = src.sync("trainer", "rollout", version, progress=kill_once_under_way, timeout=120)
            finally:
                if killing:
                    killing[0].join()
                kill(r1)
            assert killing, "the sync reported no bytes to move"
            got = outcomes(resp)
            # Whenever replica 1's engine died, replicas 0 and 2 commit every byte in the same call.
            assert got["rollout.r0"] == (True, "") and got["rollout.r2"] == (True, ""), got
            assert np.array_equal(r0.tensors["w"], weights(version))
            assert np.array_equal(r2.tensors["w"], weights(version))
            # Its engine died mid-execute: cut for its changed registrations, or (its rank gone with
            # that attempt) found gone by the attempt that ran again without it.
            committed, why = got["rollout.r1"]
            if not committed:
                assert 'registrations of group(s) "rollout.r1" on node "n2" changed' in why or \
                    "its ranks are registered nowhere" in why, got
                at_execute = True
                break
        assert at_execute, f"replica 1's engine never died during the execute: {got}"
        # Its rank left with the attempt that used it: registered again at once, filled by the next.
        again = shardcast.Client(c.target("n2"), timeout=60)
        r1 = replica(again, 1, "n2")
        version += 1
        with trainer.writing(version):
            trainer.tensors["w"][...] = weights(version)
        got = outcomes(src.sync("trainer", "rollout", version, timeout=120))
        assert all(committed for committed, _ in got.values()), got
        assert all(np.array_equal(r.tensors["w"], weights(version)) for r in (r0, r1, r2))
        again.close()
        for reg in (trainer, r0, r2):
            reg.close()


def test_a_replica_node_frozen_mid_write_takes_the_abort_as_it_thaws_and_catches_up_at_once():
    """A replica's node freezes while the sync writes into it (after its Prepare: the attempt is
    open there), as a stalled or overloaded host does: the sync cuts it and r0 commits. The abort
    it missed reaches it as it thaws, not when its lease runs out (60 s here): its rank leaves
    UPDATING within seconds, then the catch-up its engine runs next (a vLLM replica's update does)
    brings it to the version, and its client can unregister and register again. Before, each of
    those was refused for the rest of the lease ("a sync ... is in progress")."""
    from shardcast.local import Namespaces

    shardcastd_path()
    nodes = ["n0", "n1", "n2"]
    shape = (2048, 2048)  # 16 MiB of float32 per replica: over a second at 100 Mbit/s
    weights, layout = whole_tensor(shape)

    lease = ["--sync-lease-ms", "60000", "--max-sync-lease-ms", "60000"]
    with Namespaces(nodes, rate_mbit=100), LocalCluster(nodes, netns=True, extra=lease) as c:
        clients = {n: shardcast.Client(c.target(n), timeout=60) for n in nodes}
        src = clients["n0"]
        trainer = src.register("trainer", 0, 1, {"w": weights(1)}, layout("trainer", "n0"), role="source", version=1)

        def register(k: int):
            return clients[f"n{k + 1}"].register(f"rollout.r{k}", 0, 1, {"w": np.zeros(shape, np.float32)},
                                                 layout(f"rollout.r{k}", f"n{k + 1}", replica_set="rollout",
                                                        replica=k))

        replicas = {k: register(k) for k in range(2)}
        assert all(ok for ok, _ in outcomes(src.sync("trainer", "rollout", 1)).values())
        with trainer.writing(2):
            trainer.tensors["w"][...] = weights(2)
        frozen = c.daemons["n2"].proc.pid
        hit = threading.Event()

        def freeze_a_third_in(p: service_pb2.SyncProgress) -> None:
            if not hit.is_set() and p.bytes_total and 3 * p.bytes_done >= p.bytes_total:
                freeze_process(frozen)
                hit.set()

        try:
            resp = src.sync("trainer", "rollout", 2, replica_deadline_s=1.0, progress=freeze_a_third_in)
        finally:
            if hit.is_set():
                os.kill(frozen, signal.SIGCONT)
        got = outcomes(resp)
        assert hit.is_set(), f"the sync ended before a third of its bytes had moved: {got}"
        assert got["rollout.r0"] == (True, "") and not got["rollout.r1"][0] and '"n2"' in got["rollout.r1"][1], got
        # Thawed, n2 takes the abort it missed: well within the lease, the attempt has ended there.
        ended = time.monotonic() + 20
        while replicas[1].state().state == service_pb2.RANK_UPDATING and time.monotonic() < ended:
            time.sleep(0.05)
        assert replicas[1].state().state != service_pb2.RANK_UPDATING, "n2 held the given-up attempt for its lease"
        resp = clients["n2"].catch_up("rollout.r1", "trainer")
        assert resp.version == 2 and resp.seeded_from == "rollout.r0", resp
        assert np.array_equal(replicas[1].tensors["w"], weights(2))
        replicas[1].close()  # unregisters
        replicas[1] = register(1)
        with trainer.writing(3):
            trainer.tensors["w"][...] = weights(3)
        assert all(ok for ok, _ in outcomes(src.sync("trainer", "rollout", 3)).values())
        assert all(np.array_equal(r.tensors["w"], weights(3)) for r in replicas.values())
        for reg in [trainer, *replicas.values()]:
            reg.close()


def test_replicas_sharing_nodes_at_crossed_positions_are_planned_flat_and_all_commit():
    """Replica 0's ranks on n1 and n2, replica 1's on n2 and n1: each node holds the two replicas
    at different positions, which the position plan cannot express (one landing per byte per
    node needs the union of two positions' pieces there). The daemons plan the stacked layout
    flat instead: both replicas commit with every byte, version after version."""
    shardcastd_path()
    with LocalCluster(["n0", "n1", "n2"]) as c:
        clients = {n: shardcast.Client(c.target(n)) for n in c.nodes}
        src = clients["n0"]
        trainers = rank_worker.register_trainers(src)

        def crossed(k: int, nodes: list):
            layout = replica_layout(k, nodes[0])
            layout["nodes"] = nodes
            return [clients[nodes[r]].register(f"rollout.r{k}", r, 2, rank_worker.zeros(r), layout) for r in range(2)]

        r0, r1 = crossed(0, ["n1", "n2"]), crossed(1, ["n2", "n1"])
        for version in (1, 2, 3):
            if version > 1:
                step(trainers, version)
            resp = src.sync("trainer", "rollout", version)
            assert outcomes(resp) == {"rollout.r0": (True, ""), "rollout.r1": (True, "")}, outcomes(resp)
            assert holds(r0, version) and holds(r1, version)
            # Flat: the trainer's node sends each byte once per receiving node, as for one group.
            assert resp.network_bytes == 2 * REPLICA_BYTES, resp.network_bytes
        for reg in trainers + r0 + r1:
            reg.close()


def bytes_received(cluster: LocalCluster, node: str) -> float:
    """The node's shardcast_bytes_received_total."""
    return metric(cluster, node, "shardcast_bytes_received_total")


def metric(cluster: LocalCluster, node: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.daemons[node].metrics_port}/metrics",
                                  timeout=10).read().decode()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def bytes_sent(cluster: LocalCluster, node: str) -> float:
    """The node's shardcast_bytes_sent_total."""
    return metric(cluster, node, "shardcast_bytes_sent_total")


def test_a_replica_that_joins_catches_up_from_its_peers_not_the_trainer():
    """Replica r2 registers after version 2 was synced into the set and the trainer moved on to 3:
    catch_up brings it to 2 from r0 or r1, the trainer sending nothing. A sync into the set that
    reaches it first makes the catch-up a no-op; with no replica readable the trainer seeds it."""
    shardcastd_path()
    with LocalCluster(["n0", "n1", "n2", "n3"]) as c:
        clients, src, trainers, (r0, r1) = trainer_and_replicas(c, 2)
        src.sync("trainer", "rollout", 1)
        step(trainers, 2)
        src.sync("trainer", "rollout", 2)
        step(trainers, 3)  # the trainer holds 3 now: only the replicas hold 2

        r2 = register_replica(clients["n3"], 2, "n3")
        sent = bytes_sent(c, "n0")
        resp = clients["n3"].catch_up("rollout.r2", "trainer")
        assert resp.version == 2 and resp.seeded_from in ("rollout.r0", "rollout.r1"), resp
        assert resp.network_bytes == REPLICA_BYTES
        assert holds(r2, 2)
        assert clients["n3"].wait_version("rollout.r2", 2, timeout=5) == 2
        assert bytes_sent(c, "n0") == sent  # the trainer's egress stayed free
        # Caught up already: nothing moves.
        again = clients["n3"].catch_up("rollout.r2", "trainer")
        assert again.version == 2 and again.seeded_from == "" and again.network_bytes == 0

        # A sync into the set reaches every replica; a catch-up after it has nothing to do.
        src.sync("trainer", "rollout", 3)
        assert all(holds(r, 3) for r in (r0, r1, r2))
        assert clients["n3"].catch_up("rollout.r2", "trainer").version == 3

        # Version 4, asked for by name, is held by no replica: the trainer seeds it.
        step(trainers, 4)
        resp = clients["n3"].catch_up("rollout.r2", "trainer", 4)
        assert resp.version == 4 and resp.seeded_from == "trainer", resp
        assert holds(r2, 4) and holds(r0, 3)
        for reg in trainers + r0 + r1 + r2:
            reg.close()


def test_a_catch_up_and_a_sync_into_the_set_never_write_the_seed_under_each_other():
    """While a catch-up reads replica r0 as its seed, a sync into the set cuts r0 (named) instead
    of overwriting bytes being read; the other replicas commit, and the next sync repairs r0.
    (The catch-up's read is held open by preparing its seed side by hand, as its coordinator would.)"""
    shardcastd_path()
    with LocalCluster(["n0", "n1", "n2", "n3"]) as c:
        clients, src, trainers, (r0, r1) = trainer_and_replicas(c, 2)
        src.sync("trainer", "rollout", 1)
        r2 = register_replica(clients["n3"], 2, "n3")

        seeding = service_pb2.PrepareRequest(sync_id="catch-up-r2", version=1, staging_bytes=1 << 30,
                                             chunk_bytes=64 << 20, write_key=os.urandom(16), packed=True, seed=True)
        seeding.src.CopyFrom(json_format.ParseDict(replica_layout(0, "n1"), layout_pb2.Layout()))
        seeding.dst.CopyFrom(json_format.ParseDict(replica_layout(2, "n3"), layout_pb2.Layout()))
        _as_peer(c, "n1").Prepare(seeding, timeout=30)

        step(trainers, 2)
        got = outcomes(src.sync("trainer", "rollout", 2))
        assert got["rollout.r1"] == (True, "") and got["rollout.r2"] == (True, ""), got
        committed, why = got["rollout.r0"]
        assert not committed and "a catch-up is reading it" in why, why
        assert holds(r0, 1) and holds(r1, 2) and holds(r2, 2)
        # Its client cannot unregister a rank being read: refused, and nothing is lost (it stays
        # registered, its memory too), so closing again once the read ended works.
        with pytest.raises(shardcast.ShardcastError) as busy:
            r0[0].close()
        assert busy.value.code == grpc.StatusCode.FAILED_PRECONDITION and "catch-up-r2" in busy.value.details
        assert holds(r0, 1) and len([r for r in clients["n1"].list(all_nodes=False).ranks
                                     if r.group == "rollout.r0"]) == 2

        _as_peer(c, "n1").Finish(service_pb2.FinishRequest(sync_id="catch-up-r2"), timeout=30)
        step(trainers, 3)
        assert all(ok for ok, _ in outcomes(src.sync("trainer", "rollout", 3)).values())
        assert all(holds(r, 3) for r in (r0, r1, r2))
        for reg in trainers + r0 + r1 + r2:
            reg.close()


def test_catch_ups_share_a_seed_rather_than_reading_the_trainer():
    """Every replica holding version 2 is already read as another catch-up's seed (held open by
    hand, as a coordinator would): a third catch-up reads one of them too, not the trainer (which
    is at 3), and prefers a replica nobody reads when there is one."""
    shardcastd_path()
    with LocalCluster(["n0", "n1", "n2", "n3", "n4"]) as c:
        clients, src, trainers, (r0, r1) = trainer_and_replicas(c, 2)
        src.sync("trainer", "rollout", 1)
        step(trainers, 2)
        src.sync("trainer", "rollout", 2)
        step(trainers, 3)  # only the replicas hold 2
        r2 = register_replica(clients["n3"], 2, "n3")
        r3 = register_replica(clients["n4"], 3, "n4")

        def read_open(k: int, node: str, sync_id: str) -> None:
            seeding = service_pb2.PrepareRequest(sync_id=sync_id, version=2, staging_bytes=1 << 30,
                                                 chunk_bytes=64 << 20, write_key=os.urandom(16), packed=True,
                                                 seed=True)
            seeding.src.CopyFrom(json_format.ParseDict(replica_layout(k, node), layout_pb2.Layout()))
            seeding.dst.CopyFrom(json_format.ParseDict(replica_layout(3, "n4"), layout_pb2.Layout()))
            _as_peer(c, node).Prepare(seeding, timeout=30)

        # r0 read: the catch-up takes r1, which nobody reads.
        read_open(0, "n1", "reading-r0")
        resp = clients["n3"].catch_up("rollout.r2", "trainer")
        assert resp.version == 2 and resp.seeded_from == "rollout.r1", resp
        assert holds(r2, 2)

        # r0 and r1 (and r2) all read: the next catch-up still reads a replica, and the trainer
        # sends nothing.
        read_open(1, "n2", "reading-r1")
        read_open(2, "n3", "reading-r2")
        sent = bytes_sent(c, "n0")
        resp = clients["n4"].catch_up("rollout.r3", "trainer")
        assert resp.version == 2 and resp.seeded_from in ("rollout.r0", "rollout.r1", "rollout.r2"), resp
        assert holds(r3, 2) and bytes_sent(c, "n0") == sent
        for node, sync_id in (("n1", "reading-r0"), ("n2", "reading-r1"), ("n3", "reading-r2")):
            _as_peer(c, node).Finish(service_pb2.FinishRequest(sync_id=sync_id), timeout=30)
        # The reads ended: a sync into the set writes every replica.
        assert all(ok for ok, _ in outcomes(src.sync("trainer", "rollout", 3)).values())
        assert all(holds(r, 3) for r in (r0, r1, r2, r3))
        for reg in trainers + r0 + r1 + r2 + r3:
            reg.close()


def test_a_node_that_is_gone_is_forgotten_after_its_lease_and_nothing_waits_on_it():
    """Static peers n0..n3, replica r2 on n3. n3's daemon freezes (SIGSTOP: its port still takes
    connections, nothing answers). Within its lease a plain sync fails naming it and the set's sync
    cuts r2 after the peer timeout (1.5 s here); past the lease (4 s) both go on without asking it
    for longer than 100 ms and r2 is no longer named. Once n3 answers
    again it takes part: the next sync repairs r2."""
    shardcastd_path()
    with LocalCluster(["n0", "n1", "n2", "n3"], extra=["--peer-lease-ms", "4000", "--peer-timeout-ms", "1500",
                                                             "--metrics-names"]) as c:
        clients, src, trainers, (r0, r1, r2) = trainer_and_replicas(c, 3)
        infer = rank_worker.register_inference(clients["n1"])  # a plain group, on n1
        src.sync("trainer", "rollout", 1)
        src.sync("trainer", "infer", 1)
        freeze_process(c.daemons["n3"].proc.pid)
        frozen = time.monotonic()
        try:
            step(trainers, 2)
            with pytest.raises(shardcast.ShardcastError) as within:
                src.sync("trainer", "infer", 2)
            assert 'node "n3"' in within.value.details, within.value.details
            resp = src.sync("trainer", "rollout", 2)
            assert resp.gather_seconds >= 1.5  # waited for n3, as the peer timeout says
            assert outcomes(resp)["rollout.r2"][0] is False

            time.sleep(max(0.0, frozen + 4.2 - time.monotonic()))  # past the lease
            step(trainers, 3)
            resp = src.sync("trainer", "infer", 3)
            assert resp.gather_seconds < 1.5  # n3 was not waited for
            assert holds(infer, 3)
            resp = src.sync("trainer", "rollout", 3)
            assert resp.gather_seconds < 1.5
            assert outcomes(resp) == {"rollout.r0": (True, ""), "rollout.r1": (True, "")}
            assert holds(r0, 3) and holds(r1, 3) and holds(r2, 1)
            # Its metrics say so: the forgotten peer is down.
            scrape = urllib.request.urlopen(f"http://127.0.0.1:{c.daemons['n0'].metrics_port}/metrics",
                                            timeout=10).read().decode()
            assert 'shardcast_peer_up{peer="n3"} 0' in scrape
        finally:
            os.kill(c.daemons["n3"].proc.pid, signal.SIGCONT)
        step(trainers, 4)
        resp = src.sync("trainer", "rollout", 4)
        assert all(ok for ok, _ in outcomes(resp).values()) and len(resp.replicas) == 3, outcomes(resp)
        assert all(holds(r, 4) for r in (r0, r1, r2))
        for reg in trainers + r0 + r1 + r2 + infer:
            reg.close()


def test_a_replica_that_joined_by_a_catch_up_is_named_when_its_node_goes_silent_before_the_next_sync():
    """Replica r1 joins after version 1 and catches up through the trainer's daemon (the one that
    coordinates the set's syncs); its daemon then freezes before the next sync. That sync names r1
    as cut (its node does not answer) after the replica deadline, and r0 commits."""
    shardcastd_path()
    with LocalCluster(["n0", "n1", "n2"]) as c:
        clients, src, trainers, (r0,) = trainer_and_replicas(c, 1)
        src.sync("trainer", "rollout", 1)
        r1 = register_replica(clients["n2"], 1, "n2")
        assert src.catch_up("rollout.r1", "trainer").seeded_from == "rollout.r0"
        assert holds(r1, 1)
        _, got = sync_with_a_node_frozen(c, src, trainers, "n2", 2)
        assert got["rollout.r0"] == (True, ""), got
        committed, why = got["rollout.r1"]
        assert not committed and 'node(s) "n2"' in why and "do not answer" in why, why
        assert holds(r0, 2)
        assert holds(r1, 1)
        for reg in trainers + r0 + r1:
            reg.close()


def test_a_catch_up_goes_on_while_a_node_it_neither_reads_nor_writes_is_silent():
    """r2's daemon (n3) freezes; a catch-up of r1 from r0 neither reads nor writes n3, so it goes
    on without it (before, any silent peer failed it, and with it every vLLM update that catches a
    replica up)."""
    shardcastd_path()
    with LocalCluster(["n0", "n1", "n2", "n3"], extra=["--peer-timeout-ms", "1500"]) as c:
        clients, src, trainers, (r0,) = trainer_and_replicas(c, 1)
        r2 = register_replica(clients["n3"], 2, "n3")
        src.sync("trainer", "rollout", 1)
        step(trainers, 2)
        src.sync("trainer", "rollout", 2)
        r1 = register_replica(clients["n2"], 1, "n2")
        freeze_process(c.daemons["n3"].proc.pid)
        try:
            resp = src.catch_up("rollout.r1", "trainer", 2)
            assert resp.version == 2 and resp.seeded_from == "rollout.r0", resp
            assert holds(r1, 2)
        finally:
            os.kill(c.daemons["n3"].proc.pid, signal.SIGCONT)
        for reg in trainers + r0 + r1 + r2:
            reg.close()


def test_another_uid_syncing_its_own_source_into_the_set_does_not_wipe_what_the_coordinator_remembers():
    """nobody asks the trainer's daemon for a sync of its own source into root's set (its replicas
    are not nobody's to write: refused). The daemon still remembers root's replicas: when r1's node
    then freezes, root's next sync names r1 as cut and waits only the replica deadline for it."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root (setpriv) to run a caller as another uid")
    foreign = os.path.join(os.environ.get("SHARDCAST_BUILD", "build"), "bin", "foreign_caller")
    if not os.access(foreign, os.X_OK):
        pytest.skip(f"{foreign} is not built")
    shardcastd_path()
    one = ('{"group":"g","mesh":{"shape":[1]},"nodes":["n0"],"tensors":[{"name":"w","shape":[4],'
           '"dtype":"float32","placements":[{"replicate":{}}]}]}')
    with LocalCluster(["n0", "n1", "n2"], extra=["--peer-timeout-ms", "3000"]) as c:
        clients, src, trainers, (r0, r1) = trainer_and_replicas(c, 2)
        src.sync("trainer", "rollout", 1)
        sock = c.target("n0").split(":", 1)[1]
        os.chmod(os.path.dirname(sock), 0o750)  # reachable by gid 0, as the daemon tests run it
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=0", "--clear-groups", foreign, "sync", sock, one,
                              "trainer", "rollout"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "own-source OK" in out.stdout, out.stdout + out.stderr
        assert "write OK" not in out.stdout, out.stdout  # root's replicas were not nobody's to write
        resp, got = sync_with_a_node_frozen(c, src, trainers, "n2", 2)
        assert got["rollout.r0"] == (True, ""), got
        assert got["rollout.r1"][0] is False and "do not answer" in got["rollout.r1"][1], got
        assert resp.gather_seconds < 2.5  # the replica deadline, not the 3 s peer timeout
        for reg in trainers + r0 + r1:
            reg.close()
