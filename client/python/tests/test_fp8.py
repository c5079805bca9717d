"""Block-scaled fp8 through real daemons: bfloat16 and float32 trainer weights synced into
float8_e4m3fn inference weights with one float32 scale per block (v1::BlockScale), quantised at
the source, matching torch's reference recipe (shardcast.fp8) bit for bit: scale = amax / 448 of
the whole block, optionally a power of two; q = (x / scale).clamp(+-448).to(float8_e4m3fn). This
includes a block split between two destination ranks (quantised once, both hold its scale) and
edge blocks, with half the bytes of bfloat16 on the wire and deltas on top, and source shards that
cut blocks (each block's amax combined across the ranks and nodes holding its pieces)."""

from __future__ import annotations

import pytest

import shardcast
from shardcast.fp8 import block_dequantize, block_quantize
from shardcast.local import LocalCluster

torch = pytest.importorskip("torch", reason="the test venv (scripts/deps.sh) has torch")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)

R, C = 512, 320  # w: 4 x 3 blocks of 128 x 128, the last column of blocks 64 wide
M_R, M_C = 256, 200  # m: 4 x 4 blocks of 64 x 64, the last 8 wide


def src_layout(rows_per_rank_ranks=2, shape=(R, C)):
    return {"group": "trainer", "mesh": {"shape": [rows_per_rank_ranks]}, "nodes": ["n0"] * rows_per_rank_ranks,
            "tensors": [
                {"name": "w", "shape": list(shape), "dtype": "bfloat16", "placements": [{"shard": {"dim": 0}}]},
                {"name": "m", "shape": [M_R, M_C], "dtype": "float32", "placements": [{"replicate": {}}]}]}


def dst_layout(shape=(R, C)):
    return {"group": "vllm-fp8", "mesh": {"shape": [2]}, "nodes": ["n1", "n1"], "tensors": [
        {"name": "w", "shape": list(shape), "dtype": "float8_e4m3fn", "placements": [{"shard": {"dim": 1}}],
         "block_scale": {"scale": "w_scale_inv"}},
        {"name": "m", "shape": [M_R, M_C], "dtype": "float8_e4m3fn", "placements": [{"shard": {"dim": 0}}],
         "block_scale": {"block": [64, 64], "scale": "m_scale", "pow2": True}}]}


def destination(rank):
    cols = C // 2
    w_blocks = (-(-(cols * (rank + 1)) // 128)) - (cols * rank) // 128
    return {"w": torch.zeros(R, cols, dtype=torch.float8_e4m3fn),
            "w_scale_inv": torch.zeros(4, w_blocks),
            "m": torch.zeros(M_R // 2, M_C, dtype=torch.float8_e4m3fn),
            "m_scale": torch.zeros(2, 4)}


def check(w, m, dst):
    qw, sw = block_quantize(w, (128, 128))
    qm, sm = block_quantize(m, (64, 64), pow2=True)
    cols = C // 2
    for r, reg in enumerate(dst):
        got = reg.tensors
        assert torch.equal(got["w"].view(torch.uint8), qw[:, r * cols:(r + 1) * cols].view(torch.uint8)), \
            f"rank {r}: w's fp8 bits differ"
        first, last = (r * cols) // 128, -(-((r + 1) * cols) // 128)
        assert torch.equal(got["w_scale_inv"].view(torch.int32), sw[:, first:last].contiguous().view(torch.int32)), \
            f"rank {r}: w's scales differ"
        assert torch.equal(got["m"].view(torch.uint8), qm[r * 128:(r + 1) * 128].view(torch.uint8)), f"rank {r}: m"
        assert torch.equal(got["m_scale"].view(torch.int32), sm[2 * r:2 * r + 2].contiguous().view(torch.int32))
    return qw, sw


def test_block_scaled_fp8_matches_torch_bit_for_bit_with_split_and_edge_blocks(cluster):
    n0, n1 = cluster
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(R, C, generator=g) * 0.02).to(torch.bfloat16)
    w[0:128, 0:128] = 0  # an all-zero block: scale 1
    w[200, 300] = 7.5    # an edge block with one large weight
    m = torch.randn(M_R, M_C, generator=g) * 3
    with shardcast.Client(n0.target) as c0, shardcast.Client(n1.target) as c1:
        src = [c0.register("trainer", r, 2, {"w": w[r * 256:(r + 1) * 256].clone(), "m": m.clone()}, src_layout(),
                           role="source", version=1) for r in range(2)]
        dst = [c1.register("vllm-fp8", r, 2, destination(r), dst_layout()) for r in range(2)]
        result = c0.sync("trainer", "vllm-fp8", 1, verify=True)
        qw, sw = check(w, m, dst)
        assert float(sw[0, 0]) == 1.0
        # One byte per weight on the wire (bfloat16 would be two), and each node's scales once.
        assert result.network_bytes == R * C + M_R * M_C + 4 * 3 * 4 + 4 * 4 * 4
        # Dequantised, every weight is within e4m3's half ulp (2^-4 relative) of the source.
        deq = block_dequantize(qw, sw, (128, 128))
        err = ((deq - w.float()).abs() / w.float().abs().clamp_min(1e-30))[w.float().abs() > 1e-3]
        assert float(err.max()) <= 2.0 ** -4

        # A trainer step that moves 1% of the weights: deltas of fp8 bytes and of scales.
        for s in src:
            with s.writing(2):
                flat = s.tensors["w"].view(-1)
                idx = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 100]
                flat[idx] = flat[idx] * 1.5
        w = torch.cat([s.tensors["w"] for s in src])
        first = c0.sync("trainer", "vllm-fp8", 2, delta="auto")  # no base yet: dense
        assert first.delta_chunks == 0
        check(w, m, dst)
        for s in src:
            with s.writing(3):
                s.tensors["w"][3, :5] = 0.01
        w = torch.cat([s.tensors["w"] for s in src])
        delta = c0.sync("trainer", "vllm-fp8", 3, delta="auto")
        check(w, m, dst)
        assert delta.delta_chunks > 0 and delta.wire_bytes < delta.network_bytes // 10
        for reg in dst + src:
            reg.close()


def test_fp8_with_deltas_into_a_replica_set_matches_torch_on_every_replica():
    """The combination an RL fleet runs: a bf16 trainer into a replica set of fp8 engines, with
    delta syncs. Every replica's fp8 bits and scales equal torch's quantisation after each sync;
    the trainer sends each byte once (replica 0 relays to replica 1), and the second step's
    deltas carry its fp8 bytes and scales that changed; a replica cut from one sync (its engine
    holds a rank) is repaired by the next, dense, with the other still getting deltas after."""
    shardcast.local.find_shardcastd()
    with LocalCluster(["n0", "n1", "n2"]) as c:
        c0, c1, c2 = (shardcast.Client(c.target(n)) for n in ("n0", "n1", "n2"))
        g = torch.Generator().manual_seed(7)
        w = (torch.randn(R, C, generator=g) * 0.02).to(torch.bfloat16)
        m = torch.randn(M_R, M_C, generator=g) * 3
        src = [c0.register("trainer", r, 2, {"w": w[r * 256:(r + 1) * 256].clone(), "m": m.clone()}, src_layout(),
                           role="source", version=1) for r in range(2)]
        replicas = []
        for k, (client, node) in enumerate(((c1, "n1"), (c2, "n2"))):
            layout = {**dst_layout(), "group": f"vllm.r{k}", "replica_set": "vllm", "replica": k,
                      "nodes": [node, node]}
            replicas.append([client.register(f"vllm.r{k}", r, 2, destination(r), layout) for r in range(2)])

        def trainer_step(version, row):
            """A few weights of one row change, no block's amax: few fp8 bytes change."""
            for s in src:
                with s.writing(version):
                    s.tensors["w"][row, :5] = 0.001 * version
            return torch.cat([s.tensors["w"] for s in src])

        first = c0.sync("trainer", "vllm", 1, delta="auto", verify=True)
        assert [(o.group, o.committed) for o in first.replicas] == [("vllm.r0", True), ("vllm.r1", True)]
        assert first.network_bytes == 2 * (R * C + M_R * M_C + 4 * 3 * 4 + 4 * 4 * 4)
        for dst in replicas:
            check(w, m, dst)
        w = trainer_step(2, 3)
        second = c0.sync("trainer", "vllm", 2, delta="auto")
        assert second.delta_chunks > 0 and second.dense_chunks == 0
        assert second.wire_bytes < second.network_bytes // 10, (second.wire_bytes, second.network_bytes)
        for dst in replicas:
            check(w, m, dst)

        w = trainer_step(3, 40)
        with replicas[1][0].reading():
            third = c0.sync("trainer", "vllm", 3, delta="auto")
        assert [(o.group, o.committed) for o in third.replicas] == [("vllm.r0", True), ("vllm.r1", False)]
        assert third.delta_chunks > 0
        check(w, m, replicas[0])
        w = trainer_step(4, 90)
        fourth = c0.sync("trainer", "vllm", 4, delta="auto")  # replica 1 holds 2: dense
        assert fourth.dense_chunks > 0 and all(o.committed for o in fourth.replicas)
        for dst in replicas:
            check(w, m, dst)
        w = trainer_step(5, 200)
        fifth = c0.sync("trainer", "vllm", 5, delta="auto")
        assert fifth.delta_chunks > 0 and fifth.dense_chunks == 0
        for dst in replicas:
            check(w, m, dst)
        for reg in src + replicas[0] + replicas[1]:
            reg.close()
        for client in (c0, c1, c2):
            client.close()


def test_source_shards_that_cut_blocks_combine_each_blocks_amax_across_nodes(cluster):
    """384 rows over two source ranks, one per node: block row 1 (rows 128-255) lies on both, its
    large weights on rank 0 (node n0) only. Rank 1 shares node n1 with the destination ranks (a
    local copy) and quantises its part with the amax of the whole block all the same."""
    n0, n1 = cluster
    rows = 384
    shape = (rows, C)
    g = torch.Generator().manual_seed(17)
    w = (torch.randn(rows, C, generator=g) * 0.02).to(torch.bfloat16)
    w[150:160, :128] *= 500  # block (1, 0)'s amax: on rank 0 only
    w[250, 300] = 9.0  # edge block (1, 2)'s amax: on rank 1 only
    m = torch.randn(M_R, M_C, generator=g)
    layout = {**src_layout(shape=shape), "nodes": ["n0", "n1"]}
    with shardcast.Client(n0.target) as c0, shardcast.Client(n1.target) as c1:
        src = [c.register("trainer", r, 2, {"w": w[r * 192:(r + 1) * 192].clone(), "m": m.clone()}, layout,
                          role="source", version=1) for r, c in ((0, c0), (1, c1))]
        dst = [c1.register("vllm-fp8", r, 2, {**destination(r), "w": torch.zeros(rows, C // 2, dtype=torch.float8_e4m3fn),
                                              "w_scale_inv": torch.zeros(3, 2)}, dst_layout(shape=shape))
               for r in range(2)]
        c0.sync("trainer", "vllm-fp8", 1, verify=True)
        qw, sw = block_quantize(w, (128, 128))
        assert float(sw[1, 0]) > 0.01 and abs(float(sw[1, 2]) - 9.0 / 448) < 1e-7
        cols = C // 2
        for r, reg in enumerate(dst):
            assert torch.equal(reg.tensors["w"].view(torch.uint8), qw[:, r * cols:(r + 1) * cols].view(torch.uint8)), \
                f"rank {r}: w's fp8 bits differ"
            first, last = (r * cols) // 128, -(-((r + 1) * cols) // 128)
            assert torch.equal(reg.tensors["w_scale_inv"].view(torch.int32),
                               sw[:, first:last].contiguous().view(torch.int32)), f"rank {r}: w's scales differ"
        for reg in dst + src:
            reg.close()


def test_a_destination_layout_with_a_bad_block_scale_is_refused(cluster):
    _, n1 = cluster
    bad = dst_layout()
    bad["tensors"][0]["dtype"] = "bfloat16"
    with shardcast.Client(n1.target) as c1:
        with pytest.raises(shardcast.ShardcastError, match="block_scale needs dtype float8_e4m3fn"):
            c1.register("vllm-fp8", 0, 2, destination(0), bad)
        bad = dst_layout()
        bad["tensors"][1]["block_scale"]["scale"] = "w"
        with pytest.raises(shardcast.ShardcastError, match='block_scale.scale "w" is already the name'):
            c1.register("vllm-fp8", 0, 2, destination(0), bad)


def test_fused_fp8_destination_members_keep_their_own_blocks_and_scales(cluster):
    """vLLM's qkv_proj in fp8: q and k fused along dim 0 into one buffer per rank, TP=2 over
    rows; k's 128-row block is split between the two ranks (64 rows each)."""
    n0, n1 = cluster
    g = torch.Generator().manual_seed(9)
    q = torch.randn(256, 256, generator=g).to(torch.bfloat16)
    k = (torch.randn(128, 256, generator=g) * 4).to(torch.bfloat16)
    src_l = {"group": "trainer", "mesh": {"shape": [1]}, "nodes": ["n0"], "tensors": [
        {"name": n, "shape": list(t.shape), "dtype": "bfloat16"} for n, t in (("q", q), ("k", k))]}
    dst_l = {"group": "vllm-qkv", "mesh": {"shape": [2]}, "nodes": ["n1", "n1"], "tensors": [
        {"name": n, "shape": list(t.shape), "dtype": "float8_e4m3fn", "placements": [{"shard": {"dim": 0}}],
         "block_scale": {"scale": f"{n}_scale"}} for n, t in (("q", q), ("k", k))],
        "fused": [{"name": "qk_proj", "dim": 0, "tensors": ["q", "k"]}]}
    with shardcast.Client(n0.target) as c0, shardcast.Client(n1.target) as c1:
        src = c0.register("trainer", 0, 1, {"q": q.clone(), "k": k.clone()}, src_l, role="source", version=1)
        dst = [c1.register("vllm-qkv", r, 2, {"qk_proj": torch.zeros(128 + 64, 256, dtype=torch.float8_e4m3fn),
                                              "q_scale": torch.zeros(1, 2), "k_scale": torch.zeros(1, 2)}, dst_l)
               for r in range(2)]
        c0.sync("trainer", "vllm-qkv", 1, verify=True)
        qq, qs = block_quantize(q)
        qk, ks = block_quantize(k)
        for r, reg in enumerate(dst):
            fused = reg.tensors["qk_proj"].view(torch.uint8)
            assert torch.equal(fused[:128], qq[128 * r:128 * (r + 1)].view(torch.uint8)), f"rank {r}: q"
            assert torch.equal(fused[128:], qk[64 * r:64 * (r + 1)].view(torch.uint8)), f"rank {r}: k"
            assert torch.equal(reg.tensors["q_scale"], qs[r:r + 1])
            assert torch.equal(reg.tensors["k_scale"], ks)  # both ranks hold k's one row of blocks
        for reg in dst + [src]:
            reg.close()
