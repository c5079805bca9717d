"""Real PyTorch DTensors (torch >= 2.4, gloo on the CPU, one process per trainer rank) synced through
real daemons into vLLM-like inference ranks, every element checked against `full_tensor()` of
every parameter, for two versions (the second after a real AdamW step, which the registered
memory must follow: registration is in place, never a snapshot):

- FSDP2 `fully_shard` over 4 ranks (uneven shards, empty ones included);
- TP with `parallelize_module` (ColwiseParallel / RowwiseParallel) over 2 ranks;
- FSDP2 + TP on a (dp=2, tp=2) mesh (`_StridedShard` placements);
- expert-parallel MoE weights (5 experts over 4 ranks) into expert-stacked, TP-sharded ranks
  (fused w13) and into expert-parallel ranks holding whole experts; the same sharded as torchtitan
  does, the experts on a mesh of their own (explicit pieces for the router's mesh).

Destinations are registered with the named-tensor API (local tensors + a ParallelPlan) on two
nodes, two TP=2 replicas, with fused qkv_proj / gate_up_proj: the transformer's as a replica set
(each replica its own group, ParallelPlan's default), the MoE's as one plain group
(`replica_set=False`: mesh [2, 2], expert pieces naming a rank of each replica)."""

from __future__ import annotations

import multiprocessing as mp
import sys
from typing import Dict, List

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the test venv (scripts/deps.sh) has torch")

import dtensor_worker  # noqa: E402
import shardcast  # noqa: E402
from conftest import ROOT  # noqa: E402
from rank_worker import recv  # noqa: E402
from shardcast.local import LocalCluster, TorchRendezvous  # noqa: E402

sys.path.insert(0, str(ROOT / "client" / "examples" / "rl_loop"))
import model as lm  # noqa: E402

NODES = ["t0", "t1", "i0", "i1"]
INFERENCE_NODES = ["i0", "i0", "i1", "i1"]  # two replicas of TP=2


def test_torch_is_a_real_2x_with_dtensor():
    print(f"torch {torch.__version__}")
    assert int(torch.__version__.split(".")[0]) >= 2
    assert shardcast.dtensor_available() is None, shardcast.dtensor_available()


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(NODES) as c:
        yield c


class Trainers:
    """`world` trainer rank processes of `kind`, ranks 0..world/2-1 on node t0, the rest on t1."""

    def __init__(self, cluster, kind: str, world: int, group: str) -> None:
        # Forked from multiprocessing's fork server, which imports torch once for the session (about
        # 2.5 CPU-seconds each rank paid): each rank is still a process of its own, its process
        # group and gloo state new. The server runs no torch operation before it forks.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
                                    "torch.distributed.device_mesh"])
        self.rendezvous = TorchRendezvous()
        self.procs, self.conns = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            target = cluster.target("t0" if rank < world // 2 else "t1")
            p = ctx.Process(target=dtensor_worker.main, args=(kind, rank, world, self.rendezvous.port, target, group, child))
            p.start()
            self.procs.append(p)
            self.conns.append(parent)

    def registered(self):
        answers = [recv(c, "registered", timeout=180) for c in self.conns]
        return answers[0]  # (full weights, placements) from rank 0

    def step(self) -> Dict[str, np.ndarray]:
        for c in self.conns:
            c.send("step")
        return [recv(c, "stepped", timeout=180) for c in self.conns][0]

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs):
            if p.is_alive():
                c.send("exit")
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def register_destination(cluster, group: str, plans, model, nodes=INFERENCE_NODES):
    """One registration per plan (rank), each on its node's daemon; returns [(plan, tensors, reg)]."""
    out = []
    for plan in plans:
        tensors = {n: torch.zeros(shape, dtype=getattr(torch, dtype))
                   for n, (shape, dtype) in shardcast.local_shapes(plan, model).items()}
        client = shardcast.Client(cluster.target(nodes[plan.rank]))
        reg = client.register_inference(group, tensors, plan, model, nodes=nodes)
        assert reg.tensors == tensors or all(reg.tensors[n] is tensors[n] for n in tensors)
        out.append((plan, tensors, reg, client))
    return out


def wrong_elements(tensors: Dict[str, "torch.Tensor"], expected: Dict[str, "torch.Tensor"]) -> List[str]:
    assert set(tensors) == set(expected)
    bad = []
    for name, t in tensors.items():
        e = expected[name]
        if t.shape != e.shape:
            bad.append(f"{name}: shape {tuple(t.shape)} != {tuple(e.shape)}")
        elif not torch.equal(t, e):
            bad.append(f"{name}: {int((t != e).sum())} of {t.numel()} elements differ")
    return bad


def sync_and_check(cluster, src: str, destinations, version: int, full, expected_of) -> None:
    client = shardcast.Client(cluster.target("t0"))
    for dst, ranks in destinations:
        r = client.sync(src, dst, version, verify=True, wait_for_ranks=True, timeout=120)
        assert r.version == version and r.bytes_needed > 0
        assert all(o.committed for o in r.replicas), r.replicas  # a replica set's: every replica
        for plan, tensors, reg, c in ranks:
            assert c.wait_version(reg.group, version, timeout=30) >= version  # a replica's own group
            bad = wrong_elements(tensors, expected_of(dst, plan, full))
            assert not bad, f"{dst} rank {plan.rank} version {version}: {bad}"
    client.close()


def run_scenario(cluster, kind: str, world: int, destinations_of, expected_of, check_placements=None) -> None:
    src = f"{kind}-trainer"
    trainers = Trainers(cluster, kind, world, src)
    registrations = []
    try:
        full_v1, placements = trainers.registered()
        if check_placements:
            check_placements(placements)
        full_v1 = {n: torch.from_numpy(a) for n, a in full_v1.items()}
        destinations = destinations_of(cluster, kind)
        registrations = [x for _, ranks in destinations for x in ranks]
        sync_and_check(cluster, src, destinations, 1, full_v1, expected_of)
        full_v2 = {n: torch.from_numpy(a) for n, a in trainers.step().items()}
        changed = [n for n in full_v2 if not torch.equal(full_v1[n], full_v2[n])]
        assert len(changed) == len(full_v2), f"the optimizer step left {set(full_v2) - set(changed)} unchanged"
        sync_and_check(cluster, src, destinations, 2, full_v2, expected_of)
    finally:
        for _, _, reg, client in registrations:
            reg.close()
            client.close()
        trainers.close()


# ---- the transformer: FSDP2, TP, FSDP2 + TP -> vLLM-like TP=2 x 2 replicas, fused ----

def lm_destinations(cluster, kind: str):
    meta = lm.meta_model()
    plans = [lm.inference_plan(t, 2, r, 2) for r in range(2) for t in range(2)]
    ranks = register_destination(cluster, f"{kind}-vllm", plans, meta)
    assert [(reg.group, reg.rank) for _, _, reg, _ in ranks] == [
        (f"{kind}-vllm.r{r}", t) for r in range(2) for t in range(2)]  # replica set f"{kind}-vllm"
    return [(f"{kind}-vllm", ranks)]


def lm_expected(dst, plan, full):
    return lm.expected_local(full, plan.tp_rank, plan.tp_size)


@pytest.mark.slow
def test_fsdp2_over_4_ranks_uneven_into_vllm_tp(cluster):
    def placements(p):
        assert p["lm_head.weight"] == "(Shard(dim=0),)"  # 13 rows over 4 ranks: 4, 4, 4, 1
        assert p["value_head.weight"] == "(Shard(dim=0),)"  # 1 row: three ranks hold none
    run_scenario(cluster, "fsdp", 4, lm_destinations, lm_expected, placements)


def test_tp_parallelize_module_over_2_ranks_into_vllm_tp(cluster):
    def placements(p):
        assert p["layers.0.q_proj.weight"] == "(Shard(dim=0),)"
        assert p["layers.0.o_proj.weight"] == "(Shard(dim=1),)"
        assert p["embed.weight"] == "plain"  # left alone by the TP plan: replicated
    run_scenario(cluster, "tp", 2, lm_destinations, lm_expected, placements)


@pytest.mark.slow
def test_fsdp2_and_tp_on_a_2d_mesh_with_strided_shards_into_vllm_tp(cluster):
    def placements(p):
        assert "_StridedShard(dim=0, sf=2)" in p["layers.0.gate_proj.weight"], p["layers.0.gate_proj.weight"]
        assert p["layers.0.down_proj.weight"] == "(Shard(dim=0), Shard(dim=1))"
    run_scenario(cluster, "fsdp+tp", 4, lm_destinations, lm_expected, placements)


# ---- MoE experts, expert-parallel over 4 ranks -> expert-stacked TP=2 (fused w13), and EP=2 ----

def moe_meta():
    E, H, I = dtensor_worker.EXPERTS, dtensor_worker.MOE_HIDDEN, dtensor_worker.MOE_INTER
    return {"router": ((E, H), "float32"), "w1": ((E, I, H), "float32"), "w3": ((E, I, H), "float32"),
            "w2": ((E, H, I), "float32")}


def moe_plan(t: int, r: int, expert_parallel: bool):
    # One plain group of both replicas (the transformer's are a replica set): each expert piece
    # names a rank of each replica, and a sync commits on all four ranks or none.
    if expert_parallel:  # experts [0, 3) on TP rank 0 and [3, 5) on rank 1, whole
        return shardcast.ParallelPlan(tp_size=2, tp_rank=t, replicas=2, replica=r, experts=["w1", "w2", "w3"],
                                      expert_ranges=[(0, 3), (3, 5)], replica_set=False)
    return shardcast.ParallelPlan(tp_size=2, tp_rank=t, replicas=2, replica=r, column=["w1", "w3"], row=["w2"],
                                  fused={"w13": ["w1", "w3"]}, replica_set=False)


def moe_destinations(cluster, kind: str):
    meta = moe_meta()
    out = []
    for ep in (False, True):
        dst = f"moe-{'ep' if ep else 'tp'}-vllm"
        plans = [moe_plan(t, r, ep) for r in range(2) for t in range(2)]
        ranks = register_destination(cluster, dst, plans, meta)
        assert [(reg.group, reg.rank) for _, _, reg, _ in ranks] == [(dst, rank) for rank in range(4)]
        out.append((dst, ranks))
    return out


def moe_expected(dst, plan, full):
    if dst == "moe-ep-vllm":
        start, stop = plan.expert_ranges[plan.tp_rank]
        return {"router": full["router"], **{n: full[n][start:stop] for n in ("w1", "w2", "w3")}}
    t, k = plan.tp_rank, plan.tp_size
    return {"router": full["router"], "w2": full["w2"].chunk(k, dim=2)[t],
            "w13": torch.cat([full["w1"].chunk(k, dim=1)[t], full["w3"].chunk(k, dim=1)[t]], dim=1)}


@pytest.mark.slow
def test_expert_parallel_moe_into_expert_stacked_tp_and_into_ep(cluster):
    def placements(p):
        assert p["w1"] == "(Shard(dim=0),)" and p["router"] == "(Replicate(),)"
    run_scenario(cluster, "ep", 4, moe_destinations, moe_expected, placements)


def on_four_gloo_ranks(target, tag: str) -> list:
    """Runs `target(rank, 4, port, conn)` (a function of dtensor_worker) on 4 gloo ranks, each a
    process of its own, and returns what each sent under `tag`, by rank."""
    ctx = mp.get_context("forkserver")
    rendezvous = TorchRendezvous()
    conns, procs = [], []
    for rank in range(4):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(rank, 4, rendezvous.port, child))
        p.start()
        conns.append(parent)
        procs.append(p)
    try:
        return [recv(c, tag, timeout=180) for c in conns]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def test_the_boxes_a_rank_holds_are_its_local_tensor_under_every_placement_pair():
    # The layout's pieces for a mesh of a tensor's own come from shardcast.layout's reading of
    # DTensor's placements: checked here against torch's own, on 4 gloo ranks.
    for rank, (cases, not_boxes, wrong) in enumerate(on_four_gloo_ranks(dtensor_worker.check_boxes, "checked")):
        assert not wrong, f"rank {rank}: {wrong}"
        assert cases == 4 * (5 + 25 + 25) and not_boxes < cases // 4, (cases, not_boxes)


def test_ranks_of_a_tp_by_pp_grid_gather_through_both_groups_in_vllms_rank_order():
    # A vLLM engine of TP=2 x 2 pipeline stages has no process group of exactly its 4 workers:
    # shardcast.parallel.GridRanks gathers through the TP group, then the pipeline group. Every
    # rank gets every value in vLLM's rank order (stage x TP + TP rank), a step failing on one
    # rank raises on all naming it (and the next step still works), `any` reaches every rank.
    for rank, got in enumerate(on_four_gloo_ranks(dtensor_worker.check_grid, "grid")):
        assert (got["rank"], got["world"]) == (rank, 4)
        assert got["gathered"] == ["r0", "r1", "r2", "r3"], got
        assert got["step"] == ("shardcast: a step failed on worker(s) 2 (pipeline stage 1, TP rank 0): "
                               "ValueError: rank 2's own error"), got
        assert got["step_after"] == [0, 10, 20, 30]
        assert got["any_3"] is True and got["any_none"] is False


@pytest.mark.slow
def test_torchtitan_experts_on_a_mesh_of_their_own_into_expert_stacked_tp_and_into_ep(cluster):
    # The router on ("fsdp",), the experts on ("efsdp", "ep"): two meshes over the same 4 ranks,
    # neither a submesh of the other. The experts' mesh holds more tensors: it is the group's, and
    # the router's row shards become explicit pieces.
    def placements(p):
        assert p["w1"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", p["w1"]
        assert p["router"] == "(Shard(dim=0),)", p["router"]
    run_scenario(cluster, "titan-ep", 4, moe_destinations, moe_expected, placements)


@pytest.mark.slow
def test_pipeline_stages_each_holding_some_tensors_into_expert_stacked_tp_and_into_ep(cluster):
    # Two stages of a ("pp", "dp") mesh, each rank registering only its stage's parameters (FSDP2
    # on its slice of "dp"): the group's layout gathers every rank's tensors as explicit pieces.
    def placements(p):
        assert p == {"router": "(Shard(dim=0),)", "w1": "(Shard(dim=0),)"}, p  # rank 0: stage 0's only
    run_scenario(cluster, "pp", 4, moe_destinations, moe_expected, placements)


# ---- FSDP2 shards that cut fp8 blocks -> block-scaled fp8 ranks ----

@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 6])
def test_fsdp2_shards_that_cut_fp8_blocks_sync_into_block_scaled_fp8(cluster, world):
    """A 1000-row bfloat16 weight under FSDP2 at world 3 (334-row shards) or 6 (167): blocks of
    128 rows lie on two ranks, across the two trainer nodes too, and the large weights of some
    blocks sit on one of their ranks only. Every fp8 byte and scale of both TP=2 ranks is torch's
    reference on the full tensor, for two versions (the second after an AdamW step)."""
    from shardcast.fp8 import block_quantize

    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    rows, cols = dtensor_worker.FP8_ROWS, dtensor_worker.FP8_COLS
    src, dst = f"fp8-{world}-trainer", f"fp8-{world}-vllm"
    layout = {"group": dst, "mesh": {"shape": [2]}, "nodes": ["i0", "i1"], "tensors": [
        {"name": "w", "shape": [rows, cols], "dtype": "float8_e4m3fn", "placements": [{"shard": {"dim": 1}}],
         "block_scale": {"scale": "w_scale_inv"}}]}
    half = cols // 2  # 160 columns: rank 0 holds blocks 0-1 of each row, rank 1 blocks 1-2
    trainers = Trainers(cluster, "fp8", world, src)
    ranks = []
    try:
        full, placements = trainers.registered()
        assert placements["w"] == "(Shard(dim=0),)"
        shard = -(-rows // world)
        assert shard % 128 != 0  # torch.chunk's shards cut blocks
        for r, node in enumerate(["i0", "i1"]):
            client = shardcast.Client(cluster.target(node))
            tensors = {"w": torch.zeros(rows, half, dtype=torch.float8_e4m3fn), "w_scale_inv": torch.zeros(8, 2)}
            ranks.append((client.register(dst, r, 2, tensors, layout), client))
        caller = shardcast.Client(cluster.target("t0"))
        for version in (1, 2):
            if version == 2:
                full = trainers.step()
            q, scales = block_quantize(torch.from_numpy(full["w"]).to(torch.bfloat16), (128, 128))
            caller.sync(src, dst, version, verify=True, wait_for_ranks=True, timeout=120)
            for r, (reg, client) in enumerate(ranks):
                assert client.wait_version(dst, version, timeout=30) >= version
                want = q[:, r * half:(r + 1) * half].view(torch.uint8)
                got = reg.tensors["w"].view(torch.uint8)
                assert torch.equal(got, want), f"version {version} rank {r}: {int((got != want).sum())} fp8 bytes differ"
                first, last = (r * half) // 128, -(-((r + 1) * half) // 128)
                assert torch.equal(reg.tensors["w_scale_inv"].view(torch.int32),
                                   scales[:, first:last].contiguous().view(torch.int32)), \
                    f"version {version} rank {r}: scales differ"
        caller.close()
    finally:
        for reg, client in ranks:
            reg.close()
            client.close()
        trainers.close()


# ---- the named-tensor API refuses what does not fit, naming it ----

def test_inference_registration_checks_local_tensors_against_the_plan():
    meta = lm.meta_model()
    plan = lm.inference_plan(1, 2, 0, 1)
    good = {n: torch.zeros(s, dtype=getattr(torch, d)) for n, (s, d) in shardcast.local_shapes(plan, meta).items()}
    assert tuple(good["layers.0.qkv_proj.weight"].shape) == (12 + 6 + 6, 24)  # q/2 + k/2 + v/2 rows
    assert tuple(good["layers.0.o_proj.weight"].shape) == (24, 12)
    from shardcast.parallel import check_local_tensors

    check_local_tensors(plan, meta, good)
    wrong = dict(good, **{"layers.0.qkv_proj.weight": torch.zeros(23, 24)})
    with pytest.raises(ValueError, match=r'"layers.0.qkv_proj.weight" is \[23, 24\] float32, the plan gives '
                                         r"tp_rank 1 \[24, 24\] float32"):
        check_local_tensors(plan, meta, wrong)
    with pytest.raises(ValueError, match='"layers.1.down_proj.weight" is missing'):
        check_local_tensors(plan, meta, {n: t for n, t in good.items() if n != "layers.1.down_proj.weight"})
    with pytest.raises(ValueError, match='"layers.0.q_proj.weight" is not a tensor or fused buffer'):
        check_local_tensors(plan, meta, dict(good, **{"layers.0.q_proj.weight": torch.zeros(12, 24)}))
    half = dict(good, **{"norm": torch.zeros(24, dtype=torch.float16)})
    with pytest.raises(ValueError, match='"norm" is \\[24\\] float16'):
        check_local_tensors(plan, meta, half)
    with pytest.raises(ValueError, match="tp_rank 2 is not in"):
        shardcast.ParallelPlan(tp_size=2, tp_rank=2)
    with pytest.raises(ValueError, match="nodes"):
        shardcast.inference_layout("g", plan, meta)
