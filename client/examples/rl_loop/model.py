"""The RL loop example's model: a small decoder-only transformer (grouped-query attention, SwiGLU
MLP, a value head as PPO has), how a trainer shards it with PyTorch (FSDP2, TP, both), and how a
vLLM-like engine holds it (tensor parallel, q/k/v fused into qkv_proj and gate/up into gate_up_proj,
as QKVParallelLinear and MergedColumnParallelLinear do). The tests of real DTensor syncs use it too.

Sizes are chosen so that sharding is uneven where it can be: the vocabulary (13 rows) and the MLP
(42) over 4 ranks, the value head (1 row) leaves ranks empty.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 13, 24, 4, 2, 42, 2
HEAD_DIM = HIDDEN // HEADS


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)
        self.input_norm = nn.Parameter(torch.ones(HIDDEN))
        self.post_norm = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = F.rms_norm(x, (HIDDEN,), self.input_norm)
        # Under tensor parallelism the projections hold a slice of the heads: shapes come from
        # the local outputs, so the same code runs sharded and whole.
        q = self.q_proj(h).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(h).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(h).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o_proj(a)
        h = F.rms_norm(x, (HIDDEN,), self.post_norm)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.Parameter(torch.ones(HIDDEN))
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.value_head = nn.Linear(HIDDEN, 1, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        x = F.rms_norm(x, (HIDDEN,), self.norm)
        return self.lm_head(x), self.value_head(x)


def loss_fn(model: nn.Module, step: int) -> torch.Tensor:
    """A PPO-shaped loss on a fixed batch per step (the same on every rank): next-token
    cross-entropy weighted by made-up advantages, plus a value loss."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=g)
    advantages = torch.randn(2, 7, generator=g)
    logits, values = model(tokens)
    logp = -F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="none")
    policy = -(logp.view(2, 7) * advantages).mean()
    return policy + 0.5 * (values.squeeze(-1)[:, :-1] - advantages).pow(2).mean()


# ---- how the trainer shards it ----

COLUMN = ["*.q_proj.weight", "*.k_proj.weight", "*.v_proj.weight", "*.gate_proj.weight", "*.up_proj.weight"]
ROW = ["*.o_proj.weight", "*.down_proj.weight"]


def tp_plan() -> Dict[str, object]:
    """parallelize_module's plan for each layer (Megatron-style: column then row)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out: Dict[str, object] = {}
    for i in range(LAYERS):
        for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            out[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("o_proj", "down_proj"):
            out[f"layers.{i}.{name}"] = RowwiseParallel()
    return out


def shard_for_training(model: nn.Module, kind: str) -> nn.Module:
    """kind: "fsdp" (FSDP2 over every rank), "tp" (TP over every rank), "fsdp+tp" (a (dp, tp)
    mesh: TP inside, FSDP2 across: _StridedShard placements appear)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.4, 2.5
        from torch.distributed._composable.fsdp import fully_shard
    world = dist.get_world_size()
    if kind == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, tp_plan())
    elif kind == "fsdp+tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan())
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        raise ValueError(f"unknown sharding {kind!r}")
    return model


# ---- how a vLLM-like engine holds it ----

def fused_buffers() -> Dict[str, List[str]]:
    out = {}
    for i in range(LAYERS):
        p = f"layers.{i}."
        out[p + "qkv_proj.weight"] = [p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight"]
        out[p + "gate_up_proj.weight"] = [p + "gate_proj.weight", p + "up_proj.weight"]
    return out


def inference_plan(tp_rank: int, tp_size: int, replica: int, replicas: int):
    import shardcast

    return shardcast.ParallelPlan(tp_size=tp_size, tp_rank=tp_rank, replica=replica, replicas=replicas,
                                  column=COLUMN, row=ROW, fused=fused_buffers())


def meta_model() -> Dict[str, torch.Tensor]:
    """The full shapes and dtypes, without memory: what an engine knows from the model config."""
    with torch.device("meta"):
        return dict(TinyLM().named_parameters())


def expected_local(full: Dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> Dict[str, torch.Tensor]:
    """What a vLLM-like rank must hold given the trainer's full weights, sliced with torch.chunk
    directly (an independent check of the layouts the client derives)."""
    import fnmatch

    def part(name: str, t: torch.Tensor) -> torch.Tensor:
        if any(fnmatch.fnmatchcase(name, p) for p in COLUMN):
            return t.chunk(tp_size, dim=0)[tp_rank]
        if any(fnmatch.fnmatchcase(name, p) for p in ROW):
            return t.chunk(tp_size, dim=-1)[tp_rank]
        return t

    local = {n: part(n, t) for n, t in full.items()}
    out = {n: t for n, t in local.items() if not any(n in m for m in fused_buffers().values())}
    for buffer, members in fused_buffers().items():
        out[buffer] = torch.cat([local[m] for m in members], dim=0)
    return out
