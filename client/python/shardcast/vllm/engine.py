"""The `shardcast` weight-transfer backend, worker side: a vLLM `WeightTransferEngine` whose
bytes arrive through the node's shardcastd instead of a collective.

- `init_transfer_engine`: the worker probes its model (shardcast.vllm.probe), derives its
  destination rank (shardcast.vllm.layout), gathers every rank's pieces and node over vLLM's
  tensor-parallel group, and registers the rank with its node's daemon as part of one destination
  group (every rank registers the same layout). Direct parameters are registered in place, or,
  double-buffered (`double_buffer`), a staging copy of them is.
- `receive_weights({"version": V})`: waits until this worker's rank is ready at V (the trainer's
  sync commits it); a dirty rank raises at once, naming it, and a version that does not arrive in
  time raises naming the version the rank is at. Never returns with stale weights.
- Data-parallel engines (vLLM's own with `data_parallel`, or servers of their own given `replica`)
  are the replicas of one replica set: each registers group `<group>.r<replica>` (docs/daemon.md, "Replica sets"), and
  the trainer's sync into `group` reaches every replica registered when it starts; one that is
  dead or silent is cut, the others commit. With the update's `source` (the trainer's group), a
  replica that does not hold V once the sync has ended (cut from it, or started after it) catches
  up inside `receive_weights`, from a replica that holds V, else from the trainer.
- `finish_weight_update`: double-buffered, copies the landed direct parameters into the live ones
  (the only pause the update needs); then re-runs vLLM's processing for the layers that need it
  (shardcast.vllm.apply), putting the landed bytes into service.

Double buffering keeps vLLM serving its current weights while a sync lands (no byte lands in a
live parameter before `finish_weight_update`), and a failed update leaves them untouched. Without
it, direct parameters take the bytes as they land: keep generation paused (vLLM's /pause) from
`start_weight_update` until an update succeeds, since a failed one leaves them torn (the rank is
dirty, and `update_weights` says so).

Imports vLLM: load it only inside vLLM processes (the plugin does, shardcast.vllm.plugin)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from shardcast.v1 import service_pb2
from shardcast.vllm.apply import process_staged
from shardcast.vllm.clients import replica_group
from shardcast.vllm.layout import destination_layout, rank_memory
from shardcast.vllm.probe import ProbeError, probe


@dataclass
class ShardcastInitInfo(WeightTransferInitInfo):
    """What the trainer tells the workers once: the checkpoint's tensors (name -> [shape, dtype
    name], the names the model's `load_weights` takes), the destination group to register, and the
    daemon (default: the node's socket, SHARDCAST_ADDRESS / SHARDCAST_SOCKET).

    `replica`: this engine's id in the replica set `group` (it registers group `<group>.r<replica>`).
    `data_parallel`: vLLM runs data-parallel engines (`--data-parallel-size`), each one replica of
    the set `group`, its id vLLM's data-parallel index (unless `replica` names one). Neither: the
    engine registers `group` itself."""

    checkpoint: Dict[str, List[Any]] = field(default_factory=dict)
    group: str = "vllm"
    daemon: str = ""
    double_buffer: bool = False
    replica: int = -1
    data_parallel: bool = False


@dataclass
class ShardcastUpdateInfo(WeightTransferUpdateInfo):
    """One update: the version the trainer synced (or is syncing) into the group.

    `source` (replicas only): the trainer's source group, given once the sync has ended. A replica
    that does not hold `version` then (cut from the sync, or registered after it) catches up to it,
    from a replica that holds it (or from `source` when none does), instead of waiting for it."""

    version: int = 0
    timeout_s: float = 600.0
    source: str = ""


class ShardcastWeightTransferEngine(WeightTransferEngine[ShardcastInitInfo, ShardcastUpdateInfo]):
    init_info_cls = ShardcastInitInfo
    update_info_cls = ShardcastUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.client = None
        self.registration = None
        self.memory = None
        self.group = ""
        self.rank = 0
        self.replica: Optional[int] = None  # this engine's id in the replica set, None: no set
        self.seeded_from = ""  # the group the last catch-up read (a peer replica, or the trainer)

    def init_transfer_engine(self, init_info: ShardcastInitInfo) -> None:
        import shardcast
        from vllm.distributed.parallel_state import get_tp_group

        if not init_info.checkpoint:
            raise ValueError("shardcast: init_info.checkpoint is empty (name -> [shape, dtype] of every tensor)")
        if self.registration is not None:
            raise RuntimeError(f'shardcast: this worker already registered group "{self.group}"')
        shapes = {name: tuple(int(s) for s in spec[0]) for name, spec in init_info.checkpoint.items()}
        maps = probe(self.model, shapes)
        self.memory = rank_memory(maps, dict(self.model.named_parameters(remove_duplicate=False)),
                                  dict(self.model.named_modules()), double_buffer=init_info.double_buffer)
        self.client = shardcast.Client(init_info.daemon or None)
        tp = get_tp_group()
        mine = {"node": self.client.status().node, "pieces": self.memory.pieces,
                "dtypes": {l.tensor: str(pm.dtype).replace("torch.", "") for pm in maps.values() for l in pm.landings}}
        everyone: List[Optional[dict]] = [None] * tp.world_size
        torch.distributed.all_gather_object(everyone, mine, group=tp.cpu_group)
        dtypes: Dict[str, str] = {}
        for r in everyone:
            dtypes.update(r["dtypes"])
        checkpoint = {name: (shapes[name], getattr(torch, dtypes.get(name, str(spec[1])))) for name, spec in
                      init_info.checkpoint.items()}
        replica = init_info.replica
        if replica >= 0 and init_info.data_parallel:
            raise ValueError(f"shardcast: init_info names replica {replica} and data_parallel: each of this "
                             "server's data-parallel engines would register that one replica; use one of them")
        if replica < 0 and init_info.data_parallel:
            if self.parallel_config.enable_expert_parallel:
                # Experts spread over the data-parallel engines: together they are one model.
                raise ValueError("shardcast: data_parallel replicas, but vLLM runs expert parallelism across its "
                                 "data-parallel engines: they hold different experts, so they are one model, "
                                 "not replicas")
            replica = self.parallel_config.data_parallel_index
        group = init_info.group if replica < 0 else replica_group(init_info.group, replica)
        layout = destination_layout(group, [r["node"] for r in everyone], [r["pieces"] for r in everyone], checkpoint)
        if replica >= 0:
            layout.update(replica_set=init_info.group, replica=replica)
            self.replica = replica
        self.group, self.rank = group, tp.rank_in_group
        self.where = f'rank {tp.rank_in_group} of group "{self.group}" on node "{mine["node"]}"'
        self.registration = self.client.register(self.group, tp.rank_in_group, tp.world_size, self.memory.tensors,
                                                 layout)

    def start_weight_update(self) -> None:
        if self.registration is None:
            raise RuntimeError("shardcast: start_weight_update before init_transfer_engine")

    def receive_weights(self, update_info: ShardcastUpdateInfo) -> None:
        if self.registration is None:
            raise RuntimeError("shardcast: update_weights before init_transfer_engine")
        if update_info.version <= 0:
            raise ValueError(f"shardcast: update_info.version must be a version >= 1, not {update_info.version}")
        from vllm.distributed.parallel_state import get_tp_group

        tp = get_tp_group()
        error: Optional[BaseException] = None
        if self.replica is not None and update_info.source:
            error = self._catch_up(tp, update_info)
        if error is None:
            try:
                self.client.wait_version(self.group, update_info.version, timeout=update_info.timeout_s)
            except Exception as e:  # the daemon's error (a dirty rank, a timeout) or its absence, with the rank
                error = e
        # All ranks or none: vLLM ends the update session only on a worker whose update_weights
        # raises, so a rank that got the version while another did not must raise too, or its
        # session stays open and the next start_weight_update fails there.
        failed = _any_rank(tp, error is not None)
        if error is not None:
            raise RuntimeError(f"shardcast: {self.where} did not receive version {update_info.version}: "
                               f"{error}") from error
        if failed:
            raise RuntimeError(f"shardcast: {self.where} holds version {update_info.version}, but another rank "
                               "of the group did not receive it (its worker names it); the update is not applied")

    def _catch_up(self, tp, update_info: ShardcastUpdateInfo) -> Optional[BaseException]:
        """A replica whose ranks do not all hold the version once the sync has ended catches up to
        it: rank 0 of the replica asks its daemon (the bytes come from a replica that holds the
        version, else from `update_info.source`), the other ranks wait for it. Returns this rank's
        error, if any; every rank takes the same steps, so none is left in a collective."""
        version = update_info.version
        error: Optional[BaseException] = None
        try:
            behind = not any(r.rank == self.rank and r.state == service_pb2.RANK_READY and r.version >= version
                             for r in self.client.ranks(self.group))
        except Exception as e:  # the daemon's absence: wait_version is not tried either
            error, behind = e, True
        if not _any_rank(tp, behind):
            return error
        if self.rank == 0 and error is None:
            try:
                resp = self.client.catch_up(self.group, update_info.source, version, timeout=update_info.timeout_s)
                self.seeded_from = resp.seeded_from
            except Exception as e:
                error = e
        if _any_rank(tp, error is not None) and error is None:
            error = RuntimeError(f"the catch-up of replica group \"{self.group}\" to version {version} failed "
                                 "(the worker of the rank that failed names why)")
        return error

    def finish_weight_update(self) -> None:
        if self.memory is None:
            raise RuntimeError("shardcast: finish_weight_update before init_transfer_engine")
        self.memory.flip()
        process_staged(self.model, self.memory.reprocess)

    def shutdown(self) -> None:
        if self.registration is not None:
            self.registration.close()
            self.registration = None
        if self.client is not None:
            self.client.close()
            self.client = None


def _any_rank(tp, flag: bool) -> bool:
    """Whether `flag` holds on any rank of the tensor-parallel group (every rank must call it)."""
    value = torch.tensor([int(flag)], dtype=torch.int32)
    if tp.world_size > 1:
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=tp.cpu_group)
    return bool(value.item())


__all__ = ["ShardcastInitInfo", "ShardcastUpdateInfo", "ShardcastWeightTransferEngine", "ProbeError"]
