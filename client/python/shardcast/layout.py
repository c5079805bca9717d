"""Layouts: the JSON form of shardcast.v1.Layout (docs/layout-format.md), from a file, a dict, or
built from PyTorch DTensors' device mesh and placements."""

from __future__ import annotations

import functools
import itertools
import json
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

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


def _mesh_key(m: Any) -> tuple:
    return (tuple(int(n) for n in m.mesh.shape), tuple(int(r) for r in m.mesh.flatten().tolist()),
            tuple(getattr(m, "mesh_dim_names", None) or ()))


def _same_mesh(a: Any, b: Any) -> bool:
    return a is b or (tuple(a.mesh.shape) == tuple(b.mesh.shape) and _mesh_key(a) == _mesh_key(b))


def _submesh_dims(m: Any, of: Any) -> Optional[List[int]]:
    """Where `m`'s dims sit among `of`'s when `m` is `of` itself or a named submesh of it through
    this rank (FSDP2 over a TP mesh leaves the parameters TP does not touch on the "dp" submesh);
    None when it is neither."""
    if _same_mesh(m, of):
        return list(range(of.mesh.ndim))
    names, of_names = list(getattr(m, "mesh_dim_names", None) or []), list(getattr(of, "mesh_dim_names", None) or [])
    where = [of_names.index(n) if n in of_names else -1 for n in names]
    if not names or -1 in where or where != sorted(where):
        return None
    coordinate = of.get_coordinate()
    if coordinate is None:
        return None
    index = tuple(slice(None) if i in where else coordinate[i] for i in range(of.mesh.ndim))
    return where if of.mesh[index].tolist() == m.mesh.tolist() else None


def _group_meshes(tensors: Mapping[str, Any]) -> List[Any]:
    """The distinct device meshes no other one contains as a named submesh, the group's mesh first:
    one whose ranks are 0..N-1 in row-major order (they number the group's ranks), with the most
    tensors on it or on its submeshes, then the most dims. A trainer may place some parameters on a
    mesh of its own over the same ranks (torchtitan's experts on ("efsdp", "ep") beside the dense
    ("fsdp", "tp")): those become explicit pieces."""
    distinct: Dict[int, Any] = {id(t.device_mesh): t.device_mesh for t in tensors.values() if hasattr(t, "device_mesh")}
    meshes: Dict[tuple, Any] = {}
    for m in distinct.values():
        meshes.setdefault(_mesh_key(m), m)
    if not meshes:
        raise ValueError("no DTensor among the tensors: the device mesh comes from them")
    tops = [m for k, m in meshes.items()
            if not any(k2 != k and _submesh_dims(m, o) is not None for k2, o in meshes.items())]

    def order(m: Any) -> tuple:
        key = _mesh_key(m)
        held = sum(1 for t in tensors.values()
                   if hasattr(t, "device_mesh") and _submesh_dims(t.device_mesh, m) is not None)
        return (list(key[1]) != list(range(len(key[1]))), -held, -m.mesh.ndim)

    return sorted(tops, key=order)


def root_mesh(tensors: Mapping[str, Any]) -> Any:
    """The group's device mesh (its ranks are the group's ranks, row-major): the mesh most of the
    DTensors are on, or on a named submesh of (see _group_meshes)."""
    return _group_meshes(tensors)[0]


def _placements_on(mesh: Any, t: Any) -> Optional[list]:
    """`t`'s placements over `mesh`'s dims (Replicate over dims its submesh lacks); None when `t`
    is on neither `mesh` nor a named submesh of it."""
    where = _submesh_dims(t.device_mesh, mesh)
    if where is None:
        return None
    out: list = [{"replicate": {}} for _ in range(mesh.mesh.ndim)]
    for i, p in zip(where, t.placements):
        out[i] = _placement(p)
    return out


def _chunk(n: int, k: int, i: int) -> Tuple[int, int]:
    """Chunk i of torch.chunk's cut of n into k (DTensor's Shard): chunks of ceil(n / k), the last
    short or empty."""
    c = -(-n // k)
    return min(i * c, n), min((i + 1) * c, n)


def _take(held: List[Tuple[int, int]], lo: int, hi: int) -> List[Tuple[int, int]]:
    """Positions [lo, hi) of the concatenation of `held` (global intervals), as global intervals."""
    out, pos = [], 0
    for a, b in held:
        x, y = max(lo, pos), min(hi, pos + b - a)
        if x < y:
            out.append((a + x - pos, a + y - pos))
        pos += b - a
    return out


def rank_intervals(extent: int, dim: int, mesh_shape: Sequence[int], coordinate: Sequence[int],
                   placements: Sequence[Mapping[str, Any]]) -> List[Tuple[int, int]]:
    """The global intervals of tensor dim `dim` (of `extent`) that the rank at `coordinate` holds, in
    its local order, under layout placements (docs/layout-format.md, "Placements": Shard nests left
    to right, _StridedShard cuts into split_factor chunks first and keeps its part of each)."""
    held = [(0, extent)]
    for k, c, p in zip(mesh_shape, coordinate, placements):
        kind = next(iter(p))
        if kind == "replicate" or int(p[kind]["dim"]) != dim:
            continue
        n = sum(b - a for a, b in held)
        if kind == "shard":
            held = _take(held, *_chunk(n, int(k), int(c)))
        else:
            split = int(p[kind]["split_factor"])
            held = [iv for a, b in (_chunk(n, split, j) for j in range(split))
                    for lo, hi in [_chunk(b - a, int(k), int(c))] for iv in _take(held, a + lo, a + hi)]
    merged: List[Tuple[int, int]] = []
    for a, b in held:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        elif b > a:
            merged.append((a, b))
    return merged


def rank_boxes(shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
               placements: Sequence[Mapping[str, Any]]) -> List[Tuple[List[int], List[int]]]:
    """The boxes ([offsets], [sizes]) the rank at `coordinate` holds, one after another in its local
    tensor; [] when it holds nothing. A local tensor that is not such a sequence (held in several
    runs along a dim that is not its outermost) is a ValueError."""
    per_dim = [rank_intervals(int(n), d, mesh_shape, coordinate, placements) for d, n in enumerate(shape)]
    if any(not runs for runs in per_dim):
        return []
    split = [d for d, runs in enumerate(per_dim) if len(runs) > 1]
    outer = 1
    for runs in per_dim[:split[0]] if split else []:
        outer *= runs[0][1] - runs[0][0]
    if len(split) > 1 or outer != 1:
        raise ValueError(f"mesh coordinate {list(coordinate)} holds {per_dim} (global intervals per dim), "
                         "which is not a sequence of boxes in its local memory")
    d = split[0] if split else 0
    return [([a if i == d else r[0][0] for i, r in enumerate(per_dim)],
             [b - a if i == d else r[0][1] - r[0][0] for i, r in enumerate(per_dim)]) for a, b in per_dim[d]]


def _my_boxes(t: Any, where: str) -> List[Tuple[List[int], List[int]]]:
    """rank_boxes of this rank of DTensor `t`; a ValueError names `where`."""
    m = t.device_mesh
    try:
        return rank_boxes([int(s) for s in t.shape], [int(n) for n in m.mesh.shape], m.get_coordinate(),
                          [_placement(p) for p in t.placements])
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def local_offsets(t: Any, where: str) -> Optional[List[int]]:
    """Where this rank's local tensor of DTensor `t` starts in the full tensor; None when it holds
    none of it. A local tensor that is several boxes (an uneven _StridedShard) is a ValueError
    naming `where`: one offset would misplace all but its first box."""
    boxes = _my_boxes(t, where)
    if len(boxes) > 1:
        raise ValueError(f"{where}: this rank's shard is {len(boxes)} separate boxes of the parameter "
                         f"({', '.join(str(list(zip(o, s))) for o, s in boxes)}: (offset, size) per dim), not one")
    return boxes[0][0] if boxes else None


def check_local_shard(name: str, t: Any) -> None:
    """Raises when DTensor `t`'s local tensor on this rank is not the shape its placements give it:
    the layout would then say it holds other elements than it does. FSDP2 over an uneven tensor-
    or expert-parallel shard keeps torch.chunk of the rank's shard, which its _StridedShard
    placement does not describe."""
    if not hasattr(t, "to_local"):
        return
    boxes = _my_boxes(t, f'tensor "{name}"')
    want = list(boxes[0][1]) if boxes else None
    for offsets, sizes in boxes[1:]:  # boxes one after another: they differ along one dim
        d = next((i for i, (a, b) in enumerate(zip(offsets, boxes[0][0])) if a != b), 0)
        want[d] += sizes[d]
    have = [int(n) for n in t.to_local().shape]
    if have != want and (want is not None or 0 not in have):
        raise ValueError(f'tensor "{name}": this rank (mesh coordinate {list(t.device_mesh.get_coordinate())}) holds a '
                         f"local shard of {have}, but placements {list(map(str, t.placements))} give it "
                         f"{want or 'nothing'}: "
                         "FSDP2 over a tensor- or expert-parallel shard whose size its mesh does not divide keeps "
                         "chunks its _StridedShard placement does not describe (make that dim divisible)")


def _pieces_over(mesh: Any, name: str, shape: Sequence[int], placements: list) -> List[dict]:
    """Explicit pieces of a tensor placed over `mesh`, a mesh over the group's ranks in an order of
    its own: each rank's boxes, ranks holding the same boxes listed together."""
    key = _mesh_key(mesh)
    try:
        pieces = _pieces_of(key[0], key[1], tuple(shape), json.dumps(placements, sort_keys=True))
    except ValueError as e:
        raise ValueError(f'tensor "{name}": {e}') from None
    return _piece_entries(pieces)


def _piece_entries(pieces: Sequence[tuple]) -> List[dict]:
    """Layout piece entries of (ranks, offsets, sizes) triples."""
    return [{"ranks": list(ranks), "offsets": list(o), "sizes": list(sz)} for ranks, o, sz in pieces]


@functools.lru_cache(maxsize=256)
def _pieces_of(mesh_shape: tuple, mesh_ranks: tuple, shape: tuple, placements: str) -> tuple:
    # Every layer's experts have the same shape and placements: their pieces are computed once.
    # A tensor of no elements gets an empty piece on every rank: a list of no pieces would read as
    # "replicated on every rank" (docs/layout-format.md).
    placed = json.loads(placements)
    holders: Dict[tuple, List[int]] = {}
    for i, coordinate in enumerate(itertools.product(*(range(n) for n in mesh_shape))):  # row-major
        boxes = rank_boxes(shape, mesh_shape, coordinate, placed)
        holders.setdefault(tuple((tuple(o), tuple(sz)) for o, sz in boxes), []).append(mesh_ranks[i])
    pieces = tuple((tuple(ranks), o, sz) for boxes, ranks in holders.items() for o, sz in boxes)
    return pieces or ((tuple(mesh_ranks), (0,) * len(shape), shape),)


def _placed(name: str, t: Any, meshes: List[Any]) -> dict:
    """`t`'s entry fields: placements over the group's mesh, or explicit pieces when it sits on
    another mesh over the same ranks."""
    root = meshes[0]
    placements = _placements_on(root, t)
    if placements is not None:
        return {"placements": placements}
    world = sorted(int(r) for r in root.mesh.flatten().tolist())
    for other in meshes[1:]:
        placements = _placements_on(other, t)
        if placements is None:
            continue
        if sorted(int(r) for r in other.mesh.flatten().tolist()) != world:
            raise ValueError(f'tensor "{name}" is on device mesh {_mesh_name(t.device_mesh)} over ranks '
                             f"{other.mesh.flatten().tolist()}, not the group's {len(world)} ranks {world}")
        return {"pieces": _pieces_over(other, name, [int(s) for s in t.shape], placements)}
    raise ValueError(f'tensor "{name}" is on device mesh {_mesh_name(t.device_mesh)}, which is neither the '
                     f"group's mesh {_mesh_name(root)} nor a named submesh of a mesh over the group's ranks")


def _mesh_name(m: Any) -> str:
    names = list(getattr(m, "mesh_dim_names", None) or [])
    return f"{names} {m.mesh.tolist()}" if names else str(m.mesh.tolist())


def covers_group(tensors: Mapping[str, Any], world: Optional[int] = None) -> bool:
    """Whether this rank's DTensors describe the whole group: their mesh spans ranks 0..N-1 in
    row-major order (N = `world`, the process group's size, when given). Not so under pipeline
    parallelism, where each stage's parameters sit on its own slice of the ranks."""
    ranks = [int(r) for r in root_mesh(tensors).mesh.flatten().tolist()]
    return ranks == list(range(len(ranks))) and (world is None or len(ranks) == world)


def spans_job(mesh: Any, world: int) -> bool:
    """Whether `mesh`, or the larger device mesh torch sliced it from (a pipeline stage's slice of
    the job's mesh), spans ranks 0..world-1."""
    root = mesh
    get_root = getattr(mesh, "_get_root_mesh", None)
    if get_root is not None:
        root = get_root() or mesh
    else:
        try:
            from torch.distributed.device_mesh import _mesh_resources
        except ImportError:
            pass
        else:
            root = _mesh_resources.get_root_mesh(mesh) or mesh
    return sorted(int(r) for r in root.mesh.flatten().tolist()) == list(range(world))


def describe_dtensors(tensors: Mapping[str, Any]) -> Dict[str, dict]:
    """This rank's view of its tensors for a group whose ranks do not all hold the same ones
    (pipeline stages): per tensor its shape and dtype and, for a DTensor, its placements over the
    mesh it is on (or whose named submesh it is on) with that mesh's shape and global ranks.
    layout_from_views joins every rank's view."""
    meshes = _group_meshes(tensors) if any(hasattr(t, "device_mesh") for t in tensors.values()) else []
    out: Dict[str, dict] = {}
    for name, t in tensors.items():
        d: dict = {"shape": [int(s) for s in t.shape], "dtype": str(t.dtype).replace("torch.", "")}
        if hasattr(t, "device_mesh"):
            check_local_shard(name, t)
            m, placements = next((m, p) for m in meshes for p in [_placements_on(m, t)] if p is not None)
            d.update(mesh_shape=[int(n) for n in m.mesh.shape], mesh_ranks=[int(r) for r in m.mesh.flatten().tolist()],
                     placements=placements)
        out[name] = d
    return out


def layout_from_views(group: str, views: Sequence[Mapping[str, dict]], ranks: Sequence[int],
                      nodes: Sequence[str]) -> dict:
    """The layout of a group whose rank i (global rank ranks[i], on nodes[i]) described its tensors
    as views[i] (describe_dtensors): one mesh dim over the ranks, every tensor as explicit pieces
    held by the ranks that have it. A tensor two ranks describe differently, or whose mesh spans
    ranks that do not have it or lie outside the group, is a ValueError naming it and the ranks."""
    if not (len(views) == len(ranks) == len(nodes)):
        raise ValueError(f"{len(views)} views, {len(ranks)} ranks and {len(nodes)} nodes")
    rank_of = {int(g): i for i, g in enumerate(ranks)}
    first: Dict[str, Tuple[int, Mapping[str, Any]]] = {}
    holders: Dict[str, List[int]] = {}
    for r, view in enumerate(views):
        for name, d in view.items():
            r0, d0 = first.setdefault(name, (r, d))
            if d0 != d:
                raise ValueError(f'tensor "{name}": rank {r0} holds it as {dict(d0)}, rank {r} as {dict(d)}')
            holders.setdefault(name, []).append(r)
    tensors = []
    for name, (_, d) in first.items():
        entry = {"name": name, "shape": list(d["shape"]), "dtype": d["dtype"]}
        if "mesh_ranks" in d:
            outside = [g for g in d["mesh_ranks"] if g not in rank_of]
            if outside:
                raise ValueError(f'tensor "{name}": its mesh spans global ranks {outside}, which are not in the group')
            mesh_ranks = [rank_of[g] for g in d["mesh_ranks"]]
            if sorted(mesh_ranks) != holders[name]:
                raise ValueError(f'tensor "{name}": its mesh spans ranks {sorted(mesh_ranks)} but ranks '
                                 f"{holders[name]} have it")
            try:
                pieces = _pieces_of(tuple(d["mesh_shape"]), tuple(mesh_ranks), tuple(d["shape"]),
                                    json.dumps(d["placements"], sort_keys=True))
            except ValueError as e:
                raise ValueError(f'tensor "{name}": {e}') from None
        else:  # a plain tensor: whole on each rank that has it
            pieces = ((tuple(holders[name]), [0] * len(d["shape"]), list(d["shape"])),)
        entry["pieces"] = _piece_entries(pieces)
        tensors.append(entry)
    return {"group": group, "mesh": {"shape": [len(views)]}, "nodes": list(nodes), "tensors": tensors}


def layout_from_dtensors(
    group: str,
    tensors: Mapping[str, Any],
    *,
    nodes: Optional[Sequence[str]] = None,
    ranks_per_node: Optional[int] = None,
    node_prefix: str = "node-",
    fused: Optional[Sequence[Mapping[str, Any]]] = None,
) -> dict:
    """The layout (JSON form, a dict) of a group holding `tensors`, DTensors keyed by name, on a
    device mesh whose ranks are 0..N-1 in row-major order, or on named submeshes of it, or on other
    meshes over the same ranks (their tensors as explicit pieces); plain tensors among them are
    replicated: every rank holds the same values. Every rank holds these same tensors (pipeline
    stages: describe_dtensors and layout_from_views). Say where ranks run with `nodes` (one node
    name per rank) or `ranks_per_node` (+ `node_prefix`); default: every rank on its own node."""
    if not tensors:
        raise ValueError("no tensors")
    meshes = _group_meshes(tensors)
    mesh = meshes[0]
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if ranks != list(range(len(ranks))):
        raise ValueError(f"the device mesh's ranks must be 0..{len(ranks) - 1} in row-major order (got {ranks})")
    out_tensors = []
    for name, t in tensors.items():
        entry = {"name": name, "shape": [int(s) for s in t.shape], "dtype": str(t.dtype).replace("torch.", "")}
        if hasattr(t, "device_mesh"):
            check_local_shard(name, t)
            entry.update(_placed(name, t, meshes))
        # else: a plain tensor (e.g. a norm weight TP leaves alone) is the same on every rank
        out_tensors.append(entry)
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
