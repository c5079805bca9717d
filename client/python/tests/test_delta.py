"""Delta syncs through real daemons (docs/delta.md): after a first dense sync, a source daemon sends
a destination node that holds the bytes it last sent only the elements that changed; every byte
of every destination rank is checked against the source after every sync. Nodes that do not hold
the base (a rank registered again) get dense bytes in the same sync; a destination whose memory
was written outside a sync fails the delta loudly, naming the ranks, and the next sync repairs it;
double-buffered ranks take deltas rebuilt from the set their engine reads; --delta-dense-every
refreshes the bases."""

from __future__ import annotations

import types

import grpc
import pytest

import shardcast
from shardcast.local import LocalCluster
from shardcast.v1 import service_pb2

torch = pytest.importorskip("torch", reason="the test venv (scripts/deps.sh) has torch")

ROWS, COLS = 2048, 1024  # w: 4 MiB of bfloat16, so 1 MiB chunks make several per shard


def src_layout(node):
    return {"group": "trainer", "mesh": {"shape": [1]}, "nodes": [node], "tensors": [
        {"name": "w", "shape": [ROWS, COLS], "dtype": "bfloat16", "placements": [{"replicate": {}}]},
        {"name": "m", "shape": [128, 256], "dtype": "float32", "placements": [{"replicate": {}}]},
        {"name": "b", "shape": [COLS], "dtype": "bfloat16", "placements": [{"replicate": {}}]}]}


def dst_layout(nodes):
    """Rank r holds rows r/len of w, columns r/len of m (declared bfloat16: converted), all of b."""
    return {"group": "vllm", "mesh": {"shape": [len(nodes)]}, "nodes": nodes, "tensors": [
        {"name": "w", "shape": [ROWS, COLS], "dtype": "bfloat16", "placements": [{"shard": {"dim": 0}}]},
        {"name": "m", "shape": [128, 256], "dtype": "bfloat16", "placements": [{"shard": {"dim": 1}}]},
        {"name": "b", "shape": [COLS], "dtype": "bfloat16", "placements": [{"replicate": {}}]}]}


def source_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(ROWS, COLS, generator=g).to(torch.bfloat16),
            "m": torch.randn(128, 256, generator=g),
            "b": torch.randn(COLS, generator=g).to(torch.bfloat16)}


def destination_tensors(world):
    return {"w": torch.zeros(ROWS // world, COLS, dtype=torch.bfloat16),
            "m": torch.zeros(128, 256 // world, dtype=torch.bfloat16),
            "b": torch.zeros(COLS, dtype=torch.bfloat16)}


def step(src, version, fraction, seed):
    """An optimizer-like step: `fraction` of the elements of w and m change, b does not."""
    g = torch.Generator().manual_seed(seed)
    with src.writing(version):
        for name, bump in (("w", 1.0), ("m", 0.25)):
            flat = src.tensors[name].view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: int(flat.numel() * fraction)]
            flat[idx] = flat[idx] + bump


def bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def check_all(src, dst, world):
    w, m, b = src.tensors["w"], src.tensors["m"], src.tensors["b"]
    for r, reg in enumerate(dst):
        want = {"w": w[r * ROWS // world:(r + 1) * ROWS // world],
                "m": m[:, r * 256 // world:(r + 1) * 256 // world].to(torch.bfloat16), "b": b}
        for name, t in want.items():
            assert torch.equal(bits(reg.tensors[name]), bits(t.contiguous())), f"rank {r}: {name} differs"


def in_use(dst):
    """What the engine of each rank in `dst` reads (a double-buffered rank's set in use), for check_all."""
    views = []
    for reg in dst:
        with reg.reading() as tensors:
            views.append(types.SimpleNamespace(tensors={n: t.clone() for n, t in tensors.items()}))
    return views


@pytest.fixture
def two_nodes():
    shardcast.local.find_shardcastd()
    with LocalCluster(["n0", "n1"], extra=["--chunk-mib", "1"]) as c:
        yield c.daemons["n0"], c.daemons["n1"]


def test_deltas_carry_only_what_changed_and_every_byte_matches(two_nodes):
    n0, n1 = two_nodes
    with shardcast.Client(n0.target) as c0, shardcast.Client(n1.target) as c1:
        src = c0.register("trainer", 0, 1, source_tensors(), src_layout("n0"), role="source", version=1)
        dst = [c1.register("vllm", r, 2, destination_tensors(2), dst_layout(["n1", "n1"])) for r in range(2)]

        first = c0.sync("trainer", "vllm", 1, delta="auto")  # no base yet: dense, bases kept
        assert first.delta == service_pb2.DELTA_AUTO
        assert first.delta_chunks == 0 and first.dense_chunks > 1
        assert first.wire_bytes == first.network_bytes
        check_all(src, dst, 2)

        step(src, 2, 0.02, seed=2)
        second = c0.sync("trainer", "vllm", 2, delta="auto", verify=True)
        check_all(src, dst, 2)
        assert second.delta_chunks == first.dense_chunks and second.dense_chunks == 0
        assert second.network_bytes == first.network_bytes
        # 2% of the elements changed, 3 bytes each on the wire for 2 dense: about 3% of the bytes.
        assert second.wire_bytes <= 0.10 * second.network_bytes, (second.wire_bytes, second.network_bytes)

        with src.writing(3):
            pass  # a version with nothing changed: empty deltas, only the words that they landed
        third = c0.sync("trainer", "vllm", 3, delta="auto")
        assert third.wire_bytes == 0 and third.delta_chunks == first.dense_chunks
        check_all(src, dst, 2)

        step(src, 4, 0.6, seed=4)  # too much changed: those chunks travel dense
        fourth = c0.sync("trainer", "vllm", 4, delta="auto")
        check_all(src, dst, 2)
        assert fourth.dense_chunks > 0

        step(src, 5, 0.01, seed=5)
        off = c0.sync("trainer", "vllm", 5)  # dense, zero copy: the bases are not this version's
        assert off.delta == service_pb2.DELTA_OFF and off.delta_chunks == 0
        check_all(src, dst, 2)
        step(src, 6, 0.01, seed=6)
        after = c0.sync("trainer", "vllm", 6, delta="auto")
        assert after.delta_chunks == 0 and after.wire_bytes == after.network_bytes
        check_all(src, dst, 2)

        with pytest.raises(ValueError, match="delta must be one of"):
            c0.sync("trainer", "vllm", 7, delta="sometimes")
        for reg in dst:
            reg.close()
        src.close()


def test_a_node_without_the_base_gets_dense_bytes_in_the_same_sync_and_relays_forward_deltas():
    shardcast.local.find_shardcastd()
    with LocalCluster(["n0", "n1", "n2"], extra=["--chunk-mib", "1"]) as c:
        n0, n1, n2 = (c.daemons[n] for n in ("n0", "n1", "n2"))
        with shardcast.Client(n0.target) as c0, shardcast.Client(n1.target) as c1, \
                shardcast.Client(n2.target) as c2:
            src = c0.register("trainer", 0, 1, source_tensors(1), src_layout("n0"), role="source", version=1)
            layout = dst_layout(["n1", "n2"])
            dst = [c1.register("vllm", 0, 2, destination_tensors(2), layout),
                   c2.register("vllm", 1, 2, destination_tensors(2), layout)]
            c0.sync("trainer", "vllm", 1, delta="auto")
            check_all(src, dst, 2)

            step(src, 2, 0.02, seed=12)
            both = c0.sync("trainer", "vllm", 2, delta="auto")
            check_all(src, dst, 2)
            # b is needed on both nodes: it travels n0 -> n1 -> n2, forwarded as the delta it is.
            assert both.dense_chunks == 0 and both.delta_chunks > 0
            assert both.wire_bytes <= 0.10 * both.network_bytes

            # Rank 1 registers again (an inference replica restarted): EMPTY, no base on n2.
            dst[1].close()
            dst[1] = c2.register("vllm", 1, 2, destination_tensors(2), layout)
            step(src, 3, 0.02, seed=13)
            mixed = c0.sync("trainer", "vllm", 3, delta="auto")
            check_all(src, dst, 2)
            assert mixed.delta_chunks > 0 and mixed.dense_chunks > 0  # deltas to n1, dense to n2
            step(src, 4, 0.02, seed=14)
            again = c0.sync("trainer", "vllm", 4, delta="auto")  # n2 holds the base now
            check_all(src, dst, 2)
            assert again.dense_chunks == 0
            for reg in dst:
                reg.close()
            src.close()


def test_a_destination_written_outside_a_sync_fails_the_delta_naming_it_and_is_repaired(two_nodes):
    n0, n1 = two_nodes
    with shardcast.Client(n0.target) as c0, shardcast.Client(n1.target) as c1:
        src = c0.register("trainer", 0, 1, source_tensors(3), src_layout("n0"), role="source", version=1)
        dst = [c1.register("vllm", r, 2, destination_tensors(2), dst_layout(["n1", "n1"])) for r in range(2)]
        c0.sync("trainer", "vllm", 1, delta="auto")
        dst[1].tensors["w"][5, 7] += 1  # the engine wrote its weights: rank 1 no longer holds version 1
        step(src, 2, 0.02, seed=22)
        with pytest.raises(shardcast.ShardcastError, match=r'rank\(s\) 1 there do not hold version 1') as e:
            c0.sync("trainer", "vllm", 2, delta="auto")
        assert e.value.code == grpc.StatusCode.DATA_LOSS
        assert dst[1].state().state == service_pb2.RANK_DIRTY
        repaired = c0.sync("trainer", "vllm", 2, delta="auto")  # DIRTY: no base, so dense
        assert repaired.delta_chunks == 0
        check_all(src, dst, 2)
        step(src, 3, 0.02, seed=23)
        assert c0.sync("trainer", "vllm", 3, delta="auto").delta_chunks > 0
        check_all(src, dst, 2)
        for reg in dst:
            reg.close()
        src.close()


def test_double_buffered_ranks_take_deltas_rebuilt_from_the_set_their_engine_reads(two_nodes):
    """A double-buffered rank's base is its set in use: each delta is rebuilt from it into the other
    set (which holds the version before), checked, and flipped to at commit. An engine that wrote
    the set in use fails the next delta naming its rank, which keeps serving its version; the next
    sync is dense for it, the one after a delta again."""
    n0, n1 = two_nodes
    with shardcast.Client(n0.target) as c0, shardcast.Client(n1.target) as c1:
        src = c0.register("trainer", 0, 1, source_tensors(4), src_layout("n0"), role="source", version=1)
        dst = [c1.register("vllm", r, 2, destination_tensors(2), dst_layout(["n1", "n1"]),
                           shadow=destination_tensors(2)) for r in range(2)]
        assert c0.sync("trainer", "vllm", 1, delta="auto").delta_chunks == 0  # nothing held yet
        check_all(src, in_use(dst), 2)
        for version in (2, 3):
            step(src, version, 0.02, seed=30 + version)
            resp = c0.sync("trainer", "vllm", version, delta="auto")
            assert resp.delta_chunks > 0 and resp.wire_bytes < resp.network_bytes / 4, resp
            check_all(src, in_use(dst), 2)
        assert [reg.state().active_set for reg in dst] == [1, 1]  # set 0 at registration, flipped at each commit

        with dst[1].reading() as tensors:
            tensors["w"][5, 7] += 1  # the engine wrote the weights it serves: no longer version 3
        step(src, 4, 0.02, seed=34)
        with pytest.raises(shardcast.ShardcastError, match=r"rank\(s\) 1 there do not hold version 3") as e:
            c0.sync("trainer", "vllm", 4, delta="auto")
        assert e.value.code == grpc.StatusCode.DATA_LOSS
        for reg in dst:  # still serving version 3 from the set in use: nothing of 4 was flipped to
            state = reg.state()
            assert (state.state, state.version, state.active_set) == (service_pb2.RANK_READY, 3, 1)
        assert c0.sync("trainer", "vllm", 4, delta="auto").delta_chunks == 0  # dense: no base after the failure
        check_all(src, in_use(dst), 2)
        step(src, 5, 0.02, seed=35)
        assert c0.sync("trainer", "vllm", 5, delta="auto").delta_chunks > 0
        check_all(src, in_use(dst), 2)
        for reg in dst:
            reg.close()
        src.close()


def test_delta_dense_every_refreshes_the_bases():
    shardcast.local.find_shardcastd()
    with LocalCluster(["n0", "n1"], extra=["--chunk-mib", "1", "--delta-dense-every", "3"]) as c:
        n0, n1 = c.daemons["n0"], c.daemons["n1"]
        with shardcast.Client(n0.target) as c0, shardcast.Client(n1.target) as c1:
            src = c0.register("trainer", 0, 1, source_tensors(4), src_layout("n0"), role="source", version=1)
            dst = [c1.register("vllm", 0, 1, destination_tensors(1), dst_layout(["n1"]))]
            modes = []
            for v in range(1, 7):
                if v > 1:
                    step(src, v, 0.02, seed=30 + v)
                # "always": deltas whatever the daemon measured (never a refresh either).
                r = c0.sync("trainer", "vllm", v, delta="always" if v == 6 else "auto")
                modes.append((r.delta, r.delta_chunks > 0))
                # Why an "auto" sync ran dense: the refresh (these syncs are too small to be measured).
                assert ("version 3 is a multiple of --delta-dense-every 3" in r.delta_choice) == (v == 3), r.delta_choice
                check_all(src, dst, 1)
            assert modes == [(service_pb2.DELTA_AUTO, False), (service_pb2.DELTA_AUTO, True),
                             (service_pb2.DELTA_DENSE, False), (service_pb2.DELTA_AUTO, True),
                             (service_pb2.DELTA_AUTO, True), (service_pb2.DELTA_ALWAYS, True)]
            for reg in dst:
                reg.close()
            src.close()


def replica_layout(k, node):
    """Replica k of set "vllm": dst_layout's two ranks, both on `node`."""
    layout = dst_layout([node, node])
    layout.update(group=f"vllm.r{k}", replica_set="vllm", replica=k)
    return layout


def test_deltas_into_a_replica_set_follow_each_replica_through_cuts_joins_and_outside_writes():
    """Delta syncs into a replica set (one call, every replica): each replica's node reports its own
    base, the trainer's bases are kept for the set whatever its membership, and a replica that
    missed a version, joined or was written outside a sync gets dense bytes, while every byte of
    every replica is checked after every sync."""
    shardcast.local.find_shardcastd()
    with LocalCluster(["n0", "n1", "n2", "n3"], extra=["--chunk-mib", "1"]) as c:
        clients = {n: shardcast.Client(c.target(n)) for n in c.nodes}
        c0 = clients["n0"]
        src = c0.register("trainer", 0, 1, source_tensors(5), src_layout("n0"), role="source", version=1)

        def join(k):
            node = f"n{k + 1}"
            return [clients[node].register(f"vllm.r{k}", r, 2, destination_tensors(2), replica_layout(k, node))
                    for r in range(2)]

        def synced(version, members, **kwargs):
            resp = c0.sync("trainer", "vllm", version, delta="auto", **kwargs)
            got = {o.group: (o.committed, o.cut) for o in resp.replicas}
            for k, reg in members.items():
                assert got[f"vllm.r{k}"] == (True, ""), got
                check_all(src, reg, 2)
            return resp, got

        replicas = {0: join(0), 1: join(1)}
        first, _ = synced(1, replicas)
        assert first.delta == service_pb2.DELTA_AUTO and first.delta_chunks == 0 and first.dense_chunks > 0

        step(src, 2, 0.02, seed=52)
        second, _ = synced(2, replicas, verify=True)
        # The trainer sends each chunk once as a delta; replica 0 relays it to replica 1 as it is.
        assert second.dense_chunks == 0 and second.delta_chunks > 0
        assert second.wire_bytes <= 0.10 * second.network_bytes, (second.wire_bytes, second.network_bytes)

        # Replica 1 misses version 3 (its engine holds a rank): cut, and replica 0 still gets a
        # delta, though the set synced without replica 1 (another membership, the same bases).
        step(src, 3, 0.02, seed=53)
        with replicas[1][1].reading():
            third = c0.sync("trainer", "vllm", 3, delta="auto")
        got = {o.group: (o.committed, o.cut) for o in third.replicas}
        assert got["vllm.r0"] == (True, "") and not got["vllm.r1"][0], got
        assert third.dense_chunks == 0 and third.delta_chunks > 0
        check_all(src, replicas[0], 2)
        assert all(reg.state().version == 2 for reg in replicas[1])

        # Version 4: replica 1 holds 2, not 3: what lands on it travels dense (a relay chain carries
        # one encoding); every byte right on both.
        step(src, 4, 0.02, seed=54)
        fourth, _ = synced(4, replicas)
        assert fourth.dense_chunks > 0
        step(src, 5, 0.02, seed=55)
        fifth, _ = synced(5, replicas)
        assert fifth.dense_chunks == 0 and fifth.delta_chunks > 0

        # A replica joins: it holds nothing, so its chunks are dense; the sync after, deltas again.
        replicas[2] = join(2)
        step(src, 6, 0.02, seed=56)
        sixth, _ = synced(6, replicas)
        assert sixth.dense_chunks > 0
        step(src, 7, 0.02, seed=57)
        seventh, _ = synced(7, replicas)
        assert seventh.dense_chunks == 0 and seventh.delta_chunks > 0

        # Replica 2's engine writes its weights: its rebuilt chunks fail their hash, so it is cut,
        # named, and left DIRTY; the others commit the delta, and the next sync repairs it.
        replicas[2][0].tensors["w"][3, 5] += 1
        step(src, 8, 0.02, seed=58)
        eighth = c0.sync("trainer", "vllm", 8, delta="auto")
        got = {o.group: (o.committed, o.cut) for o in eighth.replicas}
        assert got["vllm.r0"] == (True, "") and got["vllm.r1"] == (True, ""), got
        assert not got["vllm.r2"][0] and "do not hold version 7" in got["vllm.r2"][1], got
        check_all(src, replicas[0], 2)
        check_all(src, replicas[1], 2)
        step(src, 9, 0.02, seed=59)
        synced(9, replicas)
        for reg in [src] + [reg for regs in replicas.values() for reg in regs]:
            reg.close()
        for client in clients.values():
            client.close()


def test_a_replica_set_of_single_and_double_buffered_replicas_takes_deltas_and_cuts_one_whose_engine_wrote():
    """Replica 0 (single-buffered) and replica 1 (double-buffered) share node n1, replica 2
    (double-buffered) is alone on n2: delta syncs reach all three, every byte each engine reads is
    the trainer's. An engine that writes the set it serves gets its node's replicas cut, named
    with the reason, while the others commit; the next sync is dense where it was cut, the one
    after a delta for every replica again."""
    shardcast.local.find_shardcastd()
    with LocalCluster(["n0", "n1", "n2"], extra=["--chunk-mib", "1"]) as c:
        clients = {n: shardcast.Client(c.target(n)) for n in c.nodes}
        c0 = clients["n0"]
        src = c0.register("trainer", 0, 1, source_tensors(5), src_layout("n0"), role="source", version=1)

        def join(k, node, doubled):
            return [clients[node].register(f"vllm.r{k}", r, 2, destination_tensors(2), replica_layout(k, node),
                                           **({"shadow": destination_tensors(2)} if doubled else {}))
                    for r in range(2)]

        replicas = {0: join(0, "n1", False), 1: join(1, "n1", True), 2: join(2, "n2", True)}

        def synced(version, committing=(0, 1, 2)):
            resp = c0.sync("trainer", "vllm", version, delta="auto")
            got = {o.group: (o.committed, o.cut) for o in resp.replicas}
            for k in committing:
                assert got[f"vllm.r{k}"] == (True, ""), (version, got)
                check_all(src, in_use(replicas[k]), 2)
            return resp, got

        synced(1)
        for version in (2, 3):
            step(src, version, 0.02, seed=50 + version)
            resp, _ = synced(version)
            assert resp.dense_chunks == 0 and resp.delta_chunks > 0, resp
        with replicas[2][0].reading() as tensors:
            tensors["w"][3, 5] += 1  # replica 2's engine writes the weights it serves
        step(src, 4, 0.02, seed=54)
        _, got = synced(4, committing=(0, 1))
        assert not got["vllm.r2"][0] and "do not hold version 3" in got["vllm.r2"][1], got
        assert [reg.state().version for reg in replicas[2]] == [3, 3]  # still serving version 3
        for version in (5, 6):  # dense for replica 2 (and its chain), then deltas for all again
            step(src, version, 0.02, seed=50 + version)
            resp, _ = synced(version)
        assert resp.dense_chunks == 0 and resp.delta_chunks > 0, resp
        with replicas[1][1].reading() as tensors:
            tensors["w"][3, 5] += 1  # replica 1's, on the node it shares with replica 0
        step(src, 7, 0.02, seed=57)
        _, got = synced(7, committing=(2,))
        assert "do not hold version 6" in got["vllm.r1"][1], got
        for version in (8, 9):
            step(src, version, 0.02, seed=50 + version)
            resp, _ = synced(version)
        assert resp.dense_chunks == 0 and resp.delta_chunks > 0, resp
        for reg in [r for k in replicas for r in replicas[k]] + [src]:
            reg.close()
        for client in clients.values():
            client.close()
