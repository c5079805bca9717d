"""Layouts derived from what each side already knows, so nobody writes layout JSON by hand:

- a trainer has DTensors (FSDP2, TP, both): `layout_from_dtensors` reads their mesh and placements;
- an inference rank has its local tensors and its engine's parallel plan (tensor-parallel rank and
  size, replicas, which weights are column- or row-parallel, fused buffers such as qkv_proj and
  gate_up_proj, expert ranges): `inference_layout` turns a `ParallelPlan` and the model's full
  tensor shapes into the group's layout, and `check_local_tensors` holds the local tensors to it.

Where the ranks run (their nodes) is gathered through torch.distributed when a process group is
there (`gather_nodes`), or given.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

TensorSpec = Tuple[Tuple[int, ...], str]  # (global shape, torch dtype name)


def dtype_name(dtype: Any) -> str:
    """The torch name of a dtype given as a torch dtype, a numpy dtype or a string."""
    text = str(dtype)
    if text.startswith("torch."):
        return text[len("torch."):]
    return {"float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32"}.get(text, text)


def tensor_specs(model: Mapping[str, Any]) -> Dict[str, TensorSpec]:
    """{name: (shape, dtype)} from tensors (a meta-device model's state_dict or named_parameters
    will do: only shapes and dtypes are read) or from (shape, dtype) pairs."""
    out: Dict[str, TensorSpec] = {}
    for name, v in model.items():
        if isinstance(v, tuple) and len(v) == 2:
            shape, dtype = v
        else:
            shape, dtype = v.shape, v.dtype
        out[name] = (tuple(int(s) for s in shape), dtype_name(dtype))
    return out


@dataclass(frozen=True)
class ParallelPlan:
    """How an inference engine holds the model on one rank, in vLLM's terms.

    Ranks are numbered replica-major: rank = replica * tp_size + tp_rank. Names are the model's
    (logical) tensor names; `column`, `row` and `experts` are fnmatch patterns over them.
    - column-parallel weights (ColumnParallelLinear: q/k/v, gate/up) are split along their output
      dim (dim -2; dim 0 of a 1-D bias) over the TP ranks, torch.chunk-style;
    - row-parallel weights (RowParallelLinear: o_proj, down_proj) along their last dim;
    - anything else is replicated;
    - `fused` maps a local buffer name to its member tensors, concatenated along the members'
      output dim (vLLM's qkv_proj = [q; k; v], gate_up_proj = [gate; up], an expert-stacked
      w13 = [w1; w3] along dim 1);
    - `experts` names expert-stacked tensors (dim 0 = expert); with `expert_ranges` (one
      (start, stop) per TP rank) each rank holds only its experts, whole (expert parallelism);
      without, they are split like any other tensor.
    """

    tp_size: int = 1
    tp_rank: int = 0
    replicas: int = 1
    replica: int = 0
    column: Sequence[str] = ()
    row: Sequence[str] = ()
    fused: Mapping[str, Sequence[str]] = field(default_factory=dict)
    experts: Sequence[str] = ()
    expert_ranges: Optional[Sequence[Tuple[int, int]]] = None

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not in [0, tp_size={self.tp_size})")
        if self.replicas < 1 or not 0 <= self.replica < self.replicas:
            raise ValueError(f"replica {self.replica} is not in [0, replicas={self.replicas})")
        if self.expert_ranges is not None and len(self.expert_ranges) != self.tp_size:
            raise ValueError(f"expert_ranges has {len(self.expert_ranges)} entries for tp_size {self.tp_size}")
        for p in (self.column, self.row, self.experts):
            if isinstance(p, str):
                raise TypeError(f"patterns must be a sequence of strings, got the string {p!r}")

    @property
    def rank(self) -> int:
        return self.replica * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.replicas * self.tp_size

    def _matches(self, patterns: Sequence[str], name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in patterns)

    def split_dim(self, name: str, ndim: int) -> Optional[int]:
        """The tensor dim `name` is split along over the TP ranks (None: not split)."""
        column, row = self._matches(self.column, name), self._matches(self.row, name)
        if column and row:
            raise ValueError(f'tensor "{name}" matches both a column- and a row-parallel pattern')
        if column:
            return max(ndim - 2, 0)
        if row:
            return ndim - 1
        return None

    def expert_parallel(self, name: str) -> bool:
        return self.expert_ranges is not None and self._matches(self.experts, name)


def _chunk(n: int, k: int, i: int) -> Tuple[int, int]:
    """[start, stop) of torch.chunk(range(n), k)[i] (empty past the last chunk)."""
    size = -(-n // k)
    return min(i * size, n), min((i + 1) * size, n)


def _fused_members(plan: ParallelPlan, specs: Mapping[str, TensorSpec]) -> Dict[str, str]:
    member_of: Dict[str, str] = {}
    for buffer, members in plan.fused.items():
        if isinstance(members, str) or not members:
            raise ValueError(f'fused buffer "{buffer}": give its member tensors as a non-empty list')
        for m in members:
            if m not in specs:
                raise ValueError(f'fused buffer "{buffer}": member "{m}" is not a tensor of the model')
            if m in member_of:
                raise ValueError(f'tensor "{m}" is in fused buffers "{member_of[m]}" and "{buffer}"')
            member_of[m] = buffer
    return member_of


def inference_layout(group: str, plan: ParallelPlan, model: Mapping[str, Any], *,
                     nodes: Optional[Sequence[str]] = None, ranks_per_node: Optional[int] = None,
                     node_prefix: str = "node-") -> dict:
    """The layout (JSON form) of an inference group whose every rank follows `plan` (with its own
    tp_rank / replica) for `model`'s tensors ({name: tensor or (shape, dtype)}: the full, logical
    shapes). Say where ranks run with `nodes` (one per rank) or `ranks_per_node` + `node_prefix`."""
    specs = tensor_specs(model)
    if not specs:
        raise ValueError("the model has no tensors")
    _fused_members(plan, specs)  # validates the fused groups
    tensors = []
    for name, (shape, dtype) in specs.items():
        entry: Dict[str, Any] = {"name": name, "shape": list(shape), "dtype": dtype}
        split = plan.split_dim(name, len(shape))
        if plan.expert_parallel(name):
            if split is not None:
                raise ValueError(f'tensor "{name}" is expert-parallel and split over TP too: experts are held whole')
            if not shape:
                raise ValueError(f'tensor "{name}": an expert-stacked tensor needs an expert dim')
            pieces = []
            for t, (start, stop) in enumerate(plan.expert_ranges or ()):
                if not 0 <= start <= stop <= shape[0]:
                    raise ValueError(f'tensor "{name}": expert range [{start}, {stop}) of TP rank {t} is outside '
                                     f"[0, {shape[0]})")
                ranks = [r * plan.tp_size + t for r in range(plan.replicas)]
                pieces.append({"ranks": ranks, "offsets": [start] + [0] * (len(shape) - 1),
                               "sizes": [stop - start] + list(shape[1:])})
            entry["pieces"] = pieces
        else:
            tp = {"replicate": {}} if split is None else {"shard": {"dim": split}}
            entry["placements"] = [{"replicate": {}}, tp]
        tensors.append(entry)
    layout: Dict[str, Any] = {"group": group, "mesh": {"shape": [plan.replicas, plan.tp_size],
                                                      "dim_names": ["dp", "tp"]}, "tensors": tensors}
    if nodes is not None:
        if len(nodes) != plan.world_size:
            raise ValueError(f"{len(nodes)} node names for {plan.world_size} ranks")
        layout["nodes"] = list(nodes)
    elif ranks_per_node is not None:
        layout["ranks_per_node"] = int(ranks_per_node)
        layout["node_prefix"] = node_prefix
    else:
        raise ValueError("say where the group's ranks run: nodes=[one per rank] or ranks_per_node=")
    fused = []
    for buffer, members in plan.fused.items():
        ndims = {len(specs[m][0]) for m in members}
        if len(ndims) != 1:
            raise ValueError(f'fused buffer "{buffer}": members have different numbers of dims')
        fused.append({"name": buffer, "dim": max(ndims.pop() - 2, 0), "tensors": list(members)})
    if fused:
        layout["fused"] = fused
    return layout


def local_shapes(plan: ParallelPlan, model: Mapping[str, Any]) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """{buffer: (local shape, dtype)} that rank `plan.rank` holds under `plan`: one entry per fused
    buffer and per tensor in none."""
    specs = tensor_specs(model)
    member_of = _fused_members(plan, specs)
    local: Dict[str, Tuple[Tuple[int, ...], str]] = {}
    for name, (shape, dtype) in specs.items():
        dims = list(shape)
        if plan.expert_parallel(name):
            start, stop = (plan.expert_ranges or [])[plan.tp_rank]
            dims[0] = stop - start
        else:
            split = plan.split_dim(name, len(shape))
            if split is not None:
                start, stop = _chunk(shape[split], plan.tp_size, plan.tp_rank)
                dims[split] = stop - start
        local[name] = (tuple(dims), dtype)
    out: Dict[str, Tuple[Tuple[int, ...], str]] = {n: v for n, v in local.items() if n not in member_of}
    for buffer, members in plan.fused.items():
        first_shape, dtype = local[members[0]]
        dim = max(len(first_shape) - 2, 0)
        dims = list(first_shape)
        dims[dim] = sum(local[m][0][dim] for m in members)
        for m in members[1:]:
            other = list(local[m][0])
            if local[m][1] != dtype:
                raise ValueError(f'fused buffer "{buffer}": member "{m}" is {local[m][1]}, "{members[0]}" is {dtype}')
            other[dim] = dims[dim]
            if other != dims:
                raise ValueError(f'fused buffer "{buffer}": member "{m}" local shape {local[m][0]} does not stack '
                                 f"with {first_shape} along dim {dim}")
        out[buffer] = (tuple(dims), dtype)
    return out


def check_local_tensors(plan: ParallelPlan, model: Mapping[str, Any], tensors: Mapping[str, Any]) -> None:
    """Raises ValueError naming every local tensor that is missing, extra, or of another shape or
    dtype than `plan` gives this rank."""
    want = local_shapes(plan, model)
    problems: List[str] = []
    for name in want:
        if name not in tensors:
            problems.append(f'"{name}" is missing (expected {list(want[name][0])} {want[name][1]})')
    for name, t in tensors.items():
        if name not in want:
            problems.append(f'"{name}" is not a tensor or fused buffer of the plan')
            continue
        shape, dtype = tuple(int(s) for s in t.shape), dtype_name(t.dtype)
        if (shape, dtype) != want[name]:
            problems.append(f'"{name}" is {list(shape)} {dtype}, the plan gives tp_rank {plan.tp_rank} '
                            f"{list(want[name][0])} {want[name][1]}")
    if problems:
        raise ValueError(f"rank {plan.rank} (replica {plan.replica}, tp_rank {plan.tp_rank}): "
                         + "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else ""))


def gather_nodes(node: str, world_size: int, process_group: Any = None) -> List[str]:
    """Every rank's node, in rank order, gathered through torch.distributed (each rank passes its
    own node; `process_group` must hold exactly the group's ranks, in rank order)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized: pass nodes= (one per rank) instead")
    size = dist.get_world_size(process_group)
    if size != world_size:
        raise ValueError(f"the process group has {size} ranks, the layout {world_size}: pass the group's own "
                         "process_group or nodes=")
    out: List[Any] = [None] * size
    dist.all_gather_object(out, node, group=process_group)
    return [str(n) for n in out]
