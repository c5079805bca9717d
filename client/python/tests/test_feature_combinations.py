"""The combinations of docs/clients.md's features table that no other test runs, through real
daemons: double-buffered replicas in a replica set (synced, caught up, deltas), a replica caught
up from its peer and then synced with deltas (the first dense, the next a delta), block-scaled fp8
into double-buffered ranks with delta syncs (deltas from the set in use, bit for bit torch's), and an fp8
replica caught up from its peer (its fp8 bytes and scales copied as they are), then synced with
deltas (the first dense, the next a delta). And the README's features table says what
docs/clients.md's does."""

from __future__ import annotations

import re
import types

import numpy as np
import pytest

import rank_worker
import shardcast
import test_delta as delta_case
import test_fp8 as fp8_case  # its helpers only: importing the module collects none of its tests here
import test_replica_sets as set_case
from conftest import ROOT, shardcastd_path
from shardcast.local import LocalCluster

torch = pytest.importorskip("torch", reason="the test venv (scripts/deps.sh) has torch")


def holds_in_use(replica, version: int) -> bool:
    """Whether the set in use of every rank of `replica` holds `version` (read pinned)."""
    for reg in replica:
        with reg.reading() as tensors:
            if not all(np.array_equal(tensors[n], rank_worker.shard("infer", n, reg.rank, version))
                       for n in rank_worker.SHAPES):
                return False
    return True


def test_double_buffered_replicas_sync_catch_up_and_take_deltas_in_a_replica_set():
    shardcastd_path()
    with LocalCluster(["n0", "n1", "n2", "n3"]) as c:
        clients = {n: shardcast.Client(c.target(n)) for n in c.nodes}
        src = clients["n0"]
        trainers = rank_worker.register_trainers(src)
        plain = set_case.register_replica(clients["n1"], 0, "n1")

        def doubled(k: int, node: str):
            return [clients[node].register(f"rollout.r{k}", r, 2, rank_worker.zeros(r),
                                           set_case.replica_layout(k, node), shadow=rank_worker.zeros(r))
                    for r in range(2)]

        shadowed = doubled(1, "n2")
        resp = src.sync("trainer", "rollout", 1, delta="auto")
        assert set_case.outcomes(resp) == {"rollout.r0": (True, ""), "rollout.r1": (True, "")}
        assert set_case.holds(plain, 1) and holds_in_use(shadowed, 1)

        # A double-buffered replica joins and catches up: from the single-buffered replica (a
        # double-buffered one is no seed: its readable set is the one its engine reads).
        late = doubled(2, "n3")
        caught = clients["n3"].catch_up("rollout.r2", "trainer")
        assert caught.seeded_from == "rollout.r0" and caught.version == 1
        assert holds_in_use(late, 1)

        # A delta sync into the set: the caught-up replica's base was committed by its catch-up, not
        # by the trainer's sync, so it is dense (for the replicas beside it on its relay chains
        # too), and every replica holds the version. (Deltas rebuilt in double-buffered ranks:
        # test_delta.py and the fp8 case below; every element changes in these steps.)
        set_case.step(trainers, 2)
        resp = src.sync("trainer", "rollout", 2, delta="auto")
        assert all(committed for committed, _ in set_case.outcomes(resp).values()), resp.replicas
        assert resp.dense_chunks > 0
        assert set_case.holds(plain, 2) and holds_in_use(shadowed, 2) and holds_in_use(late, 2)
        for reg in trainers + plain + shadowed + late:
            reg.close()


def test_block_scaled_fp8_into_double_buffered_ranks_with_delta_syncs(cluster):
    n0, n1 = cluster
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(fp8_case.R, fp8_case.C, generator=g) * 0.02).to(torch.bfloat16)
    m = torch.randn(fp8_case.M_R, fp8_case.M_C, generator=g) * 3
    with shardcast.Client(n0.target) as c0, shardcast.Client(n1.target) as c1:
        src = [c0.register("trainer", r, 2, {"w": w[r * 256:(r + 1) * 256].clone(), "m": m.clone()},
                           fp8_case.src_layout(), role="source", version=1) for r in range(2)]
        dst = [c1.register("vllm-fp8", r, 2, fp8_case.destination(r), fp8_case.dst_layout(),
                           shadow=fp8_case.destination(r)) for r in range(2)]

        def check_in_use():
            views = []
            for reg in dst:
                with reg.reading() as tensors:
                    views.append(types.SimpleNamespace(tensors={n: t.clone() for n, t in tensors.items()}))
            fp8_case.check(torch.cat([s.tensors["w"] for s in src]), m, views)

        c0.sync("trainer", "vllm-fp8", 1, delta="auto", verify=True)
        check_in_use()
        active = [reg.state().active_set for reg in dst]
        for version in (2, 3):
            for s in src:
                with s.writing(version):
                    s.tensors["w"][version, :7] = 0.01 * version
            resp = c0.sync("trainer", "vllm-fp8", version, delta="auto")
            assert resp.delta_chunks > 0  # rebuilt from the set in use into the other
            check_in_use()
            flipped = [1 - a for a in active]
            active = [reg.state().active_set for reg in dst]
            assert active == flipped  # each commit flips the set in use
        for reg in dst + src:
            reg.close()


def test_a_replica_caught_up_from_its_peer_gets_a_dense_sync_then_deltas():
    shardcastd_path()
    with LocalCluster(["n0", "n1", "n2"], extra=["--chunk-mib", "1"]) as c:
        clients = {n: shardcast.Client(c.target(n)) for n in c.nodes}
        c0 = clients["n0"]
        src = c0.register("trainer", 0, 1, delta_case.source_tensors(5), delta_case.src_layout("n0"), role="source",
                          version=1)

        def join(k: int):
            node = f"n{k + 1}"
            return [clients[node].register(f"vllm.r{k}", r, 2, delta_case.destination_tensors(2),
                                           delta_case.replica_layout(k, node)) for r in range(2)]

        first = join(0)
        c0.sync("trainer", "vllm", 1, delta="auto")
        late = join(1)
        caught = clients["n2"].catch_up("vllm.r1", "trainer")
        assert caught.seeded_from == "vllm.r0" and caught.version == 1
        delta_case.check_all(src, late, 2)
        for version in (2, 3):
            delta_case.step(src, version, 0.02, seed=70 + version)
            resp = c0.sync("trainer", "vllm", version, delta="auto")
            assert all(o.committed for o in resp.replicas), resp.replicas
            delta_case.check_all(src, first, 2)
            delta_case.check_all(src, late, 2)
            # The caught-up replica's base was committed by the catch-up, not by the trainer's sync:
            # its first delta sync is dense (for replica 0 on its relay chain too), the next a delta.
            assert (resp.delta_chunks > 0, resp.dense_chunks > 0) == ((False, True) if version == 2 else (True, False))
            # The second sync of this membership names the layouts by digest (docs/daemon.md,
            # "Layouts by digest"): the deltas and every byte are the same.
            assert resp.layouts_by_digest == (version == 3)
        for reg in [src] + first + late:
            reg.close()


def test_an_fp8_replica_catches_up_from_its_peer_and_then_takes_delta_syncs():
    """A replica that joins an fp8 set catches up from its peer: the peer's fp8 bytes and scales are
    copied as they are (never quantised again), equal to torch's quantisation of the trainer's
    weights; the deltas after follow."""
    shardcastd_path()
    with LocalCluster(["n0", "n1", "n2"]) as c:
        c0, c1, c2 = (shardcast.Client(c.target(n)) for n in ("n0", "n1", "n2"))
        g = torch.Generator().manual_seed(13)
        w = (torch.randn(fp8_case.R, fp8_case.C, generator=g) * 0.02).to(torch.bfloat16)
        m = torch.randn(fp8_case.M_R, fp8_case.M_C, generator=g) * 3
        src = [c0.register("trainer", r, 2, {"w": w[r * 256:(r + 1) * 256].clone(), "m": m.clone()},
                           fp8_case.src_layout(), role="source", version=1) for r in range(2)]

        def replica(k: int, client, node: str):
            layout = {**fp8_case.dst_layout(), "group": f"vllm.r{k}", "replica_set": "vllm", "replica": k,
                      "nodes": [node, node]}
            return [client.register(f"vllm.r{k}", r, 2, fp8_case.destination(r), layout) for r in range(2)]

        first = replica(0, c1, "n1")
        c0.sync("trainer", "vllm", 1, delta="auto", verify=True)
        late = replica(1, c2, "n2")
        caught = c2.catch_up("vllm.r1", "trainer")
        assert caught.seeded_from == "vllm.r0" and caught.version == 1
        fp8_case.check(w, m, first)
        fp8_case.check(w, m, late)  # the fp8 bytes and scales read from replica 0, as the trainer quantised them
        for version in (2, 3):
            for s in src:
                with s.writing(version):
                    s.tensors["w"][version, :5] = 0.001 * version
            w = torch.cat([s.tensors["w"] for s in src])
            resp = c0.sync("trainer", "vllm", version, delta="auto")
            assert all(o.committed for o in resp.replicas), resp.replicas
            fp8_case.check(w, m, first)
            fp8_case.check(w, m, late)
            # The caught-up replica's base was committed by the catch-up: its first delta sync is
            # dense (for the replicas on its relay chain too), the next one a delta.
            assert (resp.delta_chunks > 0) == (version == 3), (version, resp.delta_chunks, resp.dense_chunks)
            assert resp.layouts_by_digest == (version == 3)  # (its fp8 scales' amaxes as with the layouts)
        for reg in src + first + late:
            reg.close()


def _verdict_and_link(cell: str) -> tuple:
    """("yes" or "no", the docs page#anchor it links, relative to docs/) of a table cell."""
    link = re.search(r"\]\(([^)]+)\)", cell)
    verdict = re.match(r"\W*(\w+)", cell).group(1)
    return verdict, link.group(1).removeprefix("docs/") if link else None


def test_the_readme_and_clients_md_features_tables_agree():
    """README's matrix and docs/clients.md's list ("Features that combine") name the same pairs of
    features, each with the same verdict and the same section for its limits."""
    readme = (ROOT / "README.md").read_text().split("Which features combine", 1)[1]
    rows = [line for line in readme.split("\n\n", 1)[1].split("\n\n", 1)[0].splitlines()]
    columns = [c.strip() for c in rows[0].strip("|").split("|")][1:]
    in_readme = {}
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        row = cells[0].strip("*")
        for column, cell in zip(columns, cells[1:]):
            if cell:
                in_readme[frozenset((row, column))] = _verdict_and_link(cell)
    clients = (ROOT / "docs" / "clients.md").read_text().split("### Features that combine", 1)[1]
    in_clients = {}
    for line in clients.split("\n\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]:
        pair, works, where = [c.strip() for c in line.strip().strip("|").split("|")]
        features = frozenset(f.strip() for f in pair.split(" + "))
        assert len(features) == 2, line
        in_clients[features] = (_verdict_and_link(works)[0], _verdict_and_link(where)[1])
    assert len(in_readme) == 10 and set(in_readme) == set(in_clients), (
        sorted(map(sorted, set(in_readme) ^ set(in_clients))))
    for pair, said in in_readme.items():
        assert said == in_clients[pair], (sorted(pair), said, in_clients[pair])
