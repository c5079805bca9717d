"""The vLLM worker's direct path without vLLM: a rank's registered tensors are views into its live
parameters (several checkpoint tensors inside one fused parameter, at offsets inside its
allocation), and a sync lands the bytes there in place. On the CPU here; on a CUDA device (the
views then reach the daemon as CUDA IPC handles of the parameter's allocation plus an offset)
where scripts/device-check.sh runs it. The probe that finds the landings in a real vLLM is tested
in vllm_tests/."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch", reason="the test venv (scripts/deps.sh) has torch")

import shardcast  # noqa: E402
from shardcast.local import LocalCluster  # noqa: E402
from shardcast.vllm.layout import destination_layout, rank_memory  # noqa: E402
from shardcast.vllm.probe import Landing, ParamMap  # noqa: E402

H, KV = 64, 16  # hidden size; k and v rows (GQA)


def devices():
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append("cuda")
    elif os.environ.get("SHARDCAST_REQUIRE_GPU", "0") not in ("", "0"):  # scripts/device-check.sh
        out.append(pytest.param("cuda", marks=pytest.mark.xfail(strict=True, reason="no CUDA device visible")))
    else:
        out.append(pytest.param("cuda", marks=pytest.mark.skip(reason="no CUDA device "
                                                                       "(scripts/device-check.sh runs it where one is)")))
    return out


@pytest.mark.parametrize("device", devices())
def test_bytes_land_in_live_fused_parameters_in_place(device):
    checkpoint = {"q": torch.randn(H, H), "k": torch.randn(KV, H), "v": torch.randn(KV, H),
                  "norm": torch.randn(H)}
    # What the probe finds for vLLM's qkv_proj at TP=1: q, k, v one after another in one parameter.
    maps = {"qkv_proj.weight": ParamMap("qkv_proj.weight", (H + 2 * KV, H), torch.float32, [
                Landing("q", (0, 0), (H, H), 0), Landing("k", (0, 0), (KV, H), H * H),
                Landing("v", (0, 0), (KV, H), (H + KV) * H)]),
            "norm.weight": ParamMap("norm.weight", (H,), torch.float32, [Landing("norm", (0,), (H,), 0)])}
    live = {"qkv_proj.weight": torch.zeros(H + 2 * KV, H, device=device),
            "norm.weight": torch.zeros(H, device=device)}
    memory = rank_memory(maps, live)
    assert sorted(memory.direct) == ["norm.weight", "qkv_proj.weight"] and memory.processed == []
    with LocalCluster(["t0", "i0"]) as cluster:
        trainer = shardcast.Client(cluster.target("t0"))
        worker = shardcast.Client(cluster.target("i0"))
        source = {n: t.to(device) for n, t in checkpoint.items()}
        layout = {"group": "trainer", "mesh": {"shape": [1]}, "nodes": ["t0"],
                  "tensors": [{"name": n, "shape": list(t.shape), "dtype": "float32"} for n, t in source.items()]}
        src = trainer.register("trainer", 0, 1, source, layout, role="source", version=1)
        shapes = {n: (tuple(t.shape), torch.float32) for n, t in checkpoint.items()}
        dst = worker.register("vllm", 0, 1, memory.tensors,
                              destination_layout("vllm", ["i0"], [memory.pieces], shapes))
        # Registered in place (a CPU tensor's storage moves into shared memory once, as it
        # registers): the buffers are views into the live parameters, k right after q.
        base = live["qkv_proj.weight"].data_ptr()
        assert memory.tensors["k"].data_ptr() == base + H * H * 4
        before = {n: t.data_ptr() for n, t in live.items()}
        try:
            assert trainer.sync("trainer", "vllm", 1, verify=True, timeout=120).version == 1
            assert worker.wait_version("vllm", 1, timeout=30) == 1
            if device == "cuda":
                torch.cuda.synchronize()
            qkv = live["qkv_proj.weight"].cpu()
            assert torch.equal(qkv, torch.cat([checkpoint["q"], checkpoint["k"], checkpoint["v"]]))
            assert torch.equal(live["norm.weight"].cpu(), checkpoint["norm"])
            assert {n: t.data_ptr() for n, t in live.items()} == before  # in place: same storage
        finally:
            dst.close()
            src.close()
            worker.close()
            trainer.close()


def test_double_buffered_parameters_take_delta_syncs():
    """ShardcastTrainerInitInfo(double_buffer=True): bytes land in a staging tensor per direct
    parameter, never in the live one (the engine copies them over at finish_weight_update). The
    staging tensors are what the rank registers, a single set that keeps the last version's
    bytes, so a delta="auto" sync after the first sends deltas into them."""
    checkpoint = {"w": torch.randn(4 * H, H), "norm": torch.randn(H)}
    maps = {"w.weight": ParamMap("w.weight", (4 * H, H), torch.float32, [Landing("w", (0, 0), (4 * H, H), 0)]),
            "norm.weight": ParamMap("norm.weight", (H,), torch.float32, [Landing("norm", (0,), (H,), 0)])}
    live = {"w.weight": torch.zeros(4 * H, H), "norm.weight": torch.zeros(H)}
    memory = rank_memory(maps, live, double_buffer=True)
    assert sorted(memory.flips) == ["norm.weight", "w.weight"]
    with LocalCluster(["t0", "i0"]) as cluster:
        trainer = shardcast.Client(cluster.target("t0"))
        worker = shardcast.Client(cluster.target("i0"))
        layout = {"group": "trainer", "mesh": {"shape": [1]}, "nodes": ["t0"],
                  "tensors": [{"name": n, "shape": list(t.shape), "dtype": "float32"} for n, t in checkpoint.items()]}
        src = trainer.register("trainer", 0, 1, {n: t.clone() for n, t in checkpoint.items()}, layout,
                               role="source", version=1)
        shapes = {n: (tuple(t.shape), torch.float32) for n, t in checkpoint.items()}
        dst = worker.register("vllm", 0, 1, memory.tensors, destination_layout("vllm", ["i0"], [memory.pieces], shapes))
        try:
            first = trainer.sync("trainer", "vllm", 1, delta="auto", timeout=120)
            assert first.delta_chunks == 0 and first.dense_chunks > 0
            for version in (2, 3):
                with src.writing(version):  # a step changes a few weights
                    src.tensors["w"][version, :4] += 1.0
                resp = trainer.sync("trainer", "vllm", version, delta="auto", timeout=120)
                assert resp.delta_chunks > 0 and resp.wire_bytes < resp.network_bytes, resp
                staged = {n: memory.tensors[n] for n in checkpoint}
                assert all(torch.equal(staged[n], src.tensors[n]) for n in checkpoint)
                assert not live["w.weight"].any()  # nothing lands in a live parameter
        finally:
            dst.close()
            src.close()
            worker.close()
            trainer.close()
