"""The Python client against real daemons: ranks registered from separate processes (numpy and
torch), syncs with progress, every destination element checked; errors and defaults."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import numpy as np
import pytest

import shardcast
from conftest import shardcastd_path
import rank_worker
from rank_worker import Ranks, recv

try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


def test_ranks_in_separate_processes_sync_every_element(cluster):
    n0, n1 = cluster
    # trainer rank 0 numpy, rank 1 torch (when available); inference rank 0 torch, rank 1 numpy
    specs = [("trainer", 0, n0.target, False), ("trainer", 1, n0.target, HAVE_TORCH),
             ("infer", 0, n1.target, HAVE_TORCH), ("infer", 1, n1.target, False)]
    with Ranks(specs) as ranks:
        workers = ranks.workers
        assert ranks.nodes == ["n0", "n0", "n1", "n1"]
        client = shardcast.Client(n0.target)
        listed = client.list()
        assert sorted((r.group, r.rank, r.node) for r in listed.ranks) == [
            ("infer", 0, "n1"), ("infer", 1, "n1"), ("trainer", 0, "n0"), ("trainer", 1, "n0")]
        for version in (1, 2):
            for role, conn, _ in workers:
                if role == "trainer":
                    conn.send(("write", version))
                    recv(conn, "written")
            seen = []
            result = client.sync("trainer", "infer", version, verify=True, progress=seen.append)
            assert result.version == version
            assert result.plan_cached == (version > 1)
            assert seen and seen[-1].state == "committed"
            assert seen[-1].bytes_done == seen[-1].bytes_total > 0
            for role, conn, _ in workers:
                if role == "infer":
                    conn.send(("check", version))
                    got, bad = recv(conn, "checked")
                    assert got == version
                    assert bad == 0, f"{bad} wrong elements after version {version}"
        status = client.status()
        assert status.node == "n0"
        assert [g.group for g in status.groups] == ["trainer"]
        plan = client.plan("trainer", "infer")
        assert plan["network_bytes"] == plan["network_bytes_lower_bound"]
    # after close() every rank is unregistered
    assert len(shardcast.Client(n1.target).list(all_nodes=False).ranks) == 0


def test_errors_carry_the_status_code_and_the_daemons_message(cluster):
    n0, _ = cluster
    client = shardcast.Client(n0.target)
    small = {"w": np.zeros((2, 8), np.float32), "b": np.zeros(5, np.int64)}
    with pytest.raises(shardcast.ShardcastError) as e:
        client.register("trainer", 0, 2, small, rank_worker.TRAINER)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert 'buffer "w" has shape [2, 8] (16 elements) but the layout gives this rank [8, 8] (64 elements) of it' \
        in e.value.details
    # The rank is named once, not by the client and again by the daemon.
    assert e.value.details.startswith('register group "trainer" rank 0: buffer "w"'), e.value.details
    # As many elements in another shape (transposed): refused too, or the bytes would land scrambled.
    transposed = {"w": np.zeros((8, 8), np.float32).reshape(4, 16), "b": np.zeros(5, np.int64)}
    with pytest.raises(shardcast.ShardcastError) as e:
        client.register("trainer", 0, 2, transposed, rank_worker.TRAINER)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert 'buffer "w" has shape [4, 16] but the layout gives this rank [8, 8] of it' in e.value.details

    with pytest.raises(shardcast.ShardcastError) as e:
        client.sync("trainer", "infer", 1)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "trainer" in e.value.details

    with pytest.raises(ValueError, match='not "other"'):
        client.register("other", 0, 2, small, rank_worker.TRAINER)
    with pytest.raises(TypeError, match='"w"'):
        client.register("trainer", 0, 2, {"w": [1, 2, 3]}, rank_worker.TRAINER)

    good = {n: rank_worker.shard("trainer", n, 0, 1) for n in rank_worker.SHAPES}
    with client.register("trainer", 0, 2, good, rank_worker.TRAINER) as reg:
        assert reg.node == "n0"
        assert reg.registered_bytes == sum(a.nbytes for a in good.values())
        assert np.array_equal(reg.tensors["w"], good["w"])
        assert os.path.exists("/dev/shm" + reg.segment)
        segment = reg.segment
        # Timed out at version 0: raised, never returned (an application would serve stale weights).
        with pytest.raises(shardcast.ShardcastError) as stale:
            client.wait_version("trainer", 5, timeout=0.2)
        assert stale.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 'group "trainer"' in str(stale.value) and "is at version 0, not 5" in str(stale.value)
        assert "weights are stale" in str(stale.value)
    assert not os.path.exists("/dev/shm" + segment)
    assert len(client.list(all_nodes=False).ranks) == 0

    with pytest.raises(shardcast.ShardcastError) as e:
        client.wait_version("nobody", 1, timeout=0.1)
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_unreachable_daemon_and_default_target(monkeypatch):
    with pytest.raises(shardcast.ShardcastError) as e:
        shardcast.Client("unix:/tmp/shardcast-py-nobody.sock", connect_timeout=0.3)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert "/tmp/shardcast-py-nobody.sock" in str(e.value)

    monkeypatch.delenv("SHARDCAST_ADDRESS", raising=False)
    monkeypatch.delenv("SHARDCAST_SOCKET", raising=False)
    assert shardcast.default_target() == "unix:" + shardcast.DEFAULT_SOCKET
    monkeypatch.setenv("SHARDCAST_SOCKET", "/tmp/x.sock")
    assert shardcast.default_target() == "unix:/tmp/x.sock"
    monkeypatch.setenv("SHARDCAST_ADDRESS", "10.1.2.3:7070")
    assert shardcast.default_target() == "10.1.2.3:7070"


def test_default_socket_is_the_daemons():
    out = subprocess.run([str(shardcastd_path()), "--print-config", "--insecure"], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if not k.startswith("SHARDCAST_")}).stdout
    settings = dict(token.split("=", 1) for token in out.split())
    assert settings["socket"] == shardcast.DEFAULT_SOCKET


def test_torch_tensors_are_registered_in_place_and_a_moved_one_is_named(cluster):
    torch = pytest.importorskip("torch")
    n0, _ = cluster
    layout = {"group": "inplace", "mesh": {"shape": [1]}, "nodes": ["n0"],
              "tensors": [{"name": "w", "shape": [4, 3], "dtype": "float32"},
                          {"name": "b", "shape": [3], "dtype": "float32"}]}
    params = {"w": torch.nn.Parameter(torch.arange(12.0).view(4, 3)), "b": torch.nn.Parameter(torch.ones(3))}
    before = {n: p.data_ptr() for n, p in params.items()}
    with shardcast.Client(n0.target) as client:
        reg = client.register("inplace", 0, 1, params, layout)
        assert all(reg.tensors[n] is params[n] for n in params)  # the caller's own parameters
        assert all(params[n].untyped_storage().is_shared() for n in params)
        assert params["w"].tolist() == torch.arange(12.0).view(4, 3).tolist()  # values kept
        assert any(params[n].data_ptr() != before[n] for n in params)  # moved into shared memory
        assert reg.moved() == []
        reg.check()
        params["b"].data = torch.zeros(3)  # replaces the storage: syncs would read the old memory
        assert reg.moved() == ["b"]
        with pytest.raises(RuntimeError, match=r'group "inplace" rank 0: 1 registered tensor\(s\) .*: b'):
            reg.check()
        reg.close()
    with torch.no_grad():
        params["w"].add_(1)  # still the caller's memory after close(): usable, never a dangling view
    assert params["w"][0, 0].item() == 1.0


FREE_AFTER_SESSION = """
import gc, sys, time
import torch, shardcast
layout = {"group": "freed", "mesh": {"shape": [1]}, "nodes": ["n0"],
          "tensors": [{"name": "w", "shape": [64], "dtype": "float32"}]}
params = {"w": torch.arange(64.0)}
client = shardcast.Client(sys.argv[1])
client.register("freed", 0, 1, params, layout, role="source", version=1)
client.close()  # the session ends: the daemon drops the rank
with shardcast.Client(sys.argv[1]) as probe:
    while any(r.group == "freed" for r in probe.list(all_nodes=False).ranks):
        time.sleep(0.05)
del params
gc.collect()  # torch unlinks the storage's segment now
print("freed")
"""


def test_tensors_registered_in_place_are_freed_after_their_session_ends(cluster):
    # torch unlinks the segment of a storage it moved into shared memory when the storage is
    # freed, and aborts the process if the name is gone by then: the daemon, dropping a session's
    # ranks, leaves torch's segments to torch (it unlinked them, and a trainer freeing its
    # parameters after shutting its engine down died with "could not unlink the shared memory file").
    pytest.importorskip("torch")
    n0, _ = cluster
    out = subprocess.run([sys.executable, "-c", FREE_AFTER_SESSION, n0.target], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "freed", out.stderr[-3000:]


def test_views_of_one_storage_move_it_once_and_each_lands_its_own_bytes(cluster, monkeypatch):
    # A trainer's fused experts, or a flat parameter buffer: thousands of tensors are views of a
    # few storages. Each storage moves into shared memory once (its segment sized once), and each
    # view's handle points at its own bytes: a sync to another node lands every view's values.
    torch = pytest.importorskip("torch")
    n0, n1 = cluster
    real = torch.UntypedStorage._share_filename_cpu_
    moved = []

    def counting(storage):
        moved.append(storage._cdata)
        return real(storage)

    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", counting)
    flat, other = torch.arange(600.0), torch.arange(1000.0, 1060.0)
    src = {f"e{i}": flat[i * 6:(i + 1) * 6].view(2, 3) for i in range(100)}
    src.update({f"o{i}": other[i * 6:(i + 1) * 6].view(2, 3) for i in range(10)})
    tensors = [{"name": n, "shape": [2, 3], "dtype": "float32"} for n in src]
    layout = lambda group, node: {"group": group, "mesh": {"shape": [1]}, "nodes": [node], "tensors": tensors}
    dst = {n: torch.zeros(2, 3) for n in src}
    with shardcast.Client(n0.target) as c0, shardcast.Client(n1.target) as c1:
        c0.register("views", 0, 1, src, layout("views", "n0"), role="source", version=1)
        assert len(moved) == 2 and len(set(moved)) == 2  # one move per storage, not per view
        c1.register("landed", 0, 1, dst, layout("landed", "n1"))
        c0.sync("views", "landed", 1)
    assert all(torch.equal(dst[n], src[n]) for n in src)


def test_registration_maps_one_segment_at_a_time(cluster, monkeypatch):
    # One storage per parameter (no views shared): torch maps each storage's segment; the check of
    # where each tensor's bytes are maps one segment at a time, not one more per storage (the
    # process's mappings are limited: vm.max_map_count, 65 530 by default).
    import mmap
    from types import SimpleNamespace

    torch = pytest.importorskip("torch")
    from shardcast import memory

    n0, _ = cluster
    live, peak = set(), [0]

    class Counting(mmap.mmap):
        def __new__(cls, *args, **kwargs):
            m = super().__new__(cls, *args, **kwargs)
            live.add(id(m))
            peak[0] = max(peak[0], len(live))
            return m

        def close(self):
            live.discard(id(self))
            super().close()

    monkeypatch.setattr(memory, "mmap", SimpleNamespace(mmap=Counting, PROT_READ=mmap.PROT_READ))
    params = {f"p{i}": torch.full((8,), float(i)) for i in range(50)}
    layout = {"group": "many", "mesh": {"shape": [1]}, "nodes": ["n0"],
              "tensors": [{"name": n, "shape": [8], "dtype": "float32"} for n in params]}
    with shardcast.Client(n0.target) as client:
        client.register("many", 0, 1, params, layout, role="source", version=1).check()
    assert peak[0] == 1 and not live


def test_a_busy_torch_shm_manager_is_waited_for_and_other_failures_are_named(cluster, monkeypatch):
    # torch gives up on its torch_shm_manager's answer after 1 s; on a loaded node that happens
    # (it failed a vLLM worker's registration in CI). The storage is left as it was: tried again.
    torch = pytest.importorskip("torch")
    from shardcast import memory

    n0, _ = cluster
    real = torch.UntypedStorage._share_filename_cpu_
    calls = []

    def busy_twice(storage):
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError(memory.SHM_MANAGER_TIMEOUT)
        return real(storage)

    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", busy_twice)
    layout = {"group": "busy", "mesh": {"shape": [1]}, "nodes": ["n0"],
              "tensors": [{"name": "w", "shape": [4, 3], "dtype": "float32"}]}
    params = {"w": torch.nn.Parameter(torch.arange(12.0).view(4, 3))}
    with shardcast.Client(n0.target) as client:
        reg = client.register("busy", 0, 1, params, layout)
        assert len(calls) == 3 and params["w"].untyped_storage().is_shared()
        reg.check()
        reg.close()

    class Storage:  # a manager that never answers, then one failing otherwise
        def __init__(self, error):
            self.error, self.calls = error, 0

        def _share_filename_cpu_(self):
            self.calls += 1
            raise RuntimeError(self.error)

    never = Storage(memory.SHM_MANAGER_TIMEOUT)
    with pytest.raises(ValueError, match=r'tensor "w": .*torch_shm_manager\) did not answer within its 1 s limit, '
                                         r"3 times .*too busy"):
        memory._share_in_place("w", never, pauses=(0.01, 0.01))
    assert never.calls == 3
    other = Storage("unable to mmap 48 bytes")
    with pytest.raises(ValueError, match=r'tensor "w": .*in place: unable to mmap 48 bytes$'):
        memory._share_in_place("w", other, pauses=(0.01, 0.01))
    assert other.calls == 1  # not a busy manager: not tried again


def test_server_reflection_describes_the_services_to_generic_grpc_tools(cluster):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    from google.protobuf.descriptor_pool import DescriptorPool

    n0, _ = cluster
    with grpc.insecure_channel(n0.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"shardcast.v1.Shardcast", "shardcast.v1.Peer", "grpc.health.v1.Health"} <= services
        sync = DescriptorPool(db).FindServiceByName("shardcast.v1.Shardcast").FindMethodByName("Sync")
        assert sync.input_type.full_name == "shardcast.v1.SyncRequest"
        assert "dst_group" in sync.input_type.fields_by_name


def test_every_call_on_a_closed_client_says_so_and_names_the_call(cluster):
    n0, _ = cluster
    client = shardcast.Client(n0.target)
    client.status()
    client.close()
    client.close()  # closing again does nothing
    good = {n: rank_worker.shard("trainer", n, 0, 1) for n in rank_worker.SHAPES}
    calls = {
        "status": lambda: client.status(),
        "list": lambda: client.list(),
        'register group "trainer" rank 0': lambda: client.register("trainer", 0, 2, good, rank_worker.TRAINER),
        'unregister group "trainer" rank 0': lambda: client.unregister("trainer", 0),
        'acquire group "trainer" rank 0': lambda: client.acquire("trainer", 0),
        'publish group "trainer" rank 0 version 2': lambda: client.publish("trainer", 0, 2),
        'release group "infer" rank 1': lambda: client.release("infer", 1),
        'sync "trainer" -> "infer" version 1': lambda: client.sync("trainer", "infer", 1),
        'watch sync "s1"': lambda: list(client.watch("s1")),
        'wait for group "infer" version 1': lambda: client.wait_version("infer", 1, timeout=1),
        'ranks of group "infer"': lambda: client.ranks("infer"),
        'plan "trainer" -> "infer"': lambda: client.plan("trainer", "infer"),
    }
    for what, call in calls.items():
        with pytest.raises(shardcast.ShardcastError) as e:
            call()
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION, what
        assert e.value.details == f'{what}: the client of shardcastd at "{n0.target}" is closed'


def test_a_sync_without_its_source_reports_only_the_missing_source(cluster):
    """A sync whose source ranks are not registered fails naming the group. Its progress says so
    too and nothing else: when the sync repeats the last one, the daemon first tries the view it
    kept, whose refusal ("a stale view") leads to a full gather; that attempt's error is not the
    sync's, and no report shows it. The window is short, so the sync is tried many times."""
    n0, n1 = cluster
    src, dst = shardcast.Client(n0.target), shardcast.Client(n1.target)
    infer = rank_worker.register_inference(dst)
    missing = 'group "trainer" has no registered ranks (registered groups: "infer")'

    def failing_sync(version: int):
        seen = []
        with pytest.raises(shardcast.ShardcastError) as e:
            src.sync("trainer", "infer", version, progress=seen.append)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert e.value.details.endswith(missing), e.value.details
        assert seen and seen[-1].state == "failed" and seen[-1].error == missing, seen[-1:]
        for p in seen:
            assert "stale view" not in p.error and all("stale view" not in n.error for n in p.nodes), p
        return seen

    failing_sync(1)  # never registered
    version = 1
    for _ in range(30):
        # Two syncs (the second repeats the first: it keeps its view), then the source leaves.
        trainers = rank_worker.register_trainers(src, version)
        src.sync("trainer", "infer", version)
        for t in trainers:
            with t.writing(version + 1):
                for name, x in t.tensors.items():
                    x[...] = rank_worker.shard("trainer", name, t.rank, version + 1)
        assert src.sync("trainer", "infer", version + 1).repeated
        for t in trainers:
            t.close()
        failing_sync(version + 2)
        version += 2
    for reg in infer:
        reg.close()
