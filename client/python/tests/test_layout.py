"""Layouts from dicts/files, and from DTensors: the real thing where torch has DTensor, and
stand-ins with DTensor's attributes (device_mesh, placements, is_shard()...) everywhere else."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import shardcast
from shardcast.layout import load_layout, layout_from_dtensors


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
    with pytest.raises(ValueError, match="not a named submesh"):
        layout_from_dtensors("g", {"a": FakeDTensor((4,), "torch.float32", mesh, [Shard(0)]),
                                   "b": FakeDTensor((4,), "torch.float32", Mesh((2,), ranks=[1, 0]), [Shard(0)])})
    with pytest.raises(ValueError, match="3 node names for 2 ranks"):
        layout_from_dtensors("g", {"a": FakeDTensor((4,), "torch.float32", mesh, [Shard(0)])}, nodes=["a", "b", "c"])


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
