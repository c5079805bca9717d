"""Where each checkpoint tensor's elements land in a vLLM worker's parameters, found by running
vLLM's own weight loaders on index tensors: no table per architecture.

Every parameter is probed in the loader's layout, the one `model.load_weights` writes (for a layer
whose kernels hold repacked weights, the layout vLLM recorded before processing them,
`record_metadata_for_reloading`). Each checkpoint tensor is handed to `load_weights` holding its
own element indices (float64, exact below 2^53), into probe parameters filled with -1; what each
probe then holds says, element by element, which checkpoint element the loader put there. The live
parameters are swapped out for the probes during the call and put back after it.

The result, per parameter, is a list of `Landing`s: a box of one checkpoint tensor, and where its
row-major elements start in the parameter (they must be contiguous there), and the elements no
loader wrote. A loader whose result is not of that form (a transposed or permuted copy) is reported
naming the parameter; a loader that refuses a checkpoint tensor (a wrong shape, a name the model
does not have) is reported naming the tensor and the parameter it was loading into, not in vLLM's
words alone.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

MISSING = -1.0  # what a probe element holds when no loader wrote it
FIRST = 1  # checkpoint elements are numbered from here: loaders zero-fill padding (vocab rows)
EXACT = 2 ** 53  # float64 holds every integer below this exactly


class ProbeError(RuntimeError):
    """A parameter's loader does something this backend cannot land bytes for; names it."""


@dataclass(frozen=True)
class Landing:
    """Elements of checkpoint tensor `tensor` in the box [offsets, offsets + sizes), row-major,
    sitting at element `at` of the parameter onward."""

    tensor: str
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    at: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


@dataclass
class ParamMap:
    """One parameter in the loader's layout: its shape and dtype there, and what lands in it."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    landings: List[Landing]
    # Element ranges [start, end) of the flattened parameter that no loader wrote (MISSING), and
    # how many elements a loader zero-filled (a vocab shard's padding rows): neither holds any
    # checkpoint element.
    untouched: Tuple[Tuple[int, int], ...] = ()
    padding: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _loader_layout(model: torch.nn.Module) -> Dict[str, Tuple[torch.nn.Module, str, torch.Tensor]]:
    """Every parameter as `load_weights` sees it: (its module, its name there, a template tensor
    carrying its loader-layout shape, dtype and attributes, the weight loader among them)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError as e:  # a vLLM without the layerwise reload machinery
        raise ProbeError(f"this vLLM has no layerwise reload metadata ({e}); it needs vLLM >= 0.2x") from None
    out: Dict[str, Tuple[torch.nn.Module, str, torch.Tensor]] = {}
    for prefix, module in model.named_modules():
        recorded: Mapping[str, torch.Tensor] = {}
        info = LAYERWISE_INFO.get(module)
        if info is not None:
            recorded = info.restore_metadata[0]
        for local, live in module.named_parameters(recurse=False):
            full = f"{prefix}.{local}" if prefix else local
            # Recorded at construction (on the meta device); a tensor never moved there (a bias)
            # is in its loader's form live.
            out[full] = (module, local, recorded.get(local, live))
    return out


def _probe_for(template: torch.Tensor, module: torch.nn.Module, device: str = "cpu") -> torch.Tensor:
    """A float64 tensor of the template's shape, filled with MISSING, of its class (vLLM's parameter
    classes carry the loader) and with its attributes, loader methods bound to `module` (the
    recorded ones are kept unbound from it: vLLM's reload metadata must not reference its layers).
    On the meta device it holds no memory: what a loader writes into it is dropped."""
    from types import MethodType

    probe = (torch.full(tuple(template.shape), MISSING, dtype=torch.float64) if device == "cpu"
             else torch.empty(tuple(template.shape), dtype=torch.float64, device=device))
    probe.__class__ = template.__class__
    attrs = template.__dict__.copy()
    for key, value in attrs.items():
        if isinstance(value, MethodType) and not isinstance(value.__self__, torch.nn.Module):
            attrs[key] = value.__func__.__get__(module)  # vLLM's sentinel for "the layer"
    probe.__dict__ = attrs
    return probe


_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def layer_of(name: str) -> Optional[int]:
    """The decoder layer a parameter or checkpoint tensor belongs to by its name ("model.layers.7.
    mlp..." is 7), or None (embeddings, norms, lm_head)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def probe(model: torch.nn.Module, checkpoint: Mapping[str, Sequence[int]],
          names: Optional[Iterable[str]] = None) -> Dict[str, ParamMap]:
    """Runs `model.load_weights` on index tensors for `checkpoint` (name -> full shape) and maps
    every parameter it writes (all of them, or those in `names`). Parameters no checkpoint element
    lands in are left out (`unreached` names them). A loader that refuses a tensor is a ProbeError
    naming the tensor, its shape and the parameter it was loading into.

    One decoder layer at a time (`layer_of`): the layer's checkpoint tensors are loaded into float64
    probes of that layer's parameters and of those in no layer (which stay for every pass), the
    other layers' parameters being probes on the meta device. So a worker holds the float64 probes
    of one layer beside the embeddings, not of its whole model (8 bytes per element: four times a
    bfloat16 model). Where a loader touches another layer's parameter than the tensor it loads
    (a checkpoint name in no layer loaded into one, a block shared by several layers), the whole
    model is probed again in one pass: what it finds is what one pass finds."""
    layout = _loader_layout(model)
    wanted = set(layout) if names is None else set(names)
    bases: Dict[str, int] = {}
    total = FIRST
    for name, shape in checkpoint.items():
        bases[name] = total
        n = 1
        for s in shape:
            n *= int(s)
        total += n
    if total >= EXACT:
        raise ProbeError(f"{total} checkpoint elements: probe in parts (at most 2^53 at once)")
    order = sorted(bases.items(), key=lambda kv: kv[1])
    starts = torch.tensor([b for _, b in order], dtype=torch.float64)
    out: Dict[str, ParamMap] = {}

    def mapped(full: str, p: torch.Tensor) -> None:
        template = layout[full][2]
        flat = p.detach().reshape(-1)
        landings = _landings(full, flat, order, starts, checkpoint)
        if landings:
            out[full] = ParamMap(full, tuple(template.shape), template.dtype, landings,
                                 untouched=tuple(_runs(flat == MISSING)), padding=int((flat == 0).sum()))

    layers: Dict[Optional[int], List[str]] = {}
    for name in checkpoint:
        layers.setdefault(layer_of(name), []).append(name)
    try:
        _passes(model, checkpoint, layout, wanted, bases, layers, mapped)
    except _CrossLayer as crossed:
        # A loader touched a parameter of another layer than the tensor it loads (vLLM's EAGLE
        # heads load `midlayer.` into `layers.0.`, Zamba2 shares one block between layers): the
        # whole model is probed at once, as its loaders need.
        logging.getLogger("shardcast").warning(
            "shardcast: vLLM's loaders touched parameter %r while loading another layer's checkpoint tensors: "
            "probing the whole model at once (float64 probes of every parameter)", str(crossed))
        out.clear()
        _passes(model, checkpoint, layout, wanted, bases, {None: list(checkpoint)}, mapped, whole=True)
    # Parameters no layer's pass probed for real (a layer without checkpoint tensors): unreached.
    return {full: out[full] for full in layout if full in out}


class _CrossLayer(Exception):
    """A pass's loader touched a parameter probed on the meta device (another layer's)."""


def _passes(model: torch.nn.Module, checkpoint: Mapping[str, Sequence[int]], layout, wanted, bases: Mapping[str, int],
            layers: Mapping[Optional[int], List[str]], mapped, whole: bool = False) -> None:
    """Runs `load_weights` once per entry of `layers` (a layer's checkpoint tensors; None: those in no
    layer) into probes: real ones for that layer's parameters and those in no layer (kept for every
    pass), meta ones for the others; `whole`: every parameter real, in one pass. Hands each real
    probe to `mapped` when its pass is done (those in no layer after the last). Raises _CrossLayer
    when a loader touches a meta probe; the live parameters are back in place whatever happens."""
    shared = {full: _probe_for(layout[full][2], layout[full][0]) for full in layout
              if full in wanted and (whole or layer_of(full) is None)}
    saved = [(module, local, module._parameters[local]) for full, (module, local, _) in layout.items()
             if full in wanted]
    loading = _Loading()
    watch: Optional[_Watch] = None
    try:
        for layer in sorted(layers, key=lambda k: -1 if k is None else k):
            probes = dict(shared)
            for full, (module, local, template) in layout.items():
                if full in wanted and full not in shared:
                    probes[full] = _probe_for(template, module, "cpu" if layer_of(full) == layer else "meta")
                if full in probes:
                    module._parameters[local] = probes[full]

            def indices():
                for name in layers[layer]:
                    n = 1
                    for s in checkpoint[name]:
                        n *= int(s)
                    loading.tensor, loading.param = name, None
                    yield name, torch.arange(bases[name], bases[name] + n, dtype=torch.float64).reshape(
                        tuple(int(s) for s in checkpoint[name]))
                loading.tensor = None

            watch = _Watch(probes, loading)
            with torch.no_grad(), watch:
                model.load_weights(indices())
            if watch.crossed is not None:
                raise _CrossLayer(watch.crossed)
            for full, p in probes.items():
                if full not in shared and p.device.type != "meta":
                    mapped(full, p)
            del probes  # this layer's go as the next pass puts meta probes in their place
    except _CrossLayer:
        raise
    except Exception as e:
        if watch is not None and watch.crossed is not None:  # it failed on another layer's meta probe
            raise _CrossLayer(watch.crossed) from e
        raise ProbeError(loading.refusal(model, checkpoint, layout, e)) from e
    finally:
        for module, local, live in saved:
            module._parameters[local] = live
    for full, p in shared.items():
        mapped(full, p)


def unreached(model: torch.nn.Module, maps: Mapping[str, ParamMap]) -> List[str]:
    """The parameters of `model` that `load_weights` fills (in the loader's layout) but that no
    checkpoint element of a probe reached, under any of their names (a tied lm_head is the
    embedding's parameter: reached through it)."""
    reached = set()
    by_param: Dict[int, List[str]] = {}
    for full, (module, local, _) in _loader_layout(model).items():
        key = id(module._parameters[local])
        by_param.setdefault(key, []).append(full)
        if full in maps:
            reached.add(key)
    return sorted(names[0] for key, names in by_param.items() if key not in reached)


class _Loading:
    """What `load_weights` is doing during a probe: the checkpoint tensor it was handed last and
    the probe parameter it touched last while loading it."""

    def __init__(self) -> None:
        self.tensor: Optional[str] = None
        self.param: Optional[str] = None

    def refusal(self, model: torch.nn.Module, checkpoint: Mapping[str, Sequence[int]], layout, error) -> str:
        """Why the probe failed, in the checkpoint's and the parameters' names: vLLM's own message
        (an assertion about sizes) names neither."""
        said = " ".join(f"{type(error).__name__}: {error}".split())
        said = said if len(said) <= 300 else said[:300] + "..."
        if self.tensor is None:
            return f"vLLM's {type(model).__name__}.load_weights failed after the last checkpoint tensor ({said})"
        shape = [int(s) for s in checkpoint[self.tensor]]
        if self.param is None:
            return (f"checkpoint tensor {self.tensor!r} (shape {shape}): no parameter of vLLM's "
                    f"{type(model).__name__} takes it (vLLM: {said}); a trainer-only tensor is left out with "
                    f"name_map={{{self.tensor!r}: None}}")
        held = [int(s) for s in layout[self.param][2].shape]
        return (f"checkpoint tensor {self.tensor!r} (shape {shape}) does not fit vLLM's parameter {self.param!r} "
                f"(shape {held} on this rank): its loader refuses it (vLLM: {said})")


_METADATA = {"__get__", "size", "dim", "numel", "stride", "is_contiguous", "element_size", "storage_offset"}


class _Watch(torch.overrides.TorchFunctionMode):
    """Records, while `load_weights` runs, the last probe parameter any torch function touched
    (itself or a view of its storage): the parameter whose loader was at work when a refusal comes.
    It only observes."""

    def __init__(self, probes: Mapping[str, torch.Tensor], loading: _Loading) -> None:
        super().__init__()
        self.storages = {p.untyped_storage().data_ptr(): name for name, p in probes.items() if p.device.type != "meta"}
        # Meta probes (other layers' parameters) by their storage object: every meta tensor's
        # data_ptr is 0. The first one a torch function is given, by name, or None.
        self.meta = {p.untyped_storage()._cdata: name for name, p in probes.items() if p.device.type == "meta"}
        self.crossed: Optional[str] = None
        self.loading = loading

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Asking a parameter its metadata (`.data`, `.shape`, `.size()`) reads no element.
        metadata = getattr(func, "__name__", "") in _METADATA
        for value in list(args) + list(kwargs.values()):
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if not isinstance(t, torch.Tensor):
                    continue
                try:
                    if t.device.type == "meta":
                        name = self.meta.get(t.untyped_storage()._cdata) if self.meta else None
                        if name is not None and self.crossed is None and not metadata:
                            self.crossed = name
                        continue
                    name = self.storages.get(t.untyped_storage().data_ptr())
                except (RuntimeError, NotImplementedError):  # a tensor without storage
                    continue
                if name is not None:
                    self.loading.param = name
        return func(*args, **kwargs)


def _runs(mask: torch.Tensor) -> List[Tuple[int, int]]:
    """The ranges [start, end) where the flat boolean `mask` holds."""
    idx = torch.nonzero(mask).flatten()
    if idx.numel() == 0:
        return []
    breaks = torch.nonzero(idx[1:] != idx[:-1] + 1).flatten()
    starts = [int(idx[0])] + (idx[breaks + 1]).tolist()
    ends = (idx[breaks] + 1).tolist() + [int(idx[-1]) + 1]
    return list(zip(starts, ends))


def _landings(param: str, flat: torch.Tensor, order, starts: torch.Tensor,
              checkpoint: Mapping[str, Sequence[int]]) -> List[Landing]:
    written = flat >= FIRST  # not untouched (-1), not zero-filled padding (0)
    if not bool(written.any()):
        return []
    which = torch.searchsorted(starts, flat, right=True) - 1  # checkpoint tensor of each element
    which[~written] = -1
    # Runs of one checkpoint tensor, in parameter order.
    change = torch.ones_like(which, dtype=torch.bool)
    change[1:] = which[1:] != which[:-1]
    run_starts = torch.nonzero(change).flatten().tolist() + [flat.numel()]
    landings: List[Landing] = []
    seen: Dict[str, int] = {}
    for a, b in zip(run_starts[:-1], run_starts[1:]):
        t = int(which[a])
        if t < 0:
            continue
        name, base = order[t]
        if name in seen:
            raise ProbeError(f"parameter {param!r}: the loader puts {name!r} in {seen[name] + 1} separate places; "
                             "only one contiguous box of a checkpoint tensor per parameter can land directly")
        seen[name] = 0
        local = (flat[a:b] - base).to(torch.int64)
        shape = [int(s) for s in checkpoint[name]]
        landings.append(_as_box(param, name, shape, local, a))
    return landings


def box_of(local: torch.Tensor, shape: Sequence[int]) -> Optional[Tuple[List[int], List[int]]]:
    """(offsets, sizes) of the box of a tensor of `shape` whose row-major elements are exactly
    `local` (flat indices, in order), or None when they are not one box in order (a transposed or
    permuted copy)."""
    coords = []
    rem = local.clone()
    for dim in reversed(shape):
        coords.append(rem % dim)
        rem = rem // dim
    coords.reverse()
    lo = [int(c.min()) for c in coords]
    hi = [int(c.max()) + 1 for c in coords]
    sizes = [h - l for l, h in zip(lo, hi)]
    expected = torch.zeros(1, dtype=torch.int64)
    for d, (l, s) in enumerate(zip(lo, sizes)):
        stride = 1
        for later in shape[d + 1:]:
            stride *= later
        axis = (torch.arange(l, l + s, dtype=torch.int64) * stride)
        expected = (expected.unsqueeze(-1) + axis).reshape(-1)
    if expected.numel() != local.numel() or not torch.equal(expected, local):
        return None
    return lo, sizes


def _pieces(local: torch.Tensor, shape: Sequence[int]) -> Optional[List[Tuple[List[int], List[int]]]]:
    """The boxes of the stretches of `local` (flat indices) that run on without a gap, or None when
    the indices do not rise throughout (a permuted copy) or a stretch is not a box."""
    if not bool((local[1:] > local[:-1]).all()):
        return None
    breaks = (torch.nonzero(local[1:] != local[:-1] + 1).flatten() + 1).tolist()
    out = []
    for a, b in zip([0] + breaks, breaks + [local.numel()]):
        box = box_of(local[a:b], shape)
        if box is None:
            return None
        out.append(box)
    return out


def _as_box(param: str, name: str, shape: List[int], local: torch.Tensor, at: int) -> Landing:
    """The landing of `name` whose row-major elements are exactly `local` (flat indices), or an error."""
    box = box_of(local, shape)
    if box is None:
        pieces = _pieces(local, shape)
        if pieces is not None and len(pieces) > 1:
            # A tensor the checkpoint already fuses (Phi-3's qkv_proj, gate_up_proj) that vLLM's
            # loader splits again for TP > 1: this rank's q, k and v rows side by side.
            rows = ", ".join(f"[{lo[0]}, {lo[0] + size[0]})" for lo, size in pieces)
            raise ProbeError(
                f"parameter {param!r}: vLLM's loader puts {len(pieces)} separate pieces of checkpoint tensor {name!r} "
                f"(shape {list(shape)}; dim-0 ranges {rows}) into this rank's parameter: a tensor the checkpoint "
                "already fuses (as Phi-3's qkv_proj and gate_up_proj) and tensor parallelism splits again does not "
                "land directly, only one box of it per parameter; serve this model at TP=1 "
                "(docs/vllm.md, \"What trainer_init refuses\")")
        raise ProbeError(f"parameter {param!r}: the loader does not copy {name!r} as one row-major box "
                         "(its elements there are not one box of it in order)")
    return Landing(name, tuple(box[0]), tuple(box[1]), at)
