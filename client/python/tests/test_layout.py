"""Layouts from dicts/files, and from DTensors: the real thing where torch has DTensor, and
stand-ins with DTensor's attributes (device_mesh, placements, is_shard()...) everywhere else."""

from __future__ import annotations

import itertools
import json
import re
import subprocess

import numpy as np
import pytest

import shardcast
from conftest import shardcastd_path
from shardcast.layout import layout_from_dtensors, load_layout, local_offsets, rank_boxes, rank_intervals


class Shard:
    def __init__(self, dim, split_factor=None):
        self.dim = dim
        if split_factor is not None:
            self.split_factor = split_factor

    def is_shard(self, dim=None):
        return True

    def is_replicate(self):
        return False

    def is_partial(self):
        return False


class Replicate(Shard):
    def __init__(self):
        super().__init__(0)

    def is_shard(self, dim=None):
        return False

    def is_replicate(self):
        return True


class Partial(Replicate):
    def is_replicate(self):
        return False

    def is_partial(self):
        return True


class Mesh:
    def __init__(self, shape, names=None, ranks=None):
        n = int(np.prod(shape))
        self.mesh = (np.arange(n) if ranks is None else np.array(ranks)).reshape(shape)
        self.mesh_dim_names = names


class FakeDTensor:
    def __init__(self, shape, dtype, mesh, placements):
        self.shape, self.dtype, self.device_mesh, self.placements = shape, dtype, mesh, placements


def test_layout_from_dtensor_like_tensors_is_a_valid_layout():
    mesh = Mesh((2, 4), ("dp_shard", "tp"))
    tensors = {
        "w": FakeDTensor((64, 32), "torch.bfloat16", mesh, [Shard(0, split_factor=4), Shard(0)]),
        "norm": FakeDTensor((32,), "torch.float32", mesh, [Replicate(), Replicate()]),
        "o": FakeDTensor((32, 64), "torch.bfloat16", mesh, [Shard(0), Shard(1)]),
    }
    layout = layout_from_dtensors("trainer", tensors, ranks_per_node=4, node_prefix="trainer-")
    assert layout["mesh"] == {"shape": [2, 4], "dim_names": ["dp_shard", "tp"]}
    assert layout["tensors"][0] == {"name": "w", "shape": [64, 32], "dtype": "bfloat16",
                                    "placements": [{"strided_shard": {"dim": 0, "split_factor": 4}}, {"shard": {"dim": 0}}]}
    assert layout["tensors"][1]["placements"] == [{"replicate": {}}, {"replicate": {}}]
    msg = load_layout(json.dumps(layout))  # what the daemon will parse
    assert msg.group == "trainer" and msg.ranks_per_node == 4 and len(msg.tensors) == 3


def test_layout_from_dtensors_refuses_what_it_cannot_express():
    mesh = Mesh((2,))
    with pytest.raises(ValueError, match="Partial"):
        layout_from_dtensors("g", {"w": FakeDTensor((4,), "torch.float32", mesh, [Partial()])})
    with pytest.raises(ValueError, match="row-major"):
        layout_from_dtensors("g", {"w": FakeDTensor((4,), "torch.float32", Mesh((2,), ranks=[1, 0]), [Shard(0)])})
    with pytest.raises(ValueError, match=r"over ranks \[1\], not the group's 2 ranks \[0, 1\]"):
        layout_from_dtensors("g", {"a": FakeDTensor((4,), "torch.float32", mesh, [Shard(0)]),
                                   "b": FakeDTensor((4,), "torch.float32", Mesh((1,), ranks=[1]), [Shard(0)])})
    with pytest.raises(ValueError, match="3 node names for 2 ranks"):
        layout_from_dtensors("g", {"a": FakeDTensor((4,), "torch.float32", mesh, [Shard(0)])}, nodes=["a", "b", "c"])


SHARD0, STRIDED0 = {"shard": {"dim": 0}}, {"strided_shard": {"dim": 0, "split_factor": 2}}


def test_rank_intervals_follow_dtensor():
    # Held rows read from real DTensors (torch 2.15, gloo): 5 experts split over "ep" (2), then
    # FSDP2 over "efsdp" (2) of the mesh ("efsdp", "ep"), placements (_StridedShard(0, sf=2), Shard(0)).
    held = {(0, 0): [(0, 2)], (0, 1): [(3, 4)], (1, 0): [(2, 3)], (1, 1): [(4, 5)]}
    for coordinate, rows in held.items():
        assert rank_intervals(5, 0, [2, 2], coordinate, [STRIDED0, SHARD0]) == rows, coordinate
    # Shards of one dim nest left to right (torch.chunk of the chunk): 10 rows, 3 + 2, 3 + 2.
    assert [rank_intervals(10, 0, [2, 2], c, [SHARD0, SHARD0]) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]] == [
        [(0, 3)], [(3, 5)], [(5, 8)], [(8, 10)]]
    # torch.chunk leaves trailing ranks short or empty: 5 rows over 4 ranks hold 2, 2, 1, 0.
    assert [rank_intervals(5, 0, [4], (r,), [SHARD0]) for r in range(4)] == [[(0, 2)], [(2, 4)], [(4, 5)], []]
    # A placement of another dim, or Replicate, leaves this dim whole.
    assert rank_intervals(6, 1, [2, 2], (1, 1), [SHARD0, {"replicate": {}}]) == [(0, 6)]


def test_rank_boxes_are_the_local_tensor_in_order_or_refused():
    # A strided shard alone holds a part of each of its chunks: two boxes, one after another.
    assert rank_boxes([8, 3], [2], (1,), [STRIDED0]) == [([2, 0], [2, 3]), ([6, 0], [2, 3])]
    assert rank_boxes([5, 3], [4], (3,), [SHARD0]) == []  # holds nothing
    # Runs along dim 1 under 3 whole rows interleave in local memory: not boxes one after another.
    with pytest.raises(ValueError, match='mesh coordinate \\[0\\] holds .* not a sequence of boxes'):
        rank_boxes([3, 8], [2], (0,), [{"strided_shard": {"dim": 1, "split_factor": 2}}])


def test_the_planner_reads_placements_as_the_boxes_say(tmp_path):
    # The daemon resolves placements itself (planner/layout.cc); explicit pieces come from
    # rank_boxes, which test_dtensor.py checks against torch. One node per rank: a sync from every
    # tensor by its placements into the same tensor by rank_boxes' pieces moves no byte between
    # nodes exactly when both read every placement pair alike.
    choices = [{"replicate": {}}, SHARD0, {"shard": {"dim": 1}}, STRIDED0,
               {"strided_shard": {"dim": 1, "split_factor": 3}}, {"strided_shard": {"dim": 0, "split_factor": 3}}]
    cli = shardcastd_path().parent / "shardcast"
    for mesh_shape in ([4], [2, 3]):
        world = int(np.prod(mesh_shape))
        coordinates = list(itertools.product(*(range(n) for n in mesh_shape)))
        src, dst = [], []
        for shape in ([7, 6], [13, 7], [12, 12]):
            for placements in itertools.product(choices, repeat=len(mesh_shape)):
                try:
                    boxes = [rank_boxes(shape, mesh_shape, c, placements) for c in coordinates]
                except ValueError:  # not boxes one after another in a rank's memory
                    continue
                name = f"w{len(src)}"
                src.append({"name": name, "shape": shape, "dtype": "float32", "placements": list(placements)})
                dst.append({"name": name, "shape": shape, "dtype": "float32",
                            "pieces": [{"rank": r, "offsets": o, "sizes": sz}
                                       for r, b in enumerate(boxes) for o, sz in b]})
        nodes = [f"n{r}" for r in range(world)]
        for group, mesh, tensors in (("src", mesh_shape, src), ("dst", [world], dst)):
            (tmp_path / f"{group}.json").write_text(json.dumps(
                {"group": group, "mesh": {"shape": mesh}, "nodes": nodes, "tensors": tensors}))
        out = subprocess.run([str(cli), "plan", "--src", str(tmp_path / "src.json"),
                              "--dst", str(tmp_path / "dst.json"), "--json"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        plan = json.loads(out.stdout)
        assert len(src) >= 2 * len(choices) ** len(mesh_shape) and plan["bytes_needed"] > 0, len(src)
        assert plan["network_bytes"] == 0, f"mesh {mesh_shape}: {plan['network_bytes']} bytes cross nodes"


def test_pipeline_stages_views_join_into_explicit_pieces():
    # Global ranks 4..7 form the group (rank i = global 4 + i); stage 0 is ranks 0, 1 and stage 1
    # ranks 2, 3, each FSDP2 on its own slice; a plain norm lives on stage 1 only.
    def stage(global_ranks, names):
        return {n: {"shape": [5, 4], "dtype": "float32", "mesh_shape": [2], "mesh_ranks": global_ranks,
                    "placements": [SHARD0]} for n in names}
    s0, s1 = stage([4, 5], ["embed"]), {**stage([6, 7], ["head"]), "norm": {"shape": [4], "dtype": "float32"}}
    layout = shardcast.layout.layout_from_views("trainer", [s0, s0, s1, s1], [4, 5, 6, 7], ["a", "a", "b", "b"])
    assert layout["mesh"] == {"shape": [4]} and layout["nodes"] == ["a", "a", "b", "b"]
    by_name = {t["name"]: t["pieces"] for t in layout["tensors"]}
    def rows(first_rank):  # 5 rows over 2 ranks: 3 and 2
        return [{"ranks": [first_rank], "offsets": [0, 0], "sizes": [3, 4]},
                {"ranks": [first_rank + 1], "offsets": [3, 0], "sizes": [2, 4]}]
    assert by_name == {"embed": rows(0), "head": rows(2), "norm": [{"ranks": [2, 3], "offsets": [0], "sizes": [4]}]}
    assert len(load_layout(json.dumps(layout)).tensors) == 3
    # A tensor of no elements is an empty piece of its stage's ranks, not "replicated on every rank".
    empty = {"shape": [0, 4], "dtype": "float32", "mesh_shape": [2], "mesh_ranks": [6, 7], "placements": [SHARD0]}
    layout = shardcast.layout.layout_from_views("g", [s0, s0, {"e": empty}, {"e": empty}], [4, 5, 6, 7], "abcd")
    assert layout["tensors"][1]["pieces"] == [{"ranks": [2, 3], "offsets": [0, 0], "sizes": [0, 4]}]
    views = [s0, s0, s1, s1]
    with pytest.raises(ValueError, match=r'tensor "head": rank 2 holds it as .*, rank 3 as .*\[6, 5\]'):
        shardcast.layout.layout_from_views("g", views[:3] + [stage([6, 5], ["head"])], [4, 5, 6, 7], "abcd")
    with pytest.raises(ValueError, match=r'tensor "embed": its mesh spans global ranks \[5\], which are not in'):
        shardcast.layout.layout_from_views("g", [s0], [4], ["a"])
    with pytest.raises(ValueError, match=r'tensor "embed": its mesh spans ranks \[0, 1\] but ranks \[0\] have it'):
        shardcast.layout.layout_from_views("g", [s0, s1], [4, 5], ["a", "b"])


class CoordinateMesh(Mesh):
    def __init__(self, shape, names, coordinate):
        super().__init__(shape, names)
        self.coordinate = coordinate

    def get_coordinate(self):
        return list(self.coordinate)


def test_a_parameter_on_a_mesh_of_its_own_is_explicit_pieces():
    # torchtitan: the experts on ("efsdp", "ep") and the router on ("fsdp",), both over ranks 0..3.
    # The group's mesh holds the most tensors; the router's row shards become pieces.
    sparse, dense = Mesh((2, 2), ("efsdp", "ep")), Mesh((4,), ("fsdp",))
    tensors = {"router": FakeDTensor((5, 8), "torch.float32", dense, [Shard(0)]),
               **{n: FakeDTensor((5, 6, 8), "torch.float32", sparse, [Shard(0, split_factor=2), Shard(0)])
                  for n in ("w1", "w3", "w2")}}
    layout = layout_from_dtensors("trainer", tensors, ranks_per_node=2)
    assert layout["mesh"] == {"shape": [2, 2], "dim_names": ["efsdp", "ep"]}
    router = layout["tensors"][0]
    assert "placements" not in router
    assert router["pieces"] == [{"ranks": [0], "offsets": [0, 0], "sizes": [2, 8]},
                                {"ranks": [1], "offsets": [2, 0], "sizes": [2, 8]},
                                {"ranks": [2], "offsets": [4, 0], "sizes": [1, 8]}]  # rank 3 holds no row
    assert layout["tensors"][1]["placements"] == [STRIDED0, SHARD0]
    assert len(load_layout(json.dumps(layout)).tensors[0].pieces) == 3  # what the daemon parses
    # The same ranks permuted: a replicated tensor is one piece every rank holds.
    permuted = Mesh((2,), ("x",), ranks=[1, 0])
    layout = layout_from_dtensors("g", {"a": FakeDTensor((4,), "torch.float32", Mesh((2,), ("y",)), [Shard(0)]),
                                        "b": FakeDTensor((4,), "torch.float32", permuted, [Shard(0)]),
                                        "c": FakeDTensor((4,), "torch.float32", permuted, [Replicate()])})
    assert layout["mesh"]["dim_names"] == ["y"]  # fewer tensors, but its ranks number the group's
    assert layout["tensors"][0]["placements"] == [SHARD0]
    assert layout["tensors"][1]["pieces"] == [{"ranks": [1], "offsets": [0], "sizes": [2]},
                                              {"ranks": [0], "offsets": [2], "sizes": [2]}]
    assert layout["tensors"][2]["pieces"] == [{"ranks": [1, 0], "offsets": [0], "sizes": [4]}]


def test_a_local_shard_its_placements_do_not_describe_is_refused():
    # FSDP2 (dp=3) over TP (2) of 7 rows keeps torch.chunk of each TP shard: rank (dp 2, tp 1)
    # holds row 6, where (_StridedShard(0, sf=2), Shard(0)) gives it none (and (dp 2, tp 0) row 6).
    class Local(FakeDTensor):
        def to_local(self):
            return np.zeros(self.local_shape)

    mesh = CoordinateMesh((3, 2), ("dp", "tp"), (2, 1))
    w = Local((7, 4), "torch.float32", mesh, [Shard(0, split_factor=2), Shard(0)])
    w.local_shape = (1, 4)
    with pytest.raises(ValueError, match=r'tensor "w": this rank \(mesh coordinate \[2, 1\]\) holds a local shard of '
                                         r"\[1, 4\], but placements .* give it nothing: FSDP2 over"):
        layout_from_dtensors("g", {"w": w})
    w.local_shape = (0, 4)  # what the placements say: accepted
    assert layout_from_dtensors("g", {"w": w})["tensors"][0]["placements"] == [STRIDED0, SHARD0]


def test_local_offsets_refuse_a_shard_of_several_boxes():
    w = FakeDTensor((8, 3), "torch.float32", CoordinateMesh((2, 2), ("dp", "tp"), (0, 1)), [Shard(0), Shard(0)])
    assert local_offsets(w, "rank 1") == [2, 0]
    w.device_mesh = CoordinateMesh((2,), ("dp",), (1,))
    w.placements = [Shard(0, split_factor=2)]
    with pytest.raises(ValueError, match=r"rank 1: this rank's shard is 2 separate boxes of the parameter"):
        local_offsets(w, "rank 1")
    w.placements = [Shard(0)]
    w.shape = (1, 3)
    assert local_offsets(w, "rank 1") is None  # holds nothing


def test_load_layout_accepts_files_dicts_and_messages(tmp_path):
    d = {"group": "g", "mesh": {"shape": [2]}, "tensors": [{"name": "w", "shape": [4], "dtype": "float32"}]}
    f = tmp_path / "l.json"
    f.write_text(json.dumps(d))
    assert load_layout(f) == load_layout(d) == load_layout(load_layout(d))
    with pytest.raises(ValueError, match="layout"):
        load_layout({"group": "g", "no_such_field": 1})


def test_real_dtensors():
    reason = shardcast.dtensor_available()
    if reason is not None:
        pytest.skip(f"DTensor helper not tested on real DTensors: {reason}")
    import torch
    import torch.distributed as dist

    try:
        from torch.distributed.tensor import DeviceMesh, Shard as TShard, distribute_tensor
    except ImportError:
        from torch.distributed._tensor import DeviceMesh, Shard as TShard, distribute_tensor
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    mesh = DeviceMesh("cpu", [0])
    t = distribute_tensor(torch.zeros(8, 4), mesh, [TShard(0)])
    layout = layout_from_dtensors("g", {"w": t})
    assert layout["tensors"][0]["placements"] == [{"shard": {"dim": 0}}]
    assert layout["mesh"]["shape"] == [1]


def test_a_malformed_layout_names_its_file_line_and_column(tmp_path):
    f = tmp_path / "trainer.json"
    f.write_text('{\n  "group": "g",\n  "mesh": {"shape": [2]}\n  "tensors": []\n}\n')  # no comma after the mesh
    with pytest.raises(ValueError) as e:
        load_layout(f)
    assert str(e.value).startswith(f'layout file "{f}": not valid JSON at line 4 column 3: ')
    with pytest.raises(ValueError, match=r"^layout JSON: not valid JSON at line 1 column 15: "):
        load_layout('{"group": "g",}')
    # A file that is JSON but not a layout: named too.
    f.write_text('{"group": "g", "no_such_field": 1}')
    with pytest.raises(ValueError, match=re.escape(f'layout file "{f}": ') + ".*no_such_field"):
        load_layout(f)
