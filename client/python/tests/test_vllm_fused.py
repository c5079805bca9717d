"""shardcast.vllm.fused: which boxes of a trainer's fused parameters are which checkpoint tensors,
from a conversion run on index tensors (here conversions written like transformers' MoE one; the
real one runs in vllm_tests/test_rl.py), and the piece of each a sharded rank holds. No vLLM."""

from __future__ import annotations

import pytest
import torch

from shardcast.vllm.fused import Part, box_view, checkpoint_boxes

E, I, H = 3, 4, 5


def split_experts(state):
    """What transformers 5 saves a Qwen3-MoE layer's fused experts as: one tensor per expert and
    projection (gate rows first, then up)."""
    out = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = up.contiguous()
        else:
            out[name] = t
    return out


def test_fused_experts_are_boxes_of_the_parameter():
    shapes = {"mlp.experts.gate_up_proj": (E, 2 * I, H), "norm.weight": (H,)}
    boxes = checkpoint_boxes(shapes, split_experts)
    assert list(boxes) == ["mlp.experts.gate_up_proj"]  # the norm is left as it is
    parts = {p.name: p for p in boxes["mlp.experts.gate_up_proj"]}
    assert len(parts) == 2 * E
    assert parts["mlp.experts.1.up_proj.weight"] == Part("mlp.experts.1.up_proj.weight", (1, I, 0), (1, I, H), 1)
    assert parts["mlp.experts.2.gate_proj.weight"].shape == (I, H)
    # Each part's view is the tensor the conversion makes.
    fused = torch.randn(E, 2 * I, H)
    converted = split_experts({"mlp.experts.gate_up_proj": fused})
    for name, part in parts.items():
        view, offsets, sizes = box_view(fused, [0, 0, 0], part, "test")
        assert torch.equal(view, converted[name]) and offsets == [0, 0] and sizes == [I, H]
        assert view.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()  # in place


def test_a_rank_holds_the_experts_of_its_shard():
    part = checkpoint_boxes({"experts.gate_up_proj": (E, 2 * I, H)}, split_experts)["experts.gate_up_proj"]
    by_name = {p.name: p for p in part}
    fused = torch.arange(E * 2 * I * H, dtype=torch.float32).reshape(E, 2 * I, H)
    local = fused[2:3]  # FSDP's shard of rank 1 of 2: expert 2, from offset (2, 0, 0)
    assert box_view(local, [2, 0, 0], by_name["experts.0.gate_proj.weight"], "test") is None
    view, offsets, sizes = box_view(local, [2, 0, 0], by_name["experts.2.up_proj.weight"], "test")
    assert torch.equal(view, fused[2, I:]) and view.data_ptr() == fused[2, I:].data_ptr()
    assert (offsets, sizes) == ([0, 0], [I, H])
    # A shard cutting the expert's rows (Shard(1)): the piece of the checkpoint tensor it holds.
    rows = fused[:, 1:3]
    view, offsets, sizes = box_view(rows, [0, 1, 0], by_name["experts.1.gate_proj.weight"], "test")
    assert torch.equal(view, fused[1, 1:3]) and (offsets, sizes) == ([1, 0], [2, H])
    # A checkpoint tensor cut along the parameter's last dim is strided in it: refused, naming it.
    columns = Part("w.cols", (1, 0, 1), (1, 2 * I, 2), 1)
    with pytest.raises(ValueError, match=r"rank 7: checkpoint tensor 'w.cols' is not contiguous in this rank's"):
        box_view(fused, [0, 0, 0], columns, "rank 7")


def test_a_conversion_that_is_not_boxes_is_refused_naming_the_parameter():
    transposed = lambda state: {f"{n}.t": t.t().contiguous() for n, t in state.items()}  # noqa: E731
    with pytest.raises(ValueError, match=r"makes 'w.t' of parameter 'w' by other than cutting a box"):
        checkpoint_boxes({"w": (I, H)}, transposed)
    dropped = lambda state: {f"{n}.half": t[:1] for n, t in state.items()}  # noqa: E731
    with pytest.raises(ValueError, match=r"leaves 5 elements of parameter 'w' in no checkpoint tensor"):
        checkpoint_boxes({"w": (2, H)}, dropped)
    twice = lambda state: {f"{n}.{x}": t for n, t in state.items() for x in "ab"}  # noqa: E731
    with pytest.raises(ValueError, match=r"puts elements of parameter 'w' in 'w.b' and in another"):
        checkpoint_boxes({"w": (2, H)}, twice)

    def needs_others(state):
        raise KeyError("up_proj")

    with pytest.raises(ValueError, match=r"fails on parameter 'w' alone \(KeyError"):
        checkpoint_boxes({"w": (2, H)}, needs_others)


def test_a_renaming_conversion_is_one_whole_part_and_none_is_nothing():
    renamed = checkpoint_boxes({"w": (2, H)}, lambda state: {"model.w": state["w"]})
    assert renamed == {"w": [Part("model.w", (0, 0), (2, H), 0)]}
    assert checkpoint_boxes({"w": (2, H)}, None) == {}
    assert checkpoint_boxes({"w": (2, H)}, lambda state: state) == {}
