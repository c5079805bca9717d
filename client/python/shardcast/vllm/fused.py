"""Trainer parameters that hold several checkpoint tensors, found through the model's own save
conversion: no table per architecture.

A Hugging Face model may keep tensors fused that its checkpoint (what vLLM's `load_weights`
takes) holds apart: transformers 5 keeps a MoE layer's experts as one `experts.gate_up_proj`
[E, 2I, H] and one `experts.down_proj` [E, H, I], and writes `experts.{e}.gate_proj.weight`,
`experts.{e}.up_proj.weight` and `experts.{e}.down_proj.weight` when it saves. The trainer engine
registers each such checkpoint tensor as a view of the fused parameter, so every byte still moves
from the trainer's memory in place, as the checkpoint names it.

`checkpoint_boxes` runs the model's conversion (transformers' `revert_weight_conversion`, what
`save_pretrained` runs) on each parameter holding its own element indices, and reads back which
box of the parameter each checkpoint tensor is. A conversion whose result is not a set of boxes in
order (a transposed copy) is an error naming the parameter. Costs, once at `trainer_init`, an
index tensor (int32 below 2^31 elements) of one parameter's global shape at a time, and only for
the parameters the conversion renames or splits (asked first with a meta tensor). No vLLM import:
testable without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

Convert = Callable[[Dict[str, torch.Tensor]], Mapping[str, torch.Tensor]]


@dataclass(frozen=True)
class Part:
    """Checkpoint tensor `name` is the box [offsets, offsets + sizes) of a trainer parameter, less
    its first `squeezed` dims (each of size 1 in the box: one expert of a stacked tensor)."""

    name: str
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    squeezed: int = 0

    @property
    def shape(self) -> Tuple[int, ...]:
        return self.sizes[self.squeezed:]


def hf_conversion(model: Any) -> Optional[Convert]:
    """The conversion `save_pretrained` applies to `model`'s state dict (transformers >= 5), or None
    when `model` is not a transformers model or this transformers has none."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    return lambda state: revert_weight_conversion(model, state)


def checkpoint_boxes(shapes: Mapping[str, Sequence[int]], convert: Optional[Convert]) -> Dict[str, List[Part]]:
    """For each parameter (name -> global shape) that `convert` renames or splits, the checkpoint
    tensors it holds, as boxes of it; parameters it leaves as they are are absent. Raises
    ValueError naming the parameter when the conversion does not cut it into boxes in order that
    cover every element once, or fails on it alone (a conversion that needs several parameters)."""
    out: Dict[str, List[Part]] = {}
    if convert is None:
        return out
    for name, shape in shapes.items():
        shape = [int(s) for s in shape]
        numel = 1
        for s in shape:
            numel *= s
        if _left_alone(name, shape, convert):
            continue
        index = torch.arange(numel, dtype=torch.int32 if numel < 2 ** 31 else torch.int64).reshape(shape)
        version = index._version
        try:
            converted = convert({name: index})
        except Exception as e:  # the model's own code: say which parameter it failed on
            raise ValueError(f"shardcast: the model's checkpoint conversion fails on parameter {name!r} alone "
                             f"({type(e).__name__}: {e}); give its checkpoint names with name_map") from e
        if index._version != version:  # its values are no longer each element's index
            raise ValueError(f"shardcast: the model's checkpoint conversion changes parameter {name!r} in place; "
                             "give its checkpoint names with name_map")
        if list(converted) == [name] and converted[name] is index:
            continue  # left as it is
        out[name] = _boxes(name, index, converted)
    return out


def _boxes(name: str, index: torch.Tensor, converted: Mapping[str, torch.Tensor]) -> List[Part]:
    """The box of parameter `name` each converted tensor is, in conversion order. `index` holds the
    parameter's element indices (row-major, from 0), so a tensor of shape S is the box of sizes
    [1] * k + S (k: the parameter's dims it lacks) at offsets O exactly when its elements are O's
    index plus those of that box at the origin. A view of `index` (a split or a selected expert)
    is checked from its strides alone; a copy element by element, once. Every element lies in
    exactly one box: the boxes are disjoint and their elements add up to the parameter's. At a
    real MoE's sizes (hundreds of experts of millions of elements per parameter) this is a pass
    over each copy and nothing more."""
    shape = [int(s) for s in index.shape]
    strides = [int(s) for s in index.stride()]
    origins: Dict[Tuple[int, ...], torch.Tensor] = {}  # per box shape: the box at the origin
    parts: List[Part] = []
    for ckpt, tensor in converted.items():
        sizes = [int(s) for s in tensor.shape]
        squeezed = len(shape) - len(sizes)
        box = [1] * squeezed + sizes
        if squeezed < 0 or tensor.numel() == 0 or any(b > n for b, n in zip(box, shape)):
            raise _not_a_box(ckpt, name)
        first = int(tensor[(0,) * tensor.dim()])
        if not 0 <= first < index.numel():  # no element's index (a shifted copy)
            raise _not_a_box(ckpt, name)
        offsets = [(first // stride) % n for stride, n in zip(strides, shape)]
        if any(o + b > n for o, b, n in zip(offsets, box, shape)):
            raise _not_a_box(ckpt, name)
        if not _is_box_view(tensor, index, strides[squeezed:]):
            if tuple(sizes) not in origins:
                origins[tuple(sizes)] = index[tuple(slice(0, b) for b in box)].reshape(sizes)
            same = tensor if tensor.dtype == index.dtype else tensor.to(torch.int64)
            if not torch.equal(same, origins[tuple(sizes)].to(same.dtype) + first):
                raise _not_a_box(ckpt, name)
        parts.append(Part(ckpt, tuple(offsets), tuple(box), squeezed))
    _check_partition(name, shape, parts)
    return parts


def _is_box_view(tensor: torch.Tensor, index: torch.Tensor, strides: Sequence[int]) -> bool:
    """Whether `tensor` is a view of `index`'s memory whose elements run as the parameter's do in
    each of its dims (`strides`: the parameter's, of the dims it keeps): then its elements are the
    box its first element starts."""
    if tensor.dtype != index.dtype or tensor.untyped_storage().data_ptr() != index.untyped_storage().data_ptr():
        return False
    return all(n == 1 or int(t) == s for n, t, s in zip(tensor.shape, tensor.stride(), strides))


_PAIR_ROWS = 1024  # parts compared with every other at once (a bool per pair and dim)


def _check_partition(name: str, shape: Sequence[int], parts: Sequence[Part]) -> None:
    """Raises unless `parts` (boxes of parameter `name`) hold each of its elements exactly once:
    the first part overlapping an earlier one is named, else the elements none holds are counted."""
    lo = torch.tensor([p.offsets for p in parts], dtype=torch.int64).reshape(len(parts), len(shape))
    hi = lo + torch.tensor([p.sizes for p in parts], dtype=torch.int64).reshape(len(parts), len(shape))
    numel = 1
    for n in shape:
        numel *= n
    for at in range(0, len(parts), _PAIR_ROWS):
        a_lo, a_hi = lo[at:at + _PAIR_ROWS].unsqueeze(1), hi[at:at + _PAIR_ROWS].unsqueeze(1)
        overlap = ((a_lo < hi.unsqueeze(0)) & (lo.unsqueeze(0) < a_hi)).all(dim=2)
        earlier = torch.arange(len(parts)).unsqueeze(0) < torch.arange(at, at + overlap.shape[0]).unsqueeze(1)
        later = (overlap & earlier).any(dim=1)
        if bool(later.any()):
            ckpt = parts[at + int(later.nonzero()[0])].name
            raise ValueError(f"shardcast: the model's checkpoint conversion puts elements of parameter "
                             f"{name!r} in {ckpt!r} and in another checkpoint tensor")
    held = int((hi - lo).prod(dim=1).sum())
    if held != numel:
        raise ValueError(f"shardcast: the model's checkpoint conversion leaves "
                         f"{numel - held} elements of parameter {name!r} in no checkpoint tensor")


def _not_a_box(ckpt: str, name: str) -> ValueError:
    return ValueError(f"shardcast: the model's checkpoint conversion makes {ckpt!r} of parameter {name!r} by other "
                      "than cutting a box of it (a transposed or reordered copy); give its checkpoint names with "
                      "name_map")


def _left_alone(name: str, shape: Sequence[int], convert: Convert) -> bool:
    """Whether the conversion hands `name` back as it is, asked with a tensor of no memory (so
    only parameters it renames or cuts cost an index tensor)."""
    meta = torch.empty(tuple(shape), dtype=torch.int32, device="meta")
    try:
        converted = convert({name: meta})
    except Exception:  # the real probe below reports it
        return False
    return list(converted) == [name] and converted[name] is meta


def box_view(local: torch.Tensor, local_offsets: Sequence[int], part: Part,
             where: str) -> Optional[Tuple[torch.Tensor, List[int], List[int]]]:
    """The piece of checkpoint tensor `part` that a rank's local tensor holds (`local` is the box of
    the parameter starting at `local_offsets`): a view of `local`, and the piece's offsets and sizes
    in the checkpoint tensor; None when the rank holds none of it. A piece that is not contiguous in
    `local` cannot be registered in place: ValueError naming it (`where`)."""
    lo, hi = [], []
    for o, s, lo_local, n in zip(part.offsets, part.sizes, local_offsets, local.shape):
        a, b = max(o, lo_local), min(o + s, lo_local + int(n))
        if b <= a:
            return None
        lo.append(a)
        hi.append(b)
    view = local[tuple(slice(a - l, b - l) for a, b, l in zip(lo, hi, local_offsets))]
    if not view.is_contiguous():
        raise ValueError(f"shardcast: {where}: checkpoint tensor {part.name!r} is not contiguous in this rank's "
                         "shard of the parameter, so it cannot be registered in place")
    k = part.squeezed
    offsets = [a - o for a, o in zip(lo, part.offsets)][k:]
    sizes = [b - a for a, b in zip(lo, hi)][k:]
    return view.reshape(sizes), offsets, sizes


__all__ = ["Part", "box_view", "checkpoint_boxes", "hf_conversion"]
