"""A rank's registered tensors. Host tensors are copied once, at registration, into one POSIX
shared-memory segment that the daemon maps too: from then on the application and the daemon share
the same pages, so syncs read and write the application's weights directly. CUDA tensors are shared
through CUDA IPC handles without any copy."""

from __future__ import annotations

import mmap
import os
import secrets
from typing import Any, Dict, List, Mapping, Optional, Tuple

import _posixshmem  # the C module behind multiprocessing.shared_memory

from shardcast.v1 import service_pb2

_ALIGN = 64


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr")


def _nbytes(value: Any) -> int:
    if _is_torch(value):
        return value.numel() * value.element_size()
    return int(value.nbytes)


def _cuda_handle(name: str, t: Any) -> service_pb2.MemoryHandle:
    if not t.is_contiguous():
        raise ValueError(f'tensor "{name}": a CUDA tensor must be contiguous to be shared')
    storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()._untyped()
    # (device, handle, storage bytes, storage offset in the allocation, ...): torch's own IPC export.
    shared = storage._share_cuda_()
    device, handle, offset_bytes = shared[0], shared[1], shared[3]
    h = service_pb2.MemoryHandle(buffer=name)
    h.cuda.handle = handle
    h.cuda.device = int(device)
    h.cuda.offset = int(offset_bytes) + t.storage_offset() * t.element_size()
    h.cuda.size = t.numel() * t.element_size()
    return h


class SharedTensors:
    """Host tensors in one shared-memory segment (owned: unlinked by release())."""

    def __init__(self, tensors: Mapping[str, Any], *, rebind: bool = True) -> None:
        slots: List[Tuple[str, Any, int]] = []
        end = 0
        for name, value in tensors.items():
            if not _is_torch(value) and not hasattr(value, "__array_interface__"):
                raise TypeError(f'tensor "{name}": expected a numpy array or a torch tensor, got {type(value).__name__}')
            slots.append((name, value, end))
            end += (_nbytes(value) + _ALIGN - 1) // _ALIGN * _ALIGN
        # POSIX shm directly rather than multiprocessing.shared_memory, whose resource tracker
        # would unlink segments behind our back; mode 0660 as the C++ client (the daemon may run as
        # another user of the same group).
        self.name = f"/shardcast-py-{os.getpid()}-{secrets.token_hex(4)}"
        size = max(end, _ALIGN)
        fd = _posixshmem.shm_open(self.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o660)
        try:
            os.ftruncate(fd, size)
            self._map: Optional[mmap.mmap] = mmap.mmap(fd, size)
        except BaseException:
            _posixshmem.shm_unlink(self.name)
            raise
        finally:
            os.close(fd)
        self._buf = memoryview(self._map)
        self.views: Dict[str, Any] = {}
        self.handles: List[service_pb2.MemoryHandle] = []
        for name, value, offset in slots:
            view = self._place(value, offset)
            if rebind and _is_torch(value) and view is not value:
                value.data = view  # the caller's tensor (or nn.Parameter) now lives in the segment
                view = value
            self.views[name] = view
            h = service_pb2.MemoryHandle(buffer=name)
            h.shm.name = self.name
            h.shm.offset = offset
            h.shm.size = _nbytes(value)
            self.handles.append(h)

    def _place(self, value: Any, offset: int) -> Any:
        n = _nbytes(value)
        if _is_torch(value):
            import torch

            src = value.detach()
            if n == 0:
                return torch.empty(src.shape, dtype=src.dtype)
            dst = torch.frombuffer(self._buf, dtype=src.dtype, count=src.numel(), offset=offset).view(src.shape)
            dst.copy_(src)
            return dst
        import numpy as np

        src = np.asarray(value)
        dst = np.ndarray(src.shape, dtype=src.dtype, buffer=self._buf, offset=offset)
        dst[...] = src
        return dst

    def release(self) -> None:
        """Unlinks the segment; the pages stay mapped while views of them are alive."""
        if self._map is None:
            return
        try:
            _posixshmem.shm_unlink(self.name)
        except FileNotFoundError:
            pass
        self.views = {}
        self._buf.release()
        try:
            self._map.close()
        except BufferError:
            pass  # views handed to the application keep the mapping alive until they go
        self._map = None


class Registration:
    """What `Client.register` returns: the rank's tensors as the daemon sees them. For torch CPU
    tensors these are the caller's own tensors, moved into shared memory in place; for numpy arrays
    they are new arrays backed by shared memory (write the weights there); CUDA tensors are the
    caller's, shared by IPC. `close()` (or a `with` block) unregisters and frees the segment."""

    def __init__(self, client: Any, group: str, rank: int, world_size: int, response: service_pb2.RegisterResponse,
                 tensors: Dict[str, Any], shared: Optional[SharedTensors]) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.node = response.node
        self.layout_digest = response.layout_digest
        self.registered_bytes = response.registered_bytes
        self.tensors = tensors
        self._client = client
        self._shared = shared

    @property
    def segment(self) -> Optional[str]:
        """The shared-memory segment's name (None when every tensor is on a GPU)."""
        return None if self._shared is None else self._shared.name

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.unregister(self.group, self.rank)
            finally:
                self._client = None
                if self._shared is not None:
                    self._shared.release()

    def __enter__(self) -> "Registration":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Registration(group={self.group!r}, rank={self.rank}, node={self.node!r}, "
                f"tensors={list(self.tensors)}, bytes={self.registered_bytes})")
