#!/usr/bin/python3
"""Writes the example layouts shipped with Shardcast: a small Llama-like model (4 layers, hidden
512, GQA, vocab 32000, bfloat16) trained with FSDP2 x TP=4 on 2 nodes, served by vLLM with
TP=4 x DP=2 on 2 other nodes (fused qkv_proj and gate_up_proj). Run it to regenerate them."""
import json
import os

LAYERS, HIDDEN, INTER, VOCAB, KV = 4, 512, 1408, 32000, 256
TP = 4


def tensors():
    """(name, shape, kind): kind is column / row / vocab / norm."""
    out = [("model.embed_tokens.weight", [VOCAB, HIDDEN], "vocab")]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", [HIDDEN, HIDDEN], "column"),
            (p + "self_attn.k_proj.weight", [KV, HIDDEN], "column"),
            (p + "self_attn.v_proj.weight", [KV, HIDDEN], "column"),
            (p + "self_attn.o_proj.weight", [HIDDEN, HIDDEN], "row"),
            (p + "mlp.gate_proj.weight", [INTER, HIDDEN], "column"),
            (p + "mlp.up_proj.weight", [INTER, HIDDEN], "column"),
            (p + "mlp.down_proj.weight", [HIDDEN, INTER], "row"),
            (p + "input_layernorm.weight", [HIDDEN], "norm"),
            (p + "post_attention_layernorm.weight", [HIDDEN], "norm"),
        ]
    out += [("model.norm.weight", [HIDDEN], "norm"), ("lm_head.weight", [VOCAB, HIDDEN], "vocab")]
    return out


def shard(d):
    return {"shard": {"dim": d}}


def trainer():
    # FSDP2 over TP: the fsdp mesh dim shards the TP-local shard, hence _StridedShard when both
    # shard the same tensor dim.
    strided = {"strided_shard": {"dim": 0, "split_factor": TP}}
    placements = {
        "column": [strided, shard(0)],
        "vocab": [strided, shard(0)],
        "row": [shard(0), shard(1)],
        "norm": [shard(0), {"replicate": {}}],
    }
    return {
        "group": "trainer",
        "mesh": {"shape": [2, TP], "dim_names": ["fsdp", "tp"]},
        "ranks_per_node": 4,
        "node_prefix": "trainer-node-",
        "tensors": [{"name": n, "shape": s, "dtype": "bfloat16", "placements": placements[k]}
                    for n, s, k in tensors()],
    }


def vllm():
    rep = {"replicate": {}}
    placements = {"column": [rep, shard(0)], "vocab": [rep, shard(0)], "row": [rep, shard(1)], "norm": [rep, rep]}
    fused = []
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        fused.append({"name": p + "self_attn.qkv_proj.weight", "dim": 0,
                      "tensors": [p + f"self_attn.{x}_proj.weight" for x in "qkv"]})
        fused.append({"name": p + "mlp.gate_up_proj.weight", "dim": 0,
                      "tensors": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]})
    return {
        "group": "vllm",
        "mesh": {"shape": [2, TP], "dim_names": ["dp", "tp"]},
        "ranks_per_node": 4,
        "node_prefix": "infer-node-",
        "tensors": [{"name": n, "shape": s, "dtype": "bfloat16", "placements": placements[k]}
                    for n, s, k in tensors()],
        "fused": fused,
    }


here = os.path.dirname(os.path.abspath(__file__))
for name, layout in [("trainer_fsdp2_tp4.json", trainer()), ("vllm_tp4_dp2.json", vllm())]:
    with open(os.path.join(here, name), "w") as f:
        json.dump(layout, f, indent=1)
        f.write("\n")
