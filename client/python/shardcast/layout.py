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
            data, source = dict(layout), "layout"
        elif isinstance(layout, str) and layout.lstrip().startswith("{"):
            source = "layout JSON"
            data = _parse_json(layout, source)
        else:
            path = os.fspath(layout)
            source = f'layout file "{path}"'
            with open(path, encoding="utf-8") as f:
                data = _parse_json(f.read(), source)
        msg = layout_pb2.Layout()
        try:
            json_format.ParseDict(data, msg)
        except json_format.ParseError as e:
            raise ValueError(f"{source}: {e}") from None
    if group is not None:
        if msg.group and msg.group != group:
            raise ValueError(f'layout is for group "{msg.group}", not "{group}"')
        msg.group = group
    return msg


def _parse_json(text: str, source: str) -> Any:
    """`text` parsed; a ValueError naming `source` and the line and column where it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


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
    # Duck-typed on DTensor's Placement API (is_shard / is_replicate / is_partial). _StridedShard
    # (FSDP2 over TP) carries a split_factor; it is a Shard subclass up to torch 2.5 and a
    # placement of its own, with is_shard() False, from torch 2.6 on: look for split_factor first.
    if p.is_replicate():
        return {"replicate": {}}
    split = getattr(p, "split_factor", None)
    if split is not None and hasattr(p, "dim"):
        if int(split) != 1:
            return {"strided_shard": {"dim": int(p.dim), "split_factor": int(split)}}
        return {"shard": {"dim": int(p.dim)}}
    if p.is_shard():
        return {"shard": {"dim": int(p.dim)}}
    if p.is_partial():
        raise ValueError("a Partial placement holds unreduced sums: reduce (redistribute to Replicate/Shard) before syncing")
    raise ValueError(f"unsupported placement {p!r}")


def root_mesh(tensors: Mapping[str, Any]) -> Any:
    """The group's device mesh: that of the DTensor with the most mesh dims. The others must be
    on it or on a named submesh of it (FSDP2 over a TP mesh leaves the parameters TP does not
    touch on the "dp" submesh)."""
    meshes = [t.device_mesh for t in tensors.values() if hasattr(t, "device_mesh")]
    if not meshes:
        raise ValueError("no DTensor among the tensors: the device mesh comes from them")
    return max(meshes, key=lambda m: m.mesh.ndim)


def _placements_on(root: Any, name: str, t: Any) -> list:
    """`t`'s placements over the root mesh's dims (Replicate over dims its submesh lacks)."""
    m = t.device_mesh
    if m.mesh.shape == root.mesh.shape and m.mesh.tolist() == root.mesh.tolist():
        return [_placement(p) for p in t.placements]
    names, root_names = list(getattr(m, "mesh_dim_names", None) or []), list(getattr(root, "mesh_dim_names", None) or [])
    where = [root_names.index(n) if n in root_names else -1 for n in names]
    if not names or -1 in where or where != sorted(where):
        raise ValueError(f'tensor "{name}" is on device mesh {names or m.mesh.tolist()}, which is not a named '
                         f"submesh of the group's mesh {root_names or root.mesh.tolist()}")
    coordinate = root.get_coordinate()
    index = tuple(slice(None) if i in where else coordinate[i] for i in range(root.mesh.ndim))
    if root.mesh[index].tolist() != m.mesh.tolist():
        raise ValueError(f'tensor "{name}": its submesh {m.mesh.tolist()} is not the slice of the group\'s mesh '
                         f"{root.mesh.tolist()} through this rank")
    out: list = [{"replicate": {}} for _ in range(root.mesh.ndim)]
    for i, p in zip(where, t.placements):
        out[i] = _placement(p)
    return out


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
    device mesh whose ranks are 0..N-1 in row-major order (plain tensors among them are replicated:
    every rank holds the same values). Say where ranks run with `nodes` (one node
    name per rank) or `ranks_per_node` (+ `node_prefix`); default: every rank on its own node."""
    if not tensors:
        raise ValueError("no tensors")
    mesh = root_mesh(tensors)
    out_tensors = []
    for name, t in tensors.items():
        entry = {"name": name, "shape": [int(s) for s in t.shape], "dtype": str(t.dtype).replace("torch.", "")}
        if hasattr(t, "device_mesh"):
            entry["placements"] = _placements_on(mesh, name, t)
        # else: a plain tensor (e.g. a norm weight TP leaves alone) is the same on every rank
        out_tensors.append(entry)
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
