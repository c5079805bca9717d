"""Layouts derived from what each side already knows, so nobody writes layout JSON by hand:

- a trainer has DTensors (FSDP2, TP, both): `layout_from_dtensors` reads their mesh and placements;
- an inference rank has its local tensors and its engine's parallel plan (tensor-parallel rank and
  size, replicas, which weights are column- or row-parallel, fused buffers such as qkv_proj and
  gate_up_proj, expert ranges): `inference_layout` turns a `ParallelPlan` and the model's full
  tensor shapes into the layout of the group the rank registers in (with replicas, by default its
  replica's group in a replica set), and `check_local_tensors` holds the local tensors to it;
  tensors the engine serves in block-scaled fp8 (`ParallelPlan.fp8`) add a float32 scale buffer
  per rank, whose shape `local_shapes` gives and `local_tensors` allocates.

Where the ranks run (their nodes) is gathered through torch.distributed when a process group is
there (`gather_nodes`), or given.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from shardcast.fp8 import scale_shape

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

    Ranks are numbered replica-major: rank = replica * tp_size + tp_rank. With `replicas` > 1 and
    `replica_set` (the default), each replica registers as a replica set (docs/daemon.md, "Replica
    sets"): replica k of group G is a group of its own, `G.r<k>` with replica_set G, whose ranks
    are its tp_size TP ranks; one sync into G writes every replica registered and cuts one that is
    dead, held or frozen while the others commit. With `replica_set=False` the replicas form one
    plain group of replicas x tp_size ranks (mesh [replicas, tp_size]): every rank commits or none.
    Names are the model's (logical) tensor names; `column`, `row` and `experts` are fnmatch
    patterns over them.
    - column-parallel weights (ColumnParallelLinear: q/k/v, gate/up) are split along their output
      dim (dim -2; dim 0 of a 1-D bias) over the TP ranks, torch.chunk-style;
    - row-parallel weights (RowParallelLinear: o_proj, down_proj) along their last dim;
    - anything else is replicated;
    - `fused` maps a local buffer name to its member tensors, concatenated along the members'
      output dim (vLLM's qkv_proj = [q; k; v], gate_up_proj = [gate; up], an expert-stacked
      w13 = [w1; w3] along dim 1);
    - `experts` names expert-stacked tensors (dim 0 = expert); with `expert_ranges` (one
      (start, stop) per TP rank) each rank holds only its experts, whole (expert parallelism);
      without, they are split like any other tensor;
    - `fp8` names the tensors the engine serves in block-scaled fp8 (docs/daemon.md, "fp8"): each
      lands as float8_e4m3fn, quantised by the source from its float32 or bfloat16 weights, with
      one float32 scale per `fp8_block` block of its last two dims (rounded up to a power of two
      with `fp8_pow2`) in a buffer of its own named `<name>_scale_inv` (`fp8_scale_name`: vLLM's
      `weight_scale_inv` for a `.weight`). The rank holds the scales of every block its part
      touches (`local_shapes` gives the shape, `local_tensors` allocates it).
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
    fp8: Sequence[str] = ()
    fp8_block: Tuple[int, int] = (128, 128)
    fp8_pow2: bool = False
    replica_set: bool = True

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not in [0, tp_size={self.tp_size})")
        if self.replicas < 1 or not 0 <= self.replica < self.replicas:
            raise ValueError(f"replica {self.replica} is not in [0, replicas={self.replicas})")
        if not isinstance(self.replica_set, bool):  # a layout's replica_set is the set's name; here it is a switch
            raise TypeError(f"replica_set is True or False (the set's name is the group given to register_inference), "
                            f"not {self.replica_set!r}")
        if self.expert_ranges is not None and len(self.expert_ranges) != self.tp_size:
            raise ValueError(f"expert_ranges has {len(self.expert_ranges)} entries for tp_size {self.tp_size}")
        for p in (self.column, self.row, self.experts, self.fp8):
            if isinstance(p, str):
                raise TypeError(f"patterns must be a sequence of strings, got the string {p!r}")
        block = tuple(self.fp8_block)
        if len(block) != 2 or not all(isinstance(b, int) and 1 <= b <= 1 << 20 for b in block):
            raise ValueError(f"fp8_block {self.fp8_block!r}: give two block sizes in [1, 2^20] (rows, columns)")

    @property
    def rank(self) -> int:
        return self.replica * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.replicas * self.tp_size

    @property
    def in_replica_set(self) -> bool:
        """Whether each replica registers as a group of its own in a replica set."""
        return self.replica_set and self.replicas > 1

    @property
    def group_rank(self) -> int:
        """This rank's number in the group it registers in: tp_rank in a replica's group, rank
        in one plain group."""
        return self.tp_rank if self.in_replica_set else self.rank

    @property
    def group_world(self) -> int:
        """The number of ranks of the group this rank registers in."""
        return self.tp_size if self.in_replica_set else self.world_size

    def group_name(self, group: str) -> str:
        """The group this rank registers in: `<group>.r<replica>` in replica set `group`, else `group`."""
        return f"{group}.r{self.replica}" if self.in_replica_set else group

    def describe(self) -> str:
        """"rank R (replica K, tp_rank T)", for messages."""
        return f"rank {self.rank} (replica {self.replica}, tp_rank {self.tp_rank})"

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

    def is_fp8(self, name: str) -> bool:
        """Whether `name` lands as block-scaled fp8."""
        return self._matches(self.fp8, name)

    def part(self, name: str, shape: Sequence[int], tp_rank: Optional[int] = None) -> Tuple[List[int], List[int]]:
        """(offsets, sizes) of the part of tensor `name` (full shape `shape`) that TP rank `tp_rank`
        (default: this plan's) holds."""
        t = self.tp_rank if tp_rank is None else tp_rank
        offsets, sizes = [0] * len(shape), [int(s) for s in shape]
        if self.expert_parallel(name):
            start, stop = (self.expert_ranges or [])[t]
            offsets[0], sizes[0] = start, stop - start
        else:
            split = self.split_dim(name, len(shape))
            if split is not None:
                start, stop = _chunk(shape[split], self.tp_size, t)
                offsets[split], sizes[split] = start, stop - start
        return offsets, sizes


FP8_DTYPE = "float8_e4m3fn"
_QUANTISABLE = ("float32", "bfloat16", FP8_DTYPE)  # what a source quantises from; fp8 when the model is the engine's


def fp8_scale_name(name: str) -> str:
    """The scale buffer of block-scaled tensor `name`: `<name>_scale_inv` (vLLM's checkpoint name:
    `x.weight` -> `x.weight_scale_inv`)."""
    return f"{name}_scale_inv"


def fp8_block(plan: ParallelPlan, ndim: int) -> List[int]:
    """The block of an fp8 tensor of `ndim` dims: `plan.fp8_block` over the last two, 1 before."""
    return [1] * (ndim - 2) + [int(b) for b in plan.fp8_block]


def fp8_tensors(plan: ParallelPlan, model: Mapping[str, Any]) -> List[str]:
    """The names of `model` that land as block-scaled fp8 under `plan`, checked: every `fp8`
    pattern matches a tensor, each such tensor has 2 dims or more, a dtype a source quantises
    (float32 or bfloat16; float8_e4m3fn when the model given is the engine's own) and a part on
    every rank, and no scale buffer name is already a tensor's or a fused buffer's."""
    specs = tensor_specs(model)
    names = [n for n in specs if plan.is_fp8(n)]
    for pattern in plan.fp8:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in specs):
            raise ValueError(f'fp8 pattern "{pattern}" matches no tensor of the model')
    for name in names:
        shape, dtype = specs[name]
        if len(shape) < 2:
            raise ValueError(f'tensor "{name}" {list(shape)}: fp8 blocks span the last two dims, so an fp8 tensor '
                             "needs 2 dims or more")
        if dtype not in _QUANTISABLE:
            raise ValueError(f'tensor "{name}" is {dtype}: a source quantises float32 or bfloat16 weights to fp8')
        scale = fp8_scale_name(name)
        if scale in specs or scale in plan.fused:
            raise ValueError(f'tensor "{name}": its scale buffer name "{scale}" is already a tensor or fused buffer')
        for t in range(plan.tp_size):
            offsets, sizes = plan.part(name, shape, t)
            if 0 in sizes:
                raise ValueError(f'tensor "{name}" {list(shape)}: tp_rank {t} holds none of it '
                                 f"(offsets {offsets}, sizes {sizes}); an fp8 tensor needs a part on every rank "
                                 "(fewer ranks, or leave it out of fp8)")
    for buffer, members in plan.fused.items():
        kinds = {plan.is_fp8(m) for m in members if m in specs}
        if len(kinds) > 1:
            raise ValueError(f'fused buffer "{buffer}": some members are fp8 and some are not; one buffer has one dtype')
    return names


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
    """The layout (JSON form) of the inference group rank `plan.rank` registers in, every rank of
    it following `plan` (with its own tp_rank / replica), for `model`'s tensors ({name: tensor or
    (shape, dtype)}: the full, logical shapes).

    In a replica set (`plan.in_replica_set`) that is replica `plan.replica`'s own group,
    `<group>.r<replica>` with replica_set `group`: mesh [tp_size], its TP ranks only. Otherwise
    the one group `group`, mesh [replicas, tp_size]. Say where ranks run with `nodes` (one per
    rank of the group; in a replica set, this replica's tp_size names or every replica's
    world_size names, replica-major, of which it takes its own) or `ranks_per_node` +
    `node_prefix` (rank r of the world on node `<node_prefix><r // ranks_per_node>`)."""
    specs = tensor_specs(model)
    if not specs:
        raise ValueError("the model has no tensors")
    _fused_members(plan, specs)  # validates the fused groups
    fp8 = set(fp8_tensors(plan, specs))
    in_set = plan.in_replica_set
    tensors = []
    for name, (shape, dtype) in specs.items():
        entry: Dict[str, Any] = {"name": name, "shape": list(shape), "dtype": dtype}
        if name in fp8:
            entry["dtype"] = FP8_DTYPE
            entry["block_scale"] = {"block": fp8_block(plan, len(shape)), "scale": fp8_scale_name(name),
                                    "pow2": bool(plan.fp8_pow2)}
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
                ranks = [t] if in_set else [r * plan.tp_size + t for r in range(plan.replicas)]
                pieces.append({"ranks": ranks, "offsets": [start] + [0] * (len(shape) - 1),
                               "sizes": [stop - start] + list(shape[1:])})
            entry["pieces"] = pieces
        else:
            tp = {"replicate": {}} if split is None else {"shard": {"dim": split}}
            entry["placements"] = [tp] if in_set else [{"replicate": {}}, tp]
        tensors.append(entry)
    layout: Dict[str, Any] = {"group": plan.group_name(group)}
    if in_set:
        layout.update(replica_set=group, replica=plan.replica, mesh={"shape": [plan.tp_size], "dim_names": ["tp"]})
    else:
        layout["mesh"] = {"shape": [plan.replicas, plan.tp_size], "dim_names": ["dp", "tp"]}
    layout["tensors"] = tensors
    first = plan.replica * plan.tp_size  # the world rank of this replica's tp_rank 0
    if nodes is not None:
        if in_set and len(nodes) == plan.world_size:
            nodes = list(nodes)[first:first + plan.tp_size]
        elif len(nodes) != plan.group_world:
            accepted = (f"{plan.tp_size} (replica {plan.replica}'s ranks) or {plan.world_size} (every replica's, "
                        "replica-major)") if in_set else f"{plan.world_size} (one per rank)"
            raise ValueError(f'group "{plan.group_name(group)}", {plan.describe()}: {len(nodes)} node names; '
                             f"give {accepted}")
        layout["nodes"] = list(nodes)
    elif ranks_per_node is not None:
        if in_set:  # the replica's ranks stay on the nodes their world ranks are on
            if int(ranks_per_node) < 1:
                raise ValueError(f'group "{plan.group_name(group)}", {plan.describe()}: ranks_per_node must be '
                                 f"positive, not {ranks_per_node}")
            layout["nodes"] = [f"{node_prefix}{(first + t) // int(ranks_per_node)}" for t in range(plan.tp_size)]
        else:
            layout["ranks_per_node"] = int(ranks_per_node)
            layout["node_prefix"] = node_prefix
    else:
        raise ValueError(f'group "{plan.group_name(group)}": say where its ranks run: nodes=[one per rank] or '
                         "ranks_per_node=")
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
    buffer, per tensor in none, and per fp8 tensor's scale buffer (a fused member's included)."""
    specs = tensor_specs(model)
    member_of = _fused_members(plan, specs)
    fp8 = set(fp8_tensors(plan, specs))
    local: Dict[str, Tuple[Tuple[int, ...], str]] = {}
    scales: Dict[str, Tuple[Tuple[int, ...], str]] = {}
    for name, (shape, dtype) in specs.items():
        offsets, sizes = plan.part(name, shape)
        if name in fp8:
            dtype = FP8_DTYPE
            scales[fp8_scale_name(name)] = (scale_shape(offsets, sizes, fp8_block(plan, len(shape))), "float32")
        local[name] = (tuple(sizes), dtype)
    out: Dict[str, Tuple[Tuple[int, ...], str]] = {n: v for n, v in local.items() if n not in member_of}
    out.update(scales)
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


def local_tensors(plan: ParallelPlan, model: Mapping[str, Any], device: Any = "cpu") -> Dict[str, Any]:
    """Zero-filled tensors on `device` for every buffer `local_shapes` gives rank `plan.rank`: its
    parts, fused buffers, and each fp8 tensor's float32 scale buffer, ready for
    Client.register_inference."""
    import torch

    return {name: torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
            for name, (shape, dtype) in local_shapes(plan, model).items()}


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
        raise ValueError(f"{plan.describe()}: "
                         + "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else ""))


def gather_step(group: Any, world: int, what: str, step: Callable[[], Any], who: str,
                exchange: Optional[Callable[[Any], List[Any]]] = None,
                name: Callable[[int], str] = str) -> List[Any]:
    """Runs `step` on this rank and gathers every rank's result (a list, by rank): a step that
    succeeds on every rank of a torch.distributed group or fails on all of them. When the step
    raised on any rank, raises on every rank, naming each failing rank (`who`: "trainer rank",
    "worker") and its error: a rank that raised alone would leave the others waiting in the next
    collective for good. Every rank of `group` (of `world` ranks) must call it; `group` None and
    `world` 1 run the step alone. `exchange` (instead of `group`): gathers one value from every
    rank, by rank (ranks spread over several groups: shardcast.vllm.engine's). `name(r)` names rank r
    in the message (its number, unless given)."""
    import torch

    try:
        value, error = step(), None
    except Exception as e:  # every rank hears of it
        value, error, raised = None, f"{type(e).__name__}: {e}", e
    out: List[Any] = [(error, value)]
    if exchange is not None:
        out = exchange((error, value))
    elif world > 1:
        out = [None] * world
        torch.distributed.all_gather_object(out, (error, value), group=group)
    failed = [(r, err) for r, (err, _) in enumerate(out) if err is not None]
    if failed:
        message = f"shardcast: {what} failed on {who}(s) " + "; ".join(f"{name(r)}: {e}" for r, e in failed)
        if error is not None:
            raise RuntimeError(message) from raised
        raise RuntimeError(message)
    return [v for _, v in out]


class GridRanks:
    """Ranks laid out as a grid of two process groups, each rank in one of each: `inner` (its
    position among `inner.world_size` neighbours) and `outer` (the ranks at the same inner position
    across the grid's rows). Rank = outer position x inner size + inner position: vLLM's workers,
    inner its tensor-parallel group and outer its pipeline group. For when no process group holds
    exactly these ranks: a gather goes through `inner`, then `outer`. Each group is given as vLLM's
    GroupCoordinator gives it (`cpu_group`, `world_size`, `rank_in_group`). Every rank must call
    each method. `where` (for messages) says where this rank sits; `who` names a rank; `positions`
    (for messages), with `outer` of more than one rank: the names of a rank's outer and inner
    positions ("pipeline stage", "TP rank"), added to its number where a step names it."""

    def __init__(self, inner: Any, outer: Any, where: str = "", who: str = "rank",
                 positions: Optional[Tuple[str, str]] = None) -> None:
        self.inner, self.outer = inner, outer
        self.rank = outer.rank_in_group * inner.world_size + inner.rank_in_group
        self.world = inner.world_size * outer.world_size
        self.where, self.who, self.positions = where, who, positions

    def name(self, rank: int) -> str:
        """Rank `rank` as a message names it: its number, and its positions where there are rows."""
        if self.positions is None or self.outer.world_size == 1:
            return str(rank)
        outer, inner = self.positions
        return f"{rank} ({outer} {rank // self.inner.world_size}, {inner} {rank % self.inner.world_size})"

    def gather(self, value: Any) -> List[Any]:
        """Every rank's `value`, by rank."""
        import torch

        row = [value]
        if self.inner.world_size > 1:
            row = [None] * self.inner.world_size
            torch.distributed.all_gather_object(row, value, group=self.inner.cpu_group)
        if self.outer.world_size == 1:
            return row
        rows: List[Any] = [None] * self.outer.world_size
        torch.distributed.all_gather_object(rows, row, group=self.outer.cpu_group)
        return [v for r in rows for v in r]

    def step(self, what: str, step: Callable[[], Any]) -> List[Any]:
        """gather_step over these ranks: `step` succeeds on every rank or raises on all of them,
        naming each failing rank by its number here (and its positions: `name`)."""
        return gather_step(None, self.world, what, step, self.who, exchange=self.gather, name=self.name)

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank."""
        import torch

        value = torch.tensor([int(flag)], dtype=torch.int32)
        for group in (self.inner, self.outer):
            if group.world_size > 1:
                torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
        return bool(value.item())


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
