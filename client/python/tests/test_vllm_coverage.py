"""The vLLM worker's exactness checks without vLLM (shardcast.vllm.layout): every element of every
announced checkpoint tensor lands on some rank, checked from the boxes against a brute-force mask;
every parameter element is written by exactly one tensor's box or is zero padding. And the engine
core's session calls (shardcast.vllm.session): a worker's error comes back as its status, and the
engine's one error names each worker. Against the real vLLM: vllm_tests/test_recovery.py."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch", reason="the test venv (scripts/deps.sh) has torch")

from shardcast.vllm import session  # noqa: E402
from shardcast.vllm.layout import _uncovered, check_coverage, check_landings  # noqa: E402
from shardcast.vllm.probe import Landing, ParamMap, ProbeError  # noqa: E402


def brute_force_uncovered(shape, boxes) -> bool:
    mask = torch.zeros(shape, dtype=torch.bool)
    for offsets, sizes in boxes:
        mask[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = True
    return not bool(mask.all())


def test_the_boxes_cover_a_tensor_exactly_when_a_mask_of_every_element_says_so():
    rng = random.Random(55)
    for _ in range(500):
        shape = [rng.randint(1, 6) for _ in range(rng.randint(1, 3))]
        boxes = []
        for _ in range(rng.randint(0, 4)):
            offsets = [rng.randint(0, n - 1) for n in shape]
            boxes.append((offsets, [rng.randint(1, n - o) for n, o in zip(shape, offsets)]))
        gap = _uncovered(shape, boxes)
        assert (gap is not None) == brute_force_uncovered(shape, boxes), (shape, boxes)
        if gap is not None:  # what it names is a part no box covers
            for offsets, sizes in boxes:
                inside = all(o <= g and g + gs <= o + s for o, s, g, gs in zip(offsets, sizes, *gap))
                assert not inside, (shape, boxes, gap)


def test_a_tensor_larger_than_what_the_ranks_take_is_refused_naming_the_rest_and_each_box():
    # q of 300 rows, vLLM's two ranks taking 128 each (the loader cuts the rest silently).
    held = [{"q": ([0, 0], [128, 256], "qkv_proj.weight")}, {"q": ([128, 0], [128, 256], "qkv_proj.weight")}]
    with pytest.raises(ProbeError) as e:
        check_coverage({"q": [300, 256]}, held)
    assert str(e.value) == ("checkpoint tensor 'q' (shape [300, 256]): its elements [256:300, 0:256] land in no "
                            "parameter of vLLM's model, which takes less of it: 'qkv_proj.weight' takes [0:128, 0:256] "
                            "(rank 0); 'qkv_proj.weight' takes [128:256, 0:256] (rank 1)")
    check_coverage({"q": [256, 256]}, held)


def test_replicated_boxes_cover_and_a_tensor_no_rank_takes_is_refused_naming_it():
    held = [{"k": ([0, 0], [64, 256], "qkv_proj.weight")}, {"k": ([0, 0], [64, 256], "qkv_proj.weight")}]
    check_coverage({"k": [64, 256]}, held)  # one KV head on both ranks
    with pytest.raises(ProbeError, match="checkpoint tensor 'extra' \\(shape \\[4\\]\\) lands in no parameter"):
        check_coverage({"k": [64, 256], "extra": [4]}, held)


def param(name, numel, landings, untouched=(), padding=0) -> ParamMap:
    return ParamMap(name, (numel,), torch.float32, [Landing(t, (0,), (n,), at) for t, n, at in landings],
                    untouched=tuple(untouched), padding=padding)


def test_every_parameter_element_is_written_by_one_tensor_or_is_padding():
    maps = {"qkv": param("qkv", 12, [("q", 8, 0), ("k", 2, 8), ("v", 2, 10)]),
            "embed": param("embed", 10, [("embed", 8, 0)], padding=2)}
    assert check_landings(maps) == {"qkv": (12, 12, 0), "embed": (10, 8, 2)}


def test_elements_no_tensor_writes_and_boxes_that_overlap_are_refused_naming_the_parameter():
    with pytest.raises(ProbeError, match="vLLM's parameter 'qkv' \\(shape \\[12\\] on this rank\\): elements "
                                         "\\[10:12\\] .* written by no announced checkpoint tensor \\(next to 'k'"):
        check_landings({"qkv": param("qkv", 12, [("q", 8, 0), ("k", 2, 8)], untouched=[(10, 12)])})
    with pytest.raises(ProbeError, match="'q' and 'k' both land in elements \\[6:8\\]"):
        check_landings({"qkv": param("qkv", 12, [("q", 8, 0), ("k", 6, 6)])})


class Engine:
    finished = None


class Worker:
    """Stands in for vLLM's worker: its weight-transfer calls succeed or raise."""

    def __init__(self, fail: str = "", finish_error: str = "") -> None:
        self.weight_transfer_engine = Engine()
        self.fail, self.finish_error = fail, finish_error

    def update_weights(self, update_info) -> None:
        if self.fail:
            raise RuntimeError(self.fail)

    def finish_weight_update(self) -> None:
        self.weight_transfer_engine.finished = self.finish_error


def test_a_checkpoint_tensor_split_into_pieces_of_one_parameter_is_refused_naming_each_piece():
    """Phi-3's checkpoint fuses q, k and v into one qkv_proj [q 8 rows; k 4; v 4] x 3; at TP=2
    vLLM's loader gives rank 0 rows 0-3 of q, 0-1 of k and 0-1 of v, side by side in its
    parameter: three boxes of one tensor, which cannot land as one. A single box still lands, and a
    permuted copy keeps its own error."""
    from shardcast.vllm.probe import _as_box

    shape, cols = [16, 3], 3
    rows = list(range(0, 4)) + list(range(8, 10)) + list(range(12, 14))
    local = torch.tensor([r * cols + c for r in rows for c in range(cols)], dtype=torch.int64)
    with pytest.raises(ProbeError, match=r"puts 3 separate pieces of checkpoint tensor 'qkv' "
                                         r"\(shape \[16, 3\]; dim-0 ranges \[0, 4\), \[8, 10\), \[12, 14\)\)"):
        _as_box("model.qkv_proj.weight", "qkv", shape, local, 0)
    assert _as_box("p", "qkv", shape, local[:12], 5) == Landing("qkv", (0, 0), (4, 3), 5)
    with pytest.raises(ProbeError, match="not one box of it in order"):
        _as_box("p", "qkv", shape, local[:12].flip(0), 0)


def test_a_worker_that_fails_returns_its_status_instead_of_raising():
    assert session.on_worker(Worker(), "update_weights", (), {"update_info": {}}) == {"error": None,
                                                                                       "finished": None}
    assert session.on_worker(Worker("no version 9"), "update_weights", (), {"update_info": {}}) == {
        "error": "RuntimeError: no version 9", "finished": None}
    # A finish that did not go into service ends vLLM's session all the same; its status says why.
    assert session.on_worker(Worker(finish_error="half applied"), "finish_weight_update", (), {}) == {
        "error": "half applied", "finished": "half applied"}
    assert session.on_worker(Worker(), "finish_weight_update", (), {}) == {"error": None, "finished": ""}


def test_the_engine_raises_once_naming_each_worker_and_each_error_once():
    text = session._describe("update_weights", [(0, "E: a"), (1, "E: a"), (3, "E: b")], 4)
    assert text == "shardcast: vLLM's update_weights failed (3 of 4 worker(s)) on workers 0, 1: E: a; worker 3: E: b"
