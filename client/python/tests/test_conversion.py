"""Declared conversions through real daemons: a float32 trainer layout synced into a bfloat16
inference layout (the destination declares the dtype it serves) arrives bit for bit as torch's own
`.to(torch.bfloat16)` of the source (round to nearest even; a NaN as the quiet NaN 0x7fc0),
with half the bytes on the wire;
a pair the daemons do not convert is refused before anything moves, naming the tensor."""

from __future__ import annotations

import grpc
import pytest

import shardcast

torch = pytest.importorskip("torch", reason="the test venv (scripts/deps.sh) has torch")


def layout(group, nodes, dtype, placements):
    return {"group": group, "mesh": {"shape": [len(nodes)]}, "nodes": nodes,
            "tensors": [{"name": "w", "shape": [96, 80], "dtype": dtype, "placements": placements},
                        {"name": "b", "shape": [80], "dtype": dtype}]}


def test_float32_source_into_bfloat16_destination_matches_torch_bit_for_bit(cluster):
    n0, n1 = cluster
    g = torch.Generator().manual_seed(1)
    # Values that exercise rounding: normal weights, ties, tiny, huge, signed zeros.
    w = torch.randn(96, 80, generator=g) * 0.02
    w[0, :6] = torch.tensor([1.00390625, 1.01171875, -0.0, 3.0e38, 1e-40, float("inf")])
    # NaNs: quiet, signalling, negative (their bits: torch's float32 view of the ints).
    w[1, :3] = torch.tensor([0x7fc00000, 0x7f800001, -0x00400000], dtype=torch.int32).view(torch.float32)
    b = torch.randn(80, generator=g)
    src_layout = layout("fp32-trainer", ["n0"], "float32", [{"replicate": {}}])
    dst_layout = layout("bf16-vllm", ["n1", "n1"], "bfloat16", [{"shard": {"dim": 1}}])
    with shardcast.Client(n0.target) as c0, shardcast.Client(n1.target) as c1:
        src = c0.register("fp32-trainer", 0, 1, {"w": w.clone(), "b": b.clone()}, src_layout, role="source",
                          version=1)
        dst = [c1.register("bf16-vllm", r, 2, {"w": torch.zeros(96, 40, dtype=torch.bfloat16),
                                              "b": torch.zeros(80, dtype=torch.bfloat16)}, dst_layout)
               for r in range(2)]
        result = c0.sync("fp32-trainer", "bf16-vllm", 1, verify=True)
        assert result.version == 1
        # The wire carries bfloat16: half the float32 bytes of what each inference node needs.
        assert result.bytes_needed == (96 * 80 + 2 * 80) * 2
        assert result.network_bytes == (96 * 80 + 80) * 2  # once to node n1, in bfloat16
        for r, reg in enumerate(dst):
            got_w, got_b = reg.tensors["w"], reg.tensors["b"]
            want_w = w[:, r * 40:(r + 1) * 40].to(torch.bfloat16)
            nan = want_w.isnan()
            assert torch.equal(got_w.view(torch.int16)[~nan], want_w.view(torch.int16)[~nan]), f"rank {r}: w bits"
            # Every NaN arrives as the quiet NaN 0x7fc0 (torch's own CPU kernel writes 0xffff, also a NaN).
            assert int(nan.sum()) == (3 if r == 0 else 0)
            assert (got_w.view(torch.int16)[nan] == 0x7fc0).all(), f"rank {r}: a NaN is not 0x7fc0"
            assert torch.equal(got_b.view(torch.int16), b.to(torch.bfloat16).view(torch.int16)), f"rank {r}: b"
        for reg in dst:
            reg.close()
        src.close()


def test_a_conversion_the_daemons_do_not_make_is_refused_naming_the_tensor(cluster):
    n0, n1 = cluster
    with shardcast.Client(n0.target) as c0, shardcast.Client(n1.target) as c1:
        src = c0.register("bf16-trainer", 0, 1,
                          {"w": torch.zeros(96, 80, dtype=torch.bfloat16), "b": torch.zeros(80, dtype=torch.bfloat16)},
                          layout("bf16-trainer", ["n0"], "bfloat16", [{"replicate": {}}]), role="source", version=1)
        dst = c1.register("fp32-vllm", 0, 1, {"w": torch.ones(96, 80), "b": torch.ones(80)},
                          layout("fp32-vllm", ["n1"], "float32", [{"replicate": {}}]))
        with pytest.raises(shardcast.ShardcastError, match=r'tensor "w".*no conversion between these dtypes') as e:
            c0.sync("bf16-trainer", "fp32-vllm", 1)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert torch.equal(dst.tensors["w"], torch.ones(96, 80))  # nothing moved
        dst.close()
        src.close()
