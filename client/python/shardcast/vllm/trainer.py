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
fused MoE experts) is registered as one view per checkpoint tensor (shardcast.vllm.fused).

With `lora=` the trainer syncs a PEFT model's LoRA adapters instead, and only them: each adapter's
parameters, in place, as source group `<group>.lora.<adapter>` under PEFT's checkpoint names, into
the workers' `<destination>.lora.<adapter>` (shardcast.vllm.lora); the base weights never leave
the engines."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from shardcast.vllm import plugin
from shardcast.vllm.clients import replica_group, with_reply
from shardcast.parallel import gather_step
from shardcast.vllm.fused import Part, box_view, checkpoint_boxes, hf_conversion
from shardcast.vllm.lora import (LORA_COMPONENTS, AdapterSpec, ServerNames, adapter_group, adapter_path, check_config,
                                 checkpoint_name, json_config, peft_adapters, resolve_adapters)
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
    node may stay silent during a sync before it is cut (None: the daemons' sync lease).

    `lora`: sync the LoRA adapters of a PEFT model instead of its weights (docs/vllm.md, "LoRA
    adapters"): True (every adapter, vLLM ids 100001, 100002, ... in the model's order), an adapter
    name or a list of them (ids in that order), or a dict of adapter name -> vLLM id. Requests name an adapter with
    `engine.lora_request(name)`. vLLM must run with enable_lora=True."""

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
    lora: Any = None


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


def _adapter_entries(module: torch.nn.Module, adapter: str) -> List[_Entry]:
    """The parameters of PEFT adapter `adapter` under their checkpoint names (the adapter's
    component taken out, as get_peft_model_state_dict saves them); ValueError when it has none."""
    data_parallel = is_data_parallel(module)
    entries = []
    for name, param in module.named_parameters():
        clean = strip_wrappers(name, data_parallel)
        target = checkpoint_name(clean, adapter)
        if target is not None:
            entries.append(_Entry(target, param))
        elif param.requires_grad and adapter in clean.split(".")[1:]:
            # Trained with the adapter (trainable tokens, a module copy), yet no LoRA matrix vLLM loads.
            raise ValueError(f"shardcast: parameter {clean!r} belongs to LoRA adapter {adapter!r} but is none of "
                             f"its LoRA matrices ({', '.join(LORA_COMPONENTS[:4])}): vLLM would serve the adapter "
                             "without it")
    if not entries:
        raise ValueError(f"shardcast: LoRA adapter {adapter!r} has no parameters in this model (lora_A / lora_B "
                         f"of adapter {adapter!r})")
    return entries


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


def _register(client: Any, group: str, entries: List[_Entry], collective: "_Collective", replicated: bool) -> Any:
    """Registers this trainer rank's checkpoint tensors in place as a source group: DTensors with
    the layout of their mesh and placements (pipeline stages: every rank's own, gathered), parts of
    them with the pieces each rank holds (gathered), plain tensors whole on every rank (one
    process, or DDP's replicas: `replicated`). Every rank registers, or none does and every rank
    raises."""
    has_dtensors = any(type(e.param).__name__ == "DTensor" for e in entries)
    # Decided together: a stage of plain tensors beside stages of DTensors takes their path.
    if any(collective.gather("finding the DTensors", lambda: has_dtensors)):
        rank, world, tensors, layout = _dtensor_layout(client, group, entries, collective)
    else:
        rank, world, tensors, layout = _replicated_layout(client, group, entries, collective, replicated)
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


def _replicated_layout(client: Any, group: str, entries: List[_Entry], collective: "_Collective",
                       replicated: bool) -> Tuple[int, int, Dict[str, torch.Tensor], dict]:
    """Plain tensors: every rank holds each whole (a fused parameter's checkpoint tensors as views
    of it), so each is replicated over the ranks, which DDP keeps equal. Several processes holding
    plain tensors without DDP may hold different values: refused."""
    world = collective.world
    tensors = {e.name: e.param for e in entries if e.part is None}
    for e in entries:
        if e.part is not None:
            tensors[e.name] = box_view(e.param.detach(), [0] * e.param.dim(), e.part, f"parameter of {e.name!r}")[0]

    def node() -> str:
        if world > 1 and not replicated:
            raise ValueError(f"shardcast: {world} trainer processes hold plain tensors, neither DTensors nor "
                             "DistributedDataParallel's replicas, so they may differ: call trainer_init from one "
                             "process, wrap the model in DistributedDataParallel, or shard it with FSDP2")
        return client.status().node

    nodes = collective.gather(f'registering group "{group}": each rank\'s node', node)
    layout = {"group": group, "mesh": {"shape": [world]}, "nodes": nodes,
              "tensors": [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                          for n, t in tensors.items()]}
    return (torch.distributed.get_rank() if collective.on else 0), world, tensors, layout


def _dtensor_layout(client: Any, group: str, entries: List[_Entry],
                    collective: "_Collective") -> Tuple[int, int, Dict[str, torch.Tensor], dict]:
    """DTensors (and any plain tensors beside them): the layout of their mesh and placements, or of
    every rank's own under pipeline stages; a fused parameter's checkpoint tensors as the pieces
    each rank holds."""
    from shardcast.layout import covers_group, describe_dtensors, layout_from_dtensors, layout_from_views

    world = collective.world
    rank = torch.distributed.get_rank() if collective.on else 0
    whole = {e.name: e.param for e in entries if e.part is None}
    dtensors = {e.name: e.param for e in entries if hasattr(e.param, "device_mesh")}
    tensors: Dict[str, torch.Tensor] = dict(whole)

    def my_pieces() -> Tuple[bool, str, Dict[str, Any], Dict[str, Any]]:
        """Whether this rank's DTensors span the whole group (no pipeline stages), its node, the
        checkpoint tensors its fused parameters hold (name: [shape, dtype]) and the piece of each
        it holds (name: (offsets, sizes))."""
        parts: Dict[str, Any] = {}
        mine: Dict[str, Any] = {}
        shards: Dict[int, Tuple[Optional[List[int]], torch.Tensor]] = {}  # per parameter, not per part
        for e in entries:
            if e.part is None:
                continue
            parts[e.name] = [list(e.shape), str(e.param.dtype).replace("torch.", "")]
            if id(e.param) not in shards:
                shards[id(e.param)] = _shard(e, rank)
            offsets, local = shards[id(e.param)]
            if offsets is None:  # this rank's shard is empty
                continue
            piece = box_view(local, offsets, e.part, f"trainer rank {rank}, the parameter holding {e.name!r}")
            if piece is not None:
                tensors[e.name] = piece[0]
                mine[e.name] = (piece[1], piece[2])
        return bool(dtensors) and covers_group(dtensors, world), client.status().node, parts, mine

    everyone = collective.gather(f'registering group "{group}": each rank\'s pieces', my_pieces)
    nodes = [node for _, node, _, _ in everyone]
    if all(covers for covers, _, _, _ in everyone):  # one mesh over the ranks: placements where they serve
        layout = layout_from_dtensors(group, whole, nodes=nodes) if whole else {
            "group": group, "mesh": {"shape": [world]}, "nodes": nodes, "tensors": []}
    else:  # pipeline stages: each rank's own tensors, gathered
        views = collective.gather(f'registering group "{group}": each rank\'s tensors',
                                  lambda: describe_dtensors(whole))
        layout = layout_from_views(group, views, list(range(world)), nodes)
    parts: Dict[str, Any] = {}  # every rank's (stages hold different ones), in rank order
    for _, _, theirs, _ in everyone:
        for name, spec in theirs.items():
            parts.setdefault(name, spec)
    for name, (shape, dtype) in parts.items():
        layout["tensors"].append({
            "name": name, "shape": shape, "dtype": dtype,
            "pieces": [{"rank": r, "offsets": list(mine[name][0]), "sizes": list(mine[name][1])}
                       for r, (_, _, _, mine) in enumerate(everyone) if name in mine]})
    return rank, world, tensors, layout


def _shard(e: _Entry, rank: int) -> Tuple[Optional[List[int]], torch.Tensor]:
    """Where this rank's local tensor of the parameter holding `e` starts in it (None: it holds
    none of it), and that tensor."""
    from shardcast.layout import local_offsets

    if not hasattr(e.param, "device_mesh"):
        return [0] * e.param.dim(), e.param.detach()
    if any(type(p).__name__ == "Partial" for p in e.param.placements):
        raise ValueError(f"the parameter holding {e.name!r} is Partial (pending a reduction): its bytes "
                         "are not the checkpoint's")
    return (local_offsets(e.param, f"trainer rank {rank}, the parameter holding {e.name!r}"),
            e.param.to_local().detach())


def _announced_tensors(entries: Dict[str, List[_Entry]], collective: "_Collective") -> Dict[str, Dict[str, list]]:
    """adapter -> {checkpoint name: [global shape, dtype]} over every trainer rank. Ranks holding
    the same tensors (no pipeline stages) say so with a digest; otherwise every rank's are joined,
    and a name two ranks give different shapes or dtypes is a ValueError naming both."""
    import hashlib

    mine = {adapter: {e.name: [list(e.shape), str(e.param.dtype).replace("torch.", "")] for e in es}
            for adapter, es in entries.items()}
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()
    if len(set(collective.gather("comparing the checkpoint's tensors", lambda: digest))) == 1:
        return mine
    out: Dict[str, Dict[str, list]] = {}
    first_rank: Dict[Tuple[str, str], int] = {}
    for rank, theirs in enumerate(collective.gather("gathering the checkpoint's tensors", lambda: mine)):
        for adapter, named in theirs.items():
            for name, spec in named.items():
                first = out.setdefault(adapter, {}).setdefault(name, spec)
                r0 = first_rank.setdefault((adapter, name), rank)
                if first != spec:
                    raise ValueError(f"shardcast: checkpoint tensor {name!r} is {first} on trainer rank {r0} and "
                                     f"{spec} on rank {rank}")
    return out


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
        # What this rank registered: adapter name ("" for the weights, without lora=) -> its
        # registration; each is synced from its source group into its destination group.
        self.registrations: Dict[str, Any] = {}
        self.lora_ids: Dict[str, int] = {}  # lora=: adapter name -> vLLM id
        self.version = 0
        self.sent: Dict[str, int] = {}  # the version last sent of the weights ("") or of each adapter
        self.collective: Optional[_Collective] = None
        # A replica set's last sync (sender): each replica's group -> "" (committed) or why it was cut.
        self.replicas: Dict[str, str] = {}
        self._held: Dict[str, bool] = {}  # the parameters acquired between steps (see _hold)
        # Replicas added by add_replica: group -> the group their catch-up read.
        self.caught_up: Dict[str, str] = {}
        # The last sync's response (sender) of the weights ("") or of each adapter: its bytes,
        # seconds, delta and dense chunks.
        self.syncs: Dict[str, Any] = {}
        # lora= into `vllm serve` (sender): the names requests give the adapters at each server.
        self.server_names: Optional[ServerNames] = None

    @property
    def registration(self) -> Any:
        """The weights' registration (without lora=), else None."""
        return self.registrations.get("")

    def _groups(self, adapter: str) -> Tuple[str, str]:
        """(source group, destination group) of the weights ("") or of an adapter."""
        if not adapter:
            return self.info.group, self.info.destination
        return adapter_group(self.info.group, adapter), adapter_group(self.info.destination, adapter)

    def lora_request(self, adapter: str):
        """vLLM's LoRARequest naming adapter `adapter` (lora=), for generate(..., lora_request=)."""
        from vllm.lora.request import LoRARequest

        if adapter not in self.lora_ids:
            raise KeyError(f"shardcast: no LoRA adapter {adapter!r} is synced (lora= gave {sorted(self.lora_ids)})")
        return LoRARequest(adapter, self.lora_ids[adapter], adapter_path(self.info.destination, adapter))

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
        # adapter name ("": the weights) -> its checkpoint tensors
        entries: Dict[str, List[_Entry]] = {}
        configs: Dict[str, Dict[str, Any]] = {}

        def find() -> None:
            if init_info.lora is None or init_info.lora is False:
                entries[""] = _checkpoint_entries(module, init_info.name_map)
                return
            if init_info.name_map is not None:
                raise ValueError("shardcast: lora= registers PEFT's own checkpoint names; name_map does not apply")
            adapters = peft_adapters(module)
            engine.lora_ids = resolve_adapters(init_info.lora, list(adapters))
            for name in engine.lora_ids:
                configs[name] = json_config(adapters[name].to_dict() if hasattr(adapters[name], "to_dict")
                                            else vars(adapters[name]))
                check_config(name, configs[name])
                entries[name] = _adapter_entries(module, name)

        engine.collective.gather("finding the checkpoint's tensors", find)
        # All ranks or none from here: a step that fails anywhere (the daemon refusing a rank, vLLM's
        # workers refusing the checkpoint) raises on every rank, and every rank unregisters.
        try:
            engine.shardcast = shardcast.Client(init_info.daemon or None)
            for adapter, adapter_entries in entries.items():
                group, _ = engine._groups(adapter)
                engine.registrations[adapter] = _register(engine.shardcast, group, adapter_entries, engine.collective,
                                                          is_data_parallel(module))
            senders = engine.collective.gather("finding the sender", lambda: bool(engine.is_sender))
            if senders.count(True) != 1:
                raise ValueError(f"shardcast: {senders.count(True)} trainer ranks are senders (is_sender); exactly "
                                 "one must be")
            # Global shapes (a DTensor's shape is its global one), under the names registered, of
            # every rank (pipeline stages each hold their own). vLLM's workers match each against
            # their loaders before anything moves.
            tensors = _announced_tensors(entries, engine.collective)
            announced = {"checkpoint": tensors.get("", {}), "group": init_info.destination, "daemon": "",
                         "double_buffer": init_info.double_buffer, "data_parallel": init_info.data_parallel}
            if engine.lora_ids:
                announced["lora"] = {name: AdapterSpec(name, engine.lora_ids[name], configs[name],
                                                       tensors[name]).to_json() for name in engine.lora_ids}
            def initialise() -> None:
                if engine.lora_ids:  # servers able to name the adapters, holding none of these names yet
                    engine.server_names = ServerNames(init_info.destination, list(engine.lora_ids))
                    for url in ServerNames.servers(client):
                        engine.server_names.prepare(url)
                with_reply(client.init_weight_transfer_engine, announced)

            engine.collective.gather(f"initialising the weight transfer of {init_info.destination!r}",
                                     lambda: initialise() if engine.is_sender else None)
        except BaseException:
            try:
                engine.shutdown()
            except Exception as e:  # its daemon gone too: the error to raise is the first one
                _log.warning("shardcast: trainer_init failed, and unregistering %r failed too: %s", init_info.group, e)
            raise
        return engine

    def send_weights(self, adapters: Optional[List[str]] = None) -> None:
        """Publishes the next version on every rank; the sender syncs it and drives vLLM's update.
        Returns on every rank once the update is done, and raises on every rank when it failed on
        any, so no rank changes or unregisters its parameters while the sync still reads them.
        `adapters` (lora=): the adapters this update carries (None: every one); the others keep
        serving their version, and their parameters are not published."""
        names = self._carried(adapters)
        self.version += 1
        version = self.version

        def publish() -> None:
            # Its parameters hold this version (acquire waits for syncs still reading them).
            # Held since the last update (see _hold), unless its daemon restarted meanwhile.
            for name in names:
                registration = self.registrations[name]
                if not (self._held.get(name) and registration.state().held):
                    registration.acquire()
                registration.publish(version)
                self._held[name] = False

        self.collective.gather(f"publishing version {version}", publish)  # every rank, before the sync
        try:
            self.collective.gather(f"updating {self.info.destination!r} to version {version}",
                                   lambda: self._update(version, names) if self.is_sender else None)
            for name in names:  # what vLLM serves now (a failed update leaves each at its previous)
                self.sent[name] = version
        finally:
            self._hold(names)
        if self.lora_ids:  # requests to `vllm serve` name each adapter once a version of it serves
            self.collective.gather(f"naming the LoRA adapters of {self.info.destination!r} at vllm serve",
                                   lambda: self._name_adapters(names, self.client) if self.is_sender else None)

    def _name_adapters(self, names: List[str], client: Any) -> None:
        """Names `names` at every server of `client` the last update reached (ServerNames)."""
        if self.server_names is None:
            return
        for url in ServerNames.servers(client, getattr(client, "updated", None)):
            try:
                self.server_names.name(url, names)
            except Exception as e:
                raise RuntimeError(f"shardcast: the update of {names} went through, but requests to {url} cannot "
                                   f"name them yet (the next send_weights tries again): {e}") from e

    def _carried(self, adapters: Optional[List[str]]) -> List[str]:
        if adapters is None:
            return list(self.registrations)
        if not self.lora_ids:
            raise ValueError("shardcast: send_weights(adapters=...) names LoRA adapters; this engine syncs weights "
                             "(no lora=)")
        unknown = [a for a in adapters if a not in self.lora_ids]
        if unknown or not adapters:
            raise ValueError(f"shardcast: send_weights(adapters={adapters}): name one or more of "
                             f"{sorted(self.lora_ids)}")
        return list(dict.fromkeys(adapters))

    def _hold(self, names: List[str]) -> None:
        """Takes this rank's parameters back once the update is over: the optimizer changes them in
        place until the next send_weights publishes them, so nothing (a catch-up falling back to the
        trainer, a sync of someone else's) may read them meanwhile under the version published."""
        for name in names:
            try:
                self.registrations[name].acquire()
                self._held[name] = True
            except Exception as e:  # the daemon gone: the next publish acquires again, or says why
                _log.warning("shardcast: could not hold the parameters of %r between steps: %s",
                             self._groups(name)[0], e)

    def _update_info(self, version: int, names: Any, **extra: Any) -> Dict[str, Any]:
        """The workers' update info: `names` the adapters carried (a list, at `version`, or a dict
        of adapter -> its own version)."""
        info = {"version": version, **extra}
        if self.lora_ids:
            info["adapters"] = dict(names) if isinstance(names, dict) else list(names)
        return info

    def _update(self, version: int, names: List[str]) -> None:
        """The sender: sync `version` of each of `names` into its inference group and drive vLLM's
        update."""
        info = self.info
        with_reply(self.client.start_weight_update)
        replicas: Dict[str, str] = {}
        try:
            for name in names:
                source, destination = self._groups(name)
                resp = self.shardcast.sync(source, destination, version, delta=info.delta,
                                           wait_for_ranks=info.wait_for_ranks, min_replicas=info.min_replicas,
                                           replica_deadline_s=info.replica_deadline_s)
                self.syncs[name] = resp
                # (A replica that left the set since the last sync is named once, and is no member now.)
                replicas.update({r.group: "" if r.committed else r.cut for r in resp.replicas if not r.left})
        except Exception as sync_error:
            update_error = self._end_session(self.client, version, names)  # both errors are reported
            if update_error is not None:
                raise RuntimeError(f"shardcast: version {version} did not reach {info.destination!r}: "
                                   f"sync: {sync_error}; vLLM: {update_error}") from sync_error
            _log.warning("shardcast: the sync of version %d into %r reported %s, yet the workers hold the "
                         "version: the update finished", version, info.destination, sync_error)
            self._count_updated(version)  # ReplicaClients: the servers that did not are named
            return
        self.replicas = replicas
        for group, why in sorted(self.replicas.items()):
            if why:  # not yet a failure: the update catches it up (a failed catch-up is loud)
                _log.info("shardcast: replica %r was cut from the sync of version %d (%s); its workers catch up "
                          "to it in this update", group, version, why)
        # `source`: the sync has ended, so a replica that does not hold the version catches up.
        try:
            with_reply(self.client.update_weights, self._update_info(version, names, timeout_s=info.timeout_s,
                                                                     source=info.group))
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

    def _end_session(self, client: Any, version: int, names: Any) -> Optional[Exception]:
        """Ends vLLM's update session after the bytes' move failed: update_weights on a version that did
        not arrive raises on the workers (naming the rank and what it holds) and closes the session, so
        the next update can start one. Returns that error; None when the workers do hold the version
        (every byte arrived: the move failed after its commit), the update then finished."""
        return _update_and_finish(client, self._update_info(version, names, timeout_s=1.0), version)

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
        if self.server_names is not None:
            for url in ServerNames.servers(client):
                self.server_names.prepare(url)
        replica = add(client)
        if self.version > 0:
            failed = f"shardcast: replica {replica} of {self.info.destination!r} joined but did not catch up to " \
                     f"version {self.version}"
            try:
                # Inside vLLM's update session: no byte lands in a live parameter outside one.
                with_reply(client.start_weight_update)
            except Exception as e:
                raise RuntimeError(f"{failed}: {e}") from e
            # The weights' last version, or each adapter's (one not sent yet has none to catch up to).
            sent = {name: version for name, version in self.sent.items() if version > 0} if self.lora_ids \
                else {"": self.version}
            try:
                for name, version in sent.items():
                    source, destination = self._groups(name)
                    group = replica_group(destination, replica)
                    resp = self.shardcast.catch_up(group, source, version, timeout=self.info.timeout_s)
                    self.caught_up[group] = resp.seeded_from
            except Exception as catch_up_error:
                # The session must end, or the server refuses every later update.
                update_error = self._end_session(client, self.version, sent)
                if update_error is not None:
                    raise RuntimeError(f"{failed}: {catch_up_error}; vLLM: {update_error}") from catch_up_error
                _log.warning("%s reported %s, yet its workers hold the version: the update finished", failed,
                             catch_up_error)
                self._name_adapters([name for name in sent if name], client)
                return replica
            error = _update_and_finish(client, self._update_info(self.version, sent, timeout_s=self.info.timeout_s,
                                                                 source=self.info.group), self.version)
            if error is not None:
                raise RuntimeError(f"{failed}: {error}") from error
            self._name_adapters([name for name in sent if name], client)
        return replica

    def shutdown(self) -> None:
        if self.server_names is not None:  # first: a request naming an adapter gone would end vLLM's engine
            self.server_names.forget()
        try:
            for name in list(self.registrations):
                self.registrations.pop(name).close()
        finally:
            if self.shardcast is not None:
                self.shardcast.close()
                self.shardcast = None
