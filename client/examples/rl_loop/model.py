"""The toy model of the RL loop example, its two layouts, and the "training" rule both sides know.

Trainer: 4 ranks on 2 nodes, mesh (dp=2, tp=2) — FSDP-style Shard(0) over dp, Megatron-style TP.
Inference: 4 ranks on 2 nodes, vLLM-style TP=2 per node (dp=2 replicas), q/k/v fused into qkv_proj
and gate/up into gate_up_proj, as vLLM's QKVParallelLinear and MergedColumnParallelLinear hold them.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

HIDDEN, KV, INTER, LAYERS = 64, 16, 128, 2


def tensors() -> List[Tuple[str, Tuple[int, ...], str]]:
    """(name, shape, kind): kind c = column-parallel, r = row-parallel, n = norm."""
    out = []
    for l in range(LAYERS):
        p = f"layers.{l}."
        out += [(p + "q_proj", (HIDDEN, HIDDEN), "c"), (p + "k_proj", (KV, HIDDEN), "c"), (p + "v_proj", (KV, HIDDEN), "c"),
                (p + "o_proj", (HIDDEN, HIDDEN), "r"), (p + "gate_proj", (INTER, HIDDEN), "c"),
                (p + "up_proj", (INTER, HIDDEN), "c"), (p + "down_proj", (HIDDEN, INTER), "r"), (p + "norm", (HIDDEN,), "n")]
    return out


FUSED = [(f"layers.{l}.qkv_proj", [f"layers.{l}.q_proj", f"layers.{l}.k_proj", f"layers.{l}.v_proj"]) for l in range(LAYERS)] + \
        [(f"layers.{l}.gate_up_proj", [f"layers.{l}.gate_proj", f"layers.{l}.up_proj"]) for l in range(LAYERS)]

SHARD0, SHARD1, REPL = {"shard": {"dim": 0}}, {"shard": {"dim": 1}}, {"replicate": {}}


def trainer_placements(kind: str) -> list:
    return {"c": [SHARD0, SHARD0], "r": [SHARD0, SHARD1], "n": [SHARD0, REPL]}[kind]


def inference_placements(kind: str) -> list:
    return {"c": [REPL, SHARD0], "r": [REPL, SHARD1], "n": [REPL, REPL]}[kind]


def layout(role: str) -> dict:
    place = trainer_placements if role == "trainer" else inference_placements
    out = {
        "group": role,
        "mesh": {"shape": [2, 2], "dim_names": ["dp", "tp"]},
        "ranks_per_node": 2,
        "node_prefix": f"{role}-",
        "tensors": [{"name": n, "shape": list(s), "dtype": "float32", "placements": place(k)} for n, s, k in tensors()],
    }
    if role == "inference":
        out["fused"] = [{"name": name, "dim": 0, "tensors": members} for name, members in FUSED]
    return out


def weights(step: int) -> Dict[str, np.ndarray]:
    """The full model after `step` training steps (both sides compute it to check the other)."""
    out = {}
    for i, (name, shape, _) in enumerate(tensors()):
        n = int(np.prod(shape))
        out[name] = ((np.arange(n, dtype=np.float32) % 251) * 0.01 + i + step * 0.5).reshape(shape)
    return out


def _chunk(x: np.ndarray, dim: int, k: int, i: int) -> np.ndarray:
    size = -(-x.shape[dim] // k)  # torch.chunk
    return np.take(x, range(min(i * size, x.shape[dim]), min((i + 1) * size, x.shape[dim])), axis=dim)


def local(full: np.ndarray, placements: list, rank: int) -> np.ndarray:
    """A rank's shard under nested Shard/Replicate placements on the 2x2 mesh (left to right)."""
    coords = (rank // 2, rank % 2)
    for mesh_dim, p in enumerate(placements):
        if "shard" in p:
            full = _chunk(full, p["shard"]["dim"], 2, coords[mesh_dim])
    return full


def rank_buffers(role: str, rank: int, step: int) -> Dict[str, np.ndarray]:
    """What `rank` of `role` holds after `step`: one array per tensor or fused buffer."""
    full = weights(step)
    place = trainer_placements if role == "trainer" else inference_placements
    out = {name: np.ascontiguousarray(local(full[name], place(kind), rank)) for name, _, kind in tensors()}
    if role == "inference":
        for name, members in FUSED:
            out[name] = np.concatenate([out.pop(m) for m in members], axis=0)
    return out
