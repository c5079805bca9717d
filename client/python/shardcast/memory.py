"""A rank's registered memory, shared with the node's daemon without a copy where possible:

- torch CPU tensors (plain, nn.Parameter, or a DTensor's local tensor) stay where they are: their
  storage is moved into POSIX shared memory in place with torch's own machinery (the
  `file_system` sharing strategy), so every view of it (the parameter, FSDP2's padded shard, the
  optimizer's reference) keeps working and every later update lands in memory the daemon reads;
- CUDA tensors are shared without a copy: cudaMalloc memory by its CUDA IPC handle, memory of
  torch's expandable segments (cuMem allocations) by the allocations' file descriptors, handed to
  the daemon on the side channel beside its socket (hand_over; torch's shareable handle decoded
  by cuda_ipc);
- memory of any other cuMem-based allocator registers as a CuMemBuffer (its descriptors);
- numpy arrays are copied once into one segment; write into `Registration.tensors`, which are
  arrays backed by that segment;
- a tensor a rank holds no element of (an uneven shard) registers no memory.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import mmap
import os
import secrets
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import _posixshmem  # the C module behind multiprocessing.shared_memory
import grpc

from shardcast import cuda_ipc
from shardcast.v1 import service_pb2

_ALIGN = 64


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr")


def _is_dtensor(value: Any) -> bool:
    return _is_torch(value) and hasattr(value, "device_mesh") and hasattr(value, "placements")


def local_tensor(value: Any) -> Any:
    """The tensor whose memory a rank registers: a DTensor's local shard, else `value` itself."""
    if _is_dtensor(value):
        local = getattr(value, "_local_tensor", None)
        return local if local is not None else value.to_local()
    return value


def _nbytes(value: Any) -> int:
    if _is_torch(value):
        return value.numel() * value.element_size()
    return int(value.nbytes)


# The daemon's descriptor side channel (common/fd_passing.h, docs/security.md): one message of
# "SCFD", version 1, the count, two zero bytes, the descriptors attached (SCM_RIGHTS); one line back.
_FD_CHANNEL_VERSION = 1
MAX_HANDED_FDS = 64
_ANSWER_WAIT_S = 10


def fd_channel_path(socket_path: str) -> str:
    """The side channel beside the daemon's Unix socket `socket_path`."""
    return socket_path + ".fds"


def hand_over(socket_path: str, fds: Sequence[int], daemon_uids: Sequence[int] = ()) -> str:
    """Hands `fds` (duplicated by the kernel; this process keeps its own) to the daemon serving
    `socket_path`; returns the one-time token a registration names them by (this uid's only). The
    channel must be served by root, this process's uid or one of `daemon_uids` (SO_PEERCRED,
    checked before anything is sent): a process in the daemon's place never gets the descriptors."""
    if not 0 < len(fds) <= MAX_HANDED_FDS:
        raise ValueError(f"{len(fds)} descriptors to hand over (1 to {MAX_HANDED_FDS})")
    path = fd_channel_path(socket_path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError as e:
            raise ConnectionError(f"the daemon's descriptor channel {path!r}: {e.strerror}") from None
        pid, uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        if uid not in (0, os.getuid(), *daemon_uids):
            raise PermissionError(f"the daemon's descriptor channel {path!r} is served by uid {uid} (pid {pid}), not "
                                  "by root, this process's uid or a daemon uid allowed: not handing it descriptors")
        socket.send_fds(s, [b"SCFD" + bytes([_FD_CHANNEL_VERSION, len(fds), 0, 0])], list(fds))
        s.settimeout(_ANSWER_WAIT_S)  # the answer comes at once unless the channel is busy with others
        answer = b""
        while b"\n" not in answer and len(answer) < 4096:
            try:
                chunk = s.recv(512)
            except socket.timeout:
                raise TimeoutError(f"the daemon's descriptor channel {path!r} did not answer within "
                                   f"{_ANSWER_WAIT_S} s") from None
            if not chunk:
                break
            answer += chunk
    line = answer.split(b"\n", 1)[0].decode(errors="replace")
    if "\n" not in answer.decode(errors="replace"):
        raise ConnectionError(f"the daemon's descriptor channel {path!r} closed without an answer")
    if line.startswith("ok "):
        return line[3:]
    raise ValueError(f"the daemon's descriptor channel refused the descriptors: {line.removeprefix('error ')}")


@dataclass
class CuMemBuffer:
    """Device memory of cuMem (VMM) allocations, registered by their POSIX file descriptors: for an
    allocator built on cuMemCreate other than torch's (torch's expandable segments are found by
    themselves). `fds[i]` is allocation i (cuMemExportToShareableHandle with
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), `allocation_bytes[i]` its size (a multiple of its
    granularity); the allocations lie one after another, the first at 0, and the buffer is
    `nbytes` at `offset` there, on GPU `device` (this process's number; `device_uuid`, its 16-byte
    UUID, names it to the daemon, whose numbers may differ: read from torch when left empty and
    torch is in use). Registered over the Unix socket only."""

    fds: Sequence[int]
    allocation_bytes: Sequence[int]
    offset: int
    nbytes: int
    device: int = 0
    dtype: str = ""
    shape: Tuple[int, ...] = field(default_factory=tuple)
    device_uuid: bytes = b""


class HandedAllocations:
    """The descriptors of a rank's cuMem buffers, duplicated while registered (so that they name
    the same allocations when handed over again after a daemon restart); closed by close()."""

    def __init__(self) -> None:
        self.fds: Dict[str, List[int]] = {}

    def handle(self, name: str, fds: Sequence[int], allocation_bytes: Sequence[int], offset: int, nbytes: int,
               device: int, hand: Any, device_uuid: bytes = b"") -> service_pb2.MemoryHandle:
        if len(fds) != len(allocation_bytes):
            raise ValueError(f'tensor "{name}": {len(fds)} descriptors for {len(allocation_bytes)} allocation sizes')
        if name in self.fds:
            raise ValueError(f'tensor "{name}" is given twice')
        self.fds[name] = [os.dup(fd) for fd in fds]
        h = service_pb2.MemoryHandle(buffer=name)
        a = h.cuda_allocations
        a.token = hand(name, self.fds[name])
        a.allocation_bytes.extend(int(n) for n in allocation_bytes)
        a.offset = int(offset)
        a.size = int(nbytes)
        a.device = int(device)
        a.device_uuid = device_uuid or gpu_uuid(int(device))
        return h

    def refresh(self, handles: Iterable[service_pb2.MemoryHandle], hand: Any) -> None:
        """New tokens for `handles` (a registration made again: each token is spent once)."""
        for h in handles:
            if h.HasField("cuda_allocations"):
                h.cuda_allocations.token = hand(h.buffer, self.fds[h.buffer])

    def close(self) -> None:
        for fds in self.fds.values():
            for fd in fds:
                os.close(fd)
        self.fds = {}


_gpu_uuids: Dict[int, bytes] = {}


def gpu_uuid(device: int) -> bytes:
    """This process's CUDA device `device` as the daemon finds it: its UUID (16 bytes). The device
    numbers of a container (or of CUDA_VISIBLE_DEVICES) are its own, not the daemon's. b"" when
    torch is not in use here or does not say (the daemon then takes `device` as its own number)."""
    if device not in _gpu_uuids:  # (kept once read: torch imported later, or a GPU not ready yet, may say)
        torch = sys.modules.get("torch")
        try:
            uuid = cuda_ipc.uuid_bytes(torch.cuda.get_device_properties(device).uuid) if torch else b""
        except (AttributeError, AssertionError, RuntimeError, ValueError):
            uuid = b""
        if not uuid:
            return b""
        _gpu_uuids[device] = uuid
    return _gpu_uuids[device]


def _cuda_handle(name: str, t: Any, handed: Optional[HandedAllocations] = None,
                 hand: Any = None) -> service_pb2.MemoryHandle:
    if not t.is_contiguous():
        raise ValueError(f'tensor "{name}": a CUDA tensor must be contiguous to be shared')
    storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()._untyped()
    # (device, handle, storage bytes, storage offset in the allocation, ...): torch's own IPC export
    # (torch/multiprocessing/reductions.py unpacks it in this order). The handle is torch's
    # shareable handle, decoded by cuda_ipc into the bare cudaIpcMemHandle_t the daemon imports.
    try:
        shared = storage._share_cuda_()
    except RuntimeError as e:
        raise ValueError(cuda_ipc.share_failed(name, e, *_torch_context())) from None
    device, handle, offset_bytes = shared[0], shared[1], shared[3]
    try:
        block = cuda_ipc.decode(handle, int(offset_bytes))
    except cuda_ipc.UnknownHandleFormat as e:
        raise ValueError(cuda_ipc.unknown_format(name, handle, e, *_torch_context())) from None
    if isinstance(block, cuda_ipc.ExpandableSegment):
        if block.handle_type != "posix_fd" or handed is None or hand is None:
            raise ValueError(cuda_ipc.expandable_refused(name, block, *_torch_context(),
                                                         over_tcp=block.handle_type == "posix_fd"))
        # torch's offset is the storage's, from the start of the first allocation it touches.
        return handed.handle(name, [int(fd) for fd in block.handles], [block.segment_size] * len(block.handles),
                             block.offset + t.storage_offset() * t.element_size(), t.numel() * t.element_size(),
                             int(device), hand)
    h = service_pb2.MemoryHandle(buffer=name)
    h.cuda.handle = block.ipc_handle
    h.cuda.device = int(device)
    h.cuda.device_uuid = gpu_uuid(int(device))
    h.cuda.offset = block.offset + t.storage_offset() * t.element_size()
    h.cuda.size = t.numel() * t.element_size()
    return h


def _torch_context() -> Tuple[str, str]:
    """torch's version and allocator configuration, for messages about what torch shared."""
    import torch

    try:
        backend: Optional[str] = torch.cuda.memory.get_allocator_backend()
    except (AttributeError, RuntimeError):
        backend = None
    return str(torch.__version__), cuda_ipc.allocator_setting(backend)


class SegmentReader:
    """What in_place_handle learns over one registration: each storage moved into shared memory
    once, each segment's size read once (a model's thousands of views of one storage share its
    segment). The segment read last stays mapped for the next read (views of one storage come one
    after another), one at a time: a mapping per storage would count against the process's limit
    (vm.max_map_count) beside torch's own. close() unmaps it."""

    def __init__(self) -> None:
        self._shared: Dict[int, Tuple[str, int]] = {}  # a storage (its StorageImpl): segment, bytes
        self._sizes: Dict[str, int] = {}
        self._mapped: Optional[Tuple[str, mmap.mmap]] = None

    def share(self, name: str, storage: Any) -> Tuple[str, int]:
        """`storage` moved into shared memory in place (tensor `name`'s, for errors): its segment and
        size."""
        if storage._cdata not in self._shared:
            _refuse_shared_by_descriptor(name, storage)
            _manager, segment, nbytes = _share_in_place(name, storage)
            segment = segment.decode() if isinstance(segment, bytes) else str(segment)
            self._shared[storage._cdata] = (segment, int(nbytes))
        return self._shared[storage._cdata]

    def _open(self, name: str) -> Optional[mmap.mmap]:
        """Sizes `name` (once) and, unless it is empty, maps it in place of the last one mapped."""
        if self._mapped is not None and self._mapped[0] == name:
            return self._mapped[1]
        self.close()
        fd = _posixshmem.shm_open(name, os.O_RDONLY, mode=0)
        try:
            size = self._sizes[name] = os.fstat(fd).st_size
            if size == 0:
                return None
            self._mapped = (name, mmap.mmap(fd, size, prot=mmap.PROT_READ))
        finally:
            os.close(fd)
        return self._mapped[1]

    def size(self, name: str) -> int:
        if name not in self._sizes:
            self._open(name)
        return self._sizes[name]

    def read(self, name: str, offset: int, n: int) -> bytes:
        """`n` bytes at `offset`, or b"" where the segment ends before them."""
        m = self._open(name)
        return m[offset:offset + n] if m is not None and offset + n <= self._sizes[name] else b""

    def close(self) -> None:
        if self._mapped is not None:
            self._mapped[1].close()
            self._mapped = None


# torch moves a storage into shared memory through its torch_shm_manager process, and gives up on
# the manager's answer after 1 s ("Shared memory manager connection has timed out", libshm's
# socket): on a busy node (a trainer's, beside its data loaders) that happens. The storage is left
# as it was, so the move is tried again, after these pauses (16 s in all, each try waiting up to
# 1 s more for the manager: at most about 24 s).
SHM_MANAGER_TIMEOUT = "Shared memory manager connection has timed out"
SHM_MANAGER_RETRIES_S = (0.1, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0)


def _share_in_place(name: str, storage: Any, pauses: Sequence[float] = SHM_MANAGER_RETRIES_S) -> Tuple[Any, Any, int]:
    """torch's `_share_filename_cpu_` of `storage` (manager, segment name, bytes), tried again while
    torch's shared memory manager does not answer in time; a ValueError naming the tensor when it
    cannot be done."""
    tries, start = 0, time.monotonic()
    while True:
        tries += 1
        try:
            return storage._share_filename_cpu_()
        except (RuntimeError, AttributeError) as e:
            why = str(e)
            if SHM_MANAGER_TIMEOUT not in why:
                break
            if tries > len(pauses):
                why = (f"torch's shared memory manager (torch_shm_manager) did not answer within its 1 s limit, "
                       f"{tries} times over {time.monotonic() - start:.0f} s: this machine is too busy to register now; "
                       "try again when it is less loaded")
                break
        time.sleep(pauses[tries - 1])
    raise ValueError(f'tensor "{name}": its storage cannot be moved into shared memory in place: {why}')


def _refuse_shared_by_descriptor(name: str, storage: Any) -> None:
    """torch moves a storage into shared memory by copying it into a new segment and pointing the
    storage there. A storage already shared with other processes by file descriptor would leave
    them with the old memory while syncs land in the new: a ValueError."""
    if not storage.is_shared():
        return
    try:
        storage._get_shared_fd()
    except (RuntimeError, AttributeError):
        return  # a named segment already (the "file_system" strategy): registered as it is
    raise ValueError(f'tensor "{name}": its memory is shared by file descriptor (share_memory_() or '
                     'torch.multiprocessing under the default "file_descriptor" strategy, or a file mapped shared: '
                     "UntypedStorage.from_file); registering it would copy it into a named segment and leave the "
                     "other processes (or the file) with the old memory. Call "
                     'torch.multiprocessing.set_sharing_strategy("file_system") before it is shared, or register a '
                     "copy (t.clone())")


class ForeignMemoryWarning(UserWarning):
    """Client.register copied torch tensors over memory torch did not own into shared memory."""


def not_torchs_own(storage: Any) -> bool:
    """Memory torch does not own (torch.from_numpy, torch.frombuffer, DLPack, a checkpoint mapped
    from its file): moving it into shared memory copies it, and only the tensor follows."""
    return not storage.resizable() and not storage.is_shared()


def in_place_handle(name: str, t: Any, segments: SegmentReader) -> service_pb2.MemoryHandle:
    """The handle of a torch CPU tensor's memory after moving its storage into shared memory in
    place (torch's `file_system` strategy: segment /torch_<pid>_..., removed by torch when the
    storage is freed or the process ends). The data sits behind the segment's header; where is
    derived from the segment's size and checked against the tensor's own bytes. `segments`: the
    registration's reader (its caller closes it)."""
    if not t.is_contiguous():
        raise ValueError(f'tensor "{name}": strides {tuple(t.stride())} for shape {tuple(t.shape)} are not '
                         "row-major; register a contiguous tensor")
    segment, nbytes = segments.share(name, t.untyped_storage())
    header = segments.size(segment) - nbytes
    if not 0 <= header <= 4096:
        raise ValueError(f'tensor "{name}": shared segment "{segment}" has {header} bytes beyond its storage; '
                         "cannot tell where the data is")
    begin = header + t.storage_offset() * t.element_size()
    size = _nbytes(t)
    # The segment at `begin` must be the tensor's own memory (a few KiB at both ends compared).
    for off in {0, max(0, size - 4096)}:
        n = min(4096, size - off)
        if segments.read(segment, begin + off, n) != ctypes.string_at(t.data_ptr() + off, n):
            raise ValueError(f'tensor "{name}": shared segment "{segment}" does not hold the tensor at offset {begin}')
    h = service_pb2.MemoryHandle(buffer=name)
    h.shm.name = segment
    h.shm.offset = begin
    h.shm.size = size
    return h


# Segments this process made and has not unlinked: name -> the pid that made it. Unlinked when the
# interpreter exits, so that a daemon that went first (a pod's containers stopped together, a
# test's daemons killed) does not leave them in /dev/shm, which is memory. A process killed
# outright leaves them to its daemon, which unlinks a dead session's segments; a forked child
# never unlinks its parent's.
_unlink_at_exit: Dict[str, int] = {}
_unlink_at_exit_lock = threading.Lock()


def _unlink_segments_at_exit() -> None:
    with _unlink_at_exit_lock:
        mine = [name for name, pid in _unlink_at_exit.items() if pid == os.getpid()]
        _unlink_at_exit.clear()
    for name in mine:
        with contextlib.suppress(OSError):
            _posixshmem.shm_unlink(name)


atexit.register(_unlink_segments_at_exit)


class SharedTensors:
    """numpy arrays copied once into one shared-memory segment (owned: unlinked by release(), or
    when this process exits unless outlive_process() was called)."""

    def __init__(self, tensors: Mapping[str, Any]) -> None:
        slots: List[Tuple[str, Any, int]] = []
        end = 0
        for name, value in tensors.items():
            if not hasattr(value, "__array_interface__"):
                raise TypeError(f'tensor "{name}": expected a numpy array or a torch tensor, got {type(value).__name__}')
            slots.append((name, value, end))
            end += (_nbytes(value) + _ALIGN - 1) // _ALIGN * _ALIGN
        # POSIX shm directly rather than multiprocessing.shared_memory, whose resource tracker
        # would unlink segments behind our back; mode 0600 whatever the umask, as the C++ client:
        # only this uid and the daemon (root or CAP_DAC_OVERRIDE; it maps a segment only for the
        # uid that owns it) can open it (docs/security.md).
        self.name = f"/shardcast-py-{os.getpid()}-{secrets.token_hex(4)}"
        size = max(end, _ALIGN)
        fd = _posixshmem.shm_open(self.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            _posixshmem.shm_unlink(self.name)
            raise
        finally:
            os.close(fd)
        with _unlink_at_exit_lock:
            _unlink_at_exit[self.name] = os.getpid()
        # The arrays below hold the mapping through this memoryview: it stays mapped for as long as
        # any of them is alive, whatever happens to the registration.
        buf = memoryview(mapping)
        self._unlinked = False
        self.views: Dict[str, Any] = {}
        self.handles: List[service_pb2.MemoryHandle] = []
        for name, value, offset in slots:
            self.views[name] = self._place(buf, value, offset)
            h = service_pb2.MemoryHandle(buffer=name)
            h.shm.name = self.name
            h.shm.offset = offset
            h.shm.size = _nbytes(value)
            self.handles.append(h)

    @staticmethod
    def _place(buf: memoryview, value: Any, offset: int) -> Any:
        import numpy as np

        src = np.asarray(value)
        dst = np.ndarray(src.shape, dtype=src.dtype, buffer=buf, offset=offset)
        dst[...] = src
        return dst

    def outlive_process(self) -> None:
        """Leaves the segment named when this process exits: a registration without a session
        outlives its process, and a daemon restarted later maps it again by name."""
        with _unlink_at_exit_lock:
            _unlink_at_exit.pop(self.name, None)

    def release(self) -> None:
        """Unlinks the segment; its pages stay mapped while arrays viewing them are alive."""
        if self._unlinked:
            return
        self._unlinked = True
        self.outlive_process()  # (nothing left to unlink at exit)
        try:
            _posixshmem.shm_unlink(self.name)
        except FileNotFoundError:
            pass
        self.views = {}


class RegistrationTicket:
    """One registration of a rank by a Client: its id on the daemon (RegisterResponse.registration;
    the client's session updates it when it registers the rank again on a restarted daemon), and
    the id of the registration that took the rank over through the same client (replace=True), 0
    while none did. A Registration and its client hold the same ticket."""

    __slots__ = ("id", "taken_by")

    def __init__(self, registration: int) -> None:
        self.id = registration
        self.taken_by = 0


class Registration:
    """What `Client.register` returns: the rank's tensors as the daemon sees them. Torch tensors
    (CPU, CUDA, DTensors) are the caller's own, shared in place; numpy arrays are new arrays backed
    by shared memory (write the weights there). `close()` (or a `with` block) unregisters; the
    memory stays valid for as long as the application holds a tensor or array of it."""

    def __init__(self, client: Any, group: str, rank: int, world_size: int, response: service_pb2.RegisterResponse,
                 tensors: Dict[str, Any], shared: Optional[SharedTensors],
                 in_place: Optional[List[Tuple[str, Any, int]]] = None, role: str = "destination",
                 ticket: Optional[RegistrationTicket] = None) -> None:
        self.group = group
        self.role = role
        self.rank = rank
        self.world_size = world_size
        self.node = response.node
        self.layout_digest = response.layout_digest
        self.registered_bytes = response.registered_bytes
        # This registration's id on its daemon (`registration`): closing it never unregisters a
        # later registration of the rank (one that took it over with replace=True).
        self._ticket = ticket if ticket is not None else RegistrationTicket(response.registration)
        self.tensors = tensors
        self._client = client
        self._shared = shared
        self._in_place = in_place or []
        self._shadow: Any = None  # double-buffered: the second set (client._Handles)
        self._handed: Optional[HandedAllocations] = None  # descriptors of cuMem buffers, kept while registered

    @property
    def registration(self) -> int:
        """This registration's id on its daemon (a new one once the client's session registered
        the rank again on a restarted daemon)."""
        return self._ticket.id

    def moved(self) -> List[str]:
        """The registered torch tensors whose memory is no longer the memory registered: something
        replaced their storage (`param.data = ...`, `load_state_dict(assign=True)`, `model.to()`,
        FSDP2 re-padding a shard in its lazy init). The daemon would sync the old memory."""
        return [name for name, t, ptr in self._in_place if local_tensor(t).untyped_storage().data_ptr() != ptr]

    def watch(self, name: str, tensor: Any) -> None:
        """Also reports `name` as moved (moved(), check()) once `tensor`'s storage is no longer its
        storage now: for a registered view of a larger tensor (a checkpoint tensor inside a fused
        parameter), whose own storage pointer cannot tell that the parameter was replaced."""
        self._in_place.append((name, tensor, local_tensor(tensor).untyped_storage().data_ptr()))

    def check(self) -> None:
        """Raises RuntimeError naming every tensor that moved (see moved()); call it before a sync
        is triggered (the trainer example does, every step)."""
        gone = self.moved()
        if gone:
            raise RuntimeError(f'group "{self.group}" rank {self.rank}: {len(gone)} registered tensor(s) no longer '
                               f"live in the registered memory (re-register them): {', '.join(gone[:8])}")

    # ---- fences (see Client.acquire / publish / release) ----

    def acquire(self, timeout: float = 30.0) -> Any:
        """Takes this rank's memory (source: to write it; destination: to read it undisturbed)."""
        return self._mine("acquire").acquire(self.group, self.rank, timeout, registration=self._ticket)

    def publish(self, version: int) -> Any:
        """Source: the tensors hold `version` and will not change until acquired again. Checks
        first that no registered tensor moved (see check())."""
        self.check()
        return self._mine("publish").publish(self.group, self.rank, version, registration=self._ticket)

    def release(self) -> Any:
        """Destination: accept updates again."""
        return self._mine("release").release(self.group, self.rank, registration=self._ticket)

    @contextlib.contextmanager
    def writing(self, version: int, timeout: float = 30.0) -> Iterator["Registration"]:
        """Source: `with reg.writing(step): optimizer.step()` acquires the rank (waiting for syncs
        that read it), and publishes `version` when the block ends without an exception (after one,
        the rank stays acquired: no sync reads half-written weights)."""
        self._check_role("writing()", "source", "reading()")
        self.acquire(timeout)
        yield self
        self.publish(version)

    @contextlib.contextmanager
    def reading(self, timeout: float = 30.0) -> Iterator[Dict[str, Any]]:
        """Destination: `with reg.reading() as tensors: generate(tensors)`. Single-buffered: holds
        updates off while the block runs. Double-buffered (`shadow=`): syncs go on into the other
        set; the block gets the set in use, which no sync writes until the block ends."""
        self._check_role("reading()", "destination", "writing(version)")
        st = self.acquire(timeout)
        try:
            yield self.set_tensors(int(st.active_set))
        finally:
            self.release()

    def _check_role(self, call: str, role: str, instead: str) -> None:
        if self.role != role:
            raise ValueError(f'group "{self.group}" rank {self.rank}: {call} is for {role} ranks; this one is a '
                             f"{self.role} (use {instead})")

    @property
    def double_buffered(self) -> bool:
        return self._shadow is not None

    def set_tensors(self, which: int) -> Dict[str, Any]:
        """Double-buffered: the tensors of set `which` (0: the tensors, 1: the shadow)."""
        return self._shadow.views if which == 1 and self._shadow is not None else self.tensors

    def current(self) -> Dict[str, Any]:
        """The tensors of the set in use now (unpinned: see reading())."""
        active = int(self.state().active_set)
        self._live()._remember(self.group, self.rank, active=active)  # kept over a daemon restart
        return self.set_tensors(active)

    def state(self) -> Any:
        """This rank's RankStatus on its node (state, version, held, detail)."""
        for st in self._live().ranks(self.group):
            if st.rank == self.rank:
                return st
        raise RuntimeError(f'group "{self.group}" rank {self.rank} is not registered on its node any more')

    def _live(self) -> Any:
        if self._client is None:
            raise RuntimeError(f'group "{self.group}" rank {self.rank}: the registration is closed')
        return self._client

    def _mine(self, what: str) -> Any:
        """The client, for a call about this registration (FAILED_PRECONDITION once it is no
        longer the client's latest of its rank)."""
        client = self._live()
        client._check_ticket(self._ticket, self.group, self.rank, what)
        return client

    @property
    def segment(self) -> Optional[str]:
        """The segment numpy arrays were copied into (None when nothing was copied)."""
        return None if self._shared is None else self._shared.name

    def close(self) -> None:
        """Unregisters the rank and releases its memory. Refused while a sync still uses the rank
        (FAILED_PRECONDITION): then nothing is released, and closing again later works."""
        if self._client is not None:
            if not self._client._holds(self._ticket, self.group, self.rank):
                # Registered again through the client (that one is left alone), or unregistered
                # through it: nothing of this registration is left on the daemon.
                self._release()
                return
            try:
                self._client.unregister(self.group, self.rank, registration=self._ticket)
            except Exception as e:
                taken = "was taken over by" in str(e)  # another process's now: nothing to undo here
                gone = getattr(e, "code", None) == grpc.StatusCode.NOT_FOUND
                if not (taken or gone):
                    raise  # still registered: still ours, memory and all
                self._release()
                if not taken:
                    raise
                return
            self._release()

    def _release(self) -> None:
        self._client = None
        if self._shared is not None:
            self._shared.release()
        if self._shadow is not None:
            self._shadow.release()
        if self._handed is not None:
            self._handed.close()

    def __enter__(self) -> "Registration":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Registration(group={self.group!r}, rank={self.rank}, node={self.node!r}, "
                f"tensors={list(self.tensors)}, bytes={self.registered_bytes})")
