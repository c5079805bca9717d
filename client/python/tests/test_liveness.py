"""A registration lives as long as its client: ranks of a client that dies (SIGKILL, SIGTERM, an
uncaught exception) are unregistered and their shared memory unlinked; a client re-registers by
itself after its daemon restarts; tensors stay usable after close(); parameters are shared in place."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import numpy as np
import pytest

import shardcast

import rank_worker

HAVE_TORCH = True
try:
    import torch
except ImportError:  # pragma: no cover - the test venv has torch
    HAVE_TORCH = False

CLIENT = textwrap.dedent("""
    import sys, time
    import numpy as np
    import shardcast
    sys.path.insert(0, sys.argv[3])
    import rank_worker
    client = shardcast.Client(sys.argv[1])
    tensors = {n: rank_worker.shard("trainer", n, 0, 1) for n in rank_worker.SHAPES}
    reg = client.register("trainer", 0, 2, tensors, rank_worker.TRAINER, role="source", version=1)
    print(reg.segment, flush=True)
    if sys.argv[2] == "raise":
        raise RuntimeError("the trainer crashed")
    time.sleep(600)
""")


def _ranks(client: shardcast.Client):
    return [(r.group, r.rank) for r in client.list(all_nodes=False).ranks]


def _wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _reachable(predicate):
    """predicate(), or False while the daemon it asks answers UNAVAILABLE: just restarted, the
    client's channel may still be backing off from while it was down (seen under load in CI)."""
    def check() -> bool:
        try:
            return predicate()
        except shardcast.ShardcastError as e:
            if e.code == grpc.StatusCode.UNAVAILABLE:
                return False
            raise
    return check


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "raise"])
def test_a_dead_clients_ranks_are_unregistered_and_their_segments_unlinked(cluster, how):
    n0, _ = cluster
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, n0.target, how, here], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    segment = proc.stdout.readline().strip()
    assert segment.startswith("/shardcast-py-"), proc.stderr.read()
    observer = shardcast.Client(n0.target)
    assert _wait(lambda: ("trainer", 0) in _ranks(observer))
    if how != "raise":
        proc.send_signal(getattr(signal, how))
    proc.wait(timeout=30)
    assert _wait(lambda: ("trainer", 0) not in _ranks(observer)), "the dead client's rank is still registered"
    assert _wait(lambda: not os.path.exists("/dev/shm" + segment)), f"segment {segment} was not unlinked"


OUTLIVING_CLIENT = textwrap.dedent("""
    import os, sys
    import numpy as np
    import shardcast
    from shardcast import memory
    sys.path.insert(0, sys.argv[2])
    import rank_worker
    client = shardcast.Client(sys.argv[1])
    tensors = lambda r: {n: rank_worker.shard("trainer", n, r, 1) for n in rank_worker.SHAPES}
    mine = client.register("trainer", 0, 2, tensors(0), rank_worker.TRAINER, role="source", version=1)
    kept = client.register("trainer", 1, 2, tensors(1), rank_worker.TRAINER, role="source", version=1,
                           session=False)
    child = os.fork()
    if child == 0:  # a forked child's exit unlinks nothing of its parent's
        memory._unlink_segments_at_exit()
        os._exit(0)
    os.waitpid(child, 0)
    print(mine.segment, kept.segment, flush=True)
    sys.stdin.readline()  # the daemon is gone now: this process ends normally, registrations open
""")


def test_a_client_outliving_its_daemon_unlinks_its_segments_when_it_exits():
    """A daemon that goes first (a pod's containers stopped together) cannot unlink its clients'
    segments: each client unlinks its own as it exits, except a registration's without a session
    (it outlives its process by design)."""
    from shardcast.local import LocalCluster

    here = os.path.dirname(os.path.abspath(__file__))
    with LocalCluster(["n0"]) as c:
        proc = subprocess.Popen([sys.executable, "-c", OUTLIVING_CLIENT, c.target("n0"), here],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = proc.stdout.readline().split()
        assert len(line) == 2, proc.stderr.read()
        mine, kept = line
        try:
            assert os.path.exists("/dev/shm" + mine) and os.path.exists("/dev/shm" + kept)  # (the fork's exit)
            d = c.daemons["n0"]
            os.kill(d.proc.pid, signal.SIGKILL)
            d.proc.wait()
            proc.stdin.close()
            assert proc.wait(timeout=30) == 0, proc.stderr.read()
            assert not os.path.exists("/dev/shm" + mine), "the exiting client left its segment"
            assert os.path.exists("/dev/shm" + kept), "a registration without a session lost its segment"
        finally:
            proc.kill()
            for segment in (mine, kept):
                if os.path.exists("/dev/shm" + segment):
                    os.unlink("/dev/shm" + segment)


def test_clients_re_register_by_themselves_after_their_daemon_restarts(tmp_path):
    from shardcast.local import LocalCluster

    with LocalCluster(["n0", "n1"]) as c:
        src, dst = shardcast.Client(c.target("n0")), shardcast.Client(c.target("n1"))
        trainers = rank_worker.register_trainers(src)
        # (A rank registered and gone first: the restarted daemon numbers registrations anew, so
        # the inference ranks' registrations differ from the first ones.)
        dst.register("scratch", 0, 1, {"b": np.zeros(9, np.int64)},
                     {"group": "scratch", "mesh": {"shape": [1]}, "nodes": ["n1"],
                      "tensors": [{"name": "b", "shape": [9], "dtype": "int64", "placements": [{"replicate": {}}]}]}).close()
        infers = rank_worker.register_inference(dst)
        src.sync("trainer", "infer", 1)
        for node in ("n0", "n1"):
            d = c.daemons[node]
            os.kill(d.proc.pid, signal.SIGKILL)
            d.proc.wait()
            c.restart(node)
        # Back by themselves: the trainer ranks at the version they published, the inference
        # ranks empty (a new daemon knows nothing of what they hold).
        assert _wait(_reachable(lambda: len(src.ranks("trainer")) == 2 and len(dst.ranks("infer")) == 2), 15)
        assert src.reconnects == 1 and dst.reconnects == 1
        assert [shardcast.describe_rank(s) for s in src.ranks("trainer")] == ["ready(1)", "ready(1)"]
        assert [shardcast.describe_rank(s) for s in dst.ranks("infer")] == ["empty", "empty"]
        for r, reg in enumerate(trainers):
            with reg.writing(2):
                for n in rank_worker.SHAPES:
                    reg.tensors[n][...] = rank_worker.shard("trainer", n, r, 2)
        src.sync("trainer", "infer", 2, verify=True)  # the first sync after the restart commits
        assert dst.wait_version("infer", 2, timeout=5) == 2
        for r, reg in enumerate(infers):
            for n in rank_worker.SHAPES:
                assert np.array_equal(reg.tensors[n], rank_worker.shard("infer", n, r, 2)), n
        # Closed, ranks registered again by the session go (under their new registrations).
        for reg in trainers + infers:
            reg.close()
        assert [(r.group, r.rank) for r in src.list(all_nodes=True).ranks] == []


@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_a_rank_taken_over_without_a_session_is_not_registered_again_with_its_old_memory():
    """replace=True, session=False over a rank the client's session registered: after a daemon
    restart the session must not register the old memory again (torch tensors, shared in place,
    are still there to map; the new handle would follow that registration)."""
    import torch
    from shardcast.local import LocalCluster

    def tensors():
        return {"w": torch.zeros(16, 4), "b": torch.zeros(9, dtype=torch.int64)}

    with LocalCluster(["n1"]) as c:
        dst = shardcast.Client(c.target("n1"))
        old_tensors = tensors()
        dst.register("infer", 0, 2, old_tensors, rank_worker.INFERENCE)
        new = dst.register("infer", 0, 2, tensors(), rank_worker.INFERENCE, replace=True, session=False)
        d = c.daemons["n1"]
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait()
        c.restart("n1")
        assert _wait(lambda: dst.reconnects == 1, 15)  # every rank of the session tried again by then
        assert _wait(_reachable(lambda: dst.ranks("infer") == []), 5)
        with pytest.raises(shardcast.ShardcastError) as gone:  # no session: the new daemon never had it
            new.close()
        assert gone.value.code == grpc.StatusCode.NOT_FOUND

@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_a_rank_held_across_a_daemon_restart_stays_held_and_a_double_buffered_one_keeps_its_set():
    """Re-registered after its daemon restarted, a rank the engine was reading is held again (no
    sync writes it under the engine), and a double-buffered rank uses the set it was seen using
    (the newer weights), not the other one."""
    from shardcast.local import LocalCluster

    def layout(group, node):
        return {"group": group, "mesh": {"shape": [1]}, "nodes": [node],
                "tensors": [{"name": "w", "shape": [64], "dtype": "float32", "placements": [{"replicate": {}}]}]}

    with LocalCluster(["n0", "n1"]) as c:
        src, dst = shardcast.Client(c.target("n0")), shardcast.Client(c.target("n1"))
        weights = torch.full((64,), 1.0)
        trainer = src.register("trainer", 0, 1, {"w": weights}, layout("trainer", "n0"), role="source", version=1)
        single = dst.register("single", 0, 1, {"w": torch.zeros(64)}, layout("single", "n1"))
        double = dst.register("double", 0, 1, {"w": torch.zeros(64)}, layout("double", "n1"),
                              shadow={"w": torch.zeros(64)})
        for group in ("single", "double"):
            src.sync("trainer", group, 1)
        with double.reading() as seen:  # version 1 landed in the second set, now in use
            assert float(seen["w"][0]) == 1.0
        with single.reading() as tensors:
            d = c.daemons["n1"]
            os.kill(d.proc.pid, signal.SIGKILL)
            d.proc.wait()
            c.restart("n1")
            assert _wait(_reachable(lambda: len(dst.ranks("single")) == 1 and len(dst.ranks("double")) == 1), 15)
            assert _wait(lambda: dst.reconnects == 1)  # counted once every rank was tried
            assert shardcast.describe_rank(single.state()) == "empty held"
            with trainer.writing(2):
                weights.fill_(2.0)
            with pytest.raises(shardcast.ShardcastError, match="does not accept updates"):
                src.sync("trainer", "single", 2)
            assert float(tensors["w"][0]) == 1.0  # what the engine reads did not change under it
        assert shardcast.describe_rank(single.state()) == "empty"  # released: no "not acquired" error
        assert float(double.current()["w"][0]) == 1.0  # the set in use before the restart, not the zeros
        src.sync("trainer", "double", 2)  # into the other set, then flipped to it
        with double.reading() as now:
            assert float(now["w"][0]) == 2.0
        src.sync("trainer", "single", 2)
        assert float(single.tensors["w"][0]) == 2.0


@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_a_source_held_across_a_daemon_restart_keeps_its_version_floor():
    """A trainer writing its next version when its daemon restarts comes back held, above the
    version it published before: publishing that one again, or an older one, is refused as it
    was before the restart (a version means one set of bytes)."""
    from shardcast.local import LocalCluster

    one = {"group": "trainer", "mesh": {"shape": [1]}, "nodes": ["n0"],
           "tensors": [{"name": "w", "shape": [8], "dtype": "float32", "placements": [{"replicate": {}}]}]}
    with LocalCluster(["n0"]) as c:
        client = shardcast.Client(c.target("n0"), timeout=5)
        trainer = client.register("trainer", 0, 1, {"w": torch.zeros(8)}, one, role="source", version=1)
        with trainer.writing(5):
            trainer.tensors["w"].fill_(5.0)
        client.acquire("trainer", 0)  # writing version 6
        d = c.daemons["n0"]
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait()
        c.restart("n0")
        assert _wait(_reachable(lambda: client.reconnects == 1), 15)
        assert shardcast.describe_rank(trainer.state()) == "updating(5) held"
        for stale in (5, 3):
            with pytest.raises(shardcast.ShardcastError, match=f"version {stale} is not newer than version 5"):
                client.publish("trainer", 0, stale)
        client.publish("trainer", 0, 6)
        assert shardcast.describe_rank(trainer.state()) == "ready(6)"


@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_a_release_the_dead_daemon_never_answered_leaves_the_rank_free_after_the_restart():
    """The engine's reading() ends while its daemon is down: the release fails (UNAVAILABLE), and the
    rank comes back un-held, not held for good."""
    from shardcast.local import LocalCluster

    one = {"group": "infer", "mesh": {"shape": [1]}, "nodes": ["n0"],
           "tensors": [{"name": "w", "shape": [8], "dtype": "float32", "placements": [{"replicate": {}}]}]}
    with LocalCluster(["n0"]) as c:
        client = shardcast.Client(c.target("n0"), timeout=5)
        reg = client.register("infer", 0, 1, {"w": torch.zeros(8)}, one)
        d = c.daemons["n0"]
        with pytest.raises(shardcast.ShardcastError, match="UNAVAILABLE"):
            with reg.reading():
                os.kill(d.proc.pid, signal.SIGKILL)
                d.proc.wait()
        c.restart("n0")
        assert _wait(lambda: client.reconnects == 1, 15)
        assert shardcast.describe_rank(reg.state()) == "empty"
        with reg.reading():  # acquired again: the earlier hold did not come back
            assert reg.state().held


def test_a_failed_re_registration_raises_where_the_application_sees_it():
    from shardcast.local import LocalCluster

    with LocalCluster(["n0"]) as c:
        src = shardcast.Client(c.target("n0"))
        trainers = rank_worker.register_trainers(src)
        d = c.daemons["n0"]
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait()
        c.extra = c.extra + ["--max-layout-tensors", "1"]  # the trainer's layout (2 tensors) is refused now
        c.restart("n0")
        assert _wait(lambda: src.reconnects == 1, 15)
        with pytest.raises(shardcast.ShardcastError) as failed:
            src.acquire("trainer", 0)
        assert failed.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert 're-registering group "trainer" rank 0 after its daemon restarted failed: INVALID_ARGUMENT' in str(
            failed.value)
        with pytest.raises(shardcast.ShardcastError):
            src.wait_version("trainer", 1, timeout=1)
        # Once the application deals with it (here: gives the ranks up), its calls are its own again.
        for reg in trainers:
            with pytest.raises(shardcast.ShardcastError) as gone:
                reg.close()
            assert gone.value.code == grpc.StatusCode.NOT_FOUND  # the new daemon never had them
        with pytest.raises(shardcast.ShardcastError) as unknown:
            src.acquire("trainer", 0)
        assert unknown.value.code == grpc.StatusCode.NOT_FOUND


def test_wait_version_fails_fast_on_a_dirty_rank_and_the_fences_hold(cluster):
    n0, n1 = cluster
    src, dst = shardcast.Client(n0.target), shardcast.Client(n1.target)
    trainers = rank_worker.register_trainers(src)
    infers = rank_worker.register_inference(dst)
    assert [shardcast.describe_rank(s) for s in dst.ranks("infer")] == ["empty", "empty"]
    # An inference engine reading its weights holds syncs off.
    with infers[1].reading():
        assert shardcast.describe_rank(infers[1].state()) == "empty held"
        with pytest.raises(shardcast.ShardcastError) as e:
            src.sync("trainer", "infer", 1)
        assert 'group "infer" rank 1 on node "n1" does not accept updates' in e.value.details
    src.sync("trainer", "infer", 1)
    assert dst.wait_version("infer", 1, timeout=5) == 1
    # A sync into the trainer is refused; the trainer's weights stay.
    with pytest.raises(shardcast.ShardcastError) as e:
        dst.sync("infer", "trainer", 2)
    assert e.value.code.name == "FAILED_PRECONDITION"
    assert "registered as a destination" in e.value.details or "registered as a source" in e.value.details
    assert np.array_equal(trainers[0].tensors["w"], rank_worker.shard("trainer", "w", 0, 1))
    # A step that raises leaves the rank acquired: nothing reads half-written weights.
    with pytest.raises(ZeroDivisionError):
        with trainers[0].writing(2):
            trainers[0].tensors["w"][...] = 0
            1 / 0
    assert shardcast.describe_rank(trainers[0].state()) == "updating(1) held"
    with pytest.raises(shardcast.ShardcastError) as e:
        src.sync("trainer", "infer", 2)
    assert "being written by its owner" in e.value.details
    for reg in trainers + infers:
        reg.close()


def test_tensors_stay_usable_after_close_and_the_client_going(cluster):
    n0, _ = cluster
    code = textwrap.dedent("""
        import sys, gc
        import numpy as np
        import shardcast
        sys.path.insert(0, sys.argv[2])
        import rank_worker
        arrays = {n: rank_worker.shard("trainer", n, 0, 1) for n in rank_worker.SHAPES}
        tensors = dict(arrays)
        try:
            import torch
            tensors["w"] = torch.tensor(arrays["w"])  # a tensor that owns its memory: registered in place
        except ImportError:
            pass
        with shardcast.Client(sys.argv[1]) as client:
            with client.register("trainer", 0, 2, tensors, rank_worker.TRAINER) as reg:
                views = reg.tensors
        gc.collect()
        total = 0.0
        for name, t in views.items():  # after close() and the client: still mapped, still the data
            a = t.numpy() if hasattr(t, "numpy") else t
            a[...] = a + 1
            total += float(a.sum())
        print("ok", total)
    """)
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", code, n0.target, here], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_a_rank_its_client_closed_is_free_at_once_for_a_new_client_and_its_segment_unlinked(cluster):
    # A script that makes a client per step (register, sync, close) registered its rank again
    # right after close() and was refused (ALREADY_EXISTS) until the daemon had seen the session
    # end, up to 200 ms later.
    n0, _ = cluster
    tensors = {n: rank_worker.shard("trainer", n, 0, 1) for n in rank_worker.SHAPES}
    segments = []
    for step in range(5):
        client = shardcast.Client(n0.target)
        reg = client.register("trainer", 0, 2, tensors, rank_worker.TRAINER, role="source", version=step + 1)
        segments.append(reg.segment)
        assert os.path.exists("/dev/shm" + reg.segment)
        client.close()
        assert not os.path.exists("/dev/shm" + reg.segment), f"step {step}: {reg.segment} still in /dev/shm"
        with shardcast.Client(n0.target) as other:
            assert ("trainer", 0) not in _ranks(other)
    with shardcast.Client(n0.target) as client:
        with client.register("trainer", 0, 2, tensors, rank_worker.TRAINER, role="source", version=9):
            assert ("trainer", 0) in _ranks(client)
    assert len(set(segments)) == 5


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_a_client_closed_mid_sync_waits_for_it_and_leaves_its_rank_free_for_a_new_client():
    """A client per step closed while a sync still wrote its rank (32 MiB over a 100 Mbit/s link,
    network namespaces): close() returned at once with the rank still registered, and the new
    client's registration was refused, ALREADY_EXISTS suggesting `replace`, which was refused too
    (in use). Now close() waits for the sync, which commits, and the rank is free when it returns."""
    import threading

    from shardcast.local import LocalCluster, Namespaces

    shape = (2048, 4096)  # 32 MiB of float32
    weights = np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape)

    def layout(group: str, node: str) -> dict:
        return {"group": group, "mesh": {"shape": [1]}, "nodes": [node],
                "tensors": [{"name": "w", "shape": list(shape), "dtype": "float32"}]}

    with Namespaces(["n0", "n1"], rate_mbit=100), LocalCluster(["n0", "n1"], netns=True) as c:
        src = shardcast.Client(c.target("n0"), timeout=60)
        trainer = src.register("trainer", 0, 1, {"w": weights}, layout("trainer", "n0"), role="source", version=1)
        engine = shardcast.Client(c.target("n1"), timeout=60)
        engine.register("infer", 0, 1, {"w": np.zeros(shape, np.float32)}, layout("infer", "n1"))
        closing, closed = [], []

        def close_engine() -> None:
            time.sleep(0.8)  # into the transfer, of about 3 s (its bytes are counted once they all landed)
            begun = time.monotonic()
            engine.close()
            closed.append((begun, time.monotonic()))

        def close_once_planned(p) -> None:
            if not closing and p.bytes_total:
                closing.append(threading.Thread(target=close_engine))
                closing[0].start()

        resp = src.sync("trainer", "infer", 1, progress=close_once_planned, timeout=120)
        ended = time.monotonic()
        assert closing, "the sync reported no bytes to move"
        closing[0].join()
        begun, returned = closed[0]
        assert begun < ended, "close() began after the sync had ended: the link was faster than this test needs"
        assert returned >= ended - 0.05, "close() returned while its rank's sync still ran"
        assert resp.sync_id
        with shardcast.Client(c.target("n1")) as again:
            reg = again.register("infer", 0, 1, {"w": np.zeros(shape, np.float32)}, layout("infer", "n1"))
            assert shardcast.describe_rank(reg.state()) == "empty"
            reg.close()
        trainer.close()
        src.close()


def test_a_rank_registered_again_empty_is_named_with_what_brings_it_up(cluster):
    """An inference process restarted between syncs registers its rank again, empty. Syncing the
    version its group's other ranks hold is refused (not newer for them): the refusal names the
    empty rank and says to publish a newer version, which then brings every rank up."""
    n0, n1 = cluster

    def layout(group: str, node: str, world: int) -> dict:
        return {"group": group, "mesh": {"shape": [world]}, "nodes": [node] * world,
                "tensors": [{"name": "w", "shape": [8, 4], "dtype": "float32", "placements": [{"shard": {"dim": 0}}]}]}

    weights = np.arange(32, dtype=np.float32).reshape(8, 4)
    with shardcast.Client(n0.target) as src, shardcast.Client(n1.target) as dst:
        trainer = src.register("trainer", 0, 1, {"w": weights.copy()}, layout("trainer", "n0", 1), role="source",
                               version=1)
        ranks = [dst.register("infer", r, 2, {"w": np.zeros((4, 4), np.float32)}, layout("infer", "n1", 2))
                 for r in range(2)]
        src.sync("trainer", "infer", 1)
        ranks[1].close()  # its process restarted: registered again, empty
        ranks[1] = dst.register("infer", 1, 2, {"w": np.zeros((4, 4), np.float32)}, layout("infer", "n1", 2))
        with pytest.raises(shardcast.ShardcastError) as refused:
            src.sync("trainer", "infer", 1)
        why = str(refused.value)
        assert 'rank 0 on node "n1" is at version 1: version 1 is not newer' in why, why
        assert 'group "infer" rank 1 on node "n1" is empty: publish a newer version to bring it up' in why, why
        with trainer.writing(2):
            trainer.tensors["w"][...] = weights + 2
        src.sync("trainer", "infer", 2)
        for r, reg in enumerate(ranks):
            assert shardcast.describe_rank(reg.state()) == "ready(2)"
            assert np.array_equal(reg.tensors["w"], weights[4 * r:4 * r + 4] + 2)
        for reg in [trainer, *ranks]:
            reg.close()


@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_state_dict_registers_the_parameters_in_place_not_a_snapshot(cluster):
    n0, _ = cluster
    model = torch.nn.Linear(8, 4, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    layout = {"group": "sd", "mesh": {"shape": [1]}, "nodes": ["n0"],
              "tensors": [{"name": "weight", "shape": [4, 8], "dtype": "float32"}]}
    client = shardcast.Client(n0.target)
    reg = client.register("sd", 0, 1, model.state_dict(), layout, role="source")
    segment_view = reg.tensors["weight"]
    model(torch.ones(2, 8)).sum().backward()
    opt.step()  # in place: the registered memory follows
    assert torch.equal(segment_view, model.weight.detach())
    assert reg.moved() == []
    reg.close()


def test_double_buffered_engine_reads_one_set_while_syncs_write_the_other(cluster):
    n0, n1 = cluster
    src, dst = shardcast.Client(n0.target), shardcast.Client(n1.target)
    trainers = rank_worker.register_trainers(src)
    infers = [dst.register("infer", r, 2, rank_worker.zeros(r), rank_worker.INFERENCE, shadow=rank_worker.zeros(r))
              for r in range(2)]
    assert all(reg.double_buffered for reg in infers)
    src.sync("trainer", "infer", 1)
    with infers[0].reading() as weights:  # the set holding version 1, pinned
        assert np.array_equal(weights["w"], rank_worker.shard("infer", "w", 0, 1))
        for r, reg in enumerate(trainers):
            with reg.writing(2):
                for n in rank_worker.SHAPES:
                    reg.tensors[n][...] = rank_worker.shard("trainer", n, r, 2)
        src.sync("trainer", "infer", 2)  # lands in the other set and flips: the engine still sees 1
        assert np.array_equal(weights["w"], rank_worker.shard("infer", "w", 0, 1))
        assert dst.wait_version("infer", 2, timeout=5) == 2
    with infers[0].reading() as weights:
        assert np.array_equal(weights["w"], rank_worker.shard("infer", "w", 0, 2))
    for reg in trainers + infers:
        reg.close()


def test_taking_over_a_rank_needs_replace_the_holder_is_told_and_its_handle_is_inert(cluster):
    n0, _ = cluster
    holder, newcomer = shardcast.Client(n0.target), shardcast.Client(n0.target)
    mine = {n: rank_worker.shard("trainer", n, 0, 4) for n in rank_worker.SHAPES}
    theirs = {n: rank_worker.shard("trainer", n, 0, 5) for n in rank_worker.SHAPES}
    held = holder.register("trainer", 0, 2, mine, rank_worker.TRAINER, role="source", version=4)
    with pytest.raises(shardcast.ShardcastError) as refused:
        newcomer.register("trainer", 0, 2, theirs, rank_worker.TRAINER, role="source", version=5)
    assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert "register with replace to take it over" in refused.value.details
    assert [shardcast.describe_rank(s) for s in holder.ranks("trainer")] == ["ready(4)"]
    taken = newcomer.register("trainer", 0, 2, theirs, rank_worker.TRAINER, role="source", version=5, replace=True)

    def told():  # the session's event arrives on its own thread
        try:
            holder.wait_version("trainer", 1, timeout=0.1)
        except shardcast.ShardcastError as e:
            return e
        return None
    assert _wait(lambda: told() is not None)
    e = told()
    assert e.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(shardcast.ShardcastError) as acquire:
        holder.acquire("trainer", 0, timeout=1)
    assert "was taken over by" in str(acquire.value)
    assert f'group "trainer" rank 0 on node "n0" was taken over by uid {os.geteuid()} (pid {os.getpid()})' in str(e)
    assert not os.path.exists("/dev/shm" + held.segment)  # the superseded copy is unlinked
    held.close()  # inert: it does not drop the newer registration
    assert [shardcast.describe_rank(s) for s in newcomer.ranks("trainer")] == ["ready(5)"]
    taken.close()
    assert newcomer.ranks("trainer") == []


def test_a_rank_taken_over_by_its_own_client_leaves_the_old_handle_inert(cluster):
    """replace=True through the same Client (an engine re-registering its parameters): the old
    Registration's calls are refused and its close() leaves the new registration alone. And the
    calls a user can get wrong on a handle (publish(0), the other role's fence block) name it."""
    n0, n1 = cluster
    src, c = shardcast.Client(n0.target), shardcast.Client(n1.target)
    trainers = rank_worker.register_trainers(src)
    old = c.register("infer", 0, 2, rank_worker.zeros(0), rank_worker.INFERENCE)
    new = c.register("infer", 0, 2, rank_worker.zeros(0), rank_worker.INFERENCE, replace=True)
    other = c.register("infer", 1, 2, rank_worker.zeros(1), rank_worker.INFERENCE)
    assert new.registration != old.registration
    with pytest.raises(shardcast.ShardcastError) as acquire:
        old.acquire(timeout=1)
    assert acquire.value.code == grpc.StatusCode.FAILED_PRECONDITION and "was taken over by" in str(acquire.value)
    old.close()  # inert: the rank stays registered, as the new handle holds it
    assert [s.rank for s in c.ranks("infer")] == [0, 1]
    src.sync("trainer", "infer", 1)
    assert np.array_equal(new.tensors["w"], rank_worker.shard("infer", "w", 0, 1))
    with new.reading() as weights:  # the new handle's own calls act on it
        assert np.array_equal(weights["w"], rank_worker.shard("infer", "w", 0, 1))
    with pytest.raises(ValueError, match=r'publish group "trainer" rank 0 version 0: version must be'):
        trainers[0].publish(0)
    # The fence blocks of the other role are refused before they take the rank.
    with pytest.raises(ValueError, match=r"reading\(\) is for destination ranks; this one is a source"):
        with trainers[0].reading():
            pass
    with pytest.raises(ValueError, match=r"writing\(\) is for source ranks; this one is a destination"):
        with new.writing(2):
            pass
    assert [shardcast.describe_rank(s) for s in c.ranks("infer")] == ["ready(1)", "ready(1)"]  # neither held
    # A rank unregistered through the client: its handle acts on nothing any more (a registration
    # made later, here or on a restarted daemon that hands out the same id, is not its own).
    c.unregister("infer", 1)
    again = c.register("infer", 1, 2, rank_worker.zeros(1), rank_worker.INFERENCE)
    with pytest.raises(shardcast.ShardcastError, match="was unregistered through its client"):
        other.acquire(timeout=1)
    other.close()  # inert
    assert [s.rank for s in c.ranks("infer")] == [0, 1]
    for reg in [new, again] + trainers:
        reg.close()
    assert c.ranks("infer") == []
