"""Bytes synced by Shardcast into a real vLLM's workers (CPU): each worker's destination rank is
derived from vLLM's own loaders (shardcast.vllm), registered with the daemon, and a sync of the
"trained" checkpoint lands every worker's exact boxes, in place where the live parameter is the
loader's layout (direct), in a staging set where vLLM processed it (prepacked linear weights)."""

from __future__ import annotations

from shardcast.local import LocalCluster

from conftest import run_script


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


def test_tp2_each_rank_receives_exactly_its_shards(models):
    out = _sync(models["llama_tied"], 2)
    assert [r["rank"] for r in out["ranks"]] == [0, 1]
    for check in out["checks"]:
        assert check["wrong"] == []
    # Every checkpoint tensor lands somewhere; the tied lm_head is the embedding.
    assert out["checks"][0]["checked"] == out["checks"][1]["checked"] == out["layout_tensors"]
