"""docs/guide-rl-kubernetes.md's trainer code (step 5), read from the page by its markers and run
as written against real vLLM engines: two offline vLLMs (TP=1) as the replicas of the set "vllm",
in place of the `vllm serve` pods the page finds through `rl-inference`, each wired to a daemon of
its own node as a pod is, and a plain-tensor trainer (AdamW) on a third. Its `delta="auto"` sends
deltas: the first sync is dense, the next ones send the weights a step left unchanged as deltas.
Its lookup of the servers runs first against a stubbed resolver and builds vLLM's real HTTP
clients. deploy/tests/test_guide.py checks that these markers are the page's. Run as a script by
the test (vLLM starts its engines in that process)."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import re
import socket
import sys
import time
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "guide-rl-kubernetes.md"


def guide_block(name: str) -> str:
    """The page's python block marked `<!-- guide-test: vllm <this file> NAME -->`."""
    marker = f"<!-- guide-test: vllm client/python/vllm_tests/{Path(__file__).name} {name} -->"
    found = re.search(re.escape(marker) + r"\n```python\n(.*?)```", GUIDE.read_text(), re.S)
    if found is None:
        raise AssertionError(f"{GUIDE} has no python block marked {marker}")
    return found.group(1)


def test_the_guides_trainer_updates_two_vllm_replicas_every_step(models, tmp_path):
    from conftest import IN_PROCESS, run_script

    out = run_script("test_k8s_guide.py", models["llama"], str(tmp_path), env_extra=IN_PROCESS, timeout=900)
    assert out.get("error") is None, out.get("error")
    # The lookup: one vLLM HTTP client per address, on the servers' port, after waiting for them.
    assert out["http_clients"] == ["HTTPVLLMWeightSyncClient http://10.0.0.7:8000",
                                   "HTTPVLLMWeightSyncClient http://10.0.0.9:8000"]
    assert out["lookups"] == 2
    # Every step reached both replicas, none cut, as the page's loop prints it.
    assert out["printed"] == [f"step {s}: replicas [0, 1] serve it; cut from the sync: none" for s in (1, 2, 3)]
    assert out["replicas"] == {"vllm.r0": "", "vllm.r1": ""}
    assert out["weight_versions"] == ["3", "3"]
    # delta="auto": the first sync dense (no node holds a base), the next two send the unchanged
    # weights as deltas (syncs this small are not measured against dense ones: auto keeps them).
    syncs = out["syncs"]
    assert [s["delta_chunks"] > 0 for s in syncs] == [False, True, True], syncs
    assert all(s["delta"] == "DELTA_AUTO" and s["delta_choice"] == "" for s in syncs), syncs
    assert all(s["wire_bytes"] < s["network_bytes"] for s in syncs[1:]), syncs
    # Each engine's registered bytes are step 3's weights, cut the vLLM way.
    assert [c["group"] for checks in out["checks"] for c in checks] == ["vllm.r0", "vllm.r1"]
    assert all(c["wrong"] == [] and c["checked"] > 0 for checks in out["checks"] for c in checks), out["checks"]


def main() -> None:
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    from vllm import LLM

    from engines import OfflineClient, PlainTrainer, engine_args, shutdown_llm
    from shardcast.local import LocalCluster
    from shardcast.vllm.clients import ReplicaClients

    result: dict = {}
    namespace: dict = {}
    # The lookup, against a resolver that first knows no server, then two (one listed twice).
    exec(compile(guide_block("find_servers"), "guide:find_servers", "exec"), namespace)
    answers = [socket.gaierror(socket.EAI_NONAME, "no ready server"),
               [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a, port in
                (("10.0.0.9", 8000), ("10.0.0.7", 8000), ("10.0.0.9", 8000))]]
    real_lookup, real_sleep = socket.getaddrinfo, time.sleep

    def lookup(host, port, *args, **kwargs):
        assert (host, port) == ("rl-inference.rl.svc", 8000), (host, port)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    socket.getaddrinfo, time.sleep = lookup, lambda s: None
    try:
        http = namespace["find_servers"](2)
    finally:
        socket.getaddrinfo, time.sleep = real_lookup, real_sleep
    result["http_clients"] = [f"{type(c).__name__} {c.base_url}" for c in http.clients]
    result["lookups"] = 2 - len(answers)

    # What each of the trainer's syncs returned (the page's loop does not keep the response).
    import shardcast
    from shardcast.v1 import service_pb2

    real_sync, syncs = shardcast.Client.sync, []

    def recorded_sync(self, *args, **kwargs):
        resp = real_sync(self, *args, **kwargs)
        syncs.append({"delta": service_pb2.DeltaMode.Name(resp.delta), "delta_choice": resp.delta_choice,
                      "delta_chunks": resp.delta_chunks, "dense_chunks": resp.dense_chunks,
                      "wire_bytes": resp.wire_bytes, "network_bytes": resp.network_bytes})
        return resp

    shardcast.Client.sync = recorded_sync
    with LocalCluster(["n0", "n1", "n2"]) as cluster:
        # Each engine's workers reach their node's daemon (n1, n2), as in a pod: an engine takes
        # its environment's as vLLM builds it. Then the trainer's node's (n0), for the page's code.
        # Two engines in one process: the CPU backend counts the process's memory against each
        # engine's share, so the KV cache gets an explicit size (it changes no number served).
        args = dict(engine_args(1), kv_cache_memory_bytes=256 << 20)
        llms = []
        for node in ("n1", "n2"):
            os.environ["SHARDCAST_ADDRESS"] = cluster.target(node)
            llms.append(LLM(model=model_dir, worker_extension_cls="worker_ext.ShardcastCheck",
                            weight_transfer_config={"backend": "shardcast"}, **args))
        os.environ["SHARDCAST_ADDRESS"] = cluster.target("n0")
        trainer = PlainTrainer(model_dir, out_dir)
        # Steps train the last layer's MLP only: in float32 AdamW changes every weight it steps,
        # and the frozen ones stand for the most of a bf16 model that a step leaves unchanged.
        for name, param in trainer.model.named_parameters():
            param.requires_grad_(name.startswith("model.layers.1.mlp."))
        os.environ["RANK"] = "0"  # torchrun's, which the page's code reads
        steps = itertools.count(1)
        servers = [OfflineClient(llm) for llm in llms]
        namespace.update(
            EXPECTED=2,  # two engines here, four pods on the page
            find_servers=lambda expected: ReplicaClients(servers[:expected]),
            model=trainer.model, train_step=lambda model: trainer.train(next(steps)), steps=3)
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(compile(guide_block("train"), "guide:train", "exec"), namespace)
        except Exception as e:
            result["error"] = f"{type(e).__name__}: {e}"
        result["printed"] = printed.getvalue().splitlines()
        if "error" not in result:
            result["replicas"] = dict(namespace["engine"].replicas)
            step_dir = trainer.save(3)
            result["checks"] = [llm.collective_rpc("shardcast_check", args=(step_dir,)) for llm in llms]
            result["weight_versions"] = [llm.get_weight_version() for llm in llms]
            result["syncs"] = syncs
        for llm in llms:
            shutdown_llm(llm)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
