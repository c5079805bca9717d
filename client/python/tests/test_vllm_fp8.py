"""The vLLM worker's block-quantised fp8 path without vLLM: parameters as vLLM's Fp8LinearMethod
holds them with `weight_block_size` (a float8_e4m3fn `weight` and a float32 `weight_scale_inv`,
fused qkv and row-parallel layers at TP=2), the landings its loaders give for an fp8 checkpoint,
and a float32 trainer synced through real daemons into them: every fp8 byte and every scale equals
shardcast.fp8.block_quantize of the trainer's weights. The probe of a real vLLM, and what vLLM's
CPU backend can build, are in vllm_tests/."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the test venv (scripts/deps.sh) has torch")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)

import shardcast  # noqa: E402
from shardcast.fp8 import block_quantize  # noqa: E402
from shardcast.local import LocalCluster  # noqa: E402
from shardcast.vllm.layout import check_dtypes, destination_layout, fp8_blocks, fp8_scales, rank_memory  # noqa: E402
from shardcast.vllm.probe import Landing, ParamMap, ProbeError  # noqa: E402

TP, B = 2, 128
# q and k fused into qkv_proj (column-parallel: 128 rows of each per rank), o_proj row-parallel
# (128 columns per rank), a norm vLLM keeps in float32: vLLM's fp8 block layout needs each
# rank's part of a weight to be whole blocks (validate_fp8_block_shape).
SHAPES = {"q.weight": (256, 384), "k.weight": (256, 384), "o.weight": (384, 256), "norm.weight": (384,)}


class Fp8Linear(torch.nn.Module):
    """What vLLM's Fp8LinearMethod leaves on a layer with block quantisation (the attributes
    fp8_blocks reads)."""

    def __init__(self, rows, cols):
        super().__init__()
        self.weight_block_size = [B, B]
        self.weight = torch.nn.Parameter(torch.zeros(rows, cols, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(torch.zeros(-(-rows // B), -(-cols // B)), requires_grad=False)


def rank_maps(r):
    """What the probe finds on TP rank r of an fp8 checkpoint with these tensors (vLLM's loaders:
    q's rows then k's in qkv_proj.weight, their scale rows likewise in qkv_proj.weight_scale_inv)."""
    f8, f32 = torch.float8_e4m3fn, torch.float32
    return {
        "qkv_proj.weight": ParamMap("qkv_proj.weight", (256, 384), f8, [
            Landing("q.weight", (128 * r, 0), (128, 384), 0), Landing("k.weight", (128 * r, 0), (128, 384), 128 * 384)]),
        "qkv_proj.weight_scale_inv": ParamMap("qkv_proj.weight_scale_inv", (2, 3), f32, [
            Landing("q.weight_scale_inv", (r, 0), (1, 3), 0), Landing("k.weight_scale_inv", (r, 0), (1, 3), 3)]),
        "o_proj.weight": ParamMap("o_proj.weight", (384, 128), f8, [Landing("o.weight", (0, 128 * r), (384, 128), 0)]),
        "o_proj.weight_scale_inv": ParamMap("o_proj.weight_scale_inv", (3, 1), f32, [
            Landing("o.weight_scale_inv", (0, r), (3, 1), 0)]),
        "norm.weight": ParamMap("norm.weight", (384,), f32, [Landing("norm.weight", (0,), (384,), 0)]),
    }


def worker(r):
    modules = {"qkv_proj": Fp8Linear(256, 384), "o_proj": Fp8Linear(384, 128), "norm": torch.nn.Module()}
    modules["norm"].weight = torch.nn.Parameter(torch.zeros(384), requires_grad=False)
    live = {f"{m}.{p}": t for m, mod in modules.items() for p, t in mod.named_parameters()}
    return modules, live


def test_fp8_tensors_their_scales_and_dtypes_from_the_landings():
    modules, _ = worker(0)
    maps = rank_maps(0)
    blocks = fp8_blocks(maps, modules)
    assert blocks == {"q.weight": [B, B], "k.weight": [B, B], "o.weight": [B, B]}
    assert fp8_scales(SHAPES, blocks) == {"q.weight_scale_inv": (2, 3), "k.weight_scale_inv": (2, 3),
                                         "o.weight_scale_inv": (3, 2)}
    check_dtypes(maps, {"q.weight": "bfloat16", "k.weight": "float32", "o.weight": "float32"}, blocks)
    with pytest.raises(ProbeError, match="'q.weight' is float16 in the trainer"):
        check_dtypes(maps, {"q.weight": "float16"}, blocks)
    with pytest.raises(ProbeError, match="'q.weight' is float32 in the trainer"):
        check_dtypes(maps, {"q.weight": "float32"})  # not block-quantised: no conversion to fp8
    with pytest.raises(ProbeError, match="'o.weight_scale_inv': the trainer announces it"):
        fp8_scales({**SHAPES, "o.weight_scale_inv": (3, 2)}, blocks)


def test_a_scale_landing_other_than_the_blocks_of_the_weights_part_is_refused():
    maps = rank_maps(1)
    memory = rank_memory(maps, worker(1)[1])
    pieces = dict(memory.pieces)
    pieces["o.weight_scale_inv"] = ([0, 0], [3, 1])  # rank 1's columns are block column 1
    checkpoint = {n: (s, torch.float32) for n, s in {**SHAPES, **fp8_scales(SHAPES, fp8_blocks(maps, worker(1)[0]))}.items()}
    with pytest.raises(ProbeError, match=r"rank 0: 'o.weight' lands as \[0:384, 128:256\], whose scales are "
                                         r"blocks \[0:3, 1:2\] of 'o.weight_scale_inv', but vLLM's loader puts \[0:3, 0:1\]"):
        destination_layout("vllm", ["i0"], [pieces], checkpoint, fp8=fp8_blocks(maps, worker(1)[0]))


def test_float32_trainer_into_vllm_fp8_parameters_every_byte_and_scale_is_the_reference():
    g = torch.Generator().manual_seed(3)
    weights = {n: torch.randn(*s, generator=g) * 0.03 for n, s in SHAPES.items()}
    weights["o.weight"][0:128, 128:256] = 0  # an all-zero block: scale 1
    ranks = []
    for r in range(TP):
        modules, live = worker(r)
        maps = rank_maps(r)
        ranks.append((modules, live, maps, rank_memory(maps, live), fp8_blocks(maps, modules)))
    fp8 = ranks[0][4]
    checkpoint = {n: (s, torch.float32) for n, s in {**SHAPES, **fp8_scales(SHAPES, fp8)}.items()}
    layout = destination_layout("vllm", ["i0"] * TP, [m.pieces for _, _, _, m, _ in ranks], checkpoint, fp8=fp8)
    by_name = {t["name"]: t for t in layout["tensors"]}
    assert "q.weight_scale_inv" not in by_name  # derived by the daemon
    assert by_name["q.weight"]["dtype"] == "float8_e4m3fn"
    assert by_name["q.weight"]["block_scale"] == {"block": [B, B], "scale": "q.weight_scale_inv"}
    assert by_name["norm.weight"]["dtype"] == "float32" and "block_scale" not in by_name["norm.weight"]
    with LocalCluster(["t0", "i0"]) as cluster:
        trainer = shardcast.Client(cluster.target("t0"))
        worker_client = shardcast.Client(cluster.target("i0"))
        src_layout = {"group": "trainer", "mesh": {"shape": [1]}, "nodes": ["t0"],
                      "tensors": [{"name": n, "shape": list(t.shape), "dtype": "float32"} for n, t in weights.items()]}
        src = trainer.register("trainer", 0, 1, {n: t.clone() for n, t in weights.items()}, src_layout,
                               role="source", version=1)
        dst = [worker_client.register("vllm", r, TP, memory.tensors, layout)
               for r, (_, _, _, memory, _) in enumerate(ranks)]
        trainer.sync("trainer", "vllm", 1, verify=True)
        ref = {n: block_quantize(weights[n], (B, B)) for n in fp8}
        bits = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
        for r, (_, live, _, memory, _) in enumerate(ranks):
            rows = slice(128 * r, 128 * (r + 1))
            assert torch.equal(bits(live["qkv_proj.weight"]),
                               bits(torch.cat([ref["q.weight"][0][rows], ref["k.weight"][0][rows]]))), f"rank {r}: qkv"
            assert torch.equal(live["qkv_proj.weight_scale_inv"].view(torch.int32),
                               torch.cat([ref["q.weight"][1][r:r + 1], ref["k.weight"][1][r:r + 1]]).view(torch.int32))
            assert torch.equal(bits(live["o_proj.weight"]), bits(ref["o.weight"][0][:, rows])), f"rank {r}: o"
            assert torch.equal(live["o_proj.weight_scale_inv"].view(torch.int32),
                               ref["o.weight"][1][:, r:r + 1].contiguous().view(torch.int32))
            assert torch.equal(live["norm.weight"], weights["norm.weight"])
        assert float(ref["o.weight"][1][0, 1]) == 1.0
        for reg in dst + [src]:
            reg.close()
        trainer.close()
        worker_client.close()
