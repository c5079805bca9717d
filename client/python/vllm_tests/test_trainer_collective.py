"""The trainer engine's exchanges between trainer ranks are all ranks or none: a step that raises on
one rank raises on every rank, naming it (a rank that raised alone would leave the others waiting in
the next collective for good), and a step that works everywhere gathers every rank's result. So is
trainer_init: vLLM refusing the checkpoint raises on every rank and leaves nothing registered."""

from __future__ import annotations

import torch.multiprocessing as mp


def _rank(rank: int, port: int, results) -> None:
    from shardcast.local import join_process_group
    from shardcast.vllm.trainer import _Collective

    join_process_group(port, rank, 2)
    collective = _Collective()
    out = {"gathered": collective.gather("saying hello", lambda: f"hello from {rank}")}

    def fails_on_rank_1():
        if rank == 1:
            raise ValueError("its daemon refused the registration")
        return rank

    try:
        collective.gather("registering", fails_on_rank_1)
        out["error"] = None
    except RuntimeError as e:
        out["error"] = str(e)
    # Still in step: the next exchange works on both ranks.
    out["after"] = collective.gather("going on", lambda: rank)
    results.put((rank, out))


def test_a_step_failing_on_one_rank_raises_on_every_rank():
    from shardcast.local import TorchRendezvous

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = TorchRendezvous()
    procs = [ctx.Process(target=_rank, args=(r, rendezvous.port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank in (0, 1):
        assert got[rank]["gathered"] == ["hello from 0", "hello from 1"]
        assert got[rank]["error"] == ("shardcast: registering failed on trainer rank(s) 1: ValueError: its daemon "
                                      "refused the registration")
        assert got[rank]["after"] == [0, 1]


class _Daemon:
    """Stands in for a worker's daemon client: every rank holds every version already (no
    catch-up is needed), and the base weights' version never reaches rank 1."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def ranks(self, group: str) -> list:
        from types import SimpleNamespace

        from shardcast.v1 import service_pb2

        return [SimpleNamespace(rank=r, state=service_pb2.RANK_READY, version=99) for r in range(2)]

    def wait_version(self, group: str, version: int, timeout: float) -> None:
        if self.rank == 1 and ".lora." not in group:
            raise TimeoutError(f"version {version} did not reach {group!r} rank 1")


def _replica_worker(rank: int, port: int, results) -> None:
    """One of two TP workers of a replica holding base weights and a LoRA adapter: an update of
    both, with its source (so each target starts with the catch-up's collective check), whose
    base weights fail on rank 1 only."""
    from types import SimpleNamespace

    from shardcast.local import join_process_group
    from shardcast.parallel import GridRanks
    from shardcast.vllm.engine import ShardcastUpdateInfo, ShardcastWeightTransferEngine

    join_process_group(port, rank, 2)
    engine = object.__new__(ShardcastWeightTransferEngine)  # no vLLM engine: only what receive_weights reads
    engine.registration, engine.client, engine.group, engine.rank = object(), _Daemon(rank), "vllm.r0", rank
    engine.replica, engine.where, engine.base_received = 0, f'rank {rank} of group "vllm.r0"', False
    engine.adapters = {"a": SimpleNamespace(group="vllm.lora.a.r0", received=0)}
    engine.ranks = GridRanks(SimpleNamespace(cpu_group=None, world_size=2, rank_in_group=rank),
                             SimpleNamespace(cpu_group=None, world_size=1, rank_in_group=0), who="worker")
    try:
        engine.receive_weights(ShardcastUpdateInfo(version=7, source="trainer", timeout_s=5))
        results.put((rank, None))
    except RuntimeError as e:
        results.put((rank, str(e)))


def test_an_update_failing_on_one_rank_before_its_last_target_raises_on_every_rank():
    # Found in review: a rank whose base weights failed stopped there, while the other went on to
    # the adapter's catch-up check (a collective) and waited in it for good (here, where the
    # failed rank's process then exits, gloo's "Connection closed by peer" ends the wait). Every
    # rank now stops at the first target any rank failed.
    import shardcast.vllm.engine  # noqa: F401  (imported once here: the forked workers start at once)
    from shardcast.local import TorchRendezvous

    ctx = mp.get_context("fork")
    results = ctx.Queue()
    rendezvous = TorchRendezvous()
    procs = [ctx.Process(target=_replica_worker, args=(r, rendezvous.port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=90) for _ in procs)  # a rank left in a collective never answers
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert "did not receive version 7" in got[1] and "did not reach 'vllm.r0' rank 1" in got[1], got
    assert "another rank of the group did not receive it" in got[0], got


class Refusing:
    """Stands in for vLLM's weight-sync client on the sender: refuses the first init, as vLLM's
    workers refuse a checkpoint that does not fit their loaders, and takes the second."""

    def __init__(self) -> None:
        self.inits = 0

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.inits += 1
        if self.inits == 1:
            raise RuntimeError("vLLM refuses checkpoint tensor 'w'")


def _trainer_init_rank(rank: int, port: int, target: str, results) -> None:
    import torch
    from torch.distributed.fsdp import fully_shard
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import shardcast
    from shardcast.local import join_process_group
    from shardcast.vllm.trainer import ShardcastTrainerInitInfo

    join_process_group(port, rank, 2)
    model = torch.nn.Linear(8, 8)
    fully_shard(model, mesh=torch.distributed.device_mesh.init_device_mesh("cpu", (2,)))
    client = Refusing() if rank == 0 else None
    out = {}

    def init():
        return WeightTransferTrainerFactory.trainer_init(ShardcastTrainerInitInfo(rank=rank, daemon=target),
                                                         client=client, source=ModuleSource(model))

    def groups():
        with shardcast.Client(target) as c:
            return {g.group: sorted(g.ranks) for g in c.status().groups}

    try:
        init()
        out["refused"] = None
    except RuntimeError as e:
        out["refused"] = str(e)
    torch.distributed.barrier()
    out["after_refusal"] = groups()
    torch.distributed.barrier()
    engine = init()  # nothing was left registered: the same ranks register again
    torch.distributed.barrier()
    out["after_init"] = groups()
    torch.distributed.barrier()  # both ranks looked before either unregisters
    engine.shutdown()
    results.put((rank, out))


def _two_trainer_ranks(target, timeout: float = 120) -> dict:
    """Runs `target(rank, port, daemon, results)` in two spawned trainer processes beside one
    daemon (its log at info: sessions, registrations and unregistrations are in a failure's
    report); returns {rank: what it put}."""
    from shardcast.local import LocalCluster, TorchRendezvous

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = TorchRendezvous()
    with LocalCluster(["n0"], extra=["--log-level", "info"]) as cluster:
        procs = [ctx.Process(target=target, args=(r, rendezvous.port, cluster.target("n0"), results)) for r in range(2)]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=timeout) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    return got


def test_a_trainer_init_vllm_refuses_raises_on_every_rank_and_leaves_nothing_registered():
    got = _two_trainer_ranks(_trainer_init_rank)
    for rank in (0, 1):
        assert got[rank]["refused"] == ("shardcast: initialising the weight transfer of 'vllm' failed on trainer "
                                        "rank(s) 0: RuntimeError: vLLM refuses checkpoint tensor 'w'"), got[rank]
        assert got[rank]["after_refusal"] == {}, rank
        assert got[rank]["after_init"] == {"trainer": [0, 1]}, rank


class Server:
    """Stands in for one inference server, with vLLM's session rules: a start while an update is
    active is refused, an update of a version the workers do not hold raises and ends the session,
    and a finish needs one open."""

    def __init__(self) -> None:
        self.calls: list = []
        self.session = False

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.calls.append("init")

    def start_weight_update(self) -> None:
        if self.session:
            raise RuntimeError("start_weight_update called while a weight update is already active")
        self.calls.append("start")
        self.session = True

    def update_weights(self, update_info: dict) -> None:
        self.calls.append(f"update {update_info['version']}")
        self.session = False  # this server's workers hold no version
        raise RuntimeError(f"rank 0 did not receive version {update_info['version']}")

    def finish_weight_update(self, weight_version=None) -> None:
        if not self.session:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update")
        self.session = False


def test_a_replica_whose_catch_up_fails_is_named_and_its_update_session_ends():
    # add_replica opens the new server's update session before the catch-up: a catch-up that fails
    # must end it (an update of the version, which raises on the workers), or the server refuses
    # every later update ("already active").
    import torch
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from shardcast.local import LocalCluster
    from shardcast.vllm.clients import ReplicaClients
    from shardcast.vllm.trainer import ShardcastTrainerInitInfo

    with LocalCluster(["n0"]) as cluster:
        engine = WeightTransferTrainerFactory.trainer_init(
            ShardcastTrainerInitInfo(rank=0, daemon=cluster.target("n0"), timeout_s=5),
            client=ReplicaClients([Server()]), source=ModuleSource(torch.nn.Linear(8, 8)))
        try:
            engine.version = 1  # as after a send_weights: no replica holds it, so no catch-up can
            joining = Server()
            try:
                engine.add_replica(joining)
                error = ""
            except RuntimeError as e:
                error = str(e)
            assert error.startswith("shardcast: replica 1 of 'vllm' joined but did not catch up to version 1: "), error
            assert "vLLM: rank 0 did not receive version 1" in error, error
            assert joining.calls == ["init", "start", "update 1"] and not joining.session
            joining.start_weight_update()  # the next update can start
        finally:
            engine.shutdown()


class LostReply(Server):
    """The update goes through on the server (the workers hold the version, the session stays
    open), but its reply is lost: the call raises here."""

    def update_weights(self, update_info: dict) -> None:
        self.calls.append(f"update {update_info['version']}")
        raise TimeoutError("the reply was lost")

    def finish_weight_update(self, weight_version=None) -> None:
        super().finish_weight_update(weight_version)
        self.calls.append(f"finish {weight_version}")


def test_an_update_whose_reply_is_lost_is_finished_and_one_refused_ends_the_session():
    from shardcast.vllm.trainer import _update_and_finish

    lost = LostReply()
    lost.start_weight_update()
    assert _update_and_finish(lost, {"version": 3}, 3) is None  # it went through: finished
    assert lost.calls == ["start", "update 3", "finish 3"] and not lost.session
    refused = Server()
    refused.start_weight_update()
    error = _update_and_finish(refused, {"version": 3}, 3)
    assert "rank 0 did not receive version 3" in str(error)  # the update's error, not the finish's
    assert not refused.session
    refused.start_weight_update()  # the next update can start


def test_a_parameter_trained_with_an_adapter_but_no_lora_matrix_is_refused_by_name():
    # PEFT's trainable tokens (or any adapter parameter vLLM does not load as a LoRA matrix) would be
    # left behind silently: vLLM would serve the adapter without it.
    import torch

    from shardcast.vllm.trainer import _adapter_entries

    class Peft(torch.nn.Module):
        def __init__(self, extra: bool) -> None:
            super().__init__()
            self.frozen = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
            if extra:
                self.trainable_tokens_delta = torch.nn.ParameterDict({"policy": torch.nn.Parameter(torch.zeros(3))})

    class Model(torch.nn.Module):
        def __init__(self, extra: bool) -> None:
            super().__init__()
            self.q_proj = torch.nn.Module()
            self.q_proj.lora_A = torch.nn.ModuleDict({"policy": torch.nn.Linear(4, 2, bias=False)})
            self.embed = Peft(extra)

    names = [e.name for e in _adapter_entries(Model(False), "policy")]
    assert names == ["q_proj.lora_A.weight"]
    try:
        _adapter_entries(Model(True), "policy")
        error = ""
    except ValueError as e:
        error = str(e)
    assert "'embed.trainable_tokens_delta.policy' belongs to LoRA adapter 'policy'" in error, error


class Accepting:
    """Stands in for vLLM's weight-sync client on the sender: takes the checkpoint announced."""

    def __init__(self) -> None:
        self.announced = None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.announced = init_info


def _publish_and_sync_whole(engine, rank: int, vllm: "Accepting", target: str, out: dict) -> None:
    """Publishes version 1 on this trainer rank; rank 0 then syncs it into a group "dst" of one rank
    holding every checkpoint tensor announced to `vllm` whole, and puts what it announced, the
    trainer group's ranks and what landed into `out`. Both ranks then shut their engine down."""
    import numpy as np
    import torch

    import shardcast

    registration = engine.registrations[""]
    registration.acquire()
    registration.publish(1)
    torch.distributed.barrier()
    if rank == 0:
        announced = vllm.announced["checkpoint"]
        out["announced"] = sorted(announced)
        dst = {n: np.zeros(shape, np.float32) for n, (shape, _) in announced.items()}
        layout = {"group": "dst", "mesh": {"shape": [1]}, "nodes": ["n0"],
                  "tensors": [{"name": n, "shape": shape, "dtype": dtype} for n, (shape, dtype) in announced.items()]}
        with shardcast.Client(target) as c:
            out["trainer_ranks"] = sorted(r.rank for r in c.ranks("trainer"))
            reg = c.register("dst", 0, 1, dst, layout, role="destination")
            c.sync("trainer", "dst", 1, verify=True, timeout=60)
            out["synced"] = {n: np.array(t, copy=True) for n, t in reg.tensors.items()}
            reg.close()
    torch.distributed.barrier()
    engine.shutdown()


def _pipeline_stage_rank(rank: int, port: int, target: str, results) -> None:
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.core_model_loading import revert_weight_conversion
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from shardcast.local import join_process_group
    from shardcast.vllm.trainer import ShardcastTrainerInitInfo

    join_process_group(port, rank, 2)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)  # the same model on both ranks; each keeps its stage's layers, names unchanged
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False))
    if rank == 0:  # the embedding and layer 0
        model.model.layers[1], model.model.norm, model.lm_head = torch.nn.Module(), torch.nn.Identity(), None
    else:  # layer 1, the final norm and the head
        model.model.layers[0], model.model.embed_tokens = torch.nn.Module(), None
    model.lm_head = model.lm_head or torch.nn.Identity()
    model.model.embed_tokens = model.model.embed_tokens or torch.nn.Identity()
    fully_shard(model.model.layers[rank], mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    client = Accepting() if rank == 0 else None
    engine = WeightTransferTrainerFactory.trainer_init(ShardcastTrainerInitInfo(rank=rank, daemon=target),
                                                       client=client, source=ModuleSource(model))
    # This stage's checkpoint tensors as save_pretrained writes them: each expert its own tensors.
    state = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    out = {"checkpoint": {n: t.numpy().copy() for n, t in revert_weight_conversion(model, state).items()}}
    _publish_and_sync_whole(engine, rank, client, target, out)
    results.put((rank, out))


def test_pipeline_stages_each_registering_their_own_layers_sync_every_checkpoint_tensor():
    # Each trainer rank is a pipeline stage of a ("pp", "dp") mesh holding its own layers of a
    # Qwen3-MoE under FSDP2, their experts fused ([E, 2I, H]) as transformers keeps them:
    # trainer_init gathers every rank's tensors and expert pieces into the group's layout.
    got = _two_trainer_ranks(_pipeline_stage_rank, timeout=180)
    expected = {**got[0]["checkpoint"], **got[1]["checkpoint"]}
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in got[1]["checkpoint"]  # stage 1's experts, split
    assert got[0]["announced"] == sorted(expected)
    assert set(got[0]["synced"]) == set(expected)
    wrong = [n for n, e in expected.items() if not (got[0]["synced"][n] == e).all()]
    assert not wrong, wrong


def _data_parallel_rank(rank: int, port: int, target: str, results) -> None:
    import torch
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from shardcast.local import join_process_group
    from shardcast.vllm.trainer import ShardcastTrainerInitInfo

    join_process_group(port, rank, 2)
    torch.manual_seed(rank)  # DDP broadcasts rank 0's weights when it wraps the model
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    client = Accepting() if rank == 0 else None
    out = {}

    def init(module):
        return WeightTransferTrainerFactory.trainer_init(ShardcastTrainerInitInfo(rank=rank, daemon=target),
                                                         client=client, source=ModuleSource(module))

    try:  # plain tensors on two processes may differ: refused on both
        init(model)
        out["plain"] = None
    except RuntimeError as e:
        out["plain"] = str(e)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    loss = ddp(torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))).square().sum()
    loss.backward()
    torch.optim.SGD(ddp.parameters(), lr=0.1).step()  # each rank's own batch; DDP averages the gradients
    engine = init(ddp)
    out["weights"] = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    _publish_and_sync_whole(engine, rank, client, target, out)
    results.put((rank, out))


def test_ddp_replicas_register_as_every_rank_of_one_group_and_plain_copies_are_refused():
    got = _two_trainer_ranks(_data_parallel_rank)
    for rank in (0, 1):
        assert "2 trainer processes hold plain tensors, neither DTensors nor DistributedDataParallel's replicas" in \
            got[rank]["plain"], got[rank]["plain"]
    assert got[0]["trainer_ranks"] == [0, 1]  # both replicas hold every byte: a sync reads the nearest
    for name, weights in got[0]["weights"].items():
        assert (got[1]["weights"][name] == weights).all(), name  # DDP kept the replicas equal
        assert (got[0]["synced"][name] == weights).all(), name
