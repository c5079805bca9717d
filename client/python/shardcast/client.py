"""The Python client of shardcastd: the same gRPC API as the C++ client and the CLI."""

from __future__ import annotations

import json
import os
import threading
import uuid
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import grpc

from shardcast.layout import LayoutLike, layout_from_dtensors, load_layout, root_mesh
from shardcast.memory import Registration, SharedTensors, _cuda_handle, _is_torch, in_place_handle, local_tensor
from shardcast.parallel import ParallelPlan, check_local_tensors, gather_nodes, inference_layout
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


def _normalize(target: str) -> str:
    return "unix:" + target if target.startswith("/") else target


def default_target() -> str:
    """$SHARDCAST_ADDRESS (host:port or unix:PATH), else $SHARDCAST_SOCKET, else DEFAULT_SOCKET."""
    for var in ("SHARDCAST_ADDRESS", "SHARDCAST_SOCKET"):
        if os.environ.get(var):
            return _normalize(os.environ[var])
    return _normalize(DEFAULT_SOCKET)


def _error(e: grpc.RpcError, what: str) -> ShardcastError:
    return ShardcastError(e.code(), f"{what}: {e.details()}")


class Client:
    """A connection to one shardcastd (normally the node's own, over its Unix socket).

    Thread-safe: calls may come from several threads at once."""

    def __init__(self, target: Optional[str] = None, *, timeout: float = 30.0, connect_timeout: float = 5.0) -> None:
        self.target = _normalize(target) if target else default_target()
        self.timeout = timeout
        self._channel = grpc.insecure_channel(self.target, options=[("grpc.max_receive_message_length", 256 << 20)])
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise ShardcastError(grpc.StatusCode.UNAVAILABLE,
                                 f'shardcastd at "{self.target}" is not reachable (is the daemon running?)') from None
        self._stub = service_pb2_grpc.ShardcastStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- registration ----

    def register(self, group: str, rank: int, world_size: int, tensors: Mapping[str, Any],
                 layout: LayoutLike) -> Registration:
        """Registers `rank` of `group` with its local tensors, keyed by the layout's tensor or
        fused-buffer names: torch tensors (CPU or CUDA, nn.Parameters, DTensors: their local shard)
        are shared in place, numpy arrays are copied once into shared memory (see
        Registration.tensors). For layouts derived from DTensors or a parallel plan, see
        register_dtensors and register_inference."""
        msg = load_layout(layout, group)
        req = service_pb2.RegisterRequest(group=group, rank=rank, world_size=world_size)
        req.layout.CopyFrom(msg)
        copied: Dict[str, Any] = {}
        in_place: List[Tuple[str, Any, int]] = []
        for name, t in tensors.items():
            if not _is_torch(t):
                if int(getattr(t, "nbytes", 1)) > 0:
                    copied[name] = t
                continue
            local = local_tensor(t)
            if local.numel() == 0:
                continue  # a rank that holds none of a tensor (an uneven shard) registers no memory for it
            if local.is_cuda:
                req.buffers.append(_cuda_handle(name, local))
            else:
                req.buffers.append(in_place_handle(name, local))
                in_place.append((name, t, local.untyped_storage().data_ptr()))
        shared = SharedTensors(copied) if copied else None
        try:
            if shared is not None:
                req.buffers.extend(shared.handles)
            resp = self._stub.Register(req, timeout=self.timeout)
        except grpc.RpcError as e:
            if shared is not None:
                shared.release()
            raise _error(e, f'register group "{group}" rank {rank}') from None
        except BaseException:
            if shared is not None:
                shared.release()
            raise
        views = {name: (shared.views[name] if name in copied else t)  # type: ignore[union-attr]
                 for name, t in tensors.items()}
        return Registration(self, group, rank, world_size, resp, views, shared, in_place)

    def register_dtensors(self, group: str, tensors: Mapping[str, Any], *, nodes: Optional[Sequence[str]] = None,
                          process_group: Any = None) -> Registration:
        """A trainer rank registers its DTensors ({name: DTensor}, e.g. dict(model.named_parameters())
        after fully_shard / parallelize_module), in place. The group's layout comes from the
        DTensors' mesh and placements; the rank is this process's position in the mesh; each rank's
        node is gathered through torch.distributed (or given as `nodes`). Every rank of the group
        calls this (it is a collective when nodes are gathered). Register after the first forward
        pass: FSDP2 may re-pad uneven shards in its lazy init (Registration.check() tells)."""
        if not tensors:
            raise ValueError(f'register group "{group}": no tensors')
        mesh = root_mesh(tensors)
        world = int(mesh.size())
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError(f'register group "{group}": this process is not in the DTensors\' device mesh')
        rank = 0
        for c, n in zip(coordinate, mesh.mesh.shape):
            rank = rank * int(n) + int(c)
        if nodes is None:
            nodes = gather_nodes(self.status().node, world, process_group)
        layout = layout_from_dtensors(group, tensors, nodes=nodes)
        return self.register(group, rank, world, tensors, layout)

    def register_inference(self, group: str, tensors: Mapping[str, Any], plan: ParallelPlan, model: Mapping[str, Any],
                           *, nodes: Optional[Sequence[str]] = None, ranks_per_node: Optional[int] = None,
                           node_prefix: str = "node-", process_group: Any = None) -> Registration:
        """An inference rank registers its local tensors ({buffer: tensor}, named as the engine
        holds them: fused buffers by their own names) under its parallel `plan`, for `model`'s full
        tensor shapes ({name: tensor or (shape, dtype)}; a meta-device model's state_dict will do).
        Each local tensor must have exactly the shape and dtype the plan gives this rank. Nodes:
        `nodes`, `ranks_per_node` (+ `node_prefix`), or gathered through `process_group`."""
        check_local_tensors(plan, model, tensors)
        if nodes is None and ranks_per_node is None:
            nodes = gather_nodes(self.status().node, plan.world_size, process_group)
        layout = inference_layout(group, plan, model, nodes=nodes, ranks_per_node=ranks_per_node,
                                  node_prefix=node_prefix)
        return self.register(group, plan.rank, plan.world_size, tensors, layout)

    def unregister(self, group: str, rank: int) -> None:
        try:
            self._stub.Unregister(service_pb2.UnregisterRequest(group=group, rank=rank), timeout=self.timeout)
        except grpc.RpcError as e:
            raise _error(e, f'unregister group "{group}" rank {rank}') from None

    # ---- syncs ----

    def sync(self, src: str, dst: str, version: int, *, verify: bool = False, timeout: Optional[float] = None,
             wait_for_ranks: bool = False, sync_id: Optional[str] = None,
             progress: Optional[Callable[[service_pb2.SyncProgress], None]] = None) -> service_pb2.SyncResponse:
        """Syncs version `version` of `src` into `dst` and returns once every destination rank has it
        (or raises ShardcastError, and no rank has it). `progress` is called with each update."""
        sync_id = sync_id or f"py-{uuid.uuid4().hex[:12]}"
        req = service_pb2.SyncRequest(src_group=src, dst_group=dst, version=version, sync_id=sync_id)
        req.options.verify = verify
        req.options.wait_for_ranks = wait_for_ranks
        req.options.timeout_ms = int((timeout or 0) * 1000)
        watcher = None
        if progress is not None:
            watcher = threading.Thread(target=self._follow, args=(sync_id, progress), daemon=True)
            watcher.start()
        try:
            return self._stub.Sync(req, timeout=(timeout or 300.0) + 30.0)
        except grpc.RpcError as e:
            raise _error(e, f'sync "{src}" -> "{dst}" version {version}') from None
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
        try:
            for p in self._stub.Watch(service_pb2.WatchRequest(sync_id=sync_id)):
                yield p
        except grpc.RpcError as e:
            raise _error(e, f'watch sync "{sync_id}"') from None

    def wait_version(self, group: str, version: int, timeout: Optional[float] = None) -> int:
        """Waits until `group` has `version` (or newer) on this node; returns the version reached,
        which is lower than asked only when `timeout` (seconds; None = no limit) passed first."""
        remaining = timeout
        while True:
            step = 60.0 if remaining is None else min(remaining, 60.0)
            req = service_pb2.WaitVersionRequest(group=group, version=version, timeout_ms=int(step * 1000))
            try:
                got = self._stub.WaitVersion(req, timeout=step + self.timeout).version
            except grpc.RpcError as e:
                raise _error(e, f'wait for group "{group}" version {version}') from None
            if got >= version:
                return got
            if remaining is not None:
                remaining -= step
                if remaining <= 0:
                    return got

    # ---- inspection ----

    def status(self) -> service_pb2.StatusResponse:
        try:
            return self._stub.Status(service_pb2.StatusRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            raise _error(e, "status") from None

    def list(self, all_nodes: bool = True) -> service_pb2.ListResponse:
        try:
            return self._stub.List(service_pb2.ListRequest(all_nodes=all_nodes), timeout=self.timeout)
        except grpc.RpcError as e:
            raise _error(e, "list") from None

    def plan(self, src: str, dst: str) -> Dict[str, Any]:
        """The plan summary (as `shardcast plan --json` prints it) for two registered groups."""
        try:
            resp = self._stub.Plan(service_pb2.PlanRequest(src_group=src, dst_group=dst), timeout=self.timeout)
        except grpc.RpcError as e:
            raise _error(e, f'plan "{src}" -> "{dst}"') from None
        return json.loads(resp.summary_json)
