"""Bytes synced by Shardcast into a real vLLM's workers (CPU): each worker's destination rank is
derived from vLLM's own loaders (shardcast.vllm), registered with the daemon, and a sync of the
"trained" checkpoint lands every worker's exact boxes, in place where the live parameter is the
loader's layout (direct), in a staging set where vLLM processed it (prepacked linear weights)."""

from __future__ import annotations

import os
import shutil

from shardcast.local import LocalCluster

from conftest import run_script


def _trained_copy(model: str, dest: str) -> str:
    """The model with every checkpoint tensor plus 1 (what run_sync.py's source rank publishes)."""
    if not os.path.exists(dest):
        from safetensors.torch import load_file, save_file

        shutil.copytree(model, dest)
        values = load_file(os.path.join(model, "model.safetensors"))
        save_file({k: v + 1.0 for k, v in values.items()}, os.path.join(dest, "model.safetensors"),
                  metadata={"format": "pt"})
    return dest


def _sync(model: str, tp: int) -> dict:
    with LocalCluster(["n0"]) as c:
        return run_script("run_sync.py", model, str(tp), c.target("n0"), "vllm", tp=tp)


def test_tp1_every_worker_tensor_receives_its_box(models):
    out = _sync(models["llama"], 1)
    (rank,) = out["ranks"]
    assert rank["node"] == "n0"
    # On the CPU backend: embeddings, lm_head and norms land in place; linear weights are processed.
    assert "model.embed_tokens.weight" in rank["direct"] and "lm_head.weight" in rank["direct"]
    assert "model.layers.0.self_attn.qkv_proj.weight" in rank["processed"]
    assert "model.layers.1.mlp.down_proj.weight" in rank["processed"]
    (check,) = out["checks"]
    assert check["wrong"] == [] and check["checked"] == out["layout_tensors"]
    assert out["bytes_needed"] > 0
    # Processed layers re-run vLLM's processing from the synced bytes; the engine then serves
    # exactly what a vLLM started from the trained weights serves: same greedy tokens, same
    # logprobs, bit for bit.
    assert "model.layers.0.self_attn.qkv_proj" in out["processed_layers"][0]
    fresh = run_script("run_generate.py", _trained_copy(models["llama"], models["llama"] + "-trained"), "1")
    assert out["served"] == fresh["served"]


def test_tp2_each_rank_receives_exactly_its_shards(models):
    out = _sync(models["llama_tied"], 2)
    assert [r["rank"] for r in out["ranks"]] == [0, 1]
    for check in out["checks"]:
        assert check["wrong"] == []
    # Every checkpoint tensor lands somewhere; the tied lm_head is the embedding.
    assert out["checks"][0]["checked"] == out["checks"][1]["checked"] == out["layout_tensors"]
    fresh = run_script("run_generate.py", _trained_copy(models["llama_tied"], models["llama_tied"] + "-trained"), "2",
                       tp=2)
    assert out["served"] == fresh["served"]


def test_the_shardcast_backend_through_vllms_own_rl_calls(models):
    # LLM(..., weight_transfer_config={"backend": "shardcast"}): the plugin registers the backend
    # in every vLLM process; init, start, update_weights, finish as an RL trainer calls them.
    with LocalCluster(["n0"]) as c:
        out = run_script("run_engine.py", models["llama"], "1", c.target("n0"))
    fresh = run_script("run_generate.py", _trained_copy(models["llama"], models["llama"] + "-trained"), "1")
    assert out["served"] == fresh["served"]
    assert out["weight_version"] == "1"
    # A version that does not arrive raises (naming what the rank holds), never serves stale weights
    # as new, and the engine keeps serving version 1.
    # (vLLM shortens the worker's message in the middle.)
    error = out["missing_version_error"]
    assert "DEADLINE_EXCEEDED" in error and "its weights are stale (ranks: 0 ready(1))" in error
    assert out["served_after"] == out["served"]


def test_the_backend_at_tp2_gathers_every_workers_pieces_itself(models):
    # Each worker's pieces gathered over vLLM's own tensor-parallel group (gloo), not by a driver.
    with LocalCluster(["n0"]) as c:
        out = run_script("run_engine.py", models["llama_tied"], "2", c.target("n0"), tp=2)
    fresh = run_script("run_generate.py", _trained_copy(models["llama_tied"], models["llama_tied"] + "-trained"), "2",
                       tp=2)
    assert out["served"] == fresh["served"]
    assert "DEADLINE_EXCEEDED" in out["missing_version_error"]
    assert out["served_after"] == out["served"]


def test_trainer_and_worker_engines_from_vllms_factories(models):
    # The trainer engine registers the model's parameters in place and drives vLLM's update itself;
    # the workers find their node's daemon as deployed processes do (SHARDCAST_ADDRESS).
    with LocalCluster(["n0"]) as c:
        out = run_script("run_trainer.py", models["llama"], "1", c.target("n0"),
                         env_extra={"SHARDCAST_ADDRESS": c.target("n0")})
    assert out["engine"] == "ShardcastTrainerEngine"
    assert out["weight_version"] == "1"
    fresh = run_script("run_generate.py", _trained_copy(models["llama"], models["llama"] + "-trained"), "1")
    assert out["served"] == fresh["served"]
