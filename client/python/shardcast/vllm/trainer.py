"""The `shardcast` weight-transfer backend, trainer side: a vLLM `TrainerWeightTransferEngine`.

`trainer_init` runs on every trainer rank and registers the rank's parameters with its node's
daemon in place, as a source group (DTensors: their layout from mesh and placements; plain
tensors: one rank holding them whole). The sender (rank 0) then tells the inference workers what
the checkpoint holds (`init_weight_transfer_engine`). `send_weights` runs on every rank after
an optimizer step: each rank publishes the next version of its parameters, and the sender syncs
that version into the inference group and drives vLLM's update (`start_weight_update`,
`update_weights({"version": V})`, `finish_weight_update(str(V))`).

Parameters are registered under the checkpoint's names (what the model's `load_weights` takes,
mapped by vLLM itself onto its fused parameters): a Hugging Face model's own names, without the
components training wrappers add (torch.compile, FSDP1, activation checkpointing, DDP), and
renamed by `name_map` where the trainer's names are not the checkpoint's (shardcast.vllm.names).
A parameter the model's own save conversion cuts into several checkpoint tensors (transformers 5's
fused MoE experts) is registered as one view per checkpoint tensor (shardcast.vllm.fused)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from shardcast.vllm import plugin
from shardcast.vllm.clients import replica_group, with_reply
from shardcast.vllm.collective import gather_step
from shardcast.vllm.fused import Part, box_view, checkpoint_boxes, hf_conversion
from shardcast.vllm.names import checkpoint_names, is_data_parallel, refuse_fsdp1, strip_wrappers

_log = logging.getLogger("shardcast")

plugin.register()  # the trainer registry too, for a process that defines these first


@dataclass
class ShardcastTrainerInitInfo(TrainerInitInfo):
    """`group`: the trainer's source group; `destination`: the inference group the workers register
    (their `ShardcastInitInfo.group`); `daemon`: this node's shardcastd ("": the local socket);
    `delta`: the sync's delta mode (docs/delta.md); `timeout_s`: how long the workers wait for a
    version; `double_buffer`: the workers' direct parameters double-buffered (vLLM serves during
    the transfer, and a failed update leaves it serving the previous version); `wait_for_ranks`:
    a sync that finds a rank or a daemon missing waits for it (up to the daemon's sync timeout)
    instead of failing at once, naming it; `name_map`: a dict or a function from the trainer's
    parameter names (without wrapper components) to the checkpoint's (shardcast.vllm.names).

    `data_parallel`: vLLM runs data-parallel engines (`--data-parallel-size`), each one replica of the
    set `destination` (docs/vllm.md, "Data-parallel replicas"). When `destination` is a replica set
    (so, or servers driven through shardcast.vllm.clients.ReplicaClients): `min_replicas`, the fewest replicas that must take
    the version (0: 1), else `send_weights` raises; `replica_deadline_s`, how long a replica's
    node may stay silent during a sync before it is cut (None: the daemons' sync lease)."""

    backend: ClassVar[str] = "shardcast"
    group: str = "trainer"
    destination: str = "vllm"
    daemon: str = ""
    delta: str = "off"
    timeout_s: float = 600.0
    double_buffer: bool = False
    wait_for_ranks: bool = False
    name_map: Any = None
    data_parallel: bool = False
    min_replicas: int = 0
    replica_deadline_s: Optional[float] = None


def _update_and_finish(client: Any, update_info: dict, version: int) -> Optional[Exception]:
    """update_weights(update_info), then finish_weight_update: the end of vLLM's update session,
    whatever happens. An update that fails on the server ends the session there; one whose reply
    was lost (a timeout, a dropped connection) may have gone through, its session still open: a
    finish then ends it, and succeeds only where the workers took the version. Returns the
    update's error when the session ended without it, None when the update finished."""
    try:
        with_reply(client.update_weights, update_info)
    except Exception as update_error:
        try:
            with_reply(client.finish_weight_update, str(version))
        except Exception:
            return update_error
        _log.warning("shardcast: update_weights of version %d reported %s, yet the update finished", version,
                     update_error)
        return None
    try:
        with_reply(client.finish_weight_update, str(version))
    except Exception as finish_error:
        return finish_error
    return None


def _end_session(client: Any, version: int) -> Optional[Exception]:
    """Ends vLLM's update session after the bytes' move failed: update_weights on a version that did
    not arrive raises on the workers (naming the rank and what it holds) and closes the session, so
    the next update can start one. Returns that error; None when the workers do hold the version
    (every byte arrived: the move failed after its commit), the update then finished."""
    return _update_and_finish(client, {"version": version, "timeout_s": 1.0}, version)


@dataclass
class _Entry:
    """One checkpoint tensor the trainer registers: parameter `param` whole, or its box `part`."""

    name: str
    param: torch.Tensor
    part: Optional[Part] = None

    @property
    def shape(self) -> List[int]:
        return list(self.part.shape) if self.part is not None else [int(s) for s in self.param.shape]


def _checkpoint_entries(module: torch.nn.Module, name_map: Any) -> List[_Entry]:
    """The checkpoint tensors `module`'s parameters hold: each parameter under its checkpoint name,
    or, where the model's own save conversion cuts it into several (shardcast.vllm.fused), each
    part; `name_map` renames (or, with None, leaves out) parameters, and what the conversion makes.
    A parameter `name_map` names is not converted."""
    named = dict(module.named_parameters())
    data_parallel = is_data_parallel(module)
    clean = {n: strip_wrappers(n, data_parallel) for n in named}
    # A parameter name_map names is the user's word: the model's conversion is not asked about it.
    converted = {n: t for n, t in named.items() if not _mapped(clean[n], name_map)}
    parts = checkpoint_boxes({clean[n]: t.shape for n, t in converted.items()}, hf_conversion(_unwrapped(module)))
    raw: List[_Entry] = []
    for n, t in named.items():
        if clean[n] in parts:
            raw.extend(_Entry(p.name, t, p) for p in parts[clean[n]])
        else:
            raw.append(_Entry(clean[n], t))
    targets = checkpoint_names([e.name for e in raw], name_map)
    return [_Entry(targets[e.name], e.param, e.part) for e in raw if e.name in targets]


def _mapped(name: str, name_map: Any) -> bool:
    """Whether `name_map` renames (or leaves out) parameter `name`."""
    if name_map is None:
        return False
    if callable(name_map):
        return name_map(name) != name
    return name in name_map


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside torch.compile and DDP wrappers."""
    while True:
        inner = getattr(module, "_orig_mod", None)
        if inner is None and is_data_parallel(module):
            inner = module.module
        if not isinstance(inner, torch.nn.Module):
            return module
        module = inner


def _register(client: Any, group: str, entries: List[_Entry], collective: "_Collective") -> Any:
    """Registers this trainer rank's checkpoint tensors in place as a source group: DTensors with
    the layout of their mesh and placements, parts of them with the pieces each rank holds
    (gathered), plain tensors as one rank holding them whole. Every rank registers, or none does
    and every rank raises."""
    whole = {e.name: e.param for e in entries if e.part is None}
    if not any(type(e.param).__name__ == "DTensor" for e in entries):
        tensors = dict(whole)
        for e in entries:
            if e.part is not None:
                view = box_view(e.param.detach(), [0] * e.param.dim(), e.part, f"parameter of {e.name!r}")
                tensors[e.name] = view[0]
        node = client.status().node
        layout = {"group": group, "mesh": {"shape": [1]}, "nodes": [node],
                  "tensors": [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                              for n, t in tensors.items()]}
        registration = client.register(group, 0, 1, tensors, layout, role="source")
        for e in entries:  # a replaced fused parameter shows in Registration.check() too
            if e.part is not None:
                registration.watch(e.name, e.param)
        return registration
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from shardcast.layout import layout_from_dtensors, root_mesh

    mesh = root_mesh({e.name: e.param for e in entries if hasattr(e.param, "device_mesh")})
    world = int(mesh.size())
    tensors: Dict[str, torch.Tensor] = dict(whole)
    me: List[int] = []  # this process's mesh rank

    def my_pieces() -> Tuple[int, str, Dict[str, Any]]:
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError("this process is not in the DTensors' device mesh")
        rank = 0
        for c, n in zip(coordinate, mesh.mesh.shape):
            rank = rank * int(n) + int(c)
        me.append(rank)
        mine: Dict[str, Any] = {}
        for e in entries:
            if e.part is None:
                continue
            if hasattr(e.param, "device_mesh"):
                if any(type(p).__name__ == "Partial" for p in e.param.placements):
                    raise ValueError(f"the parameter holding {e.name!r} is Partial (pending a reduction): its bytes "
                                     "are not the checkpoint's")
                _, offsets = compute_local_shape_and_global_offset(e.param.shape, e.param.device_mesh,
                                                                   e.param.placements)
                local = e.param.to_local().detach()
            else:
                offsets, local = [0] * e.param.dim(), e.param.detach()
            piece = box_view(local, offsets, e.part, f"trainer rank {rank}, the parameter holding {e.name!r}")
            if piece is not None:
                tensors[e.name] = piece[0]
                mine[e.name] = (piece[1], piece[2])
        return rank, client.status().node, mine

    everyone = sorted(collective.gather(f'registering group "{group}": each rank\'s pieces', my_pieces),
                      key=lambda r: r[0])
    if [r for r, _, _ in everyone] != list(range(world)):
        raise ValueError(f'registering group "{group}": the mesh ranks of the trainer processes are '
                         f"{[r for r, _, _ in everyone]}, not 0..{world - 1}")
    rank = me[0]
    nodes = [node for _, node, _ in everyone]
    layout = layout_from_dtensors(group, whole, nodes=nodes) if whole else {
        "group": group, "mesh": {"shape": [world]}, "nodes": nodes, "tensors": []}
    for e in entries:
        if e.part is not None:
            layout["tensors"].append({
                "name": e.name, "shape": list(e.shape), "dtype": str(e.param.dtype).replace("torch.", ""),
                "pieces": [{"rank": r, "offsets": list(mine[e.name][0]), "sizes": list(mine[e.name][1])}
                           for r, _, mine in everyone if e.name in mine]})
    registration = []

    def register() -> None:
        registration.append(client.register(group, rank, world, tensors, layout, role="source"))
        for e in entries:  # a replaced fused parameter shows in Registration.check() too
            if e.part is not None and e.name in tensors:
                registration[0].watch(e.name, e.param)

    try:
        collective.gather(f'registering group "{group}" rank {rank}', register)
    except BaseException:
        if registration:  # registered here, not everywhere: nothing is left half-registered
            registration[0].close()
        raise
    return registration[0]


class _Collective:
    """The trainer ranks' own exchanges, each all ranks or none: `gather` runs a step on this rank
    and gathers every rank's result, and when the step raised anywhere it raises on every rank,
    naming the ranks and their errors (a rank that raised alone would leave the others waiting in
    the next collective for good). On a gloo group of its own: the sender's update can take as
    long as vLLM's (`timeout_s`), longer than an NCCL default group's watchdog allows others to
    wait."""

    def __init__(self) -> None:
        import datetime

        dist = torch.distributed
        self.on = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if self.on else 1
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=2)) if self.on else None

    def gather(self, what: str, step) -> List[Any]:
        return gather_step(self.group, self.world, what, step, "trainer rank")


def _module_of(source: Any) -> torch.nn.Module:
    module = getattr(source, "_module", None) if source is not None else None
    if not isinstance(module, torch.nn.Module):
        raise ValueError("shardcast: trainer_init registers a module's parameters in place: pass "
                         "source=ModuleSource(model)")
    return module


class ShardcastTrainerEngine(TrainerWeightTransferEngine[ShardcastTrainerInitInfo]):
    init_info_cls = ShardcastTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info: Optional[ShardcastTrainerInitInfo] = None
        self.shardcast = None
        self.registration = None
        self.version = 0
        self.collective: Optional[_Collective] = None
        # A replica set's last sync (sender): each replica's group -> "" (committed) or why it was cut.
        self.replicas: Dict[str, str] = {}
        self._held = False  # the parameters acquired between steps (see _hold)
        # Replicas added by add_replica: group -> the group their catch-up read.
        self.caught_up: Dict[str, str] = {}

    @classmethod
    def trainer_init(cls, init_info: ShardcastTrainerInitInfo, *, client, source=None) -> "ShardcastTrainerEngine":
        import shardcast

        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.info = init_info
        module = _module_of(source)
        refuse_fsdp1(module)
        if init_info.data_parallel and hasattr(client, "add"):
            raise ValueError("shardcast: data_parallel (vLLM's own data-parallel engines, one server) and "
                             "ReplicaClients (one server per replica) each number the replicas: use one of them")
        engine.collective = _Collective()
        entries: List[_Entry] = []
        engine.collective.gather("finding the checkpoint's tensors",
                                 lambda: entries.extend(_checkpoint_entries(module, init_info.name_map)))
        # All ranks or none from here: a step that fails anywhere (the daemon refusing a rank, vLLM's
        # workers refusing the checkpoint) raises on every rank, and every rank unregisters.
        try:
            engine.shardcast = shardcast.Client(init_info.daemon or None)
            engine.registration = _register(engine.shardcast, init_info.group, entries, engine.collective)
            senders = engine.collective.gather("finding the sender", lambda: bool(engine.is_sender))
            if senders.count(True) != 1:
                raise ValueError(f"shardcast: {senders.count(True)} trainer ranks are senders (is_sender); exactly "
                                 "one must be")
            # Global shapes (a DTensor's shape is its global one), under the names registered. vLLM's
            # workers match each against their loaders before anything moves.
            checkpoint = {e.name: [list(e.shape), str(e.param.dtype).replace("torch.", "")] for e in entries}
            engine.collective.gather(f"initialising the weight transfer of {init_info.destination!r}", lambda: (
                with_reply(client.init_weight_transfer_engine, {
                    "checkpoint": checkpoint, "group": init_info.destination, "daemon": "",
                    "double_buffer": init_info.double_buffer, "data_parallel": init_info.data_parallel})
                if engine.is_sender else None))
        except BaseException:
            try:
                engine.shutdown()
            except Exception as e:  # its daemon gone too: the error to raise is the first one
                _log.warning("shardcast: trainer_init failed, and unregistering %r failed too: %s", init_info.group, e)
            raise
        return engine

    def send_weights(self) -> None:
        """Publishes the next version on every rank; the sender syncs it and drives vLLM's update.
        Returns on every rank once the update is done, and raises on every rank when it failed on
        any, so no rank changes or unregisters its parameters while the sync still reads them."""
        self.version += 1
        version = self.version

        def publish() -> None:
            # Its parameters hold this version (acquire waits for syncs still reading them).
            # Held since the last update (see _hold), unless its daemon restarted meanwhile.
            if not (self._held and self.registration.state().held):
                self.registration.acquire()
            self.registration.publish(version)
            self._held = False

        self.collective.gather(f"publishing version {version}", publish)  # every rank, before the sync
        try:
            self.collective.gather(f"updating {self.info.destination!r} to version {version}",
                                   lambda: self._update(version) if self.is_sender else None)
        finally:
            self._hold()

    def _hold(self) -> None:
        """Takes this rank's parameters back once the update is over: the optimizer changes them in
        place until the next send_weights publishes them, so nothing (a catch-up falling back to the
        trainer, a sync of someone else's) may read them meanwhile under the version published."""
        try:
            self.registration.acquire()
            self._held = True
        except Exception as e:  # the daemon gone: the next publish acquires again, or says why
            _log.warning("shardcast: could not hold the parameters of %r between steps: %s", self.info.group, e)

    def _update(self, version: int) -> None:
        """The sender: sync `version` into the inference group and drive vLLM's update."""
        info = self.info
        with_reply(self.client.start_weight_update)
        try:
            resp = self.shardcast.sync(info.group, info.destination, version, delta=info.delta,
                                       wait_for_ranks=info.wait_for_ranks, min_replicas=info.min_replicas,
                                       replica_deadline_s=info.replica_deadline_s)
        except Exception as sync_error:
            update_error = _end_session(self.client, version)  # both errors are reported
            if update_error is not None:
                raise RuntimeError(f"shardcast: version {version} did not reach {info.destination!r}: "
                                   f"sync: {sync_error}; vLLM: {update_error}") from sync_error
            _log.warning("shardcast: the sync of version %d into %r reported %s, yet the workers hold the "
                         "version: the update finished", version, info.destination, sync_error)
            self._count_updated(version)  # ReplicaClients: the servers that did not are named
            return
        # (A replica that left the set since the last sync is named once, and is no member now.)
        self.replicas = {r.group: "" if r.committed else r.cut for r in resp.replicas if not r.left}
        for group, why in sorted(self.replicas.items()):
            if why:  # not yet a failure: the update catches it up (a failed catch-up is loud)
                _log.info("shardcast: replica %r was cut from the sync of version %d (%s); its workers catch up "
                          "to it in this update", group, version, why)
        # `source`: the sync has ended, so a replica that does not hold the version catches up.
        try:
            with_reply(self.client.update_weights, {"version": version, "timeout_s": info.timeout_s,
                                                    "source": info.group})
        except Exception:
            # vLLM's data-parallel engines: those whose update went through hold the version and
            # keep their session open; finishing ends it there (the others refuse: theirs ended).
            try:
                with_reply(self.client.finish_weight_update, str(version))
            except Exception:
                pass
            raise
        with_reply(self.client.finish_weight_update, str(version))
        self._count_updated(version)

    def _count_updated(self, version: int) -> None:
        """ReplicaClients: names the servers whose update failed (the others finished it) and
        raises when fewer than `min_replicas` took the version."""
        failed = getattr(self.client, "failed", None)
        if not isinstance(failed, dict) or not failed:
            return
        for replica, why in sorted(failed.items()):
            _log.warning("shardcast: version %d did not reach replica %d of %r, which serves its previous "
                         "version: %s", version, replica, self.info.destination, why)
        updated = len(getattr(self.client, "updated", []))
        if updated < max(1, self.info.min_replicas):
            raise RuntimeError(f"shardcast: version {version} reached {updated} replica(s) of "
                               f"{self.info.destination!r}, fewer than min_replicas={self.info.min_replicas}: "
                               + "; ".join(f"replica {k}: {why}" for k, why in sorted(failed.items())))

    def add_replica(self, client: Any) -> int:
        """Sender only, with `client` a shardcast.vllm.clients.ReplicaClients: adds an inference
        server (a client of the protocol) as the set's next replica, initialises it, and brings it
        to the version last sent. The catch-up runs through the trainer's daemon (the one that
        coordinates the set's syncs, which then knows the replica and names it if its node goes
        silent); its bytes come from the replicas that hold the version (`caught_up` records
        which): the trainer's parameters are held between steps (the optimizer is changing them),
        so with no replica holding it the catch-up fails, naming why, and the next send_weights
        brings the replica the following version. Returns its
        replica id; raises, naming the replica, when the catch-up failed (the server stays in the
        set, and the next `send_weights` reaches it)."""
        if not self.is_sender:
            raise RuntimeError("shardcast: add_replica runs on the sender rank")
        add = getattr(self.client, "add", None)
        if add is None:
            raise TypeError("shardcast: add_replica needs the trainer engine's client to be a "
                            "shardcast.vllm.clients.ReplicaClients")
        replica = add(client)
        if self.version > 0:
            group = replica_group(self.info.destination, replica)
            failed = f"shardcast: replica {replica} of {self.info.destination!r} joined but did not catch up to " \
                     f"version {self.version}"
            try:
                # Inside vLLM's update session: no byte lands in a live parameter outside one.
                with_reply(client.start_weight_update)
            except Exception as e:
                raise RuntimeError(f"{failed}: {e}") from e
            try:
                resp = self.shardcast.catch_up(group, self.info.group, self.version, timeout=self.info.timeout_s)
            except Exception as catch_up_error:
                # The session must end, or the server refuses every later update.
                update_error = _end_session(client, self.version)
                if update_error is not None:
                    raise RuntimeError(f"{failed}: {catch_up_error}; vLLM: {update_error}") from catch_up_error
                _log.warning("%s reported %s, yet its workers hold the version: the update finished", failed,
                             catch_up_error)
                return replica
            self.caught_up[group] = resp.seeded_from
            error = _update_and_finish(client, {"version": self.version, "timeout_s": self.info.timeout_s,
                                                "source": self.info.group}, self.version)
            if error is not None:
                raise RuntimeError(f"{failed}: {error}") from error
        return replica

    def shutdown(self) -> None:
        try:
            if self.registration is not None:
                self.registration.close()
                self.registration = None
        finally:
            if self.shardcast is not None:
                self.shardcast.close()
                self.shardcast = None
