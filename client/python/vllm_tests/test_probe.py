"""shardcast.vllm.probe against a real vLLM (CPU): where each checkpoint tensor lands in each
worker's parameters, found by vLLM's own loaders, at TP=1 and TP=2, for every layer kind a
Llama has (QKV with GQA and replicated KV heads, merged gate_up, column and row parallel, vocab
parallel embedding with padding, untied and tied lm_head, replicated norms)."""

from __future__ import annotations

from conftest import IN_PROCESS, run_script


def landings(worker: dict, param: str) -> list:
    return [tuple(map(lambda x: tuple(x) if isinstance(x, list) else x, l)) for l in worker[param]["landings"]]


def covered(entry: dict) -> int:
    total = 0
    for _, _, sizes, _ in entry["landings"]:
        n = 1
        for s in sizes:
            n *= s
        total += n
    return total


def test_tp1_every_parameter_maps_and_live_ones_hold_the_checkpoint(models):
    out = run_script("run_probe.py", models["llama"], "1", env_extra=IN_PROCESS)
    (w,) = out["workers"]
    p = "model.layers.0."
    # QKV: q rows, then k, then v (GQA: 2 KV heads of 64), each a whole checkpoint tensor.
    assert landings(w, p + "self_attn.qkv_proj.weight") == [
        (p + "self_attn.q_proj.weight", (0, 0), (256, 256), 0),
        (p + "self_attn.k_proj.weight", (0, 0), (128, 256), 256 * 256),
        (p + "self_attn.v_proj.weight", (0, 0), (128, 256), 384 * 256)]
    assert landings(w, p + "mlp.gate_up_proj.weight") == [
        (p + "mlp.gate_proj.weight", (0, 0), (512, 256), 0),
        (p + "mlp.up_proj.weight", (0, 0), (512, 256), 512 * 256)]
    # Every element of every parameter is some checkpoint element (no padding at TP=1).
    for name, entry in w.items():
        n = 1
        for s in entry["shape"]:
            n *= s
        assert covered(entry) == n, name
    # Linear weights are prepacked on the CPU (live parameter emptied): processed. Embeddings, the
    # untied lm_head and the norms are live in the loader's layout, and hold exactly the bytes the
    # landings say.
    assert w[p + "self_attn.qkv_proj.weight"]["live_shape"] != w[p + "self_attn.qkv_proj.weight"]["shape"]
    for name in ("model.embed_tokens.weight", "lm_head.weight", p + "input_layernorm.weight", "model.norm.weight"):
        assert w[name]["holds_checkpoint"] is True, name
    # The probe leaves the model as it was: the same greedy tokens after it.
    assert out["after"] == out["before"]


def test_tp2_shards_replicated_kv_heads_vocab_padding_and_tied_embeddings(models):
    out = run_script("run_probe.py", models["llama_tied"], "2", tp=2, env_extra=IN_PROCESS)
    w0, w1 = out["workers"]
    p = "model.layers.0."
    # Column parallel: each rank its half of q's rows (2 query heads of 64); one KV head, which
    # both ranks hold whole (replicated, TP 2 > 1 KV head).
    for rank, w in enumerate((w0, w1)):
        assert landings(w, p + "self_attn.qkv_proj.weight") == [
            (p + "self_attn.q_proj.weight", (128 * rank, 0), (128, 256), 0),
            (p + "self_attn.k_proj.weight", (0, 0), (64, 256), 128 * 256),
            (p + "self_attn.v_proj.weight", (0, 0), (64, 256), 192 * 256)]
        # Row parallel: a column half of o_proj and down_proj, the whole parameter.
        assert landings(w, p + "self_attn.o_proj.weight") == [(p + "self_attn.o_proj.weight", (0, 128 * rank), (256, 128), 0)]
        assert landings(w, p + "mlp.down_proj.weight") == [(p + "mlp.down_proj.weight", (0, 256 * rank), (256, 256), 0)]
        # Replicated norm.
        assert landings(w, "model.norm.weight") == [("model.norm.weight", (0,), (256,), 0)]
        # Tied: lm_head is the embedding; nothing lands in it of its own.
        assert "lm_head.weight" not in w
    # Vocab parallel: 500 rows padded to 512, 256 per rank; rank 1 holds rows 256..499, then 12
    # rows of padding that no checkpoint element lands in.
    assert landings(w0, "model.embed_tokens.weight") == [("model.embed_tokens.weight", (0, 0), (256, 256), 0)]
    assert landings(w1, "model.embed_tokens.weight") == [("model.embed_tokens.weight", (256, 0), (244, 256), 0)]
    assert w1["model.embed_tokens.weight"]["shape"] == [256, 256]
    assert w0["model.embed_tokens.weight"]["holds_checkpoint"] and w1["model.embed_tokens.weight"]["holds_checkpoint"]
    assert out["after"] == out["before"]
