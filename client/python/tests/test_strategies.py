"""The baselines Shardcast is measured against, executed by the same daemons (sync(strategy=...)):
every destination rank pulling its own slices, and everything through one root node. Each routing
delivers every byte, and the bytes the daemons actually sent are the ones its shape implies."""

from __future__ import annotations

import pytest

import shardcast
from shardcast.local import LocalCluster
from shardcast.v1 import service_pb2

torch = pytest.importorskip("torch", reason="the test venv (scripts/deps.sh) has torch")

ROWS, COLS, B = 1024, 512, 4096
W_BYTES, B_BYTES = ROWS * COLS * 2, B * 4


def src_layout():
    """FSDP over two trainer nodes, one rank each."""
    return {"group": "trainer", "mesh": {"shape": [2]}, "nodes": ["t0", "t1"], "tensors": [
        {"name": "w", "shape": [ROWS, COLS], "dtype": "bfloat16", "placements": [{"shard": {"dim": 0}}]},
        {"name": "b", "shape": [B], "dtype": "float32", "placements": [{"shard": {"dim": 0}}]}]}


def dst_layout():
    """Two inference nodes, TP=2 each: w split by rows within the node, b whole on every rank."""
    return {"group": "vllm", "mesh": {"shape": [2, 2], "dim_names": ["dp", "tp"]}, "nodes": ["i0", "i0", "i1", "i1"],
            "tensors": [
                {"name": "w", "shape": [ROWS, COLS], "dtype": "bfloat16",
                 "placements": [{"replicate": {}}, {"shard": {"dim": 0}}]},
                {"name": "b", "shape": [B], "dtype": "float32", "placements": [{"replicate": {}}, {"replicate": {}}]}]}


def model(version):
    g = torch.Generator().manual_seed(version)
    return torch.randn(ROWS, COLS, generator=g).to(torch.bfloat16), torch.randn(B, generator=g)


def test_every_routing_delivers_every_byte_with_the_traffic_of_its_shape():
    shardcast.local.find_shardcastd()
    with LocalCluster(["t0", "t1", "i0", "i1"], extra=["--chunk-mib", "1"]) as c:
        d = c.daemons
        with shardcast.Client(d["t0"].target) as c0, shardcast.Client(d["t1"].target) as c1, \
                shardcast.Client(d["i0"].target) as ci0, shardcast.Client(d["i1"].target) as ci1:
            w, b = model(1)
            srcs = [cl.register("trainer", r, 2, {"w": w[r * ROWS // 2:(r + 1) * ROWS // 2].clone(),
                                                  "b": b[r * B // 2:(r + 1) * B // 2].clone()},
                                src_layout(), role="source", version=1)
                    for r, cl in enumerate((c0, c1))]
            dsts = [cl.register("vllm", r, 4, {"w": torch.zeros(ROWS // 2, COLS, dtype=torch.bfloat16),
                                               "b": torch.zeros(B)}, dst_layout())
                    for r, cl in ((0, ci0), (1, ci0), (2, ci1), (3, ci1))]

            def publish(version):
                w, b = model(version)
                for r, s in enumerate(srcs):
                    with s.writing(version):
                        s.tensors["w"].copy_(w[r * ROWS // 2:(r + 1) * ROWS // 2])
                        s.tensors["b"].copy_(b[r * B // 2:(r + 1) * B // 2])
                return w, b

            def check(w, b):
                for r, reg in enumerate(dsts):
                    half = r % 2
                    assert torch.equal(reg.tensors["w"].view(torch.int16),
                                       w[half * ROWS // 2:(half + 1) * ROWS // 2].view(torch.int16)), f"rank {r}: w"
                    assert torch.equal(reg.tensors["b"], b), f"rank {r}: b"

            # Planned: each inference node gets w and b once (a relay may forward them).
            # Rank pull: each rank its own half of w and all of b: b crosses twice per node.
            # Gather-broadcast: t1's halves to t0 first, then t0 sends each node all of w and b.
            expected = {"planned": 2 * (W_BYTES + B_BYTES),
                        "rank-pull": 2 * (W_BYTES + 2 * B_BYTES),
                        "gather-broadcast": (W_BYTES + B_BYTES) // 2 + 2 * (W_BYTES + B_BYTES)}
            names = {"planned": service_pb2.STRATEGY_PLANNED, "rank-pull": service_pb2.STRATEGY_RANK_PULL,
                     "gather-broadcast": service_pb2.STRATEGY_GATHER_BROADCAST}
            version = 1
            for strategy in ("planned", "rank-pull", "gather-broadcast", "rank-pull", "planned"):
                if version > 1:
                    w, b = publish(version)
                out = c0.sync("trainer", "vllm", version, strategy=strategy, verify=True)
                check(w, b)
                assert out.strategy == names[strategy]
                assert out.network_bytes == expected[strategy], strategy
                # What the daemons sent, counted as they sent it: the plan's shape, executed.
                assert out.wire_bytes == expected[strategy], strategy
                version += 1

            plan = c0.plan("trainer", "vllm", strategy="gather-broadcast")
            assert plan["network_bytes"] == expected["gather-broadcast"]
            assert c0.plan("trainer", "vllm")["network_bytes"] == expected["planned"]

            with pytest.raises(ValueError, match="strategy must be one of"):
                c0.sync("trainer", "vllm", version, strategy="scatter")
            publish(version)
            with pytest.raises(shardcast.ShardcastError, match="baseline") as err:
                c0.sync("trainer", "vllm", version, strategy="rank-pull", delta="auto")
            assert err.value.code.name == "INVALID_ARGUMENT"
            # Nothing was written: the same version syncs next.
            out = c0.sync("trainer", "vllm", version, strategy="gather-broadcast")
            check(*model(version))
            for reg in dsts + srcs:
                reg.close()
