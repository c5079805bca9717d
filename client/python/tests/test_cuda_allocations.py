"""cuMem allocations (torch's expandable segments, any cuMemCreate-based allocator) registered by
their file descriptors, on CPU: daemons with emulated GPUs (--emulate-gpus), memfds standing in for
the physical allocations, mapped one after another here as an allocator maps them. The client hands
the descriptors over on the daemon's side channel; a sync lands every byte; after the destination's
daemon restarts, the session hands them over again and registers anew."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

import shardcast
from shardcast import memory

ALLOCATION = 16384  # a multiple of the emulated granularity (the page size)
N = 6000  # int32 elements: 24000 bytes at offset 1000 span the first two allocations
OFFSET = 1000


class Allocations:
    """`count` memfds of ALLOCATION bytes, mapped one after another into one reserved range."""

    def __init__(self, count: int) -> None:
        self.fds = [os.memfd_create("shardcast-test-allocation") for _ in range(count)]
        for fd in self.fds:
            os.ftruncate(fd, ALLOCATION)
        # One mapping per memfd, read back as one array through a copy-free view of each.
        self.maps = [mmap.mmap(fd, ALLOCATION) for fd in self.fds]

    def write(self, offset: int, data: bytes) -> None:
        for i, m in enumerate(self.maps):
            lo, hi = max(offset, i * ALLOCATION), min(offset + len(data), (i + 1) * ALLOCATION)
            if lo < hi:
                m[lo - i * ALLOCATION:hi - i * ALLOCATION] = data[lo - offset:hi - offset]

    def read(self, offset: int, n: int) -> bytes:
        return b"".join(bytes(m)[max(0, offset - i * ALLOCATION):max(0, offset + n - i * ALLOCATION)]
                        for i, m in enumerate(self.maps))[:n]

    def buffer(self) -> shardcast.CuMemBuffer:
        return shardcast.CuMemBuffer(fds=self.fds, allocation_bytes=[ALLOCATION] * len(self.fds), offset=OFFSET,
                                     nbytes=N * 4, device=0, dtype="int32", shape=(N,))

    def close(self) -> None:
        for m in self.maps:
            m.close()
        for fd in self.fds:
            os.close(fd)


def _layout(group: str, node: str) -> dict:
    return {"group": group, "mesh": {"shape": [1]}, "nodes": [node],
            "tensors": [{"name": "w", "shape": [N], "dtype": "int32", "placements": [{"replicate": {}}]}]}


def _wait(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except shardcast.ShardcastError:
            pass
        time.sleep(0.05)
    return predicate()


def test_cumem_allocations_sync_every_byte_and_register_again_after_a_restart():
    from shardcast.local import LocalCluster

    expected = (np.arange(N, dtype=np.int32) * 7 + 3).tobytes()
    src_mem, dst_mem = Allocations(2), Allocations(2)
    try:
        with LocalCluster(["n0", "n1"], extra=["--emulate-gpus", "1"]) as c:
            src, dst = shardcast.Client(c.target("n0")), shardcast.Client(c.target("n1"))
            src_mem.write(OFFSET, expected)
            src.register("trainer", 0, 1, {"w": src_mem.buffer()}, _layout("trainer", "n0"), role="source",
                         version=1)
            dst.register("infer", 0, 1, {"w": dst_mem.buffer()}, _layout("infer", "n1"))
            src.sync("trainer", "infer", 1, verify=True)
            assert dst_mem.read(OFFSET, N * 4) == expected
            assert dst_mem.read(0, OFFSET) == bytes(OFFSET)  # nothing written before the buffer

            c.daemons["n1"].stop()
            dst_mem.write(OFFSET, bytes(N * 4))
            c.restart("n1")
            assert _wait(lambda: dst.reconnects == 1 and len(dst.ranks("infer")) == 1)
            src.sync("trainer", "infer", 1, verify=True)
            assert dst_mem.read(OFFSET, N * 4) == expected
    finally:
        src_mem.close()
        dst_mem.close()


def emulated_uuid(gpu: int) -> bytes:
    """An emulated GPU's UUID, as shardcastd --emulate-gpus gives it (transport/emulated_gpus.h)."""
    return b"shardcast-gpu" + gpu.to_bytes(3, "big")


def test_a_container_names_its_gpu_by_uuid_and_the_daemon_finds_it_under_its_own_number():
    """A container's device numbers are its own (it calls the one GPU it was given device 0, or
    CUDA_VISIBLE_DEVICES renumbers them); the daemon sees every GPU of the node. The client names
    the GPU by its UUID, and the daemon goes by it: a buffer on the client's device 3, which this
    2-GPU daemon does not have, registers on the daemon's GPU 1 and a sync lands every byte. A UUID
    the node's GPUs do not have is refused, listing the ones it has."""
    from shardcast.local import LocalCluster

    expected = (np.arange(N, dtype=np.int32) * 5 + 1).tobytes()
    src_mem, dst_mem, stray = Allocations(2), Allocations(2), Allocations(2)
    try:
        with LocalCluster(["n0", "n1"], extra=["--emulate-gpus", "2"]) as c:
            src, dst = shardcast.Client(c.target("n0")), shardcast.Client(c.target("n1"))
            src_mem.write(OFFSET, expected)
            on_gpu1 = src_mem.buffer()
            on_gpu1.device, on_gpu1.device_uuid = 3, emulated_uuid(1)
            src.register("trainer", 0, 1, {"w": on_gpu1}, _layout("trainer", "n0"), role="source", version=1)
            dst.register("infer", 0, 1, {"w": dst_mem.buffer()}, _layout("infer", "n1"))
            src.sync("trainer", "infer", 1, verify=True)
            assert dst_mem.read(OFFSET, N * 4) == expected

            elsewhere = stray.buffer()
            elsewhere.device_uuid = emulated_uuid(5)
            with pytest.raises(shardcast.ShardcastError) as refused:
                dst.register("other", 0, 1, {"w": elsewhere}, _layout("other", "n1"))
            why = str(refused.value)
            assert refused.value.code.name == "FAILED_PRECONDITION", why
            assert "(the client's device 0, GPU-73686172-6463-6173-742d-677075000005) is none of this daemon's 2 " \
                   "GPUs (0: GPU-73686172-6463-6173-742d-677075000000, 1: GPU-73686172-6463-6173-742d-677075000001)" \
                   in why, why
            assert "NVIDIA_VISIBLE_DEVICES=all" in why, why
    finally:
        for mem in (src_mem, dst_mem, stray):
            mem.close()


def test_cumem_allocations_refused_with_the_daemons_reason_and_over_tcp_by_name():
    from shardcast.local import LocalCluster

    mem = Allocations(1)
    try:
        with LocalCluster(["n0"], extra=["--emulate-gpus", "1"]) as c:
            client = shardcast.Client(c.target("n0"))
            small = shardcast.CuMemBuffer(fds=mem.fds, allocation_bytes=[ALLOCATION], offset=ALLOCATION - 4096,
                                          nbytes=N * 4, device=0, dtype="int32", shape=(N,))
            with pytest.raises(shardcast.ShardcastError) as outside:
                client.register("g", 0, 1, {"w": small}, _layout("g", "n0"))
            assert 'buffer "w": bytes [12288, 36288) lie outside its 1 allocation(s) of 16384 bytes' in str(
                outside.value)
            # Nothing to hand over is refused before anything is sent.
            with pytest.raises(ValueError) as forged:
                memory.hand_over(c.target("n0")[len("unix:"):], [])
            assert "descriptors to hand over" in str(forged.value)
        # A TCP client cannot carry descriptors: refused before anything is sent.
        tcp = shardcast.client._Handles({"w": mem.buffer()}, hand=None)
        with pytest.raises(ValueError) as over_tcp:
            tcp.share()
        assert 'tensor "w": cuMem allocations register only over the daemon\'s Unix socket' in str(over_tcp.value)
    finally:
        mem.close()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_descriptors_go_only_to_a_channel_served_by_the_daemons_uid():
    """A process of another uid in the daemon's place on `<socket>.fds` never gets the descriptors:
    the client reads the channel's uid (SO_PEERCRED) before it sends anything."""
    directory = tempfile.mkdtemp(prefix="shardcast-squat-")  # under /tmp: reachable by uid 65534
    os.chmod(directory, 0o777)
    sock = os.path.join(directory, "d.sock")
    squatter = subprocess.Popen(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
         "import socket, sys\n"
         "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); print('up', flush=True)\n"
         "c, _ = s.accept(); c.recv(64); c.close()\n", memory.fd_channel_path(sock)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "up"
        fd = os.memfd_create("shardcast-test-squat")
        try:
            with pytest.raises(PermissionError) as refused:
                memory.hand_over(sock, [fd])
            assert "is served by uid 65534" in str(refused.value)
            # Named as a daemon uid (a DaemonSet's non-root daemon), it is believed.
            with pytest.raises(ConnectionError):  # it read the message and closed without an answer
                memory.hand_over(sock, [fd], daemon_uids=[65534])
        finally:
            os.close(fd)
    finally:
        squatter.kill()
        squatter.wait()
        shutil.rmtree(directory, ignore_errors=True)
