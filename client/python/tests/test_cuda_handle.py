"""torch's CUDA shareable handles, decoded on the CPU (shardcast/cuda_ipc.py): byte strings of every
layout torch writes, built field by field from torch's source (c10/cuda/CUDACachingAllocator.cpp,
`shareIpcHandle` and `ExpandableSegment::share`) and the 2.13 and 2.15 binaries, so the next change
of the format fails here; the refusals and what they tell the user; and the handle a registration
sends for a CUDA tensor (the bare cudaIpcMemHandle_t, never torch's prefixed string)."""

from __future__ import annotations

import inspect
import re
import sys

import pytest

from shardcast import cuda_ipc, memory
from shardcast.cuda_ipc import CudaMallocBlock, ExpandableSegment, UnknownHandleFormat, decode

# A cudaIpcMemHandle_t's 64 bytes, none of them equal to a version or type byte at the same place.
IPC = bytes((7 * i + 200) % 256 for i in range(64))
FABRIC = [bytes((i + k) % 256 for i in range(64)) for k in (1, 2)]


def le(value: int, width: int, signed: bool = False) -> bytes:
    return value.to_bytes(width, sys.byteorder, signed=signed)


def versioned(version: int, kind: str, payload: bytes) -> bytes:
    """shareIpcHandle: ss.put(SHAREABLE_HANDLE_VERSION); ss.put(type); then the payload."""
    return bytes([version]) + kind.encode() + payload


def header_v2(pid: int, segment_size: int, count: int, padding: bytes = b"\0" * 4) -> bytes:
    """ExpandableSegment::ShareHeader up to torch 2.12: {pid_t pid; size_t segment_size; size_t num_handles}."""
    return le(pid, 4, signed=True) + padding + le(segment_size, 8) + le(count, 8)


def header_v3(pid: int, segment_size: int, count: int, handle_type: int, padding: bytes = b"\0" * 4) -> bytes:
    """torch 2.13 on (pytorch#179618): the same, then the Expandable_Segments_Handle_Type it used
    (int, 1 POSIX fd, 2 fabric), padded to 32 bytes."""
    return header_v2(pid, segment_size, count, padding) + le(handle_type, 4, signed=True) + b"\0" * 4


# ---- what decodes ----

def test_a_bare_handle_is_torch_before_shareable_handles():
    block = decode(IPC, 4096)
    assert block == CudaMallocBlock(IPC, 4096, None)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_a_cuda_malloc_handle_is_the_ipc_handle_without_version_and_type(version):
    raw = versioned(version, "c", IPC)
    assert len(raw) == 66  # what torch 2.11 gave the H200 device check (issue 49)
    block = decode(raw, 2 << 20)
    assert isinstance(block, CudaMallocBlock)
    assert block.ipc_handle == IPC  # exactly the 64 bytes: not the prefix, not the string whole
    assert block.offset == 2 << 20 and block.version == version


def test_the_v2_expandable_segment_of_one_allocation_is_the_30_bytes_torch_2_11_sends():
    raw = versioned(2, "e", header_v2(pid=4321, segment_size=20 << 20, count=1) + le(17, 4, signed=True))
    assert len(raw) == 30  # "CUDA IPC handle of 30 bytes" in issue 49
    seg = decode(raw, 512)
    assert seg == ExpandableSegment(2, 4321, 20 << 20, "posix_fd", (17,), 512)
    assert seg.bytes_spanned == 20 << 20


def test_a_v2_expandable_segment_over_three_allocations():
    raw = versioned(2, "e", header_v2(99, 2 << 20, 3) + le(5, 4) + le(6, 4) + le(9, 4))
    seg = decode(raw, 0)
    assert isinstance(seg, ExpandableSegment)
    assert seg.handles == (5, 6, 9) and seg.handle_type == "posix_fd" and seg.bytes_spanned == 6 << 20


def test_a_v2_expandable_segment_by_fabric_handles():
    raw = versioned(2, "e", header_v2(99, 20 << 20, 2) + FABRIC[0] + FABRIC[1])
    seg = decode(raw, 0)
    assert isinstance(seg, ExpandableSegment)
    assert seg.handle_type == "fabric" and seg.handles == tuple(FABRIC)


def test_the_v3_expandable_segment_records_its_handle_type():
    raw = versioned(3, "e", header_v3(77, 20 << 20, 1, handle_type=1) + le(23, 4))
    assert len(raw) == 38  # 2.13 and 2.15 write a 32-byte header
    assert decode(raw, 64) == ExpandableSegment(3, 77, 20 << 20, "posix_fd", (23,), 64)
    raw = versioned(3, "e", header_v3(77, 20 << 20, 2, handle_type=2) + FABRIC[0] + FABRIC[1])
    seg = decode(raw, 0)
    assert isinstance(seg, ExpandableSegment) and seg.handle_type == "fabric" and seg.handles == tuple(FABRIC)


def test_the_padding_after_pid_is_not_read():
    # pytorch#198305: some builds leave those four bytes uninitialised.
    raw = versioned(3, "e", header_v3(77, 2 << 20, 1, 1, padding=b"\xde\xad\xbe\xef") + le(3, 4))
    seg = decode(raw, 0)
    assert isinstance(seg, ExpandableSegment) and seg.pid == 77 and seg.segment_size == 2 << 20


def test_no_versioned_layout_is_64_bytes_long():
    # torch's reader (and decode) take exactly 64 bytes as a bare handle: no versioned handle of any
    # known layout can have that size, whatever its number of segments.
    sizes = {len(versioned(v, "c", IPC)) for v in cuda_ipc.VERSIONS}
    for count in range(1, 64):
        for header in (24, 32):
            sizes |= {2 + header + 4 * count, 2 + header + 64 * count}
    assert cuda_ipc.IPC_HANDLE_BYTES not in sizes


# ---- what is refused ----

@pytest.mark.parametrize("raw", [
    versioned(4, "c", IPC),  # a version this client was not written for, though 66 bytes long
    versioned(0, "c", IPC),
    versioned(0x63, "c", IPC)[1:] + b"\0",  # no version byte at all: 'c' read as a version
], ids=["v4", "v0", "no-version"])
def test_an_unknown_version_is_refused_whatever_its_length(raw):
    with pytest.raises(UnknownHandleFormat, match=r"version \d+"):
        decode(raw, 0)


@pytest.mark.parametrize("raw, why", [
    (versioned(3, "x", IPC), r"type 'x'"),
    (versioned(3, "\x01", IPC), r"type 0x01"),
    (versioned(3, "c", IPC[:63]), r"63 bytes after its version and type"),
    (versioned(3, "c", IPC + b"\0"), r"65 bytes after its version and type"),
    (b"\x03", r"no version and type"),
    (b"", r"no version and type"),
    (versioned(1, "e", header_v2(1, 2 << 20, 1) + le(3, 4)), r"expandable-segment layouts of versions 2 to 3"),
    (versioned(2, "e", header_v2(1, 2 << 20, 2) + le(3, 4)), r"counts 2 segment\(s\)"),
    (versioned(2, "e", header_v2(1, 2 << 20, 0)), r"counts 0 segment\(s\)"),
    (versioned(3, "e", header_v3(1, 2 << 20, 1, 1) + le(3, 4) + le(4, 4)), r"carries 8 bytes of handles"),
    (versioned(3, "e", header_v3(1, 2 << 20, 1, 0) + le(3, 4)), r"handle type 0"),
    (versioned(3, "e", header_v3(1, 0, 1, 1) + le(3, 4)), r"of 0 bytes"),
    (versioned(3, "e", b"\0" * 20), r"fewer than its 32-byte header"),
], ids=lambda v: v if isinstance(v, str) else f"{len(v)}-bytes")
def test_malformed_and_unknown_handles_are_refused(raw, why):
    with pytest.raises(UnknownHandleFormat, match=why):
        decode(raw, 0)


def test_the_expandable_refusals_name_torch_the_setting_and_the_way_out(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    seg = decode(versioned(2, "e", header_v2(1, 20 << 20, 1) + le(3, 4)), 0)
    assert isinstance(seg, ExpandableSegment)
    # Over TCP: the descriptors cannot reach the daemon.
    msg = cuda_ipc.expandable_refused("layers.0.w", seg, "2.11.0+cu130", cuda_ipc.allocator_setting("native"),
                                      over_tcp=True)
    for part in ('tensor "layers.0.w"', "torch 2.11.0+cu130", 'PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"',
                 "allocator backend native", "1 cuMem allocation(s) of 20971520 bytes by posix fd",
                 "shareable-handle version 2", "side channel beside its Unix socket", "not over TCP", "docs/gpu.md"):
        assert part in msg, part
    # Fabric handles: not imported.
    fabric = decode(versioned(3, "e", header_v3(1, 20 << 20, 1, 2) + bytes(64)), 0)
    msg = cuda_ipc.expandable_refused("layers.0.w", fabric, "2.15.0", cuda_ipc.allocator_setting("native"))
    for part in ('tensor "layers.0.w"', "by fabric, shareable-handle version 3", "not by fabric handle",
                 "expandable_segments:False", "docs/gpu.md"):
        assert part in msg, part


class _FakeStorage:
    def __init__(self, shared):
        self.shared = shared

    def _share_cuda_(self):
        return self.shared


class _FakeCudaTensor:
    """What _cuda_handle reads of a CUDA tensor, with torch's `_share_cuda_()` tuple given."""

    def __init__(self, shared, storage_offset: int, numel: int, element_size: int) -> None:
        self.storage = _FakeStorage(shared)
        self._offset, self._numel, self._element = storage_offset, numel, element_size

    def is_contiguous(self):
        return True

    def untyped_storage(self):
        return self.storage

    def storage_offset(self):
        return self._offset

    def numel(self):
        return self._numel

    def element_size(self):
        return self._element


def test_an_expandable_segment_is_handed_over_as_its_descriptors_at_torchs_offset():
    """torch's 'e' handle names descriptors of this process: each allocation the storage touches
    is handed over (duplicated), and the buffer lies at torch's offset plus the view's."""
    import os

    fds = [os.memfd_create("shardcast-test-e") for _ in range(2)]
    try:
        raw = versioned(3, "e", header_v3(os.getpid(), 2 << 20, 2, 1) + le(fds[0], 4, True) + le(fds[1], 4, True))
        # (device, handle, storage bytes, offset of the storage from the first allocation, ...)
        t = _FakeCudaTensor((1, raw, 3 << 20, 1536), storage_offset=10, numel=(3 << 20) // 4 - 10, element_size=4)
        handed, seen = memory.HandedAllocations(), []

        def hand(name, given):
            seen.append((name, [os.fstat(fd).st_ino for fd in given]))
            return "token-1"

        h = memory._cuda_handle("w", t, handed, hand)
        a = h.cuda_allocations
        assert (h.buffer, a.token, list(a.allocation_bytes), a.offset, a.size, a.device) == (
            "w", "token-1", [2 << 20, 2 << 20], 1536 + 40, (3 << 20) - 40, 1)
        assert seen == [("w", [os.fstat(fd).st_ino for fd in fds])]  # the same files, duplicated
        assert all(d not in fds for d in handed.fds["w"])
        handed.close()
        # Without a Unix socket to the daemon (hand is None): refused by name.
        with pytest.raises(ValueError, match=r'tensor "w": .*not over TCP'):
            memory._cuda_handle("w", t, memory.HandedAllocations(), None)
    finally:
        for fd in fds:
            os.close(fd)


def test_the_unknown_format_refusal_names_the_bytes_torch_and_the_setting(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:native")
    raw = versioned(4, "c", IPC)
    with pytest.raises(UnknownHandleFormat) as e:
        decode(raw, 0)
    msg = cuda_ipc.unknown_format("w", raw, e.value, "2.99.0", cuda_ipc.allocator_setting())
    for part in ('tensor "w"', "torch 2.99.0", "shareable handle version 4", "66 bytes",
                 'PYTORCH_ALLOC_CONF="backend:native"', "docs/gpu.md"):
        assert part in msg, part


def test_allocator_setting_says_when_nothing_is_set(monkeypatch):
    for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(v, raising=False)
    assert cuda_ipc.allocator_setting() == "PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF unset"


# ---- what a registration sends (memory._cuda_handle with torch's CUDA storage played on the CPU) ----

class SharedStorage:
    """What `_cuda_handle` reads of a CUDA tensor's storage: `_share_cuda_()`'s tuple."""

    def __init__(self, handle: bytes, offset: int, error: Exception = None) -> None:
        self.handle, self.offset, self.error = handle, offset, error

    def _share_cuda_(self):
        if self.error is not None:
            raise self.error
        # (device, handle, storage bytes, storage offset, ref counter, its offset, event, sync required)
        return (0, self.handle, 1 << 20, self.offset, b"/torch_ref", 0, None, False)


class CudaView:
    """A contiguous float32 view starting `storage_offset` elements into its storage."""

    def __init__(self, storage: SharedStorage, storage_offset: int, numel: int) -> None:
        self._storage, self._offset, self._numel = storage, storage_offset, numel

    def is_contiguous(self) -> bool:
        return True

    def untyped_storage(self) -> SharedStorage:
        return self._storage

    def storage_offset(self) -> int:
        return self._offset

    def element_size(self) -> int:
        return 4

    def numel(self) -> int:
        return self._numel


@pytest.mark.parametrize("raw", [IPC, versioned(2, "c", IPC), versioned(3, "c", IPC)], ids=["bare", "v2", "v3"])
def test_a_registration_sends_the_bare_ipc_handle_and_the_view_offset(raw):
    # storage 1 MiB into the cudaMalloc block; the view 100 floats into the storage.
    h = memory._cuda_handle("w", CudaView(SharedStorage(raw, 1 << 20), storage_offset=100, numel=256))
    assert h.buffer == "w"
    assert h.cuda.handle == IPC
    assert h.cuda.offset == (1 << 20) + 400
    assert h.cuda.size == 1024 and h.cuda.device == 0


def test_a_registration_refuses_an_expandable_segment_by_name():
    pytest.importorskip("torch")
    raw = versioned(3, "e", header_v3(1, 20 << 20, 1, 1) + le(3, 4))
    with pytest.raises(ValueError, match=r'tensor "w": its memory comes from torch\'s expandable segments'):
        memory._cuda_handle("w", CudaView(SharedStorage(raw, 0), 0, 16))


def test_a_registration_refuses_what_torch_cannot_share():
    pytest.importorskip("torch")
    err = RuntimeError("cudaMallocAsync does not yet support shareIpcHandle. If you need it, please file an issue")
    with pytest.raises(ValueError, match=r'tensor "w": torch .* cannot share its CUDA memory .*cudaMallocAsync'):
        memory._cuda_handle("w", CudaView(SharedStorage(b"", 0, error=err), 0, 16))


def test_torch_still_returns_device_handle_and_offset_where_the_client_reads_them():
    # _cuda_handle reads _share_cuda_()'s elements 0, 1 and 3: torch's own reduce_tensor unpacks
    # them by these names, in this order.
    torch = pytest.importorskip("torch")
    source = inspect.getsource(torch.multiprocessing.reductions.reduce_tensor)
    unpacked = re.search(r"\(\s*([\w\s,]+?)\s*,?\s*\)\s*=\s*storage\._share_cuda_\(\)", source)
    assert unpacked is not None, "torch no longer unpacks storage._share_cuda_() in reduce_tensor"
    names = [n.strip() for n in unpacked.group(1).split(",") if n.strip()]
    assert names[:4] == ["device", "handle", "storage_size_bytes", "storage_offset_bytes"], names


def test_a_gpu_uuid_reads_from_what_torch_gives_and_nothing_else():
    """torch's device properties give `.uuid` as an object with the 16 values in `bytes` (its
    _CUuuid) whose text is the 8-4-4-4-12 form; nvidia-smi -L prints it after "GPU-"."""
    raw = bytes(range(16))

    class CUuuid:
        bytes = list(raw)

        def __str__(self) -> str:
            return "00010203-0405-0607-0809-0a0b0c0d0e0f"

    assert cuda_ipc.uuid_bytes(CUuuid()) == raw
    assert cuda_ipc.uuid_bytes("00010203-0405-0607-0809-0a0b0c0d0e0f") == raw
    assert cuda_ipc.uuid_bytes("GPU-00010203-0405-0607-0809-0a0b0c0d0e0f") == raw
    for unreadable in ("GPU-0001", "not a uuid", None, 7):
        assert cuda_ipc.uuid_bytes(unreadable) == b"", unreadable

    class Short:
        bytes = [1, 2, 3]

    assert cuda_ipc.uuid_bytes(Short()) == b""
    assert cuda_ipc.uuid_bytes("MIG-00010203-0405-0607-0809-0a0b0c0d0e0f") == raw  # a MIG instance's own


def test_a_gpu_uuid_not_read_is_not_kept():
    """Read before torch was imported (a CuMemBuffer of another allocator, say): b"", and read
    again later rather than kept, so a torch tensor registered then names its GPU."""
    memory._gpu_uuids.clear()
    saved = sys.modules.pop("torch", None)
    try:
        assert memory.gpu_uuid(0) == b""
    finally:
        if saved is not None:
            sys.modules["torch"] = saved
    assert 0 not in memory._gpu_uuids
