"""The Python client of shardcastd: the same gRPC API as the C++ client and the CLI."""

from __future__ import annotations

import dataclasses
import json
import operator
import os
import sys
import threading
import time
import uuid
import warnings
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import grpc

from shardcast.layout import (LayoutLike, covers_group, describe_dtensors, layout_from_dtensors, layout_from_views,
                              load_layout, root_mesh, spans_job)
from shardcast.memory import (CuMemBuffer, ForeignMemoryWarning, HandedAllocations, Registration, RegistrationTicket,
                              SegmentReader, SharedTensors, _cuda_handle, _is_torch, hand_over, in_place_handle,
                              local_tensor, not_torchs_own)
from shardcast.parallel import ParallelPlan, check_local_tensors, gather_nodes, gather_step, inference_layout
from shardcast.v1 import service_pb2, service_pb2_grpc

#: Where a node's daemon listens for local clients (common/defaults.h says the same).
DEFAULT_SOCKET = "/run/shardcast/shardcastd.sock"


class ShardcastError(Exception):
    """A call the daemon refused or that failed: `code` is the grpc.StatusCode, `details` the
    daemon's message (which names the group, rank, buffer or node at fault)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


_STRATEGIES = {"planned": service_pb2.STRATEGY_PLANNED, "rank-pull": service_pb2.STRATEGY_RANK_PULL,
               "gather-broadcast": service_pb2.STRATEGY_GATHER_BROADCAST}


def _strategy(name: str) -> int:
    if name not in _STRATEGIES:
        raise ValueError(f'strategy must be one of {", ".join(_STRATEGIES)}, not {name!r}')
    return _STRATEGIES[name]


def _normalize(target: str) -> str:
    return "unix:" + target if target.startswith("/") else target


def daemon_uids_from_env() -> List[int]:
    """$SHARDCAST_DAEMON_UID: uids (comma-separated) a daemon may run as besides root and this
    process's own (a DaemonSet's non-root daemon: 10001)."""
    out = []
    for part in os.environ.get("SHARDCAST_DAEMON_UID", "").split(","):
        if part.strip():
            out.append(int(part))
    return out


def check_daemon_uid(path: str, allowed: Sequence[int] = (), timeout: float = 5.0) -> int:
    """The uid of the process serving the Unix socket `path` (SO_PEERCRED, the kernel's word),
    checked against root, this process's uid and `allowed`: PERMISSION_DENIED otherwise, so a
    process that took the daemon's place on the socket path is never believed (docs/security.md)."""
    import socket
    import struct

    deadline = time.monotonic() + timeout
    while True:  # a daemon still starting (no socket yet) is waited for, as a channel would
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            s.connect(path)
            creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid, uid, _ = struct.unpack("3i", creds)
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ShardcastError(grpc.StatusCode.UNAVAILABLE,
                                     f'shardcastd at "unix:{path}" is not reachable (is the daemon running?): {e}') from None
            time.sleep(0.05)
        finally:
            s.close()
    if uid not in {0, os.geteuid(), *allowed}:
        raise ShardcastError(grpc.StatusCode.PERMISSION_DENIED,
                             f'the process serving "unix:{path}" (pid {pid}) runs as uid {uid}, not as root, this '
                             f"process's uid or one of $SHARDCAST_DAEMON_UID: not a daemon this client trusts (if it "
                             f"is your deployment's shardcastd, set SHARDCAST_DAEMON_UID={uid})")
    return uid


def default_target() -> str:
    """$SHARDCAST_ADDRESS (host:port or unix:PATH), else $SHARDCAST_SOCKET, else DEFAULT_SOCKET."""
    for var in ("SHARDCAST_ADDRESS", "SHARDCAST_SOCKET"):
        if os.environ.get(var):
            return _normalize(os.environ[var])
    return _normalize(DEFAULT_SOCKET)


def _error(e: grpc.RpcError, what: str) -> ShardcastError:
    details = e.details() or ""
    # The daemon's message names the rank already ('group "g" rank 0: ...'): named once.
    verb, _, subject = what.partition(" ")
    if subject and details.startswith(subject + ":"):
        return ShardcastError(e.code(), f"{verb} {details}")
    return ShardcastError(e.code(), f"{what}: {details}")


_ROLES = {"source": service_pb2.ROLE_SOURCE, "destination": service_pb2.ROLE_DESTINATION}
_STATES = {service_pb2.RANK_EMPTY: "empty", service_pb2.RANK_UPDATING: "updating", service_pb2.RANK_READY: "ready",
           service_pb2.RANK_DIRTY: "dirty"}


def describe_rank(st: Any) -> str:
    """'ready(3)', 'updating(4)', 'empty', 'dirty' (+ ' held' when acquired) for a RankStatus,
    RankRegistration or RemoteRank."""
    name = _STATES.get(st.state, "unknown")
    out = f"{name}({st.version})" if name in ("ready", "updating") else name
    return out + (" held" if st.held else "")


def _dtype_name(t: Any) -> str:
    """The torch name of a tensor's or array's dtype ('float32', 'bfloat16', ...)."""
    return str(t.dtype).replace("torch.", "")


def _check_version(what: str, version: Any, *, none: bool = False) -> int:
    """`version` as an int in [1, 2^63) (0 too where `none`: no version), or a ValueError naming
    the call. Any integer type will do (a numpy step counter), not a bool or a float."""
    try:
        v = None if isinstance(version, bool) else operator.index(version)
    except TypeError:
        v = None
    if v is None or not (0 if none else 1) <= v < 1 << 63:
        raise ValueError(f"{what}: version must be an integer in [{0 if none else 1}, 2^63), not {version!r}")
    return v


class _Handles:
    """One set of a rank's tensors as memory handles: torch tensors shared in place (CPU), by CUDA
    IPC (cudaMalloc memory) or by their cuMem allocations' descriptors (expandable segments, and
    CuMemBuffers), numpy arrays copied once into one segment. `hand`(name, fds) hands descriptors
    to the daemon and returns their token (None: no Unix socket to the daemon)."""

    def __init__(self, tensors: Mapping[str, Any], hand: Any = None) -> None:
        self.tensors = tensors
        self.hand = hand
        self.handles: List[service_pb2.MemoryHandle] = []
        self.in_place: List[Tuple[str, Any, int]] = []
        self.shared: Optional[SharedTensors] = None
        self.handed = HandedAllocations()
        self.views: Dict[str, Any] = {}
        self.copied_foreign: List[str] = []  # torch tensors over memory torch did not own (copied in)

    def share(self) -> None:
        segments = SegmentReader()
        try:
            self._share(segments)
        finally:
            segments.close()

    def _share(self, segments: SegmentReader) -> None:
        copied: Dict[str, Any] = {}
        for name, t in self.tensors.items():
            if isinstance(t, CuMemBuffer):
                if self.hand is None:
                    raise ValueError(f'tensor "{name}": cuMem allocations register only over the daemon\'s Unix '
                                     "socket (their file descriptors travel on its side channel), not over TCP")
                h = self.handed.handle(name, t.fds, t.allocation_bytes, t.offset, t.nbytes, t.device, self.hand,
                                       t.device_uuid)
                h.dtype = t.dtype
                h.shape.extend(int(d) for d in t.shape)
                self.handles.append(h)
                continue
            if not _is_torch(t):
                if int(getattr(t, "nbytes", 1)) > 0:
                    copied[name] = t
                continue
            local = local_tensor(t)
            if local.numel() == 0:
                continue  # a rank that holds none of a tensor (an uneven shard) registers no memory for it
            if local.is_cuda:
                h = _cuda_handle(name, local, self.handed, self.hand)
            else:
                storage = local.untyped_storage()
                foreign, shared, before = not_torchs_own(storage), storage.is_shared(), storage.data_ptr()
                h = in_place_handle(name, local, segments)
                # A shared mapping that is not torch's own segment (UntypedStorage.from_file) moved too.
                if foreign or (shared and local.untyped_storage().data_ptr() != before):
                    self.copied_foreign.append(name)
                self.in_place.append((name, t, local.untyped_storage().data_ptr()))
            h.dtype = _dtype_name(local)  # the daemon checks them against the layout
            h.shape.extend(int(d) for d in local.shape)
            self.handles.append(h)
        if copied:
            self.shared = SharedTensors(copied)
            for h in self.shared.handles:
                value = copied[h.buffer]
                h.dtype = _dtype_name(value)
                h.shape.extend(int(d) for d in getattr(value, "shape", ()))
            self.handles.extend(self.shared.handles)
        self.views = {name: (self.shared.views[name] if name in copied else t)  # type: ignore[union-attr]
                      for name, t in self.tensors.items()}

    def release(self) -> None:
        if self.shared is not None:
            self.shared.release()
        self.handed.close()


class _Session:
    """The client's liveness with its daemon: a Session stream open for the life of this process
    (the daemon unregisters its ranks and unlinks their segments when it ends), re-opened after the
    daemon restarts, every registration then made again (source ranks at the version they last
    published, unless acquired)."""

    def __init__(self, client: "Client") -> None:
        self._client = client
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self.id: Optional[str] = None
        self._lost = False
        self._closed = False
        self._call: Any = None
        self.reconnects = 0
        # The session is back after a daemon restart and its ranks are being registered again:
        # calls about ranks wait for it (Client._check_session), so they see the outcome.
        self.reregistering = False
        # (group, rank) -> [request, published version, held, the sets' handed allocations, the set
        # last seen in use, the sets' segments this client made (SharedTensors, None: in place)]
        self.ranks: Dict[Tuple[str, int], List[Any]] = {}
        # (group, rank) -> why re-registering it after a daemon restart failed: the client's next
        # call about its ranks raises it (Client._check_session) until it is registered again.
        self.failures: Dict[Tuple[str, int], str] = {}
        self._thread = threading.Thread(target=self._run, name="shardcast-session", daemon=True)
        self._thread.start()

    def wait(self, timeout: float) -> str:
        with self._ready:
            if not self._ready.wait_for(lambda: self.id is not None or self._closed, timeout=timeout) or self.id is None:
                raise ShardcastError(grpc.StatusCode.UNAVAILABLE,
                                     f'no session with shardcastd at "{self._client.target}" (is the daemon running?)')
            return self.id

    def _run(self) -> None:
        req = service_pb2.SessionRequest(client=f"python pid {os.getpid()}")
        while True:
            with self._lock:
                if self._closed:
                    return
                call = self._call = self._client._stub.Session(req)
            try:
                first = next(call)
                self._client.node = first.node or self._client.node
                with self._ready:
                    self.id = first.session_id
                    lost, self._lost = self._lost, False
                    self.reregistering = lost
                    self._ready.notify_all()
                if lost:
                    self._reregister(first.session_id)
                for event in call:  # later events: ranks another process took over
                    with self._lock:
                        for s in event.superseded:
                            self.failures[(s.group, s.rank)] = s.message
                    for s in event.superseded:
                        print(f"shardcast: {s.message}", file=sys.stderr)
            except (grpc.RpcError, StopIteration):
                pass
            with self._ready:
                if self.id is not None:
                    self._lost = True
                self.id = None
                self._call = None
                if self._closed:
                    return
            time.sleep(0.2)

    def _reregister(self, session_id: str) -> None:
        try:
            self._register_again(session_id)
        finally:
            with self._ready:  # counted once every rank was tried, its failure recorded
                self.reconnects += 1
                self.reregistering = False
                self._ready.notify_all()

    def _register_again(self, session_id: str) -> None:
        with self._lock:
            again = []
            for (group, rank), (req, published, held, handed, active, _) in self.ranks.items():
                r = service_pb2.RegisterRequest()
                r.CopyFrom(req)
                r.session_id = session_id
                r.version = published if r.role == service_pb2.ROLE_SOURCE else 0  # held: its floor
                # Held as it was (an engine reading it, a trainer writing it: no sync may touch it),
                # and double-buffered with the set last seen in use, not the other (older) one.
                r.held = held
                r.active_set = active if len(r.shadow_buffers) else 0
                again.append((r, handed))
        for r, handed in again:
            try:
                # cuMem allocations are handed over again: a token names one registration on one daemon.
                for allocations, handles in zip(handed, (r.buffers, r.shadow_buffers)):
                    allocations.refresh(handles, self._client._hand_over)
                resp = self._client._stub.Register(r, timeout=self._client.timeout)
                with self._lock:
                    self.failures.pop((r.group, r.rank), None)
                    gone = (r.group, r.rank) not in self.ranks  # unregistered meanwhile: undo
                if gone:
                    self._client._stub.Unregister(service_pb2.UnregisterRequest(
                        group=r.group, rank=r.rank, registration=resp.registration), timeout=self._client.timeout)
                    continue
                with self._client._registrations_lock:
                    # The rank's Registration follows: its ticket is this client's latest.
                    ticket = self._client._registrations.get((r.group, r.rank))
                    if ticket is not None:
                        ticket.id = resp.registration
                if ticket is None:  # unregistered meanwhile: undo
                    self._client._stub.Unregister(service_pb2.UnregisterRequest(
                        group=r.group, rank=r.rank, registration=resp.registration), timeout=self._client.timeout)
            except (grpc.RpcError, OSError, ValueError) as e:
                detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
                why = f're-registering group "{r.group}" rank {r.rank} after its daemon restarted failed: {detail}'
                print(f"shardcast: {why}", file=sys.stderr)
                with self._lock:
                    self.failures[(r.group, r.rank)] = why

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._call is not None:
                self._call.cancel()
            self._ready.notify_all()
        self._thread.join(timeout=5)


#: The DNS name every daemon certificate carries; TCP channels verify it (scripts/certs.sh).
DAEMON_IDENTITY = "shardcast-daemon"


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """PEM files of a TCP client: the cluster CA, and a client certificate and key (or none, with a token)."""
    ca: str = ""
    cert: str = ""
    key: str = ""

    @staticmethod
    def from_env() -> "TlsFiles":
        return TlsFiles(os.environ.get("SHARDCAST_TLS_CA", ""), os.environ.get("SHARDCAST_TLS_CERT", ""),
                        os.environ.get("SHARDCAST_TLS_KEY", ""))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if not self.ca:
            raise ValueError("TLS to a daemon needs the cluster CA (SHARDCAST_TLS_CA)")
        if bool(self.cert) != bool(self.key):
            raise ValueError("give a client certificate and its key together (SHARDCAST_TLS_CERT, SHARDCAST_TLS_KEY)")

        def read(path: str) -> Optional[bytes]:
            if not path:
                return None
            with open(path, "rb") as f:
                return f.read()
        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


def read_token(path: str) -> str:
    """The bearer token in the first line of `path` (a daemon's --client-token-file)."""
    with open(path, encoding="utf-8") as f:
        token = f.readline().strip()
    if not token:
        raise ValueError(f"the token file {path!r} is empty")
    return token


class Client:
    """A connection to one shardcastd (normally the node's own, over its Unix socket).

    Thread-safe: calls may come from several threads at once."""

    def __init__(self, target: Optional[str] = None, *, timeout: float = 30.0, connect_timeout: float = 5.0,
                 tls: Optional["TlsFiles"] = None, token_file: Optional[str] = None,
                 daemon_uids: Optional[Sequence[int]] = None) -> None:
        """`target`: the daemon (default: $SHARDCAST_ADDRESS, $SHARDCAST_SOCKET, the node's socket).
        Over TCP, `tls` (default: $SHARDCAST_TLS_CA with $SHARDCAST_TLS_CERT/$SHARDCAST_TLS_KEY) and
        `token_file` (default: $SHARDCAST_TOKEN_FILE) authenticate this client; see docs/security.md.
        Over the Unix socket the daemon must run as root, as this process's uid or as one of
        `daemon_uids` (default: $SHARDCAST_DAEMON_UID); else PERMISSION_DENIED (check_daemon_uid)."""
        self.target = _normalize(target) if target else default_target()
        self._daemon_uids = list(daemon_uids) if daemon_uids is not None else daemon_uids_from_env()
        if self.target.startswith("unix:"):
            check_daemon_uid(self.target[len("unix:"):], self._daemon_uids, connect_timeout)
        self.timeout = timeout
        options = [
            ("grpc.max_receive_message_length", 256 << 20),
            # A restarted daemon is reached at once, not after gRPC's reconnect backoff (up to 120 s);
            # each connection attempt (TLS handshake included) gets 5 s: gRPC's "min reconnect
            # backoff" is that attempt's timeout, and 100 ms fails handshakes on a loaded host.
            # Over the Unix socket an attempt fails at once while the daemon's accept queue is full
            # (another local process connecting in a loop): tried again every 20-50 ms, it takes
            # the first slot the daemon frees (docs/security.md, "Limits").
            ("grpc.initial_reconnect_backoff_ms", 20 if self.target.startswith("unix:") else 100),
            ("grpc.min_reconnect_backoff_ms", 5000),
            ("grpc.max_reconnect_backoff_ms", 50 if self.target.startswith("unix:") else 1000),
            ("grpc.use_local_subchannel_pool", 1),  # not a connection another channel left to an old daemon
        ]
        tls = tls if tls is not None else TlsFiles.from_env()
        token_file = token_file if token_file is not None else os.environ.get("SHARDCAST_TOKEN_FILE", "")
        if self.target.startswith("unix:") or not (tls.ca or token_file):
            self._channel = grpc.insecure_channel(self.target, options=options)
        else:
            credentials = tls.channel_credentials()
            if token_file:
                credentials = grpc.composite_channel_credentials(
                    credentials, grpc.access_token_call_credentials(read_token(token_file)))
            options.append(("grpc.ssl_target_name_override", DAEMON_IDENTITY))
            self._channel = grpc.secure_channel(self.target, credentials, options=options)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise ShardcastError(grpc.StatusCode.UNAVAILABLE,
                                 f'shardcastd at "{self.target}" is not reachable (is the daemon running? over TCP it '
                                 'needs $SHARDCAST_TLS_CA and a client certificate or token, see docs/security.md)') from None
        self._stub = service_pb2_grpc.ShardcastStub(self._channel)
        #: The node of this client's daemon, once known (a session, a registration, status()).
        self.node: Optional[str] = None
        self._session: Optional[_Session] = None
        self._session_lock = threading.Lock()
        # (group, rank) -> this client's latest registration of the rank (RegisterResponse.registration,
        # kept current over daemon restarts): acquire, publish, release and unregister act only on
        # it, never on a later one of another process. Its Registration holds the same ticket.
        self._registrations: Dict[Tuple[str, int], RegistrationTicket] = {}
        self._registrations_lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Ends the session (the daemon unregisters this client's ranks) and the connection. Every
        later call raises ShardcastError (FAILED_PRECONDITION); closing again does nothing. The
        session's ranks are free when it returns: another client may register them at once. A rank
        a sync uses is waited for until the sync lets go of it (10 s at most in all; one still in
        use then is named on stderr and unregistered by the daemon once the sync lets go)."""
        if self._closed:
            return
        self._closed = True
        if self._session is not None:
            self._unregister_session_ranks()
            self._session.close()
        self._channel.close()

    def _unregister_session_ranks(self) -> None:
        """Unregisters the session's ranks one by one and unlinks the segments this client made for
        them, as the session's end would. Its end alone frees them a moment later (the daemon gives a
        process that lives on 200 ms to go first: docs/daemon.md, "Registration"), and a client of this
        process registering one of them meanwhile was refused (ALREADY_EXISTS). A rank a sync uses is
        waited for until that sync lets go of it; one still in use after 10 s in all is left to the
        session's end (the daemon unregisters it once the sync lets go), said on stderr. So is every
        rank while the session is not open (the daemon restarting: its registration ids start over,
        and a rank whose re-registration failed may be another process's now)."""
        session = self._session
        deadline = time.monotonic() + min(self.timeout, 10.0)
        in_use = []
        with session._ready:
            session._ready.wait_for(lambda: not session.reregistering, timeout=deadline - time.monotonic())
            if session.id is None or session.reregistering:
                return
            ranks = [(key, entry) for key, entry in session.ranks.items() if key not in session.failures]
        for (group, rank), entry in ranks:
            with self._registrations_lock:
                ticket = self._registrations.get((group, rank))
            if ticket is None:
                continue
            using, gone = "", False
            while time.monotonic() < deadline:
                try:
                    self._stub.Unregister(service_pb2.UnregisterRequest(group=group, rank=rank,
                                                                        registration=ticket.id),
                                          timeout=max(deadline - time.monotonic(), 0.001))
                    gone = True
                    break
                except grpc.RpcError as e:
                    if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        return  # the daemon is not answering: the session's end frees them all
                    if e.code() == grpc.StatusCode.NOT_FOUND:
                        gone = True
                        break
                    if e.code() != grpc.StatusCode.FAILED_PRECONDITION or "in use by sync" not in (e.details() or ""):
                        using = ""  # not ours to unregister now (taken over, say): the session's end
                        break       # frees what is still ours
                    using = e.details()
                    time.sleep(0.05)  # a sync uses it: until it lets go
            else:
                using = using or "not tried: the close's 10 s ran out"
            if using:
                in_use.append(f'group "{group}" rank {rank} ({using})')
            if not gone:
                continue
            with session._lock:
                session.ranks.pop((group, rank), None)
            for shared in entry[5]:  # as the session's end would: the segments this client made
                if shared is not None:
                    shared.release()
            for handed in entry[3]:  # and the cuMem allocations' descriptors it held for them
                if handed is not None:
                    handed.close()
        if in_use:
            print(f"shardcast: closing the client of {self.target}: still registered, unregistered by the daemon "
                  f"once no sync uses them: {'; '.join(in_use)}", file=sys.stderr)

    def _check_open(self, what: str) -> None:
        """Raises (FAILED_PRECONDITION) once the client is closed: gRPC's own error for a closed
        channel is a bare ValueError that names neither the call nor the daemon."""
        if self._closed:
            raise ShardcastError(grpc.StatusCode.FAILED_PRECONDITION,
                                 f'{what}: the client of shardcastd at "{self.target}" is closed')

    def _registration(self, group: str, rank: int, registration: Union[int, RegistrationTicket, None] = None) -> int:
        """The registration to act on: `registration` (a RegisterResponse.registration, or a
        Registration's ticket, read now: after _check_session, which waits out a re-registration),
        or this client's latest of the rank when None."""
        if isinstance(registration, RegistrationTicket):
            return registration.id
        if registration is not None:
            return registration
        with self._registrations_lock:
            ticket = self._registrations.get((group, rank))
            return 0 if ticket is None else ticket.id

    def _holds(self, ticket: RegistrationTicket, group: str, rank: int) -> bool:
        """Whether `ticket` is this client's latest registration of the rank."""
        with self._registrations_lock:
            return self._registrations.get((group, rank)) is ticket

    def _check_ticket(self, ticket: RegistrationTicket, group: str, rank: int, what: str) -> None:
        """Raises (FAILED_PRECONDITION) for a Registration that is no longer this client's latest
        of its rank: registered again through this client (replace=True), or unregistered through
        it. Its calls must not act on another registration (ids start again at 1 on a restarted
        daemon)."""
        if self._holds(ticket, group, rank):
            return
        why = (f"was taken over by registration {ticket.taken_by} of this process (replace=True): use the "
               "Registration it returned") if ticket.taken_by else "was unregistered through its client"
        raise ShardcastError(grpc.StatusCode.FAILED_PRECONDITION, f'{what}: group "{group}" rank {rank} {why}')

    def _check_session(self, *groups: str) -> None:
        """Raises (FAILED_PRECONDITION) while a rank of this client's session, of one of `groups`,
        is no longer this process's: it could not be registered again after its daemon restarted,
        or another process took it over (replace). Its memory no longer receives syncs, and
        nothing else would tell the application."""
        session = self._session
        if session is None:
            return
        with session._ready:
            # Its ranks being registered again after a daemon restart: wait for the outcome.
            session._ready.wait_for(lambda: not session.reregistering or session._closed, timeout=self.timeout)
            failures = [why for (group, _), why in sorted(session.failures.items()) if group in groups]
        if failures:
            raise ShardcastError(grpc.StatusCode.FAILED_PRECONDITION,
                                 "; ".join(failures) + " (register the rank again, or unregister it)")

    def _fail(self, e: grpc.RpcError, what: str) -> ShardcastError:
        """The daemon's error; when the daemon itself is gone, one that names it (its node)."""
        # gRPC's own words for a connection that failed (the daemon's messages never start so).
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) and (e.details() or "").startswith(
                ("Socket closed", "Stream removed", "failed to connect", "Connection reset", "Broken pipe", "recvmsg",
                 "sendmsg", "Connection refused")):
            node = f' (node "{self.node}")' if self.node else ""
            return ShardcastError(e.code(), f'{what}: shardcastd at "{self.target}"{node} went away: {e.details()}')
        return _error(e, what)

    @property
    def reconnects(self) -> int:
        """How many times this client re-registered its ranks after its daemon restarted (counted once
        every rank was tried: a failure is recorded by then)."""
        return 0 if self._session is None else self._session.reconnects

    def _session_id(self) -> str:
        with self._session_lock:
            if self._session is None:
                self._session = _Session(self)
        return self._session.wait(self.timeout)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- registration ----

    def _hand_over(self, name: str, fds: List[int]) -> str:
        """Hands the descriptors of tensor `name`'s cuMem allocations to this client's daemon."""
        try:
            return hand_over(self.target[len("unix:"):], fds, self._daemon_uids)
        except (OSError, ValueError) as e:
            raise ValueError(f'tensor "{name}": {e}') from None

    def register(self, group: str, rank: int, world_size: int, tensors: Mapping[str, Any],
                 layout: LayoutLike, *, role: str = "destination", version: int = 0,
                 session: bool = True, shadow: Optional[Mapping[str, Any]] = None,
                 replace: bool = False, readers: Sequence[int] = ()) -> Registration:
        """Registers `rank` of `group` with its local tensors, keyed by the layout's tensor or
        fused-buffer names: torch tensors (CPU or CUDA, nn.Parameters, DTensors: their local shard)
        are shared in place, numpy arrays are copied once into shared memory (see
        Registration.tensors). For layouts derived from DTensors or a parallel plan, see
        register_dtensors and register_inference.

        `role`: "source" (a trainer: syncs read it once it publishes a version, see
        Registration.publish) or "destination" (syncs write it). A source may register with the
        `version` its tensors already hold. With `session` (the default) the registration lives as
        long as this process and this client: the daemon drops it when the process dies, and it is
        made again by itself after the daemon restarts.

        `shadow` (destinations): a second set of the same tensors, for engines that cannot pause:
        syncs write the set not in use and flip at commit, a failed sync leaves the set in use
        untouched. Twice the memory. Read through `with reg.reading() as tensors:` (the set in use,
        pinned while the block runs).

        A rank registered already (by this process or another) is refused (ALREADY_EXISTS naming
        its holder) unless `replace`: then this registration takes it over and the holder is told
        (its next call about the rank raises, naming this process). One a sync uses is refused
        either way (FAILED_PRECONDITION naming the sync) until the sync ends. `readers`: uids besides this
        group's owner whose syncs may read it out of this node (docs/security.md)."""
        what = f'register group "{group}" rank {rank}'
        self._check_open(what)
        if role not in _ROLES:
            raise ValueError(f'{what}: role must be "source" or "destination", not {role!r}')
        version = _check_version(what, version, none=True)
        if shadow is not None and len(shadow) == 0 and len(tensors) > 0:
            raise ValueError(f"{what}: shadow is empty: a double-buffered rank gives a second tensor for every "
                             "tensor (or leave shadow out for a single-buffered rank)")
        msg = load_layout(layout, group)
        req = service_pb2.RegisterRequest(group=group, rank=rank, world_size=world_size, role=_ROLES[role],
                                          version=version, replace=replace, readers=list(readers))
        req.layout.CopyFrom(msg)
        if shadow is not None and role != "destination":
            raise ValueError(f"{what}: only a destination rank is double-buffered")
        hand = self._hand_over if self.target.startswith("unix:") else None
        sets = [_Handles(tensors, hand)] + ([_Handles(shadow, hand)] if shadow is not None else [])
        try:
            for handles in sets:
                handles.share()
            req.buffers.extend(sets[0].handles)
            if shadow is not None:
                req.shadow_buffers.extend(sets[1].handles)
            if session:
                req.session_id = self._session_id()
            resp = self._stub.Register(req, timeout=self.timeout)
            self.node = resp.node
        except grpc.RpcError as e:
            for handles in sets:
                handles.release()
            raise self._fail(e, what) from None
        except BaseException:
            for handles in sets:
                handles.release()
            raise
        foreign = [name for handles in sets for name in handles.copied_foreign]
        if foreign:
            warnings.warn(f'{what}: {len(foreign)} torch tensor(s) did not own their memory ({", ".join(foreign[:4])}'
                          f'{", ..." if len(foreign) > 4 else ""}: torch.from_numpy, torch.frombuffer, DLPack or a '
                          "checkpoint mapped from its file) and were copied into shared memory: the tensors follow, "
                          "but whatever else holds the old memory (a numpy array written to) is no longer what syncs "
                          "read or write. Harmless for a mapped checkpoint; otherwise use the tensors, or register "
                          "tensors that own their memory (t.clone())", ForeignMemoryWarning, stacklevel=2)
        ticket = RegistrationTicket(resp.registration)
        with self._registrations_lock:
            earlier = self._registrations.get((group, rank))
            if earlier is not None:  # replace=True through this client: that handle is done
                earlier.taken_by = resp.registration
            self._registrations[(group, rank)] = ticket
        if not session:  # the rank outlives this process: so does its segment's name
            for handles in sets:
                if handles.shared is not None:
                    handles.shared.outlive_process()
        if session and self._session is not None:
            with self._session._lock:
                req.replace = False  # re-made after a restart: a rank the new daemon does not hold
                self._session.ranks[(group, rank)] = [req, version, False, [h.handed for h in sets], 0,
                                                      [h.shared for h in sets]]
                self._session.failures.pop((group, rank), None)
        elif self._session is not None:
            # A rank the session held, taken over by this registration without one: the session
            # must not register the old memory again after a restart (and its ticket with it).
            with self._session._lock:
                self._session.ranks.pop((group, rank), None)
                self._session.failures.pop((group, rank), None)
        reg = Registration(self, group, rank, world_size, resp, sets[0].views, sets[0].shared, sets[0].in_place,
                           role=role, ticket=ticket)
        reg._handed = sets[0].handed
        if shadow is not None:
            reg._shadow = sets[1]
        return reg

    def register_dtensors(self, group: str, tensors: Mapping[str, Any], *, nodes: Optional[Sequence[str]] = None,
                          process_group: Any = None, version: int = 0) -> Registration:
        """A trainer rank registers its DTensors ({name: DTensor}, e.g. dict(model.named_parameters())
        after fully_shard / parallelize_module), in place. The group's layout comes from the
        DTensors' mesh and placements; the rank is this process's position in the mesh; each rank's
        node is gathered through torch.distributed (or given as `nodes`). Every rank of the group
        calls this (it is a collective when nodes are gathered). Register after the first forward
        pass: FSDP2 may re-pad uneven shards in its lazy init (Registration.check() tells). The
        group is a source: give the `version` the parameters hold now, or publish one later
        (Registration.writing / publish).

        Under pipeline parallelism (each stage's parameters on its own slice of the ranks) the
        group's ranks are those of `process_group` (default: the world), and every one of them
        calls this: every rank's tensors are gathered through it, `nodes` given or not."""
        self._check_open(f'register group "{group}"')
        if not tensors:
            raise ValueError(f'register group "{group}": no tensors')
        what = f'register group "{group}"'
        if nodes is not None and covers_group(tensors, len(nodes)):
            return self._register_one_mesh(group, tensors, nodes, version)
        import torch.distributed as dist

        mesh_ranks = root_mesh(tensors).mesh.flatten().tolist()
        if not dist.is_available() or not dist.is_initialized():
            if nodes is None and covers_group(tensors):
                raise ValueError(f"{what}: torch.distributed is not initialized: pass nodes= (one per rank) instead")
            raise ValueError(f"{what}: the DTensors' mesh spans ranks {mesh_ranks}"
                             + (f" and {len(nodes)} nodes are given" if nodes is not None else "")
                             + ": pipeline stages register through torch.distributed, which is not initialized")
        world = dist.get_world_size(process_group)
        if nodes is not None and len(nodes) != world:
            raise ValueError(f"{what}: {len(nodes)} node names for a process group of {world} ranks")
        if process_group is None and not covers_group(tensors, world) and not spans_job(root_mesh(tensors), world):
            # Neither the world's mesh nor a stage of it: gathering over the world would wait for
            # processes that never call.
            raise ValueError(f"{what}: the process group has {world} ranks, the DTensors' mesh spans ranks "
                             f"{mesh_ranks}: pass the group's own process_group or nodes=")

        def mine() -> Tuple[str, bool]:
            return (str(nodes[dist.get_rank(process_group)]) if nodes is not None else self.status().node,
                    covers_group(tensors, world))

        # One gather decides the path for every rank alike, and a rank failing fails them all.
        everyone = gather_step(process_group, world, f"{what}: each rank's node", mine, "rank")
        nodes = [n for n, _ in everyone]
        if all(covers for _, covers in everyone):
            return self._register_one_mesh(group, tensors, nodes, version)
        views = gather_step(process_group, world, f"{what}: each rank's tensors (pipeline stages)",
                            lambda: (dist.get_rank(), describe_dtensors(tensors)), "rank")
        layout = layout_from_views(group, [v for _, v in views], [g for g, _ in views], nodes)
        return self.register(group, dist.get_rank(process_group), world, tensors, layout, role="source",
                             version=version)

    def _register_one_mesh(self, group: str, tensors: Mapping[str, Any], nodes: Sequence[str],
                           version: int) -> Registration:
        """register_dtensors when the DTensors' mesh is the group's ranks 0..N-1, row-major."""
        mesh = root_mesh(tensors)
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError(f'register group "{group}": this process is not in the DTensors\' device mesh')
        rank = 0
        for c, n in zip(coordinate, mesh.mesh.shape):
            rank = rank * int(n) + int(c)
        layout = layout_from_dtensors(group, tensors, nodes=nodes)
        return self.register(group, rank, int(mesh.size()), tensors, layout, role="source", version=version)

    def register_inference(self, group: str, tensors: Mapping[str, Any], plan: ParallelPlan, model: Mapping[str, Any],
                           *, nodes: Optional[Sequence[str]] = None, ranks_per_node: Optional[int] = None,
                           node_prefix: str = "node-", process_group: Any = None) -> Registration:
        """An inference rank registers its local tensors ({buffer: tensor}, named as the engine
        holds them: fused buffers by their own names) under its parallel `plan`, for `model`'s full
        tensor shapes ({name: tensor or (shape, dtype)}; a meta-device model's state_dict will do).
        Each local tensor must have exactly the shape and dtype the plan gives this rank
        (shardcast.local_tensors allocates them; tensors in `plan.fp8` are float8_e4m3fn, each with
        its float32 scale buffer).

        With `plan.replicas` > 1 and `plan.replica_set` (the default), `group` names a replica set:
        this rank registers as rank `plan.tp_rank` of its replica's own group, `<group>.r<replica>`
        (of `plan.tp_size` ranks), and a sync into `group` writes every replica registered, cutting
        one that cannot take part while the others commit (docs/daemon.md, "Replica sets"). Wait
        for versions on the returned Registration's `group`. Otherwise it is rank `plan.rank` of
        the one group `group`. Nodes (see inference_layout): `nodes`, `ranks_per_node`
        (+ `node_prefix`), or gathered through `process_group`, which holds exactly the ranks of
        the group registered in (in a replica set, the replica's own TP group)."""
        name = plan.group_name(group)
        what = f'register group "{name}" {plan.describe()}'
        self._check_open(what)
        check_local_tensors(plan, model, tensors)
        if nodes is None and ranks_per_node is None:
            try:
                nodes = gather_nodes(self.status().node, plan.group_world, process_group)
            except ValueError as e:
                raise ValueError(f"{what}: {e}") from None
        layout = inference_layout(group, plan, model, nodes=nodes, ranks_per_node=ranks_per_node,
                                  node_prefix=node_prefix)
        return self.register(name, plan.group_rank, plan.group_world, tensors, layout, role="destination")

    def unregister(self, group: str, rank: int, registration: Union[int, RegistrationTicket, None] = None) -> None:
        """Unregisters `rank` of `group` as this client registered it (or `registration`, a
        RegisterResponse.registration): a later registration of the rank, by another process, is
        left alone (FAILED_PRECONDITION naming its holder). Refused while a sync still uses the
        rank (FAILED_PRECONDITION): it stays this client's, and unregistering again later works."""
        what = f'unregister group "{group}" rank {rank}'
        self._check_open(what)
        with self._registrations_lock:
            latest = self._registrations.get((group, rank))
        if isinstance(registration, RegistrationTicket):
            stale = registration is not latest
        else:
            stale = registration is not None and latest is not None and registration != latest.id
        if stale:
            # Not this client's latest registration of the rank (it took the rank over itself, or an
            # id of another process): the daemon decides, and this client's latest stays as it is.
            try:
                self._stub.Unregister(service_pb2.UnregisterRequest(
                    group=group, rank=rank, registration=self._registration(group, rank, registration)),
                    timeout=self.timeout)
            except grpc.RpcError as e:
                raise self._fail(e, what) from None
            return
        entry, failure = None, None
        if self._session is not None:  # out first: the session must not register it again meanwhile
            with self._session._lock:
                entry = self._session.ranks.pop((group, rank), None)
                failure = self._session.failures.pop((group, rank), None)
        with self._registrations_lock:
            known = self._registrations.pop((group, rank), None)
        # Read after the session's entry is out: a re-registration that finished meanwhile
        # updated the ticket; one that finishes later finds no ticket and undoes itself.
        registration = known.id if known is not None else (registration or 0)
        try:
            self._stub.Unregister(service_pb2.UnregisterRequest(group=group, rank=rank, registration=registration),
                                  timeout=self.timeout)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND and "taken over" not in (e.details() or ""):
                # Still registered here (a sync uses it, or the daemon did not answer): still ours.
                if entry is not None:
                    with self._session._lock:
                        self._session.ranks[(group, rank)] = entry
                        if failure is not None:
                            self._session.failures[(group, rank)] = failure
                if known is not None:
                    with self._registrations_lock:
                        self._registrations.setdefault((group, rank), known)  # (still its latest)
            raise self._fail(e, what) from None

    # ---- fences ----

    def acquire(self, group: str, rank: int, timeout: float = 30.0,
                registration: Union[int, RegistrationTicket, None] = None) -> service_pb2.RankStatus:
        """Takes a rank's memory: a source rank to write it (waits until every sync reading it
        ended; syncs then refuse it until it publishes), a destination rank to read it undisturbed
        (waits until the sync writing it ended; syncs then refuse it until it is released).
        `registration`: act only on that registration of the rank (a RegisterResponse.registration;
        default: this client's latest); a later one that took the rank over refuses the call."""
        what = f'acquire group "{group}" rank {rank}'
        self._check_open(what)
        self._check_session(group)
        req = service_pb2.AcquireRequest(group=group, rank=rank, timeout_ms=int(timeout * 1000),
                                         registration=self._registration(group, rank, registration))
        try:
            st = self._stub.Acquire(req, timeout=timeout + self.timeout).status
        except grpc.RpcError as e:
            raise self._fail(e, what) from None
        self._remember(group, rank, held=True, active=st.active_set)
        return st

    def publish(self, group: str, rank: int, version: int,
                registration: Union[int, RegistrationTicket, None] = None) -> service_pb2.RankStatus:
        """A source rank's tensors hold `version` and will not change until acquired again
        (`registration`: as for acquire)."""
        return self._release(group, rank, version, f'publish group "{group}" rank {rank} version {version}',
                             registration)

    def release(self, group: str, rank: int,
                registration: Union[int, RegistrationTicket, None] = None) -> service_pb2.RankStatus:
        """A destination rank accepts updates again (`registration`: as for acquire)."""
        return self._release(group, rank, None, f'release group "{group}" rank {rank}', registration)

    def _release(self, group: str, rank: int, version: Optional[int], what: str,
                 registration: Union[int, RegistrationTicket, None]) -> service_pb2.RankStatus:
        version = 0 if version is None else _check_version(what, version)
        self._check_open(what)
        self._check_session(group)
        req = service_pb2.ReleaseRequest(group=group, rank=rank, version=version,
                                         registration=self._registration(group, rank, registration))
        try:
            st = self._stub.Release(req, timeout=self.timeout).status
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND):
                # The daemon that held the rank is gone (or a new one does not have it yet): the
                # re-registration takes the release as done, not held for good.
                self._remember(group, rank, held=False, published=version or None)
            raise self._fail(e, what) from None
        self._remember(group, rank, held=False, published=version or None)
        return st

    def _remember(self, group: str, rank: int, *, held: Optional[bool] = None, published: Optional[int] = None,
                  active: Optional[int] = None) -> None:
        """What the rank's re-registration after a daemon restart restores: held, the version a
        source published, the set a double-buffered destination was seen using."""
        if self._session is None:
            return
        with self._session._lock:
            entry = self._session.ranks.get((group, rank))
            if entry is not None:
                if held is not None:
                    entry[2] = held
                if published:
                    entry[1] = published
                if active is not None:
                    entry[4] = int(active)

    # ---- syncs ----

    def sync(self, src: str, dst: str, version: int, *, verify: bool = False, timeout: Optional[float] = None,
             wait_for_ranks: bool = False, sync_id: Optional[str] = None, delta: str = "off",
             strategy: str = "planned", min_replicas: int = 0, replica_deadline_s: Optional[float] = None,
             catch_up: bool = False,
             progress: Optional[Callable[[service_pb2.SyncProgress], None]] = None) -> service_pb2.SyncResponse:
        """Syncs version `version` of `src` into `dst` and returns once every destination rank has it
        (or raises ShardcastError, and no rank has it). `progress` is called with each update.

        `delta`: "off" (dense), "auto" (only the elements that changed, to nodes that hold the bytes
        this source last sent them; dense to the others, in the same sync; the whole sync dense while
        delta syncs of these groups measure slower than dense ones: see docs/delta.md), "always"
        (as "auto", faster or not) or "dense" (dense, keeping the bases for later deltas). The
        response's wire_bytes, delta_chunks, dense_chunks and delta_choice say what happened.

        `strategy`: "planned" (Shardcast's plan) or a baseline it is measured against, run by the same
        daemons, dense: "rank-pull" (every destination rank gets its own slices straight from source
        ranks) or "gather-broadcast" (everything through source rank 0's node, which sends each node
        what it needs).

        `dst` may name a replica set (layouts registered with replica_set=dst, one group per
        replica, as register_inference makes for ParallelPlan(replicas=N)): every replica registered when the sync starts takes part, unless it cannot (its
        node does not answer, it is incomplete or refuses the version): it is then cut, and the
        response's `replicas` says which committed and why the others were cut. The sync fails
        when fewer than `min_replicas` (at least 1) take part. A replica whose node fails during the
        sync is cut and the sync runs again without it, within the same call; `replica_deadline_s`
        (seconds; default: the daemons' sync lease) bounds how long a replica's node may stay
        silent before it is cut.

        `catch_up`: `dst` is one replica of a set, brought to `version` (0: the newest version a
        replica of its set holds) from a replica that holds it, or from `src` when none can be
        read; see catch_up()."""
        what = f'sync "{src}" -> "{dst}" version {version}'
        version = _check_version(what, version, none=catch_up)
        self._check_open(what)
        self._check_session(src, dst)
        modes = {"off": service_pb2.DELTA_OFF, "auto": service_pb2.DELTA_AUTO, "always": service_pb2.DELTA_ALWAYS,
                 "dense": service_pb2.DELTA_DENSE}
        if delta not in modes:
            raise ValueError(f'delta must be one of {", ".join(modes)}, not {delta!r}')
        strategy_value = _strategy(strategy)
        sync_id = sync_id or f"py-{uuid.uuid4().hex[:12]}"
        req = service_pb2.SyncRequest(src_group=src, dst_group=dst, version=version, sync_id=sync_id)
        req.options.verify = verify
        req.options.wait_for_ranks = wait_for_ranks
        req.options.delta = modes[delta]
        req.options.strategy = strategy_value
        req.options.timeout_ms = int((timeout or 0) * 1000)
        if min_replicas < 0:
            raise ValueError(f"min_replicas must not be negative, not {min_replicas}")
        req.options.min_replicas = min_replicas
        req.options.catch_up = catch_up
        if replica_deadline_s is not None:
            if replica_deadline_s < 0:
                raise ValueError(f"replica_deadline_s must not be negative, not {replica_deadline_s}")
            req.options.replica_deadline_ms = int(replica_deadline_s * 1000)
        watcher = None
        if progress is not None:
            watcher = threading.Thread(target=self._follow, args=(sync_id, progress), daemon=True)
            watcher.start()
        try:
            return self._stub.Sync(req, timeout=(timeout or 300.0) + 30.0)
        except grpc.RpcError as e:
            raise self._fail(e, what) from None
        finally:
            if watcher is not None:
                watcher.join(timeout=10)

    def _follow(self, sync_id: str, progress: Callable[[service_pb2.SyncProgress], None]) -> None:
        try:
            for p in self.watch(sync_id):
                progress(p)
        except ShardcastError:
            pass  # the sync's own result is what the caller gets

    def watch(self, sync_id: str) -> Iterator[service_pb2.SyncProgress]:
        """Yields the progress of a sync this daemon coordinates until it is committed or failed."""
        what = f'watch sync "{sync_id}"'
        self._check_open(what)
        try:
            for p in self._stub.Watch(service_pb2.WatchRequest(sync_id=sync_id)):
                yield p
        except grpc.RpcError as e:
            raise self._fail(e, what) from None

    def wait_version(self, group: str, version: int, timeout: Optional[float] = None) -> int:
        """Waits until every rank of `group` on this node is ready at `version` or newer and returns
        the version they are all ready at (>= `version`). Never returns stale weights: when
        `timeout` (seconds; None = no limit) passes first it raises ShardcastError
        (DEADLINE_EXCEEDED) naming the version the ranks are at. A dirty rank (a sync wrote part of
        a version and failed) raises ShardcastError (FAILED_PRECONDITION) at once, naming the rank
        and the sync."""
        what = f'wait for group "{group}" version {version}'
        version = _check_version(what, version, none=True)
        self._check_open(what)
        self._check_session(group)
        remaining = timeout
        while True:
            step = 60.0 if remaining is None else max(0.0, min(remaining, 60.0))
            req = service_pb2.WaitVersionRequest(group=group, version=version, timeout_ms=int(step * 1000))
            try:
                got = self._stub.WaitVersion(req, timeout=step + self.timeout)
            except grpc.RpcError as e:
                raise self._fail(e, what) from None
            if got.version >= version:
                return got.version
            if remaining is not None:
                remaining -= step
                if remaining <= 0:
                    states = ", ".join(f"{r.rank} {describe_rank(r)}" for r in list(got.ranks)[:8])
                    more = f" (+{len(got.ranks) - 8} more)" if len(got.ranks) > 8 else ""
                    node = f' on node "{self.node}"' if self.node else " on this node"
                    raise ShardcastError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f'group "{group}"{node} is at version {got.version}, not {version}, after waiting '
                        f"{timeout:g} s: its weights are stale (ranks: {states}{more})")

    def ranks(self, group: str) -> List[service_pb2.RankStatus]:
        """The state of every rank of `group` on this node (see describe_rank); [] when none is
        registered here."""
        what = f'ranks of group "{group}"'
        self._check_open(what)
        req = service_pb2.WaitVersionRequest(group=group, version=0, timeout_ms=0)
        try:
            return list(self._stub.WaitVersion(req, timeout=self.timeout).ranks)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return []  # none registered on this node
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION:  # a dirty rank: Status tells them all
                raise self._fail(e, what) from None
        for g in self.status().groups:
            if g.group == group:
                return list(g.rank_states)
        return []

    # ---- inspection ----

    def catch_up(self, replica: str, source: str, version: int = 0, *, timeout: Optional[float] = None,
                 sync_id: Optional[str] = None) -> service_pb2.SyncResponse:
        """Brings replica group `replica` (one replica of a set, registered after the set's last
        sync, or cut from it) up to `version`, 0 meaning the newest version a complete replica of
        its set holds. The bytes come from such a replica (peer-seeded: the trainer's network
        stays free for the next step), or from `source` (the set's source group) when none can be
        read; the response's `seeded_from` names which, and its `version` what the replica holds
        now. A replica at that version or newer already (a sync into the set reached it first)
        is left as it is: nothing moves. See docs/daemon.md, "Replica sets"."""
        return self.sync(source, replica, version, timeout=timeout, sync_id=sync_id, catch_up=True)

    def status(self, all_nodes: bool = False) -> service_pb2.StatusResponse:
        """The daemon, its peers, its groups and its syncs (running, then the last ended);
        `all_nodes`: every reachable daemon's syncs."""
        self._check_open("status")
        try:
            return self._stub.Status(service_pb2.StatusRequest(all_nodes=all_nodes), timeout=self.timeout)
        except grpc.RpcError as e:
            raise self._fail(e, "status") from None

    def list(self, all_nodes: bool = True) -> service_pb2.ListResponse:
        self._check_open("list")
        try:
            return self._stub.List(service_pb2.ListRequest(all_nodes=all_nodes), timeout=self.timeout)
        except grpc.RpcError as e:
            raise self._fail(e, "list") from None

    def plan(self, src: str, dst: str, *, strategy: str = "planned", nic_gbps: float = 0.0) -> Dict[str, Any]:
        """The plan summary (as `shardcast plan --json` prints it) for two registered groups: the
        plan a sync with `strategy` runs (see sync), its prediction for NICs of `nic_gbps`
        (0: the default)."""
        what = f'plan "{src}" -> "{dst}"'
        self._check_open(what)
        req = service_pb2.PlanRequest(src_group=src, dst_group=dst, strategy=_strategy(strategy), nic_gbps=nic_gbps)
        try:
            resp = self._stub.Plan(req, timeout=self.timeout)
        except grpc.RpcError as e:
            raise self._fail(e, what) from None
        return json.loads(resp.summary_json)
