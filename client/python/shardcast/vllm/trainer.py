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
from typing import Any, ClassVar, Dict, List, Optional

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from shardcast.vllm import plugin
from shardcast.vllm.fused import Part, box_view, checkpoint_boxes, hf_conversion
from shardcast.vllm.names import checkpoint_names, is_data_parallel, refuse_fsdp1, strip_wrappers

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
    parameter names (without wrapper components) to the checkpoint's (shardcast.vllm.names)."""

    backend: ClassVar[str] = "shardcast"
    group: str = "trainer"
    destination: str = "vllm"
    daemon: str = ""
    delta: str = "off"
    timeout_s: float = 600.0
    double_buffer: bool = False
    wait_for_ranks: bool = False
    name_map: Any = None


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
    part; `name_map` then renames (or, with None, leaves out) what comes out."""
    named = dict(module.named_parameters())
    data_parallel = is_data_parallel(module)
    clean = {n: strip_wrappers(n, data_parallel) for n in named}
    parts = checkpoint_boxes({clean[n]: t.shape for n, t in named.items()}, hf_conversion(_unwrapped(module)))
    raw: List[_Entry] = []
    for n, t in named.items():
        if clean[n] in parts:
            raw.extend(_Entry(p.name, t, p) for p in parts[clean[n]])
        else:
            raw.append(_Entry(clean[n], t))
    targets = checkpoint_names([e.name for e in raw], name_map)
    return [_Entry(targets[e.name], e.param, e.part) for e in raw if e.name in targets]


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside torch.compile and DDP wrappers."""
    while True:
        inner = getattr(module, "_orig_mod", None)
        if inner is None and is_data_parallel(module):
            inner = module.module
        if not isinstance(inner, torch.nn.Module):
            return module
        module = inner


def _register(client: Any, group: str, entries: List[_Entry]) -> Any:
    """Registers this trainer rank's checkpoint tensors in place as a source group: DTensors with
    the layout of their mesh and placements, parts of them with the pieces each rank holds
    (gathered), plain tensors as one rank holding them whole."""
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
        return client.register(group, 0, 1, tensors, layout, role="source")
    import torch.distributed as dist
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from shardcast.layout import layout_from_dtensors, root_mesh

    mesh = root_mesh({e.name: e.param for e in entries if hasattr(e.param, "device_mesh")})
    world = int(mesh.size())
    rank = 0
    for c, n in zip(mesh.get_coordinate(), mesh.mesh.shape):
        rank = rank * int(n) + int(c)
    tensors: Dict[str, torch.Tensor] = dict(whole)
    mine: Dict[str, Any] = {}
    for e in entries:
        if e.part is None:
            continue
        if hasattr(e.param, "device_mesh"):
            _, offsets = compute_local_shape_and_global_offset(e.param.shape, e.param.device_mesh,
                                                               e.param.placements)
            local = e.param.to_local().detach()
        else:
            offsets, local = [0] * e.param.dim(), e.param.detach()
        piece = box_view(local, offsets, e.part, f"trainer rank {rank}, the parameter holding {e.name!r}")
        if piece is not None:
            tensors[e.name] = piece[0]
            mine[e.name] = (piece[1], piece[2])
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, (client.status().node, mine))
    nodes = [r[0] for r in everyone]
    layout = layout_from_dtensors(group, whole, nodes=nodes) if whole else {
        "group": group, "mesh": {"shape": [world]}, "nodes": nodes, "tensors": []}
    for e in entries:
        if e.part is not None:
            layout["tensors"].append({
                "name": e.name, "shape": list(e.shape), "dtype": str(e.param.dtype).replace("torch.", ""),
                "pieces": [{"rank": r, "offsets": list(p[1][e.name][0]), "sizes": list(p[1][e.name][1])}
                           for r, p in enumerate(everyone) if e.name in p[1]]})
    return client.register(group, rank, world, tensors, layout, role="source")


def _sender_rank(is_sender: bool) -> int:
    """The global rank of the one trainer rank that is the sender (gathered; 0 in one process)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    flags: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(is_sender))
    if flags.count(True) != 1:
        raise ValueError(f"shardcast: {flags.count(True)} trainer ranks are senders (is_sender); exactly one must be")
    return flags.index(True)


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
        self.sender = 0  # the sending trainer rank's global rank (torch.distributed)

    @classmethod
    def trainer_init(cls, init_info: ShardcastTrainerInitInfo, *, client, source=None) -> "ShardcastTrainerEngine":
        import shardcast

        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.info = init_info
        module = _module_of(source)
        refuse_fsdp1(module)
        entries = _checkpoint_entries(module, init_info.name_map)
        engine.shardcast = shardcast.Client(init_info.daemon or None)
        engine.registration = _register(engine.shardcast, init_info.group, entries)
        engine.sender = _sender_rank(engine.is_sender)
        if engine.is_sender:
            # Global shapes (a DTensor's shape is its global one), under the names registered.
            checkpoint = {e.name: [list(e.shape), str(e.param.dtype).replace("torch.", "")] for e in entries}
            client.init_weight_transfer_engine({"checkpoint": checkpoint, "group": init_info.destination,
                                                "daemon": "", "double_buffer": init_info.double_buffer})
        return engine

    def send_weights(self) -> None:
        """Publishes the next version on every rank; the sender syncs it and drives vLLM's update.
        Returns on every rank once the update is done (or failed: then it raises on every rank),
        so no rank changes or unregisters its parameters while the sync still reads them."""
        self.version += 1
        version = self.version
        # Every rank: its parameters hold this version (acquire waits for syncs still reading them).
        self.registration.acquire()
        self.registration.publish(version)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed:
            torch.distributed.barrier()  # every rank published before the sender syncs
        error: Optional[BaseException] = None
        if self.is_sender:
            try:
                self._update(version)
            except Exception as e:  # every rank hears of it below
                error = e
        if distributed:
            word: List[Optional[str]] = [None if error is None else f"{type(error).__name__}: {error}"]
            torch.distributed.broadcast_object_list(word, src=self.sender)
            if error is None and word[0] is not None:
                raise RuntimeError(f"shardcast: the update to version {version} failed on the sending trainer rank: "
                                   f"{word[0]}")
        if error is not None:
            raise error

    def _update(self, version: int) -> None:
        """The sender: sync `version` into the inference group and drive vLLM's update."""
        self.client.start_weight_update()
        try:
            self.shardcast.sync(self.info.group, self.info.destination, version, delta=self.info.delta,
                                wait_for_ranks=self.info.wait_for_ranks)
        except Exception as sync_error:
            # vLLM's update session must end: update_weights on a version that did not arrive
            # raises on the workers (naming the rank and what it holds) and closes the session,
            # so the next send_weights can start one. Both errors are reported. (Workers that do
            # hold the version, ready at it, got every byte: the sync failed after its commit.)
            try:
                self.client.update_weights({"version": version, "timeout_s": 1.0})
            except Exception as update_error:
                raise RuntimeError(f"shardcast: version {version} did not reach {self.info.destination!r}: "
                                   f"sync: {sync_error}; vLLM: {update_error}") from sync_error
            logging.getLogger("shardcast").warning(
                "shardcast: the sync of version %d into %r reported %s, yet every worker holds the version: "
                "finishing the update", version, self.info.destination, sync_error)
            self.client.finish_weight_update(str(version))
            return
        self.client.update_weights({"version": version, "timeout_s": self.info.timeout_s})
        self.client.finish_weight_update(str(version))

    def shutdown(self) -> None:
        if self.registration is not None:
            self.registration.close()
            self.registration = None
        if self.shardcast is not None:
            self.shardcast.close()
            self.shardcast = None
