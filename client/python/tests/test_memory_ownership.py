"""A registered rank's memory is its own: the daemon refuses a destination buffer that is the same
memory as another buffer (another rank's, its own other set's, a source's); the client refuses
torch tensors other processes share by file descriptor and warns about tensors over memory torch
did not own (a numpy array), which torch copies away at registration. Each of these let a sync
report every rank ready while the bytes landed somewhere else, or on top of each other."""

from __future__ import annotations

import multiprocessing
import warnings

import numpy as np
import pytest
import torch

import shardcast


def layout(group: str, nodes, placements, shape=(8, 4), names=("w",)):
    return {"group": group, "mesh": {"shape": [len(nodes)]}, "nodes": list(nodes),
            "tensors": [{"name": n, "shape": list(shape), "dtype": "float32", "placements": placements}
                        for n in names]}


SHARDED = [{"shard": {"dim": 0}}]
WHOLE = [{"replicate": {}}]
WEIGHTS = torch.arange(32, dtype=torch.float32).reshape(8, 4)


def refused(call, *expected: str) -> str:
    with pytest.raises(shardcast.ShardcastError) as e:
        call()
    message = str(e.value)
    for part in expected:
        assert part in message, message
    return message


def test_one_tensor_for_two_destination_ranks_is_refused_naming_both(cluster):
    n0, n1 = cluster
    c1 = shardcast.Client(n1.target)
    shared = torch.zeros(4, 4)
    c1.register("infer", 0, 2, {"w": shared}, layout("infer", ["n1", "n1"], SHARDED))
    message = refused(lambda: c1.register("infer", 1, 2, {"w": shared}, layout("infer", ["n1", "n1"], SHARDED)),
                      'group "infer" rank 1: buffer "w"', 'is the same memory as buffer "w"',
                      'of group "infer" rank 0 (destination) on node "n1"', "must be its own")
    assert "bytes [" in message and "shm segment" in message
    assert [s.rank for s in c1.ranks("infer")] == [0]  # nothing of the refused one stays


def test_overlapping_views_and_a_shadow_set_on_the_same_tensors_are_refused(cluster):
    _, n1 = cluster
    c1 = shardcast.Client(n1.target)
    both = torch.zeros(12, 4)
    two = layout("two", ["n1"], WHOLE, names=("a", "b"))
    refused(lambda: c1.register("two", 0, 1, {"a": both[0:8], "b": both[4:12]}, two),
            'buffer "b"', 'is the same memory as its buffer "a"')
    mine = {"w": torch.zeros(8, 4)}
    refused(lambda: c1.register("doubled", 0, 1, mine, layout("doubled", ["n1"], WHOLE), shadow=mine),
            "(shadow set)", "each set of a double-buffered rank")


def test_a_destination_on_a_sources_memory_is_refused_either_way_round(cluster):
    n0, _ = cluster
    c0 = shardcast.Client(n0.target)
    weights = WEIGHTS.clone()
    c0.register("trainer", 0, 1, {"w": weights}, layout("trainer", ["n0"], WHOLE), role="source", version=1)
    refused(lambda: c0.register("infer", 0, 1, {"w": weights}, layout("infer", ["n0"], WHOLE)),
            'of group "trainer" rank 0 (source)', "must be its own")
    target = torch.zeros(8, 4)
    c0.register("infer2", 0, 1, {"w": target}, layout("infer2", ["n0"], WHOLE))
    refused(lambda: c0.register("trainer2", 0, 1, {"w": target}, layout("trainer2", ["n0"], WHOLE), role="source",
                                version=1),
            'of group "infer2" rank 0 (destination)', "would write over this source's weights")


def test_what_may_share_memory_still_registers_and_syncs_exactly(cluster):
    """Sources may share memory (a tied weight under two names, two groups over one model);
    destination ranks may be disjoint slices of one tensor; a rank re-registered with replace
    takes its own memory back."""
    n0, n1 = cluster
    c0, c1 = shardcast.Client(n0.target), shardcast.Client(n1.target)
    tied = WEIGHTS.clone()
    c0.register("trainer", 0, 1, {"w": tied, "v": tied}, layout("trainer", ["n0"], WHOLE, names=("w", "v")),
                role="source", version=1)
    c0.register("trainer-too", 0, 1, {"w": tied}, layout("trainer-too", ["n0"], WHOLE), role="source", version=1)
    one = torch.zeros(16, 4)  # rank 0 takes rows 0-3 of each tensor, rank 1 rows 4-7, all in one storage
    infer = layout("infer", ["n1", "n1"], SHARDED, names=("w", "v"))
    regs = [c1.register("infer", r, 2, {"w": one[4 * r:4 * r + 4], "v": one[8 + 4 * r:12 + 4 * r]}, infer)
            for r in (0, 1)]
    c0.sync("trainer", "infer", 1, verify=True)
    assert torch.equal(one[:8], WEIGHTS) and torch.equal(one[8:], WEIGHTS)
    again = c1.register("infer", 1, 2, {"w": one[4:8], "v": one[12:16]}, infer, replace=True)
    assert again.registration != regs[1].registration


def test_a_tensor_over_numpy_memory_is_copied_in_with_a_warning_and_the_tensor_follows(cluster):
    """torch copies memory it does not own into shared memory: the tensor follows, the numpy array
    does not. Harmless for a checkpoint mapped from its file (a Hugging Face model's weights),
    wrong for an array the application goes on writing: the client says so, naming the tensor."""
    n0, n1 = cluster
    c0, c1 = shardcast.Client(n0.target), shardcast.Client(n1.target)
    c0.register("trainer", 0, 1, {"w": WEIGHTS.clone()}, layout("trainer", ["n0"], WHOLE), role="source", version=1)
    array = np.zeros((8, 4), np.float32)
    tensor = torch.from_numpy(array)
    with pytest.warns(shardcast.ForeignMemoryWarning, match=r'rank 0: 1 torch tensor\(s\) did not own their memory \(w:'):
        reg = c1.register("infer", 0, 1, {"w": tensor}, layout("infer", ["n1"], WHOLE))
    c0.sync("trainer", "infer", 1)
    assert torch.equal(tensor, WEIGHTS) and reg.tensors["w"] is tensor
    assert not array.any()  # no longer the registered memory, as the warning says
    with warnings.catch_warnings():
        warnings.simplefilter("error", shardcast.ForeignMemoryWarning)  # a tensor owning its memory: none
        c1.register("infer2", 0, 1, {"w": torch.zeros(8, 4)}, layout("infer2", ["n1"], WHOLE))


def test_a_tensor_over_a_file_mapped_shared_is_refused(cluster, tmp_path):
    _, n1 = cluster
    c1 = shardcast.Client(n1.target)
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(128))
    mapped = torch.empty(0).set_(torch.UntypedStorage.from_file(str(path), shared=True, nbytes=128), 0, (8, 4))
    with pytest.raises(ValueError, match=r'tensor "w": its memory is shared by file descriptor.*from_file'):
        c1.register("infer", 0, 1, {"w": mapped}, layout("infer", ["n1"], WHOLE))


def _child_reads(t: torch.Tensor, ready, done, out) -> None:
    ready.set()
    done.wait(30)
    out.put(t.sum().item())


def test_a_tensor_shared_with_another_process_by_descriptor_is_refused(cluster):
    _, n1 = cluster
    c1 = shardcast.Client(n1.target)
    t = torch.zeros(8, 4)
    t.share_memory_()  # torch's default strategy: by file descriptor
    with pytest.raises(ValueError, match='shared by file descriptor.*"file_system"'):
        c1.register("infer", 0, 1, {"w": t}, layout("infer", ["n1"], WHOLE))
    # Shared as a named segment instead: registered in place, and the other process sees the sync.
    ctx = multiprocessing.get_context("fork")
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        named = torch.zeros(8, 4)
        named.share_memory_()
        ready, done, out = ctx.Event(), ctx.Event(), ctx.Queue()
        child = ctx.Process(target=_child_reads, args=(named, ready, done, out))
        child.start()
        assert ready.wait(30)
        c1.register("infer", 0, 1, {"w": named}, layout("infer", ["n1"], WHOLE))
        c0 = shardcast.Client(cluster[0].target)
        c0.register("trainer", 0, 1, {"w": WEIGHTS.clone()}, layout("trainer", ["n0"], WHOLE), role="source",
                    version=1)
        c0.sync("trainer", "infer", 1)
        done.set()
        assert out.get(timeout=30) == WEIGHTS.sum().item()
        child.join(30)
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


def test_an_empty_shadow_and_a_version_out_of_range_are_refused_naming_the_call(cluster):
    n0, n1 = cluster
    c0, c1 = shardcast.Client(n0.target), shardcast.Client(n1.target)
    with pytest.raises(ValueError, match='register group "infer" rank 0: shadow is empty'):
        c1.register("infer", 0, 1, {"w": torch.zeros(8, 4)}, layout("infer", ["n1"], WHOLE), shadow={})
    with pytest.raises(ValueError, match=r'sync "trainer" -> "infer" version -1: version must be an integer in \[1'):
        c0.sync("trainer", "infer", -1)
    with pytest.raises(ValueError, match=r"version must be an integer in \[0, 2\^63\), not 1.5"):
        c0.register("trainer", 0, 1, {"w": WEIGHTS.clone()}, layout("trainer", ["n0"], WHOLE), role="source",
                    version=1.5)
    with pytest.raises(ValueError, match=r"wait for group \"infer\" version 9223372036854775808: version must be"):
        c1.wait_version("infer", 1 << 63)
    with pytest.raises(ValueError, match="not True"):
        c0.sync("trainer", "infer", True)
