"""One trainer rank of the real-DTensor tests, in its own process: torch.distributed over gloo on
the CPU, the example transformer sharded with FSDP2 / TP / both (or MoE experts sharded over an
expert-parallel mesh), real AdamW steps, its parameters registered in place with its node's
daemon through the named-tensor API. Talks to the test over a pipe; rank 0 sends the full weights
(`full_tensor()` of every parameter) after every step."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "client" / "examples" / "rl_loop"))

# MoE sizes: 5 experts over 4 ranks is uneven (2, 2, 1, 0: the last rank holds none).
EXPERTS, MOE_HIDDEN, MOE_INTER = 5, 8, 6


def fully_shard():
    """FSDP2's fully_shard, wherever this torch keeps it."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.4, 2.5
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def build_moe_weights():
    import torch

    g = torch.Generator().manual_seed(7)
    return {"router": torch.randn(EXPERTS, MOE_HIDDEN, generator=g),
            "w1": torch.randn(EXPERTS, MOE_INTER, MOE_HIDDEN, generator=g),
            "w3": torch.randn(EXPERTS, MOE_INTER, MOE_HIDDEN, generator=g),
            "w2": torch.randn(EXPERTS, MOE_HIDDEN, MOE_INTER, generator=g)}


def build_moe(mesh):
    import torch.nn as nn
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = build_moe_weights()
    module = nn.Module()
    for name, t in full.items():
        placement = [Replicate()] if name == "router" else [Shard(0)]
        module.register_parameter(name, nn.Parameter(distribute_tensor(t, mesh, placement)))
    return module


def titan_meshes(world: int):
    """torchtitan's two views of one world: the dense parameters' ("fsdp",) and the experts'
    ("efsdp", "ep"), unflattened from a 1-D world mesh (two meshes on torch without _unflatten)."""
    from torch.distributed.device_mesh import init_device_mesh

    ep = 2
    world_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("world",))
    if hasattr(world_mesh, "_unflatten"):
        return (world_mesh._unflatten(0, (world,), ("fsdp",)),
                world_mesh._unflatten(0, (world // ep, ep), ("efsdp", "ep")))
    return (init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",)),
            init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep")))


class TitanMoE:
    """The MoE weights as torchtitan shards them: the router under FSDP2 on the dense mesh, the
    stacked experts split over "ep" (Shard(0)) and then under FSDP2 on "efsdp" of the experts' own
    mesh, which leaves them (_StridedShard(0), Shard(0)) on ("efsdp", "ep")."""

    @staticmethod
    def build(world: int):
        import torch.nn as nn
        from torch.distributed.tensor import Shard, distribute_tensor

        class Part(nn.Module):
            def forward(self, step):
                loss = sum(((p - 0.1 * step) ** 2).sum() for p in self.parameters())
                return loss.full_tensor() if hasattr(loss, "full_tensor") else loss

        class Whole(nn.Module):
            def forward(self, step):
                return self.dense(step) + self.experts(step)

        dense_mesh, sparse_mesh = titan_meshes(world)
        full = build_moe_weights()
        net = Whole()
        net.dense, net.experts = Part(), Part()
        net.dense.router = nn.Parameter(full["router"])
        for name in ("w1", "w3", "w2"):
            setattr(net.experts, name, nn.Parameter(distribute_tensor(full[name], sparse_mesh["ep"], [Shard(0)])))
        fully_shard()(net.experts, mesh=sparse_mesh["efsdp"])
        fully_shard()(net.dense, mesh=dense_mesh)
        return net

    @staticmethod
    def name(parameter: str) -> str:  # the checkpoint's names: "experts.w1" is "w1"
        return parameter.split(".")[-1]


class PipelineMoE:
    """The MoE weights over two pipeline stages of a ("pp", "dp") mesh: stage 0 holds the router
    and w1, stage 1 w3 and w2, each under FSDP2 on its own slice of "dp"."""

    STAGES = (("router", "w1"), ("w3", "w2"))

    @staticmethod
    def build(world: int):
        import torch.nn as nn
        from torch.distributed.device_mesh import init_device_mesh

        class Stage(nn.Module):
            def forward(self, step):
                return sum(((p - 0.1 * step) ** 2).sum() for p in self.parameters())

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
        full = build_moe_weights()
        net = Stage()
        for name in PipelineMoE.STAGES[mesh.get_coordinate()[0]]:
            net.register_parameter(name, nn.Parameter(full[name]))
        return fully_shard()(net, mesh=mesh["dp"])

    @staticmethod
    def full_weights(net, rank: int):
        """Every stage's full weights on rank 0 (full_tensor() within each stage, then gathered)."""
        import torch.distributed as dist

        mine = {n: p.full_tensor().detach().numpy().copy() for n, p in net.named_parameters()}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return {n: a for stage in everyone for n, a in stage.items()} if rank == 0 else None


# The fp8 scenario: one bfloat16 weight of FP8_ROWS x FP8_COLS under FSDP2; at world sizes 3 and
# 6 its row shards (torch.chunk) cut blocks of 128 rows.
FP8_ROWS, FP8_COLS = 1000, 320


def build_fp8(world: int):
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    class Weight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(11)
            w = torch.randn(FP8_ROWS, FP8_COLS, generator=g) * 0.02
            w[130:140] *= 300  # blocks whose amax sits on one of their ranks only (world 6: block 1,
            w[300:310] *= 300  # block 2; world 3: block 2)
            self.w = nn.Parameter(w.to(torch.bfloat16))

        def forward(self):  # FSDP2 gathers the weight for its forward and reduce-scatters its grad
            return self.w

    return fully_shard()(Weight(), mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))


def fp8_loss(module, step):
    return ((module().float() - 0.01 * step) ** 2).sum()


def moe_loss(module, step):
    # Sums over sharded DTensors are Partial; full_tensor() reduces them (differentiably).
    loss = sum(((p - 0.1 * step) ** 2).sum() for p in module.parameters())
    return loss.full_tensor()


def main(kind: str, rank: int, world: int, port: int, target: str, group: str, conn) -> None:
    import torch
    import torch.distributed as dist

    import model as lm
    import shardcast
    from shardcast.local import join_process_group

    try:
        join_process_group(port, rank, world)
        torch.manual_seed(0)  # the same initial weights on every rank
        name_of = str  # checkpoint name of a parameter
        if kind == "ep":
            from torch.distributed.device_mesh import init_device_mesh

            net = build_moe(init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
            loss_of = moe_loss
        elif kind == "titan-ep":
            net = TitanMoE.build(world)
            loss_of, name_of = (lambda module, step: module(step)), TitanMoE.name
        elif kind == "pp":
            net = PipelineMoE.build(world)
            loss_of = lambda module, step: module(step)  # noqa: E731
        elif kind == "fp8":
            net = build_fp8(world)
            loss_of = fp8_loss
        else:
            net = lm.shard_for_training(lm.TinyLM(), kind)
            loss_of = lm.loss_fn
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)

        def train_step(step: int) -> None:
            opt.zero_grad()
            loss_of(net, step).backward()
            opt.step()

        def full_weights():
            # A collective: every rank takes part, rank 0 sends (bfloat16 as float32: numpy has none).
            if kind == "pp":
                return PipelineMoE.full_weights(net, rank)
            full = {name_of(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                    for n, p in net.named_parameters()}
            out = {n: (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy() for n, t in full.items()}
            return out if rank == 0 else None

        train_step(0)  # the first forward runs FSDP2's lazy init: register after it
        client = shardcast.Client(target)
        params = {name_of(n): p for n, p in net.named_parameters()}
        reg = client.register_dtensors(group, params, version=1)  # the weights the test calls version 1
        placements = {n: str(getattr(p, "placements", "plain")) for n, p in params.items()}
        conn.send(("registered", (full_weights(), placements)))
        step = 1
        while True:
            cmd = conn.recv()
            if cmd == "step":
                step += 1
                with reg.writing(step):  # no sync reads while the optimizer writes; then step is published
                    train_step(step)  # in place: the registered memory holds the new weights
                conn.send(("stepped", full_weights()))
            elif cmd == "exit":
                reg.close()
                client.close()
                dist.destroy_process_group()
                conn.send(("closed", None))
                return
    except Exception as e:  # reported to the test, which fails with it
        import traceback

        conn.send(("error", f"trainer rank {rank}: {e!r}\n{traceback.format_exc()}"))


def check_boxes(rank: int, world: int, port: int, conn) -> None:
    """This rank's boxes from shardcast.layout against real DTensors: for meshes of 1 and 2 dims
    (one of them with its ranks permuted), every pair of placements among Replicate, Shard and
    _StridedShard, and uneven shapes, the full tensor read at the boxes must be `to_local()`.
    Sends ("checked", (cases, cases that are not boxes, mismatches))."""
    import itertools

    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from shardcast.layout import _placement, rank_boxes
    from shardcast.local import join_process_group

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # torch 2.4, 2.5
        from torch.distributed._tensor.placement_types import _StridedShard
    try:
        join_process_group(port, rank, world)
        choices = [Replicate(), Shard(0), Shard(1), _StridedShard(0, split_factor=2), _StridedShard(1, split_factor=3)]
        meshes = [DeviceMesh("cpu", list(range(world))), DeviceMesh("cpu", [[0, 1], [2, 3]]),
                  DeviceMesh("cpu", [[3, 1], [0, 2]])]
        cases, not_boxes, wrong = 0, 0, []
        for mesh, shape in itertools.product(meshes, [(5, 3), (7, 6), (1, 4), (13, 7)]):
            for placements in itertools.product(choices, repeat=mesh.mesh.ndim):
                full = torch.arange(shape[0] * shape[1], dtype=torch.float64).reshape(shape)
                try:  # each rank cuts its own: torch's scatter refuses uneven strided shards
                    local = distribute_tensor(full, mesh, list(placements), src_data_rank=None).to_local()
                except TypeError:  # torch < 2.5: no src_data_rank
                    local = distribute_tensor(full, mesh, list(placements)).to_local()
                cases += 1
                try:
                    boxes = rank_boxes(list(shape), list(mesh.mesh.shape), mesh.get_coordinate(),
                                       [_placement(p) for p in placements])
                except ValueError:
                    not_boxes += 1
                    continue
                got = torch.cat([full[tuple(slice(o, o + s) for o, s in zip(offs, sizes))].reshape(-1)
                                 for offs, sizes in boxes]) if boxes else torch.zeros(0, dtype=torch.float64)
                if not torch.equal(got, local.reshape(-1)):
                    wrong.append(f"mesh {mesh.mesh.tolist()} {placements} shape {shape}: boxes {boxes}, "
                                 f"local {local.reshape(-1).tolist()}")
        conn.send(("checked", (cases, not_boxes, wrong[:5])))
    except Exception as e:
        import traceback

        conn.send(("error", f"rank {rank}: {e!r}\n{traceback.format_exc()}"))


def check_grid(rank: int, world: int, port: int, conn) -> None:
    """shardcast.parallel.GridRanks over 4 gloo ranks laid out as vLLM lays out TP=2 x PP=2 (TP
    groups [0, 1] and [2, 3], pipeline groups [0, 2] and [1, 3]): what a gather, a step that fails
    on one rank and `any` give here. Sends ("grid", {...})."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from shardcast.local import join_process_group
    from shardcast.parallel import GridRanks

    try:
        join_process_group(port, rank, world)
        groups = {}
        for ranks in ([0, 1], [2, 3], [0, 2], [1, 3]):  # every rank creates every group, in order
            groups[tuple(ranks)] = dist.new_group(ranks, backend="gloo")
        tp = [0, 1] if rank < 2 else [2, 3]
        pp = [0, 2] if rank % 2 == 0 else [1, 3]
        inner = SimpleNamespace(cpu_group=groups[tuple(tp)], world_size=2, rank_in_group=tp.index(rank))
        outer = SimpleNamespace(cpu_group=groups[tuple(pp)], world_size=2, rank_in_group=pp.index(rank))
        grid = GridRanks(inner, outer, who="worker", positions=("pipeline stage", "TP rank"))
        out = {"rank": grid.rank, "world": grid.world, "gathered": grid.gather(f"r{rank}")}

        def fails_on_2():
            if rank == 2:
                raise ValueError("rank 2's own error")
            return rank

        try:
            grid.step("a step", fails_on_2)
            out["step"] = "no error"
        except RuntimeError as e:
            out["step"] = str(e)
        out["step_after"] = grid.step("the next step", lambda: rank * 10)
        out["any_3"] = grid.any(rank == 3)
        out["any_none"] = grid.any(False)
        conn.send(("grid", out))
    except Exception as e:
        import traceback

        conn.send(("error", f"rank {rank}: {e!r}\n{traceback.format_exc()}"))
