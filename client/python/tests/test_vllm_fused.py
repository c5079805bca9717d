"""shardcast.vllm.fused: which boxes of a trainer's fused parameters are which checkpoint tensors,
from a conversion run on index tensors (here conversions written like transformers' MoE one; the
real one runs in vllm_tests/test_rl.py), and the piece of each a sharded rank holds. No vLLM."""

from __future__ import annotations

import pytest
import torch

from shardcast.vllm import fused
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


def test_copies_and_views_give_the_same_boxes_and_hundreds_of_experts_are_each_their_own():
    # transformers' own conversion copies the gate and up halves and views down_proj's experts:
    # a copy is checked element by element, a view by its strides; both give each expert its box.
    experts = 300

    def copied(state):
        return {k: t.clone() for k, t in split_experts(state).items()}

    shapes = {"experts.gate_up_proj": (experts, 2 * I, H)}
    by_view, by_copy = checkpoint_boxes(shapes, split_experts), checkpoint_boxes(shapes, copied)
    assert by_view == by_copy
    parts = by_view["experts.gate_up_proj"]
    assert [p.name for p in parts] == [f"experts.{e}.{w}_proj.weight" for e in range(experts) for w in ("gate", "up")]
    assert parts[2 * 171 + 1] == Part("experts.171.up_proj.weight", (171, I, 0), (1, I, H), 1)


def test_a_run_of_elements_that_wraps_a_row_or_overlaps_is_no_partition(monkeypatch):
    # Elements 3..6 of a (2, 5) parameter are in order, yet no box: they wrap from row 0 into row 1.
    wrapped = lambda state: {"a": state["w"].reshape(-1)[:3], "b": state["w"].reshape(-1)[3:7],  # noqa: E731
                             "c": state["w"].reshape(-1)[7:]}
    with pytest.raises(ValueError, match=r"makes 'b' of parameter 'w' by other than cutting a box"):
        checkpoint_boxes({"w": (2, H)}, wrapped)
    # A transposed view of a square parameter: its strides, not its shape, say it is no box.
    with pytest.raises(ValueError, match=r"makes 'w.t' of parameter 'w' by other than cutting a box"):
        checkpoint_boxes({"w": (H, H)}, lambda state: {"w.t": state["w"].t()})
    # As many elements as the parameter, one row twice and one in none: the second holder named.
    row = lambda state: {"a": state["w"][0], "b": state["w"][1], "c": state["w"][1].clone()}  # noqa: E731
    with pytest.raises(ValueError, match=r"puts elements of parameter 'w' in 'c' and in another"):
        checkpoint_boxes({"w": (3, H)}, row)
    # A copy shifted by a row is in order but holds no element's index where it starts (beyond the
    # end, before the start): no box.
    shifted = lambda state: {"a": state["w"][0] + 2 * H, "b": state["w"][1] - 2 * H}  # noqa: E731
    with pytest.raises(ValueError, match=r"makes 'a' of parameter 'w' by other than cutting a box"):
        checkpoint_boxes({"w": (2, H)}, shifted)
    with pytest.raises(ValueError, match=r"makes 'model.s' of parameter 's' by other than cutting a box"):
        checkpoint_boxes({"s": (1,)}, lambda state: {"model.s": state["s"] + 1})
    # A conversion that rewrites the parameter in place (here: transposes it) and hands it back
    # renamed: its values are no element's index any more, refused by name.
    def in_place(state):
        w = state["w"]
        w.copy_(w.t().clone())
        return {"x": w}

    with pytest.raises(ValueError, match=r"changes parameter 'w' in place"):
        checkpoint_boxes({"w": (H, H)}, in_place)
    # One that drops the parameter altogether.
    with pytest.raises(ValueError, match=r"leaves 10 elements of parameter 'w' in no checkpoint tensor"):
        checkpoint_boxes({"w": (2, H)}, lambda state: {})
    # Compared a few rows of pairs at a time, the same answers.
    monkeypatch.setattr(fused, "_PAIR_ROWS", 2)
    with pytest.raises(ValueError, match=r"puts elements of parameter 'w' in 'c' and in another"):
        checkpoint_boxes({"w": (3, H)}, row)
    many = checkpoint_boxes({"experts.gate_up_proj": (9, 2 * I, H)}, split_experts)["experts.gate_up_proj"]
    assert len(many) == 18 and many[17].offsets == (8, I, 0)
