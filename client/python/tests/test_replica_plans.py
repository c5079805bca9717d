"""ParallelPlan(replicas=N) as a replica set (docs/clients.md, "Named tensors"): each replica's
layout is its own group `<set>.r<k>` of its TP ranks, register_inference registers it, one sync
into the set writes every replica and cuts a held one while the other commits; replica_set=False
keeps one plain group. And the replica deadline's one Python name, `replica_deadline_s`."""

from __future__ import annotations

import numpy as np
import pytest

import shardcast
from conftest import shardcastd_path
from shardcast.local import LocalCluster

torch = pytest.importorskip("torch", reason="the test venv (scripts/deps.sh) has torch")

MODEL = {"w": ((8, 6), "float32"), "e": ((5, 4), "float32"), "b": ((5,), "float32")}
TRAINER = {"group": "trainer", "mesh": {"shape": [1]}, "nodes": ["n0"], "tensors": [
    {"name": n, "shape": list(shape), "dtype": dtype, "placements": [{"replicate": {}}]}
    for n, (shape, dtype) in MODEL.items()]}


def plan(replica: int, tp_rank: int, **kw) -> shardcast.ParallelPlan:
    """TP=2 x 2 replicas: w column-parallel, e expert-parallel (experts [0, 3) and [3, 5)), b replicated."""
    return shardcast.ParallelPlan(tp_size=2, tp_rank=tp_rank, replicas=2, replica=replica, column=["w"],
                                  experts=["e"], expert_ranges=[(0, 3), (3, 5)], **kw)


def entries(layout: dict) -> dict:
    return {t["name"]: t for t in layout["tensors"]}


def test_a_plan_with_replicas_lays_out_its_replica_as_a_member_of_a_set():
    p = plan(1, 0)
    assert (p.in_replica_set, p.rank, p.group_rank, p.group_world, p.group_name("g")) == (True, 2, 0, 2, "g.r1")
    layout = shardcast.inference_layout("g", p, MODEL, nodes=["a", "b", "c", "d"])
    assert (layout["group"], layout["replica_set"], layout["replica"]) == ("g.r1", "g", 1)
    assert layout["mesh"] == {"shape": [2], "dim_names": ["tp"]}
    assert layout["nodes"] == ["c", "d"]  # every replica's nodes, replica-major: its own slice
    assert shardcast.inference_layout("g", p, MODEL, nodes=["x", "y"])["nodes"] == ["x", "y"]  # its own
    # ranks_per_node: each rank stays on the node its world rank is on (world ranks 2, 3).
    assert shardcast.inference_layout("g", p, MODEL, ranks_per_node=3, node_prefix="i")["nodes"] == ["i0", "i1"]
    got = entries(layout)
    assert got["w"]["placements"] == [{"shard": {"dim": 0}}]
    assert got["b"]["placements"] == [{"replicate": {}}]
    assert got["e"]["pieces"] == [{"ranks": [0], "offsets": [0, 0], "sizes": [3, 4]},
                                  {"ranks": [1], "offsets": [3, 0], "sizes": [2, 4]}]
    # Every replica's layout is the same but for group, replica and nodes (what a set requires).
    other = shardcast.inference_layout("g", plan(0, 1), MODEL, nodes=["a", "b", "c", "d"])
    assert (other["group"], other["replica"], other["nodes"]) == ("g.r0", 0, ["a", "b"])
    assert other["tensors"] == layout["tensors"] and other["mesh"] == layout["mesh"]
    assert shardcast.load_layout(layout).replica_set == "g"  # a valid Layout message
    with pytest.raises(ValueError) as wrong:
        shardcast.inference_layout("g", p, MODEL, nodes=["a", "b", "c"])
    assert str(wrong.value) == ('group "g.r1", rank 2 (replica 1, tp_rank 0): 3 node names; give 2 (replica 1\'s '
                                "ranks) or 4 (every replica's, replica-major)")


def test_a_plan_without_a_replica_set_lays_out_one_plain_group():
    for p in (plan(1, 0, replica_set=False),
              shardcast.ParallelPlan(tp_size=2, tp_rank=1, column=["w"], experts=["e"], expert_ranges=[(0, 3), (3, 5)])):
        world = p.world_size
        assert (p.in_replica_set, p.group_rank, p.group_world, p.group_name("g")) == (False, p.rank, world, "g")
        layout = shardcast.inference_layout("g", p, MODEL, nodes=[f"n{r}" for r in range(world)])
        assert layout["group"] == "g" and "replica_set" not in layout and "replica" not in layout
        assert layout["mesh"] == {"shape": [p.replicas, 2], "dim_names": ["dp", "tp"]}
        assert layout["nodes"] == [f"n{r}" for r in range(world)]
        got = entries(layout)
        assert got["w"]["placements"] == [{"replicate": {}}, {"shard": {"dim": 0}}]
        assert [piece["ranks"] for piece in got["e"]["pieces"]] == [list(range(0, world, 2)), list(range(1, world, 2))]
        layout = shardcast.inference_layout("g", p, MODEL, ranks_per_node=2)
        assert (layout["ranks_per_node"], layout["node_prefix"]) == (2, "node-")
    with pytest.raises(TypeError, match="replica_set is True or False .* not 'g'"):
        plan(0, 0, replica_set="g")
    with pytest.raises(ValueError, match=r'group "g", rank 2 \(replica 1, tp_rank 0\): 2 node names; give 4 '
                                         r"\(one per rank\)"):
        shardcast.inference_layout("g", plan(1, 0, replica_set=False), MODEL, nodes=["a", "b"])


def full(name: str, version: int) -> np.ndarray:
    shape, _ = MODEL[name]
    return (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 1000 * version + 7 * len(name))


def holds(replica, version: int) -> bool:
    """Whether every rank of `replica` ([(plan, reg)]) holds its part of `version`."""
    for p, reg in replica:
        want = {"w": full("w", version)[4 * p.tp_rank:4 * p.tp_rank + 4], "b": full("b", version),
                "e": full("e", version)[[0, 3][p.tp_rank]:[3, 5][p.tp_rank]]}
        if any(not np.array_equal(reg.tensors[n].numpy(), want[n]) for n in want):
            return False
    return True


def test_register_inference_of_two_replicas_makes_a_set_one_sync_writes_and_a_held_replica_is_cut():
    shardcastd_path()
    nodes = ["n1", "n1", "n2", "n2"]  # replica 0 on n1, replica 1 on n2
    with LocalCluster(["n0", "n1", "n2"]) as c:
        clients = {n: shardcast.Client(c.target(n)) for n in c.nodes}
        trainer = clients["n0"]
        src = trainer.register("trainer", 0, 1, {n: full(n, 1) for n in MODEL}, TRAINER, role="source", version=1)
        replicas = []
        for k in range(2):
            plans = [plan(k, t) for t in range(2)]
            replicas.append([(p, clients[nodes[p.rank]].register_inference(
                "rollout", shardcast.local_tensors(p, MODEL), p, MODEL, nodes=nodes)) for p in plans])
        assert [(reg.group, reg.rank, reg.world_size) for r in replicas for _, reg in r] == [
            ("rollout.r0", 0, 2), ("rollout.r0", 1, 2), ("rollout.r1", 0, 2), ("rollout.r1", 1, 2)]
        listed = {(r.group, r.rank): (r.replica_set, r.replica) for r in trainer.list(all_nodes=True).ranks
                  if r.group.startswith("rollout")}
        assert listed == {("rollout.r0", 0): ("rollout", 0), ("rollout.r0", 1): ("rollout", 0),
                          ("rollout.r1", 0): ("rollout", 1), ("rollout.r1", 1): ("rollout", 1)}

        # One sync into the set writes both replicas.
        resp = trainer.sync("trainer", "rollout", 1, replica_deadline_s=5.0, min_replicas=2)
        assert [(o.group, o.replica, o.committed, o.cut) for o in resp.replicas] == [
            ("rollout.r0", 0, True, ""), ("rollout.r1", 1, True, "")]
        assert clients["n2"].wait_version("rollout.r1", 1, timeout=10) == 1
        assert holds(replicas[0], 1) and holds(replicas[1], 1)

        # Replica 1's engine holds a rank: it is cut and named, replica 0 commits.
        with src.writing(2):
            for n in MODEL:
                src.tensors[n][...] = full(n, 2)
        with replicas[1][1][1].reading():
            resp = trainer.sync("trainer", "rollout", 2, replica_deadline_s=5.0)
        got = {o.group: (o.committed, o.cut) for o in resp.replicas}
        assert got["rollout.r0"] == (True, ""), got
        assert not got["rollout.r1"][0] and "does not accept updates" in got["rollout.r1"][1], got
        assert holds(replicas[0], 2) and holds(replicas[1], 1)
        assert clients["n1"].wait_version("rollout.r0", 2, timeout=10) == 2
        with pytest.raises(shardcast.ShardcastError, match="at version 1"):
            clients["n2"].wait_version("rollout.r1", 2, timeout=0.5)

        # The deadline's one Python name carries its unit; the old keyword is gone.
        with pytest.raises(TypeError, match="replica_deadline"):
            trainer.sync("trainer", "rollout", 3, replica_deadline=1.0)
        with pytest.raises(ValueError, match="replica_deadline_s must not be negative, not -1"):
            trainer.sync("trainer", "rollout", 3, replica_deadline_s=-1)
        for replica in replicas:
            for _, reg in replica:
                reg.close()
        src.close()
        for client in clients.values():
            client.close()
