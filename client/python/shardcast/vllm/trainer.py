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
renamed by `name_map` where the trainer's names are not the checkpoint's (shardcast.vllm.names)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from shardcast.vllm import plugin
from shardcast.vllm.names import checkpoint_names, is_data_parallel, refuse_fsdp1

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

    @classmethod
    def trainer_init(cls, init_info: ShardcastTrainerInitInfo, *, client, source=None) -> "ShardcastTrainerEngine":
        import shardcast

        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.info = init_info
        module = _module_of(source)
        refuse_fsdp1(module)
        named = dict(module.named_parameters())
        names = checkpoint_names(named, init_info.name_map, is_data_parallel(module))
        params: Dict[str, torch.Tensor] = {names[n]: t for n, t in named.items() if n in names}
        engine.shardcast = shardcast.Client(init_info.daemon or None)
        is_dtensor = any(type(t).__name__ == "DTensor" for t in params.values())
        if is_dtensor:
            engine.registration = engine.shardcast.register_dtensors(init_info.group, params)
        else:
            node = engine.shardcast.status().node
            layout = {"group": init_info.group, "mesh": {"shape": [1]}, "nodes": [node],
                      "tensors": [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                                  for n, t in params.items()]}
            engine.registration = engine.shardcast.register(init_info.group, 0, 1, params, layout, role="source")
        if engine.is_sender:
            # Global shapes (a DTensor's shape is its global one), under the names registered.
            checkpoint = {n: [list(t.shape), str(t.dtype).replace("torch.", "")] for n, t in params.items()}
            client.init_weight_transfer_engine({"checkpoint": checkpoint, "group": init_info.destination,
                                                "daemon": "", "double_buffer": init_info.double_buffer})
        return engine

    def send_weights(self) -> None:
        self.version += 1
        version = self.version
        # Every rank: its parameters hold this version (acquire waits for syncs still reading them).
        self.registration.acquire()
        self.registration.publish(version)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()  # every rank published before the sender syncs
        if not self.is_sender:
            return
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
