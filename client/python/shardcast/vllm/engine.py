"""The `shardcast` weight-transfer backend, worker side: a vLLM `WeightTransferEngine` whose
bytes arrive through the node's shardcastd instead of a collective.

- `init_transfer_engine`: the worker probes its model (shardcast.vllm.probe), derives its
  destination rank (shardcast.vllm.layout), gathers every rank's pieces and node over the engine's
  workers (vLLM's tensor-parallel ranks of every pipeline stage: shardcast.parallel.GridRanks),
  and registers the rank with its node's daemon as part of one destination group (every rank
  registers the same layout). A model vLLM serves in block-quantised fp8 takes
  the trainer's float32 or bfloat16 weights: they land as fp8, quantised at the source, and their
  scales in vLLM's `weight_scale_inv` (shardcast.vllm.layout, docs/vllm.md "fp8"). Direct parameters are registered in place, or,
  double-buffered (`double_buffer`), a staging copy of them is. The announced checkpoint must fit
  vLLM's loaders exactly (every announced element lands, every parameter element is written by one
  tensor); a refusal raises on every worker and leaves nothing registered.
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
  (shardcast.vllm.apply), putting the landed bytes into service. vLLM's engine core then resets its
  prefix cache in the same call (shardcast.vllm.session), before it schedules another step.
- LoRA adapters (`lora` in the init info, shardcast.vllm.lora): each adapter its own group, landed
  in buffers of the worker's own and put into service by vLLM's own in-memory adapter API when the
  update finishes (`after_finish`, once vLLM has removed every adapter as it does after an update).
  An update names the adapters it carries (`adapters`); the others keep serving what they serve.

Every call reaches this engine through shardcast.vllm.session, which runs it on every worker and
reports each worker's status, so one worker's error never leaves vLLM's RPC replies out of step.

Double buffering keeps vLLM serving its current weights while a sync lands (no byte lands in a
live parameter before `finish_weight_update`), and a failed update leaves them untouched. Without
it, direct parameters take the bytes as they land: keep generation paused (vLLM's /pause) from
`start_weight_update` until an update succeeds, since a failed one leaves them torn (the rank is
dirty, and `update_weights` says so).

Imports vLLM: load it only inside vLLM processes (the plugin does, shardcast.vllm.plugin)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from shardcast.v1 import service_pb2
from shardcast.vllm.apply import process_staged
from shardcast.vllm.clients import replica_group
from shardcast.parallel import GridRanks
from shardcast.vllm.layout import (DTYPE_NAMES, check_coverage, check_dtypes, destination_layout, fp8_blocks,
                                   fp8_scales, rank_memory)
from shardcast.vllm.lora import (AdapterSpec, Installer, WorkerAdapter, adapter_group, adapter_path,
                                 replicated_pieces, worker_buffers)
from shardcast.vllm.probe import ProbeError, probe, unreached

_log = logging.getLogger("shardcast")


@dataclass
class ShardcastInitInfo(WeightTransferInitInfo):
    """What the trainer tells the workers once: the checkpoint's tensors (name -> [shape, dtype
    name], the names the model's `load_weights` takes), the destination group to register, and the
    daemon (default: the node's, SHARDCAST_ADDRESS / SHARDCAST_SOCKET / its socket as the worker's
    environment named it when vLLM built the engine).

    `replica`: this engine's id in the replica set `group` (it registers group `<group>.r<replica>`).
    `data_parallel`: vLLM runs data-parallel engines (`--data-parallel-size`), each one replica of
    the set `group`, its id vLLM's data-parallel index (unless `replica` names one). Neither: the
    engine registers `group` itself.

    `lora`: LoRA adapters (name -> {"id": vLLM's lora_int_id, "config": the PEFT configuration,
    "tensors": checkpoint name -> [shape, dtype name]}), each registered as group
    `<group>.lora.<name>` (shardcast.vllm.lora). `checkpoint` may then be empty: the base weights
    stay as loaded."""

    checkpoint: Dict[str, List[Any]] = field(default_factory=dict)
    group: str = "vllm"
    daemon: str = ""
    double_buffer: bool = False
    replica: int = -1
    data_parallel: bool = False
    lora: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ShardcastUpdateInfo(WeightTransferUpdateInfo):
    """One update: the version the trainer synced (or is syncing) into the group.

    `source` (replicas only): the trainer's source group, given once the sync has ended. A replica
    that does not hold `version` then (cut from the sync, or registered after it) catches up to it,
    from a replica that holds it (or from `source` when none does), instead of waiting for it."""

    version: int = 0
    timeout_s: float = 600.0
    source: str = ""
    # The LoRA adapters this update carries, at `version` (a list) or each at its own (a dict of
    # adapter -> version; a replica added to the set catches up to each adapter's last). None: the
    # base weights, if registered, and every adapter. The others keep serving their version. Their
    # source groups derive from `source`.
    adapters: Any = None


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
        self.where = "this worker"
        # The last finish_weight_update: None (not run since shardcast.vllm.session asked), "" (put
        # into service), or why it failed.
        self.finished: Optional[str] = None
        # LoRA adapters by name (shardcast.vllm.lora), and what drives vLLM's LoRA manager.
        self.adapters: Dict[str, WorkerAdapter] = {}
        self.installer: Optional[Installer] = None
        # vLLM's model runner of this worker, set by shardcast.vllm.session before every call.
        self.runner: Any = None
        self.base_received = False  # this update session received the base weights' version
        self.ranks: Optional[GridRanks] = None  # the workers of this group, once registered
        # This worker's daemon unless the init info names one: as its environment named it when vLLM
        # built the engine (engines sharing a process, each with its own node, keep their own).
        from shardcast.client import default_target

        self.daemon = default_target()

    def init_transfer_engine(self, init_info: ShardcastInitInfo) -> None:
        """All workers of the engine or none: each matches the announced checkpoint against vLLM's
        loaders (ProbeError naming the tensor and the parameter), the group checks that every
        announced element lands somewhere, and the ranks register only when all of that held on
        every rank; a refusal raises on every worker, naming the rank it came from, and leaves
        nothing registered, so the trainer may initialise again."""
        if not init_info.checkpoint and not init_info.lora:
            raise ValueError("shardcast: init_info.checkpoint is empty (name -> [shape, dtype] of every tensor), "
                             "and it names no LoRA adapter (lora)")
        if self.registration is not None or self.adapters:
            raise RuntimeError(f'shardcast: this worker already registered group "{self.group}"')
        replica = self._replica(init_info)
        ranks = _model_ranks()
        if init_info.lora and ranks.outer.world_size > 1:
            raise ValueError(f"shardcast: LoRA adapters into a vLLM of {ranks.outer.world_size} pipeline stages: each "
                             "rank holds every adapter whole, and a stage's LoRA layers take only its own layers' "
                             "parts (not built); serve adapters at pipeline_parallel_size=1")
        if init_info.checkpoint:
            self._init_weights(init_info, replica, ranks)
        if init_info.lora:
            try:
                self._init_adapters(init_info, replica, ranks)
            except BaseException:
                self.shutdown()  # the base weights' registration too: all or nothing
                raise

    def _init_weights(self, init_info: ShardcastInitInfo, replica: int, ranks: GridRanks) -> None:
        """Registers the base weights' destination rank (see init_transfer_engine)."""
        shapes = {name: tuple(int(s) for s in spec[0]) for name, spec in init_info.checkpoint.items()}
        announced = {name: str(spec[1]).replace("torch.", "") for name, spec in init_info.checkpoint.items()}
        mine: Dict[str, Any] = {}
        try:
            everyone = ranks.step("matching the checkpoint against vLLM's loaders",
                                  lambda: self._prepare(init_info, shapes, announced, mine))
            dtypes: Dict[str, str] = {}
            fp8: Dict[str, List[int]] = {}
            for r in everyone:
                dtypes.update(r["dtypes"])
                fp8.update(r["fp8"])
            # Deterministic from what every rank gathered: it holds (or raises) on every rank alike.
            scales = fp8_scales(shapes, fp8)
            check_coverage({**shapes, **scales}, [r["held"] for r in everyone])
            checkpoint = {name: (shapes[name], getattr(torch, dtypes.get(name, announced[name])))
                          for name in init_info.checkpoint}
            checkpoint.update({name: (shape, torch.float32) for name, shape in scales.items()})
            group = init_info.group if replica < 0 else replica_group(init_info.group, replica)
            layout = destination_layout(group, [r["node"] for r in everyone], [r["pieces"] for r in everyone],
                                        checkpoint, fp8=fp8)
            if replica >= 0:
                layout.update(replica_set=init_info.group, replica=replica)
            where = f'rank {ranks.rank} of group "{group}"{ranks.where} on node "{mine["node"]}"'

            def register() -> None:
                mine["registration"] = mine["client"].register(group, ranks.rank, ranks.world,
                                                               mine["memory"].tensors, layout)

            ranks.step(f'registering group "{group}"', register)
        except BaseException:
            _release(mine)  # registered here but not everywhere, or not at all: nothing is left behind
            raise
        self.client, self.memory, self.registration = mine["client"], mine["memory"], mine["registration"]
        self.group, self.rank, self.where = group, ranks.rank, where
        self.ranks = ranks
        self.replica = replica if replica >= 0 else None

    def _init_adapters(self, init_info: ShardcastInitInfo, replica: int, ranks: GridRanks) -> None:
        """Registers one destination group per LoRA adapter, every rank holding each adapter whole
        (vLLM's LoRA layers cut it per TP rank when it is put into service), after every worker
        checked that vLLM takes each adapter (shardcast.vllm.lora.Installer.check)."""
        import shardcast

        specs = [AdapterSpec.from_json(name, value) for name, value in init_info.lora.items()]
        mine: Dict[str, Any] = {"client": self.client}

        def prepare() -> str:
            if self.runner is None:
                raise RuntimeError("LoRA adapters are put into service by shardcast.vllm.session (the plugin "
                                   "installs it in vLLM's engine core); this call did not come through it")
            installer = Installer(self.runner, self._serving)
            installer.check(specs)
            mine["installer"] = installer
            mine["buffers"] = {s.name: worker_buffers(s) for s in specs}
            if mine["client"] is None:
                mine["client"] = mine["own_client"] = shardcast.Client(init_info.daemon or self.daemon)
            return mine["client"].status().node

        adapters: Dict[str, WorkerAdapter] = {}
        try:
            nodes = ranks.step("checking the LoRA adapters against vLLM's LoRA layers", prepare)

            def register() -> None:
                for spec in specs:
                    replica_set = adapter_group(init_info.group, spec.name)
                    group = replica_set if replica < 0 else replica_group(replica_set, replica)
                    checkpoint = {n: (shape, getattr(torch, dtype.replace("torch.", "")))
                                  for n, (shape, dtype) in spec.tensors.items()}
                    layout = destination_layout(group, nodes, [replicated_pieces(spec)] * len(nodes), checkpoint)
                    if replica >= 0:
                        layout.update(replica_set=replica_set, replica=replica)
                    adapter = WorkerAdapter(spec, group, mine["buffers"][spec.name],
                                            path=adapter_path(init_info.group, spec.name))
                    adapter.registration = mine["client"].register(group, ranks.rank, ranks.world,
                                                                   adapter.buffers, layout)
                    adapters[spec.name] = adapter

            ranks.step("registering the LoRA adapters' groups", register)
        except BaseException:
            for adapter in adapters.values():
                _release({"registration": adapter.registration})
            _release({"client": mine.get("own_client")})
            raise
        self.client, self.installer, self.adapters = mine["client"], mine["installer"], adapters
        self.rank, self.ranks = ranks.rank, ranks
        self.replica = replica if replica >= 0 else None
        if self.registration is None:
            self.group = init_info.group
            self.where = (f'rank {ranks.rank} of the LoRA adapters of "{init_info.group}" on node '
                          f'"{nodes[ranks.rank]}"')
        _log.info("shardcast: %s: LoRA adapter(s) %s registered; each is put into service through vLLM's in-memory "
                  "adapter API (LoRAModel.from_lora_tensors), never loaded from disk", self.where,
                  ", ".join(f"{a.spec.name} (id {a.spec.id})" for a in adapters.values()))

    def _prepare(self, init_info: ShardcastInitInfo, shapes, announced, mine: Dict[str, Any]) -> Dict[str, Any]:
        """This rank's part of init: what vLLM's loaders do with the announced checkpoint, refused
        where they do not take it whole and exactly (shardcast.vllm.layout), and this rank's
        memory and node. Fills `mine` (memory, client, node) as it goes, for the caller to release."""
        import shardcast

        maps = probe(self.model, shapes)
        modules = dict(self.model.named_modules())
        fp8 = fp8_blocks(maps, modules)
        if fp8:
            # vLLM serves these in block-quantised fp8: probe again with their scale tensors, as
            # vLLM's fp8 checkpoint names them, to find where each rank's scales land.
            maps = probe(self.model, {**shapes, **fp8_scales(shapes, fp8)})
        left = unreached(self.model, maps)
        if left:
            raise ProbeError(f"vLLM's parameter(s) {', '.join(map(repr, left[:8]))}"
                             f"{f' and {len(left) - 8} more' if len(left) > 8 else ''}: no announced checkpoint "
                             "tensor lands in them, so they would keep their weights through every update")
        check_dtypes(maps, announced, fp8)
        mine["memory"] = rank_memory(maps, dict(self.model.named_parameters(remove_duplicate=False)),
                                     modules, double_buffer=init_info.double_buffer)
        mine["client"] = shardcast.Client(init_info.daemon or self.daemon)
        mine["node"] = mine["client"].status().node
        return {"node": mine["node"], "pieces": mine["memory"].pieces,
                "held": {l.tensor: (list(l.offsets), list(l.sizes), pm.name) for pm in maps.values()
                         for l in pm.landings},
                "dtypes": {l.tensor: DTYPE_NAMES.get(pm.dtype, str(pm.dtype).replace("torch.", ""))
                           for pm in maps.values() for l in pm.landings},
                "fp8": fp8}

    def _replica(self, init_info: ShardcastInitInfo) -> int:
        """This engine's replica id in the set `init_info.group`, or -1 (no set)."""
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
        return replica

    def start_weight_update(self) -> None:
        if self.registration is None and not self.adapters:
            raise RuntimeError("shardcast: start_weight_update before init_transfer_engine")
        self.base_received = False
        for adapter in self.adapters.values():
            adapter.received = 0

    def _targets(self, update_info: ShardcastUpdateInfo) -> List[Tuple[Optional[WorkerAdapter], str, str, int]]:
        """What this update carries: (adapter or None for the base weights, the group, the source
        group a replica catches up from, the version)."""
        out: List[Tuple[Optional[WorkerAdapter], str, str, int]] = []
        names = update_info.adapters
        if names is None and self.registration is not None:
            out.append((None, self.group, update_info.source, update_info.version))
        if names is None:
            names = sorted(self.adapters)
        versions = dict(names) if isinstance(names, dict) else {n: update_info.version for n in names}
        unknown = [n for n in versions if n not in self.adapters]
        if unknown:
            raise ValueError(f"shardcast: the update names LoRA adapter(s) {unknown}; this worker registered "
                             f"{sorted(self.adapters) or 'none'}")
        for name, version in versions.items():
            if not isinstance(version, int) or version <= 0:
                raise ValueError(f"shardcast: the update's version of LoRA adapter {name!r} is {version!r}, not a "
                                 "version >= 1")
            adapter = self.adapters[name]
            source = adapter_group(update_info.source, name) if update_info.source else ""
            out.append((adapter, adapter.group, source, version))
        if not out:
            raise ValueError("shardcast: the update names no LoRA adapter (adapters=[]) and carries no weights")
        return out

    def receive_weights(self, update_info: ShardcastUpdateInfo) -> None:
        if self.registration is None and not self.adapters:
            raise RuntimeError("shardcast: update_weights before init_transfer_engine")
        if update_info.version <= 0:
            raise ValueError(f"shardcast: update_info.version must be a version >= 1, not {update_info.version}")
        ranks = self.ranks
        targets = self._targets(update_info)
        error: Optional[BaseException] = None
        failed_group = ""
        failed = False
        for adapter, group, source, version in targets:
            if self.replica is not None and source:
                error = self._catch_up(ranks, group, source, version, update_info.timeout_s)
            if error is None:
                try:
                    self.client.wait_version(group, version, timeout=update_info.timeout_s)
                except Exception as e:  # the daemon's error (a dirty rank, a timeout) or its absence, with the rank
                    error = e
            if error is not None:
                failed_group = group
            # All ranks or none, target by target: every rank takes the same steps (a catch-up's
            # are collective), so all stop at the first target any rank failed. And vLLM ends the
            # update session only on a worker whose update_weights raises: a rank that got the
            # version while another did not must raise too, or its session stays open and the
            # next start_weight_update fails there.
            failed = ranks.any(error is not None)
            if failed:
                break
        what = self.where if failed_group == self.group else f'{self.where}, group "{failed_group}"'
        if error is not None:
            raise RuntimeError(f"shardcast: {what} did not receive version {update_info.version}: "
                               f"{error}") from error
        if failed:
            raise RuntimeError(f"shardcast: {self.where} holds version {update_info.version}, but another rank "
                               "of the group did not receive it (its worker names it); the update is not applied")
        for adapter, _, _, version in targets:
            if adapter is None:
                self.base_received = True
            else:
                adapter.received = version

    def _catch_up(self, ranks: GridRanks, group: str, source: str, version: int,
                  timeout_s: float) -> Optional[BaseException]:
        """A replica whose ranks do not all hold the version once the sync has ended catches up to
        it: rank 0 of the replica asks its daemon (the bytes come from a replica that holds the
        version, else from `source`), the other ranks wait for it. Returns this rank's error, if
        any; every rank takes the same steps, so none is left in a collective."""
        error: Optional[BaseException] = None
        try:
            behind = not any(r.rank == self.rank and r.state == service_pb2.RANK_READY and r.version >= version
                             for r in self.client.ranks(group))
        except Exception as e:  # the daemon's absence: wait_version is not tried either
            error, behind = e, True
        if not ranks.any(behind):
            return error
        if self.rank == 0 and error is None:
            try:
                resp = self.client.catch_up(group, source, version, timeout=timeout_s)
                self.seeded_from = resp.seeded_from
            except Exception as e:
                error = e
        if ranks.any(error is not None) and error is None:
            error = RuntimeError(f"the catch-up of replica group \"{group}\" to version {version} failed "
                                 "(the worker of the rank that failed names why)")
        return error

    def finish_weight_update(self) -> None:
        """Puts the landed bytes into service. Does not raise once it starts: vLLM's worker closes
        its update session only when this returns, and a session left open refuses every later
        update. A failure is kept in `finished` (error text; "" when it went through) for
        shardcast.vllm.session, which reports it as this worker's status. LoRA adapters received
        are taken out of their buffers here and put into service by `after_finish`."""
        if self.memory is None and not self.adapters:
            raise RuntimeError("shardcast: finish_weight_update before init_transfer_engine")
        try:
            if self.memory is not None and self.base_received:
                self.memory.flip()
                process_staged(self.model, self.memory.reprocess)
            for adapter in self.adapters.values():
                if adapter.received:
                    adapter.take()
            self.finished = ""
        except Exception as e:  # the live weights may be part new, part old: said, not hidden
            self.finished = (f"shardcast: {self.where}: putting the update into service failed, its weights may be "
                             f"part old, part new until the next update: {type(e).__name__}: {e}")
        self.base_received = False

    def _serving(self, path: str) -> Optional[Tuple[AdapterSpec, Dict[str, torch.Tensor]]]:
        """The adapter a `shardcast://` path names and the tensors of its version in service, None
        when none is (shardcast.vllm.lora.Installer answers vLLM's load of the path with it)."""
        for adapter in self.adapters.values():
            if adapter.path == path and adapter.serving:
                return adapter.spec, adapter.committed
        return None

    def after_finish(self) -> Optional[str]:
        """After vLLM's finish_weight_update, which removes every LoRA adapter (reset_lora_state):
        puts this worker's adapters back into vLLM's adapter cache, each at the version it serves
        (one vLLM drops or evicts later is built again from that version when a request names it).
        Returns why one could not be, else None. Runs between two engine steps
        (shardcast.vllm.session)."""
        if self.installer is None:
            return None
        errors = []
        for adapter in self.adapters.values():
            if not adapter.serving:
                continue  # no version yet: a request naming it is refused (no such adapter)
            try:
                self.installer.install(adapter.spec, adapter.committed, adapter.path)
            except Exception as e:
                errors.append(f"LoRA adapter {adapter.spec.name!r} (id {adapter.spec.id}, version {adapter.serving}) "
                              f"could not be put back into service: {type(e).__name__}: {e}")
        return "; ".join(errors) or None

    def shutdown(self) -> None:
        registration = self.registration
        for adapter in self.adapters.values():
            _release({"registration": adapter.registration})
            adapter.registration = None
            if self.installer is not None:  # no longer served: a later engine may register the id again
                try:
                    self.installer.remove(adapter.spec, adapter.path)
                except Exception as e:
                    _log.warning("shardcast: removing LoRA adapter %r from vLLM failed: %s", adapter.spec.name, e)
        self.adapters = {}
        _release({"registration": registration, "client": self.client})
        self.registration = self.client = None


def _release(held: Dict[str, Any]) -> None:
    """Unregisters and closes what `held` has of a registration and a client; an error doing so is
    logged (the daemon may be gone), not raised over the one that got here."""
    registration, client = held.get("registration"), held.get("client")
    try:
        if registration is not None:
            registration.close()
    except Exception as e:
        _log.warning("shardcast: unregistering %s failed: %s", registration.group, e)
    finally:
        if client is not None:
            client.close()


def _model_ranks() -> GridRanks:
    """The workers that together hold one copy of the model, one destination group: vLLM's
    tensor-parallel ranks of each pipeline stage, stage after stage (rank = stage x TP + TP rank,
    vLLM's own order). vLLM has no process group of exactly them (its world spans data-parallel
    engines too): gathers go through its tensor-parallel group, then its pipeline group."""
    from vllm.distributed import parallel_state

    pcp = getattr(parallel_state, "get_pcp_group", None)
    if pcp is not None and pcp().world_size > 1:
        raise ValueError(f"shardcast: vLLM runs prefill context parallelism ({pcp().world_size} ranks per "
                         "tensor-parallel rank), which this backend does not register (not built)")
    tp, pp = parallel_state.get_tp_group(), parallel_state.get_pp_group()
    where = f" (pipeline stage {pp.rank_in_group}, TP rank {tp.rank_in_group})" if pp.world_size > 1 else ""
    return GridRanks(tp, pp, where=where, who="worker", positions=("pipeline stage", "TP rank"))


__all__ = ["ShardcastInitInfo", "ShardcastUpdateInfo", "ShardcastWeightTransferEngine", "ProbeError"]
