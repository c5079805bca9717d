"""Layouts: the JSON form of shardcast.v1.Layout (docs/layout-format.md), from a file, a dict, or
built from PyTorch DTensors' device mesh and placements."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional, Sequence, Union

from google.protobuf import json_format

from shardcast.v1 import layout_pb2

LayoutLike = Union[layout_pb2.Layout, Mapping[str, Any], str, "os.PathLike[str]"]


def load_layout(layout: LayoutLike, group: Optional[str] = None) -> layout_pb2.Layout:
    """Returns `layout` as a Layout message: a message, a dict in the JSON form, a JSON string, or
    the path of a JSON file. `group` fills (or must match) the layout's group."""
    if isinstance(layout, layout_pb2.Layout):
        msg = layout_pb2.Layout()
        msg.CopyFrom(layout)
    else:
        if isinstance(layout, Mapping):
            data = dict(layout)
        elif isinstance(layout, str) and layout.lstrip().startswith("{"):
            data = json.loads(layout)
        else:
            with open(os.fspath(layout), encoding="utf-8") as f:
                data = json.load(f)
        msg = layout_pb2.Layout()
        try:
            json_format.ParseDict(data, msg)
        except json_format.ParseError as e:
            raise ValueError(f"layout: {e}") from None
    if group is not None:
        if msg.group and msg.group != group:
            raise ValueError(f'layout is for group "{msg.group}", not "{group}"')
        msg.group = group
    return msg


def dtensor_available() -> Optional[str]:
    """None when this torch has DTensor; otherwise why not (for skip messages)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch is not installed"
    for module in ("torch.distributed.tensor", "torch.distributed._tensor"):
        try:
            mod = __import__(module, fromlist=["DTensor"])
            if hasattr(mod, "DTensor"):
                return None
        except ImportError:
            continue
    import torch

    return f"torch {torch.__version__} has no DTensor (needs torch >= 2.0)"


def _placement(p: Any) -> dict:
    # Duck-typed on DTensor's Placement API (is_shard / is_replicate / is_partial), which has been
    # stable from torch 2.0 on; _StridedShard is a Shard with a split_factor.
    if p.is_replicate():
        return {"replicate": {}}
    if p.is_shard():
        split = getattr(p, "split_factor", None)
        if split is not None and split != 1:
            return {"strided_shard": {"dim": int(p.dim), "split_factor": int(split)}}
        return {"shard": {"dim": int(p.dim)}}
    if p.is_partial():
        raise ValueError("a Partial placement holds unreduced sums: reduce (redistribute to Replicate/Shard) before syncing")
    raise ValueError(f"unsupported placement {p!r}")


def layout_from_dtensors(
    group: str,
    tensors: Mapping[str, Any],
    *,
    nodes: Optional[Sequence[str]] = None,
    ranks_per_node: Optional[int] = None,
    node_prefix: str = "node-",
    fused: Optional[Sequence[Mapping[str, Any]]] = None,
) -> dict:
    """The layout (JSON form, a dict) of a group holding `tensors`, DTensors keyed by name, all on one
    device mesh whose ranks are 0..N-1 in row-major order. Say where ranks run with `nodes` (one node
    name per rank) or `ranks_per_node` (+ `node_prefix`); default: every rank on its own node."""
    if not tensors:
        raise ValueError("no tensors")
    mesh = None
    out_tensors = []
    for name, t in tensors.items():
        m = t.device_mesh
        if mesh is None:
            mesh = m
        elif m.mesh.tolist() != mesh.mesh.tolist():
            raise ValueError(f'tensor "{name}" is on another device mesh than the first tensor')
        out_tensors.append(
            {
                "name": name,
                "shape": [int(s) for s in t.shape],
                "dtype": str(t.dtype).replace("torch.", ""),
                "placements": [_placement(p) for p in t.placements],
            }
        )
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if ranks != list(range(len(ranks))):
        raise ValueError(f"the device mesh's ranks must be 0..{len(ranks) - 1} in row-major order (got {ranks})")
    layout: dict = {"group": group, "mesh": {"shape": [int(s) for s in mesh.mesh.shape]}, "tensors": out_tensors}
    names = getattr(mesh, "mesh_dim_names", None)
    if names:
        layout["mesh"]["dim_names"] = list(names)
    if nodes is not None:
        if len(nodes) != len(ranks):
            raise ValueError(f"{len(nodes)} node names for {len(ranks)} ranks")
        layout["nodes"] = list(nodes)
    else:
        layout["ranks_per_node"] = int(ranks_per_node or 1)
        layout["node_prefix"] = node_prefix
    if fused:
        layout["fused"] = [dict(f) for f in fused]
    return layout
