"""The GPU path from Python (skipped without a CUDA device: runs in scripts/device-check.sh): a
real torch DTensor on a CUDA device mesh, each rank's shard a CUDA tensor registered in place
through CUDA IPC, synced through real daemons into destination ranks whose tensors are CUDA
tensors too (TP over columns: strided slices of the source rows), every element checked."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

torch = pytest.importorskip("torch", reason="the test venv (scripts/deps.sh) has torch")
if not torch.cuda.is_available():
    if os.environ.get("SHARDCAST_REQUIRE_GPU", "0") not in ("", "0"):  # scripts/device-check.sh
        pytest.fail("no CUDA device visible to torch and SHARDCAST_REQUIRE_GPU is set", pytrace=False)
    pytest.skip("no CUDA device (scripts/device-check.sh runs this where one is)", allow_module_level=True)

import gpu_worker  # noqa: E402
import shardcast  # noqa: E402
from rank_worker import recv  # noqa: E402
from shardcast.local import LocalCluster, TorchRendezvous  # noqa: E402


def destination_layout(group: str):
    return {"group": group, "mesh": {"shape": [2]}, "nodes": ["i0", "i0"],
            "tensors": [{"name": "w", "shape": [gpu_worker.ROWS, gpu_worker.COLS], "dtype": "float32",
                         "placements": [{"shard": {"dim": 1}}]},
                        {"name": "b", "shape": [gpu_worker.COLS], "dtype": "bfloat16",
                         "placements": [{"replicate": {}}]}]}


def test_cuda_dtensor_syncs_into_cuda_destination_ranks():
    with LocalCluster(["t0", "i0"]) as cluster:
        ctx = mp.get_context("spawn")
        rendezvous, procs, conns = TorchRendezvous(), [], []
        for rank in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=gpu_worker.main, args=(rank, 2, rendezvous.port, cluster.target("t0"), "gpu-trainer", child))
            p.start()
            procs.append(p)
            conns.append(parent)
        regs = []
        try:
            for c in conns:
                recv(c, "registered", timeout=180)
            full = gpu_worker.full_weights()
            cols = gpu_worker.COLS // 2
            dests = []
            for r in range(2):
                tensors = {"w": torch.zeros(gpu_worker.ROWS, cols, device="cuda"),
                           "b": torch.zeros(gpu_worker.COLS, dtype=torch.bfloat16, device="cuda")}
                client = shardcast.Client(cluster.target("i0"))
                regs.append((client.register("gpu-vllm", r, 2, tensors, destination_layout("gpu-vllm")), client))
                dests.append(tensors)
            coordinator = shardcast.Client(cluster.target("t0"))
            result = coordinator.sync("gpu-trainer", "gpu-vllm", 1, verify=True, wait_for_ranks=True, timeout=120)
            assert result.version == 1
            assert regs[0][1].wait_version("gpu-vllm", 1, timeout=30) >= 1
            for r, tensors in enumerate(dests):
                torch.cuda.synchronize()
                expect_w = full["w"][:, r * cols:(r + 1) * cols]
                assert torch.equal(tensors["w"].cpu(), expect_w), f"rank {r}: w differs"
                assert torch.equal(tensors["b"].cpu(), full["b"]), f"rank {r}: b differs"
            coordinator.close()
        finally:
            for reg, client in regs:
                reg.close()
                client.close()
            for c, p in zip(conns, procs):
                if p.is_alive():
                    c.send("exit")
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
