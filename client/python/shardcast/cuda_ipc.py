"""torch's CUDA shareable handles, decoded: what `UntypedStorage._share_cuda_()` returns becomes the
bare cudaIpcMemHandle_t and offset that shardcastd imports, the file descriptors of the cuMem
allocations of an expandable segment (handed to shardcastd by memory.hand_over), or a refusal
that says why and what to do.

The layouts are torch's own (c10/cuda/CUDACachingAllocator.cpp: `shareIpcHandle`,
`ExpandableSegment::share`, and the reader `MemHandleCacheEntry`); docs/gpu.md says which torch
writes which. Native byte order throughout: the handle never leaves this machine.

  bare           64 bytes, a cudaIpcMemHandle_t: torch before shareable handles. torch's reader
                 takes a handle of exactly this size as one; no versioned handle has this size.
  versioned      version (1 byte), type (1 byte), payload. torch refuses versions above its own.
    type 'c'     a cudaMalloc block: the 64-byte cudaIpcMemHandle_t of the block's base. torch's
                 offset is the storage's offset from that base. The same in versions 1, 2 and 3.
    type 'e'     an expandable segment (cuMemCreate + cuMemMap): a header, then one entry per
                 physical allocation (segment) the storage touches, a POSIX fd (int32, a descriptor
                 of the sharing process) or a 64-byte CUmemFabricHandle. torch's offset is the
                 storage's offset from the start of the first of them. Header:
                   version 2: int32 pid, 4 padding, uint64 segment size, uint64 count     (24 bytes)
                   version 3: the same, then int32 handle type (1 fd, 2 fabric), 4 padding (32 bytes)
                 Version 2 does not record the handle type: the entries' total size does
                 (count x 4 or count x 64, never both for a count above 0).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional, Tuple, Union

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
FABRIC_HANDLE_BYTES = 64  # sizeof(CUmemFabricHandle)
_FD_BYTES = 4

TYPE_CUDA_MALLOC = ord("c")
TYPE_EXPANDABLE_SEGMENT = ord("e")
# The versions this client reads. Their 'c' payload is one layout: torch's reader of each version
# reads every version up to its own, 'c' the same way.
VERSIONS = (1, 2, 3)
# Versions whose 'e' header is known (version 1's is not established here: refused as unknown).
_EXPANDABLE_HEADER_BYTES = {2: 24, 3: 32}
# torch's Expandable_Segments_Handle_Type (c10/cuda/CUDAAllocatorConfig.h), as version 3 records it.
_HANDLE_TYPES = {1: "posix_fd", 2: "fabric"}


class UnknownHandleFormat(ValueError):
    """Bytes this client does not know how to read: a version or type it was not written for, or a
    handle whose size disagrees with its own header."""


@dataclass(frozen=True)
class CudaMallocBlock:
    """Memory the daemon can import: a cudaMalloc allocation's IPC handle, and where the storage
    begins in that allocation."""

    ipc_handle: bytes
    offset: int
    version: Optional[int]  # None: a bare handle (torch before shareable handles)


@dataclass(frozen=True)
class ExpandableSegment:
    """Memory of torch's expandable segments: physical allocations exported as file descriptors of
    the sharing process, which the client hands to the daemon on its socket's side channel (or as
    fabric handles, which the daemon does not import)."""

    version: int
    pid: int
    segment_size: int
    handle_type: str  # "posix_fd" or "fabric"
    handles: Tuple[Union[int, bytes], ...]  # fds or 64-byte fabric handles, one per segment
    offset: int

    @property
    def bytes_spanned(self) -> int:
        return self.segment_size * len(self.handles)


def decode(handle: bytes, offset: int) -> Union[CudaMallocBlock, ExpandableSegment]:
    """torch's shareable handle and offset (elements 1 and 3 of `_share_cuda_()`), decoded.
    Raises UnknownHandleFormat for anything but the layouts above."""
    handle = bytes(handle)
    if len(handle) == IPC_HANDLE_BYTES:
        return CudaMallocBlock(handle, int(offset), None)
    if len(handle) < 2:
        raise UnknownHandleFormat(f"a shareable handle of {len(handle)} byte(s) has no version and type")
    version, kind, payload = handle[0], handle[1], handle[2:]
    if version not in VERSIONS:
        raise UnknownHandleFormat(f"shareable handle version {version}: this client reads versions {_span(VERSIONS)} "
                                  "and the bare handle of torch before them")
    if kind == TYPE_CUDA_MALLOC:
        if len(payload) != IPC_HANDLE_BYTES:
            raise UnknownHandleFormat(f"shareable handle version {version} type 'c' carries {len(payload)} bytes "
                                      f"after its version and type, not a {IPC_HANDLE_BYTES}-byte cudaIpcMemHandle_t")
        return CudaMallocBlock(payload, int(offset), version)
    if kind == TYPE_EXPANDABLE_SEGMENT:
        return _expandable(version, payload, int(offset))
    shown = repr(chr(kind)) if 0x20 < kind < 0x7F else f"0x{kind:02x}"
    raise UnknownHandleFormat(f"shareable handle version {version}, type {shown}: this client knows types 'c' "
                              "(cudaMalloc) and 'e' (expandable segment)")


def _expandable(version: int, payload: bytes, offset: int) -> ExpandableSegment:
    header_bytes = _EXPANDABLE_HEADER_BYTES.get(version)
    if header_bytes is None:
        raise UnknownHandleFormat(f"shareable handle version {version} (type 'e', expandable segment): this client "
                                  f"reads the expandable-segment layouts of versions {_span(_EXPANDABLE_HEADER_BYTES)}")
    if len(payload) < header_bytes:
        raise UnknownHandleFormat(f"shareable handle version {version} type 'e' has {len(payload)} bytes after its "
                                  f"version and type, fewer than its {header_bytes}-byte header")
    pid = _int(payload, 0, 4, signed=True)  # bytes 4..7: padding, unset in some torch builds (not read)
    segment_size = _int(payload, 8, 8)
    count = _int(payload, 16, 8)
    entries = payload[header_bytes:]
    if version >= 3:
        recorded = _int(payload, 24, 4, signed=True)
        if recorded not in _HANDLE_TYPES:
            raise UnknownHandleFormat(f"shareable handle version {version} type 'e' records handle type {recorded} "
                                      f"(known: {', '.join(f'{k} {v}' for k, v in _HANDLE_TYPES.items())})")
        handle_type = _HANDLE_TYPES[recorded]
    elif count > 0 and len(entries) == count * _FD_BYTES:
        handle_type = "posix_fd"
    elif count > 0 and len(entries) == count * FABRIC_HANDLE_BYTES:
        handle_type = "fabric"
    else:
        raise UnknownHandleFormat(f"shareable handle version {version} type 'e' counts {count} segment(s) but "
                                  f"carries {len(entries)} bytes of handles (expected {count} x {_FD_BYTES} or "
                                  f"{count} x {FABRIC_HANDLE_BYTES})")
    width = _FD_BYTES if handle_type == "posix_fd" else FABRIC_HANDLE_BYTES
    if count == 0 or segment_size == 0 or len(entries) != count * width:
        raise UnknownHandleFormat(f"shareable handle version {version} type 'e' ({handle_type}) counts {count} "
                                  f"segment(s) of {segment_size} bytes but carries {len(entries)} bytes of handles "
                                  f"(expected {count} x {width})")
    if handle_type == "posix_fd":
        handles: Tuple[Union[int, bytes], ...] = tuple(_int(entries, i * width, width, signed=True)
                                                       for i in range(count))
    else:
        handles = tuple(entries[i * width:(i + 1) * width] for i in range(count))
    return ExpandableSegment(version, pid, segment_size, handle_type, handles, offset)


def uuid_bytes(uuid: object) -> bytes:
    """A GPU's UUID as its 16 bytes, from what torch's device properties give (`.uuid`: an object
    whose `bytes` are the 16 values, or text as nvidia-smi -L prints it, with or without "GPU-" or
    "MIG-").
    b"" for anything else: the daemon then takes the client's device number as its own."""
    raw = getattr(uuid, "bytes", None)
    if raw is not None:
        try:
            out = bytes(raw)
        except (TypeError, ValueError):
            return b""
        return out if len(out) == 16 else b""
    text = str(uuid).strip()
    if text.upper().startswith(("GPU-", "MIG-")):  # (a MIG instance's: its own UUID)
        text = text[4:]
    try:
        out = bytes.fromhex(text.replace("-", ""))
    except ValueError:
        return b""
    return out if len(out) == 16 else b""


def _int(data: bytes, at: int, width: int, signed: bool = False) -> int:
    return int.from_bytes(data[at:at + width], sys.byteorder, signed=signed)


def _span(versions) -> str:
    v = sorted(versions)
    return f"{v[0]} to {v[-1]}" if len(v) > 1 else str(v[0])


# ---- what a user reads when a tensor cannot be registered ----

_ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_DOCS = "docs/gpu.md, \"Which torch and allocator settings\""


def allocator_setting(backend: Optional[str] = None) -> str:
    """The allocator configuration this process was started with, as a user would set it."""
    set_vars = [f'{v}="{os.environ[v]}"' for v in _ALLOC_CONF_VARIABLES if os.environ.get(v)]
    out = ", ".join(set_vars) if set_vars else " and ".join(_ALLOC_CONF_VARIABLES) + " unset"
    return out + (f", allocator backend {backend}" if backend else "")


def unknown_format(name: str, handle: bytes, error: UnknownHandleFormat, torch_version: str, setting: str) -> str:
    """Why the tensor `name` cannot be registered: torch shared it in a format decode() refused."""
    return (f'tensor "{name}": torch {torch_version} shared its CUDA memory in a format this Shardcast client '
            f"does not know ({error}; {len(bytes(handle))} bytes; {setting}). Use a torch version docs/gpu.md lists, "
            f"with expandable segments off, or a Shardcast client that reads this format ({_DOCS})")


def expandable_refused(name: str, segment: ExpandableSegment, torch_version: str, setting: str,
                       over_tcp: bool = False) -> str:
    """Why the tensor `name`, whose memory is an expandable segment, cannot be registered: over TCP
    (its descriptors travel only on the Unix socket's side channel), or shared by fabric handle."""
    what = (f'tensor "{name}": its memory comes from torch\'s expandable segments ({setting}; torch {torch_version} '
            f"shares it as {len(segment.handles)} cuMem allocation(s) of {segment.segment_size} bytes by "
            f"{segment.handle_type.replace('_', ' ')}, shareable-handle version {segment.version})")
    if over_tcp:
        return (what + ", whose file descriptors reach shardcastd only on the side channel beside its Unix socket: "
                "register through the node's socket (not over TCP), or allocate the tensors with expandable "
                f"segments off ({_DOCS})")
    return (what + ": shardcastd imports cuMem allocations by POSIX file descriptor, not by fabric handle. "
            "Allocate the tensors you register with expandable segments off: "
            "torch.cuda.memory._set_allocator_settings(\"expandable_segments:False\") before, "
            f"\"expandable_segments:True\" after ({_DOCS})")


def share_failed(name: str, error: BaseException, torch_version: str, setting: str) -> str:
    """torch itself refused to share the tensor's memory (the cudaMallocAsync backend does, so does
    an allocation cudaIpcGetMemHandle cannot export)."""
    return (f'tensor "{name}": torch {torch_version} cannot share its CUDA memory with another process ({setting}): '
            f"{str(error).rstrip('. ')}. Register tensors allocated by torch's default caching allocator with expandable segments "
            f"off ({_DOCS})")
