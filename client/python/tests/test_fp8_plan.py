"""Block-scaled fp8 destinations declared through the named API (ParallelPlan.fp8,
Client.register_inference, shardcast.local_tensors): the layout entries with their block_scale,
each rank's fp8 part and scale buffer shapes (TP 1, 2 and 3, uneven splits, blocks straddling
ranks, fused members, experts), the inputs refused, and a float32 trainer synced through real
daemons into such ranks, every fp8 byte and scale equal to shardcast.fp8.block_quantize."""

from __future__ import annotations

import itertools

import pytest

import shardcast
from shardcast.fp8 import block_quantize, scale_shape
from shardcast.parallel import ParallelPlan, check_local_tensors, inference_layout, local_shapes, local_tensors

torch = pytest.importorskip("torch", reason="the test venv (scripts/deps.sh) has torch")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)


def plan(tp_size=1, tp_rank=0, **kw):
    return ParallelPlan(tp_size=tp_size, tp_rank=tp_rank, **kw)


# ---- shapes and layout entries ----


@pytest.mark.parametrize("tp, expected", [
    (1, [(4096, 4096, 32, 32)]),
    (2, [(4096, 2048, 32, 16)] * 2),
    # torch.chunk: 1366, 1366, 1364 columns; block columns 10 and 21 straddle two ranks each.
    (3, [(4096, 1366, 32, 11), (4096, 1366, 32, 12), (4096, 1364, 32, 11)]),
])
def test_each_ranks_fp8_part_and_scale_buffer_shape_row_parallel(tp, expected):
    model = {"w": ((4096, 4096), "bfloat16"), "norm": ((4096,), "float32")}
    for r in range(tp):
        shapes = local_shapes(plan(tp, r, row=["w"], fp8=["w"]), model)
        rows, cols, srows, scols = expected[r]
        assert shapes == {"w": ((rows, cols), "float8_e4m3fn"), "w_scale_inv": ((srows, scols), "float32"),
                          "norm": ((4096,), "float32")}


def test_blocks_straddling_ranks_column_parallel_uneven_split():
    # 200 rows over 3 ranks: 67, 67, 66; block row 0 is on ranks 0 and 1, block row 1 on 1 and 2.
    model = {"k": ((200, 200), "float32")}
    got = [local_shapes(plan(3, r, column=["k"], fp8=["k"]), model)["k_scale_inv"] for r in range(3)]
    assert got == [((1, 2), "float32"), ((2, 2), "float32"), ((1, 2), "float32")]


def test_scale_shape_is_the_blocks_a_part_touches_brute_force():
    # Every element's block, collected: the part's scale buffer spans exactly those blocks.
    for n, block in itertools.product((1, 5, 8, 13, 17), (1, 3, 4, 8)):
        for start in range(n + 1):
            for end in range(start + 1, n + 1):
                touched = {i // block for i in range(start, end)}
                assert scale_shape([start], [end - start], [block]) == (max(touched) - min(touched) + 1,)
                assert min(touched) == start // block
    assert scale_shape([0, 67, 0], [4, 67, 256], (128, 128)) == (4, 2, 2)  # 1 before the last two dims


def test_layout_entries_carry_block_scale_only_for_fp8_tensors():
    model = {"a.weight": ((256, 300), "bfloat16"), "b.weight": ((3, 130, 260), "float32"),
             "a.bias": ((256,), "float32")}
    p = plan(2, 0, column=["a.*"], row=["b.weight"], fp8=["*.weight"], fp8_block=(64, 128), fp8_pow2=True)
    entries = {t["name"]: t for t in inference_layout("g", p, model, ranks_per_node=2)["tensors"]}
    assert entries["a.weight"]["dtype"] == "float8_e4m3fn"
    assert entries["a.weight"]["block_scale"] == {"block": [64, 128], "scale": "a.weight_scale_inv", "pow2": True}
    assert entries["b.weight"]["block_scale"] == {"block": [1, 64, 128], "scale": "b.weight_scale_inv", "pow2": True}
    assert entries["a.bias"]["dtype"] == "float32" and "block_scale" not in entries["a.bias"]
    assert shardcast.load_layout(inference_layout("g", p, model, ranks_per_node=2))  # valid JSON form
    shapes = local_shapes(p, model)
    assert shapes["b.weight"] == ((3, 130, 130), "float8_e4m3fn")
    assert shapes["b.weight_scale_inv"] == ((3, 3, 2), "float32")  # 130 rows: 3 blocks of 64; cols 0-129: 2


def test_fused_members_each_have_a_scale_buffer_and_experts_hold_their_blocks():
    model = {"q": ((384, 200), "bfloat16"), "k": ((200, 200), "bfloat16"), "w1": ((5, 96, 64), "float32")}
    p = plan(3, 1, column=["q", "k"], fused={"qkv": ["q", "k"]}, experts=["w1"],
             expert_ranges=[(0, 2), (2, 4), (4, 5)], fp8=["q", "k", "w1"])
    assert local_shapes(p, model) == {
        "qkv": ((128 + 67, 200), "float8_e4m3fn"),
        "q_scale_inv": ((1, 2), "float32"), "k_scale_inv": ((2, 2), "float32"),
        "w1": ((2, 96, 64), "float8_e4m3fn"), "w1_scale_inv": ((2, 1, 1), "float32")}
    tensors = local_tensors(p, model)
    check_local_tensors(p, model, tensors)
    assert tensors["qkv"].dtype == torch.float8_e4m3fn and tensors["k_scale_inv"].dtype == torch.float32
    tensors["k_scale_inv"] = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r'"k_scale_inv" is \[1, 2\] float32, the plan gives tp_rank 1 \[2, 2\]'):
        check_local_tensors(p, model, tensors)


@pytest.mark.parametrize("kw, model, message", [
    ({"fp8": ["bias"]}, {"bias": ((64,), "float32")}, r'"bias" \[64\]: .* needs 2 dims or more'),
    ({"fp8": ["nope*"]}, {"w": ((8, 8), "float32")}, 'fp8 pattern "nope\\*" matches no tensor of the model'),
    ({"fp8": ["ids"]}, {"ids": ((8, 8), "int64")}, '"ids" is int64: a source quantises float32 or bfloat16'),
    ({"fp8": ["w"], "tp_size": 3, "column": ["w"]}, {"w": ((2, 256), "float32")},
     r'"w" \[2, 256\]: tp_rank 2 holds none of it'),
    ({"fp8": ["w"]}, {"w": ((8, 8), "float32"), "w_scale_inv": ((1, 1), "float32")},
     'scale buffer name "w_scale_inv" is already a tensor'),
    ({"fp8": ["q"], "column": ["q", "k"], "fused": {"qk": ["q", "k"]}},
     {"q": ((8, 8), "float32"), "k": ((8, 8), "float32")}, 'fused buffer "qk": some members are fp8'),
])
def test_bad_fp8_declarations_are_refused_naming_the_tensor(kw, model, message):
    p = ParallelPlan(**kw)
    with pytest.raises(ValueError, match=message):
        inference_layout("g", p, model, ranks_per_node=1)
    with pytest.raises(ValueError, match=message):
        local_shapes(p, model)


def test_bad_fp8_plan_arguments_are_refused():
    with pytest.raises(ValueError, match="fp8_block"):
        ParallelPlan(fp8=["w"], fp8_block=(128,))
    with pytest.raises(ValueError, match="fp8_block"):
        ParallelPlan(fp8=["w"], fp8_block=(0, 128))
    with pytest.raises(TypeError, match="sequence of strings"):
        ParallelPlan(fp8="w")


# ---- through real daemons ----

MODEL = {
    "q": ((384, 200), "float32"),   # column, 128 rows per rank: aligned
    "k": ((200, 200), "float32"),   # column, 67/67/66 rows: blocks straddle ranks
    "o": ((200, 300), "float32"),   # row, 100 columns per rank: blocks straddle ranks
    "norm": ((200,), "float32"),    # replicated, stays float32
}
TP = 3


def dst_plan(t, pow2=False):
    return ParallelPlan(tp_size=TP, tp_rank=t, column=["q", "k"], row=["o"], fused={"qk": ["q", "k"]},
                        fp8=["q", "k", "o"], fp8_pow2=pow2)


def src_layout():
    # Two float32 trainer ranks, each tensor split along dim 0 (192 / 100 rows: both cut a block).
    return {"group": "trainer", "mesh": {"shape": [2]}, "nodes": ["n0", "n0"],
            "tensors": [{"name": n, "shape": list(s), "dtype": "float32", "placements": [{"shard": {"dim": 0}}]}
                        for n, (s, _) in MODEL.items()]}


def expected_rank(p, weights):
    """What rank p holds, from the whole-tensor reference: {buffer: tensor}."""
    out = {}
    for name, w in weights.items():
        offsets, sizes = p.part(name, w.shape)
        part = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        if p.is_fp8(name):
            q, scale = block_quantize(w, p.fp8_block, pow2=p.fp8_pow2)
            out[name] = q[part]
            out[shardcast.fp8_scale_name(name)] = scale[tuple(slice(o // b, -(-(o + s) // b))
                                                               for o, s, b in zip(offsets, sizes, p.fp8_block))]
        else:
            out[name] = w[part]
    for buffer, members in p.fused.items():
        out[buffer] = torch.cat([out.pop(m) for m in members], dim=0)
    return out


def bits(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("pow2", [False, True])
def test_float32_trainer_into_fp8_ranks_declared_through_register_inference(cluster, pow2):
    n0, n1 = cluster
    g = torch.Generator().manual_seed(11)
    weights = {n: torch.randn(*s, generator=g) * 0.05 for n, (s, _) in MODEL.items()}
    weights["k"][60:70, 120:136] *= 300  # block (0, 0) and (0, 1): amax on the ranks' shared rows
    weights["o"][0:128, 128:256] = 0     # an all-zero block: scale 1
    plans = [dst_plan(t, pow2) for t in range(TP)]
    with shardcast.Client(n0.target) as c0, shardcast.Client(n1.target) as c1:
        src = [c0.register("trainer", r, 2, {n: w.chunk(2)[r].clone() for n, w in weights.items()}, src_layout(),
                           role="source", version=1) for r in range(2)]
        dst = [c1.register_inference("rollout", local_tensors(p, MODEL), p, MODEL, nodes=["n1"] * TP)
               for p in plans]
        c0.sync("trainer", "rollout", 1, verify=True)
        for version in (1, 2):
            for p, reg in zip(plans, dst):
                want = expected_rank(p, weights)
                assert set(reg.tensors) == set(want)
                for name, t in want.items():
                    assert torch.equal(bits(reg.tensors[name]), bits(t)), f"version {version} rank {p.rank}: {name}"
            if version == 2:
                break
            for s in src:  # a trainer step that moves every weight, and one block's amax
                with s.writing(2):
                    for t in s.tensors.values():
                        t.mul_(1.25)
            weights = {n: torch.cat([s.tensors[n] for s in src]) for n in MODEL}
            c0.sync("trainer", "rollout", 2)
        for reg in dst + src:
            reg.close()
