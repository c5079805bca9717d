"""A vLLM worker's destination rank, from what `probe` found: the tensors it registers (views of
its live parameters where they are in the loader's layout, of a staging set in that layout where
they are not) and the group's layout (every rank's pieces, gathered). Before anything registers,
the checkpoint the trainer announces is matched against what vLLM's loaders did with it: every
element of every announced tensor lands somewhere in the group (`check_coverage`), every element
of every parameter it reaches is one checkpoint element or the loader's zero padding, each written
by exactly one tensor's box (`check_landings`), and the trainer's dtype reaches the parameter's
(`check_dtypes`).

A model vLLM serves in block-quantised fp8 (an fp8 checkpoint with `weight_block_size` in its
quantization_config) holds each linear layer's `weight` as float8_e4m3fn beside a float32
`weight_scale_inv`, one scale per block. `fp8_blocks` finds the checkpoint tensors that land in such
weights, `fp8_scales` names and sizes their scale tensors (vLLM's checkpoint names,
`<name>.weight_scale_inv`) for the probe, and `destination_layout` declares each such tensor
block-scaled: the trainer sends float32 or bfloat16, the source quantises, and the scales land in
vLLM's `weight_scale_inv` as they would from the fp8 checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from shardcast.fp8 import scale_shape
from shardcast.parallel import fp8_scale_name
from shardcast.vllm.probe import ParamMap, ProbeError

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.float64: "float64", torch.int8: "int8", torch.uint8: "uint8", torch.int32: "int32",
               torch.int64: "int64", torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


@dataclass
class RankMemory:
    """One worker's destination rank: the registered tensors (checkpoint name -> a view of the
    memory its box lands in), which parameters are direct and which processed, the processed ones'
    staging tensors, and this rank's pieces (checkpoint name -> (offsets, sizes))."""

    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    direct: List[str] = field(default_factory=list)
    processed: List[str] = field(default_factory=list)
    staging: Dict[str, torch.Tensor] = field(default_factory=dict)
    pieces: Dict[str, Tuple[List[int], List[int]]] = field(default_factory=dict)
    # What vLLM's processing must run on after bytes land (shardcast.vllm.apply): every processed
    # parameter (from its staging tensor) and every direct one whose layer derives kernel state
    # from it (from the live parameter itself: an lm_head the CPU backend prepacks keeps its
    # weight in the loader's layout, yet computes with a packed copy made from it).
    reprocess: Dict[str, torch.Tensor] = field(default_factory=dict)
    # Double-buffered: direct parameters land in a staging tensor of their own too, copied into the
    # live parameter when the update finishes (parameter name -> (staging, live)).
    flips: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # What a sync writes into each parameter, from the boxes (check_landings): parameter name ->
    # (elements, written by exactly one checkpoint tensor's box, zero padding no tensor writes).
    coverage: Dict[str, Tuple[int, int, int]] = field(default_factory=dict)

    def flip(self) -> None:
        """Puts double-buffered direct parameters' landed bytes into the live parameters (in place:
        their storage stays, so CUDA graphs over them stay valid)."""
        for staged, live in self.flips.values():
            live.data.copy_(staged.view(live.shape))


def is_direct(live: torch.Tensor, pm: ParamMap) -> bool:
    """The live parameter is exactly the loader's layout: bytes can land in it in place."""
    return (tuple(live.shape) == pm.shape and live.dtype == pm.dtype and live.is_contiguous()
            and live.device.type in ("cpu", "cuda"))


def derives_kernel_state(layer: torch.nn.Module) -> bool:
    """Whether vLLM processes `layer`'s weights after loading (a quantisation method, or the
    layer's own hook): then its kernels may compute with state derived from the parameters (a
    packed copy), and bytes landing in a parameter are not in service until that runs again."""
    try:
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    except ImportError:
        return True  # cannot tell: process it, which is never wrong
    return isinstance(getattr(layer, "quant_method", None), QuantizeMethodBase) or callable(
        getattr(layer, "process_weights_after_loading", None))


_KEEPS: Dict[Tuple[Any, ...], bool] = {}


def processing_keeps(layer: torch.nn.Module, local: str) -> bool:
    """Whether vLLM's processing of `layer` leaves its parameter `local` holding what it holds: then
    a parameter of the loader's shape and dtype is in the loader's layout live, and bytes may land
    in it. A layer whose processing rearranges a parameter in place, keeping its shape (the CPU
    backend prepacks FusedMoE's `w13_weight` and `w2_weight` that way), must not take bytes
    directly. Found by processing a copy of the layer from its live values, once per layer class,
    processing method, parameter shape, dtype and device: a rearrangement applied twice is not the
    one applied once. The copy costs one such layer's memory for a moment. A layer that
    cannot be copied or processed again counts as rearranging (its parameters are processed from
    staging, which is never wrong)."""
    live = getattr(layer, local)
    quant_method = getattr(layer, "quant_method", None)
    experts = getattr(getattr(quant_method, "moe_kernel", None), "fused_experts", None)
    key = (type(layer), type(quant_method), type(experts), local, tuple(live.shape), live.dtype, live.device.type)
    if key not in _KEEPS:
        _KEEPS[key] = _processed_copy_keeps(layer, local)
    return _KEEPS[key]


def _processed_copy_keeps(layer: torch.nn.Module, local: str) -> bool:
    import copy

    from shardcast.vllm.apply import run_processing

    try:
        clone = copy.deepcopy(layer)
        before = getattr(clone, local).detach().clone()
        run_processing(clone)
        after = getattr(clone, local)
    except Exception:  # vLLM's own code on a copy: any failure means "cannot tell"
        return False
    return (tuple(after.shape) == tuple(before.shape) and after.dtype == before.dtype
            and bool(torch.equal(after.detach(), before)))


def _kept_by_every_layer(param: torch.Tensor, live: Mapping[str, torch.Tensor],
                         modules: Optional[Mapping[str, torch.nn.Module]]) -> bool:
    """No layer holding `param` (under any of its names: a tied lm_head is the embedding's)
    rearranges it when processing."""
    for alias, other in live.items():
        if other is not param:
            continue
        prefix, _, local = alias.rpartition(".")
        layer = (modules or {}).get(prefix)
        if layer is not None and derives_kernel_state(layer) and not processing_keeps(layer, local):
            return False
    return True


def rank_memory(maps: Mapping[str, ParamMap], live: Mapping[str, torch.Tensor],
                modules: Mapping[str, torch.nn.Module] = None, double_buffer: bool = False) -> RankMemory:
    """The tensors this worker registers for `maps` (probe's result), `live` its named parameters
    (`named_parameters(remove_duplicate=False)`), `modules` its named modules (to tell which
    direct parameters' layers must be processed again; without them, all are). With
    `double_buffer`, no byte lands in a live parameter: direct ones get a staging tensor too
    (RankMemory.flips), so the engine serves its current weights until the update finishes, and a
    failed update leaves them as they were. A checkpoint tensor landing in two parameters of one
    worker is an error naming both (one rank holds one buffer per tensor)."""
    out = RankMemory(coverage=check_landings(maps))
    where: Dict[str, str] = {}
    for name, pm in maps.items():
        param = live[name]
        if is_direct(param, pm) and _kept_by_every_layer(param, live, modules):
            if double_buffer:
                # From the live values: elements no checkpoint element lands in (a vocab shard's
                # padding rows) keep theirs through the flip.
                staged = param.detach().clone()
                out.flips[name] = (staged, param)
                memory = staged.reshape(-1)
            else:
                memory = param.data.reshape(-1)
            out.direct.append(name)
            # The parameter under every name it has (a tied lm_head is the embedding's): each of
            # those layers may keep state derived from it.
            for alias, other in live.items():
                if other is not param:
                    continue
                layer = (modules or {}).get(alias.rpartition(".")[0])
                if layer is None or derives_kernel_state(layer):
                    out.reprocess[alias] = param
        else:
            staged = torch.zeros(pm.shape, dtype=pm.dtype, device=param.device)
            out.staging[name] = staged
            out.reprocess[name] = staged
            memory = staged.reshape(-1)
            out.processed.append(name)
        for l in pm.landings:
            if l.tensor in where:
                raise ProbeError(f"checkpoint tensor {l.tensor!r} lands in both {where[l.tensor]!r} and {name!r} "
                                 "on one worker; a rank holds one buffer per tensor")
            where[l.tensor] = name
            out.tensors[l.tensor] = memory[l.at:l.at + l.numel].view(l.sizes)
            out.pieces[l.tensor] = (list(l.offsets), list(l.sizes))
    return out


def fp8_blocks(maps: Mapping[str, ParamMap], modules: Mapping[str, torch.nn.Module]) -> Dict[str, List[int]]:
    """Checkpoint tensor -> block ([rows, columns], vLLM's `weight_block_size`) for every tensor
    that lands in a block-quantised fp8 weight: a float8_e4m3fn parameter `weight` of a layer with
    a `weight_block_size` and a `weight_scale_inv` (vLLM's Fp8LinearMethod with block quantisation)."""
    out: Dict[str, List[int]] = {}
    for name, pm in maps.items():
        prefix, _, local = name.rpartition(".")
        layer = modules.get(prefix)
        block = getattr(layer, "weight_block_size", None)
        if pm.dtype != torch.float8_e4m3fn or local != "weight" or block is None \
                or not hasattr(layer, "weight_scale_inv"):
            continue
        for l in pm.landings:
            out[l.tensor] = [int(b) for b in block]
    return out


def fp8_scales(shapes: Mapping[str, Sequence[int]], blocks: Mapping[str, Sequence[int]]) -> Dict[str, Tuple[int, ...]]:
    """The scale tensors of the fp8 tensors `blocks` names, as vLLM's checkpoint has them: name ->
    full shape (one per block, ceil(shape / block)). A trainer that announces one itself is refused
    (the source computes the scales, and the daemon refuses a source tensor of that name)."""
    out: Dict[str, Tuple[int, ...]] = {}
    for name, block in blocks.items():
        scale = fp8_scale_name(name)
        if scale in shapes:
            raise ProbeError(f"checkpoint tensor {scale!r}: the trainer announces it, but vLLM holds {name!r} in "
                             "block-quantised fp8 and the sync computes its scales from the trainer's weights; "
                             "announce the float32 or bfloat16 weight only")
        shape = [int(s) for s in shapes[name]]
        full = [1] * (len(shape) - len(block)) + [int(b) for b in block]
        out[scale] = tuple(-(-s // b) for s, b in zip(shape, full))
    return out


def destination_layout(group: str, nodes: Sequence[str], pieces: Sequence[Mapping[str, Tuple[List[int], List[int]]]],
                       checkpoint: Mapping[str, Tuple[Sequence[int], torch.dtype]],
                       fp8: Optional[Mapping[str, Sequence[int]]] = None) -> Dict[str, Any]:
    """The group's layout (the JSON form of shardcast.v1.Layout): rank r on nodes[r] holds
    pieces[r] (checkpoint name -> (offsets, sizes)); `checkpoint` gives each tensor's full shape and
    the dtype the destination holds it in. Tensors no rank holds are left out.

    `fp8` (fp8_blocks' result: tensor -> block) declares those tensors block-scaled fp8; their
    scale tensors (fp8_scales) are derived by the daemon, not declared, and each rank's piece of
    one must be exactly the blocks its piece of the weight touches (the buffer the daemon fills),
    or a ProbeError names both."""
    if len(nodes) != len(pieces):
        raise ValueError(f"{len(nodes)} nodes for {len(pieces)} ranks")
    fp8 = dict(fp8 or {})
    scales = {fp8_scale_name(name): name for name in fp8}
    tensors = []
    for name, (shape, dtype) in checkpoint.items():
        if name in scales:
            continue
        held = [{"rank": r, "offsets": list(p[name][0]), "sizes": list(p[name][1])}
                for r, p in enumerate(pieces) if name in p]
        if not held:
            continue
        entry: Dict[str, Any] = {"name": name, "shape": [int(s) for s in shape], "pieces": held}
        if name in fp8:
            block = [1] * (len(shape) - len(fp8[name])) + [int(b) for b in fp8[name]]
            _check_scale_pieces(name, block, pieces)
            dtype = torch.float8_e4m3fn
            entry["block_scale"] = {"block": block, "scale": fp8_scale_name(name)}
        if dtype not in DTYPE_NAMES:
            raise ProbeError(f"checkpoint tensor {name!r}: dtype {dtype} has no Shardcast name")
        entry["dtype"] = DTYPE_NAMES[dtype]
        tensors.append(entry)
    return {"group": group, "mesh": {"shape": [len(nodes)]}, "nodes": list(nodes), "tensors": tensors}


def _check_scale_pieces(name: str, block: Sequence[int], pieces: Sequence[Mapping[str, Tuple[List[int], List[int]]]]):
    scale = fp8_scale_name(name)
    for r, p in enumerate(pieces):
        if name not in p:
            continue
        offsets, sizes = p[name]
        want = ([int(o) // b for o, b in zip(offsets, block)], list(scale_shape(offsets, sizes, block)))
        got = p.get(scale)
        if got is None or (list(got[0]), list(got[1])) != want:
            raise ProbeError(f"rank {r}: {name!r} lands as {_box(offsets, sizes)}, whose scales are blocks "
                             f"{_box(*want)} of {scale!r}, but vLLM's loader puts "
                             f"{_box(*got) if got else 'none of them'} on this rank")


# Source -> destination dtypes a sync takes (planner::convertible, the daemon's rule): the same
# dtype, float32 into bfloat16 (rounded at the source), and float32 or bfloat16 into a
# block-scaled float8_e4m3fn (quantised at the source; only where `fp8_blocks` finds vLLM's
# block-quantised weight, whose scales the sync then writes too).
_SYNC_CONVERTS = {("float32", "bfloat16")}
_FP8_FROM = {"float32", "bfloat16"}


def check_dtypes(maps: Mapping[str, ParamMap], announced: Mapping[str, str],
                 fp8: Optional[Mapping[str, Sequence[int]]] = None) -> None:
    """Every checkpoint tensor's dtype as the trainer announces it (name -> torch dtype name)
    reaches the dtype of the parameter it lands in, or a ProbeError names both. `fp8`: the tensors
    landing in block-quantised fp8 weights (fp8_blocks)."""
    for name, pm in maps.items():
        held = DTYPE_NAMES.get(pm.dtype, str(pm.dtype))
        for l in pm.landings:
            sent = announced.get(l.tensor, held)
            if l.tensor in (fp8 or {}) and held == "float8_e4m3fn" and sent in _FP8_FROM:
                continue
            if sent != held and (sent, held) not in _SYNC_CONVERTS:
                raise ProbeError(f"checkpoint tensor {l.tensor!r} is {sent} in the trainer, vLLM's parameter {name!r} "
                                 f"holds {held}: a sync writes a tensor in its own dtype, float32 into bfloat16, or "
                                 "float32 or bfloat16 into a block-quantised fp8 weight")


def check_landings(maps: Mapping[str, ParamMap]) -> Dict[str, Tuple[int, int, int]]:
    """Every element of every parameter `maps` names is written by exactly one checkpoint tensor's
    box, or is padding the loader zero-fills: the boxes do not overlap, and none is left that no
    announced tensor writes (a tensor the trainer does not announce, or announces too small).
    Returns, per parameter, (elements, written, padding); raises a ProbeError naming the parameter
    and the elements otherwise."""
    out: Dict[str, Tuple[int, int, int]] = {}
    for name, pm in maps.items():
        spans = sorted((l.at, l.at + l.numel, l.tensor) for l in pm.landings)
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if start < end:
                raise ProbeError(f"vLLM's parameter {name!r}: {first!r} and {second!r} both land in elements "
                                 f"[{start}:{end}] of it")
        if pm.untouched:
            a, b = pm.untouched[0]
            near = sorted({t for s0, e0, t in spans if e0 == a or s0 == b})
            raise ProbeError(f"vLLM's parameter {name!r} (shape {list(pm.shape)} on this rank): elements [{a}:{b}] "
                             f"(of {sum(e - s for s, e in pm.untouched)} in all) are written by no announced "
                             f"checkpoint tensor" + (f" (next to {', '.join(map(repr, near))}: announced smaller than "
                                                     "vLLM's loader takes it?)" if near else ""))
        written = sum(e - s for s, e, _ in spans)
        if written + pm.padding != pm.numel:
            raise ProbeError(f"vLLM's parameter {name!r}: {written} elements written and {pm.padding} zero padding "
                             f"of {pm.numel}")
        out[name] = (pm.numel, written, pm.padding)
    return out


def check_coverage(shapes: Mapping[str, Sequence[int]], ranks: Sequence[Mapping[str, Tuple[Any, Any, str]]]) -> None:
    """Every element of every announced checkpoint tensor (name -> shape) lands on some rank of
    the group: `ranks[r]` maps each tensor rank r holds to (offsets, sizes, the vLLM parameter it
    lands in). Replicated boxes (a KV head on several ranks) are fine; an element no rank takes
    (a tensor announced larger than vLLM's, a name no parameter takes) is a ProbeError naming the
    tensor, the elements and where the rest of it lands. Exact, from the boxes alone; one pass over
    the ranks' boxes (a MoE checkpoint names tens of thousands of tensors)."""
    landed: Dict[str, List[Tuple[List[int], List[int], str, int]]] = {}
    for r, held in enumerate(ranks):
        for n, (offsets, sizes, param) in held.items():
            landed.setdefault(n, []).append((list(offsets), list(sizes), param, r))
    for name, shape in shapes.items():
        shape = [int(s) for s in shape]
        boxes = landed.get(name, [])
        gap = _uncovered(shape, [(o, s) for o, s, _, _ in boxes])
        if gap is None:
            continue
        if not boxes:
            raise ProbeError(f"checkpoint tensor {name!r} (shape {shape}) lands in no parameter of vLLM's model (a "
                             f"name it does not load, or one its loader skips); a trainer-only tensor is left out "
                             f"with name_map={{{name!r}: None}}")
        takes = "; ".join(sorted({f"{param!r} takes {_box(o, s)} (rank {r})" for o, s, param, r in boxes}))
        raise ProbeError(f"checkpoint tensor {name!r} (shape {shape}): its elements {_box(*gap)} land in no "
                         f"parameter of vLLM's model, which takes less of it: {takes}")


def _box(offsets: Sequence[int], sizes: Sequence[int]) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes)) + "]"


def _uncovered(shape: Sequence[int], boxes: Sequence[Tuple[Sequence[int], Sequence[int]]]):
    """(offsets, sizes) of a part of a tensor of `shape` that none of `boxes` covers, or None. Cuts
    each dimension at every box's edges: every cell of that grid is inside a box or outside all."""
    cuts = []
    for d, n in enumerate(shape):
        edges = {0, n}
        for o, s in boxes:
            edges.update((min(max(o[d], 0), n), min(max(o[d] + s[d], 0), n)))
        cuts.append(sorted(edges))
    spans = [list(zip(c, c[1:])) for c in cuts]
    for cell in product(*spans):
        if any(all(o[d] <= a and b <= o[d] + s[d] for d, (a, b) in enumerate(cell)) for o, s in boxes):
            continue
        return [a for a, _ in cell], [b - a for a, b in cell]
    return None
