"""Tiny float32 models made locally from transformers configs (no download), with a word-level
tokenizer: what the vLLM tests serve. bfloat16 dies with SIGILL on the CI machine's CPU."""

from __future__ import annotations

import os


def make_llama(path: str, *, vocab: int = 512, hidden: int = 256, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, tied: bool = False, seed: int = 0) -> str:
    """A Llama-architecture model (GQA when kv_heads < heads) saved to `path` (once)."""
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=256, tie_word_embeddings=tied, torch_dtype="float32")
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path, vocab)
    return path


def make_qwen3_moe(path: str, *, vocab: int = 512, hidden: int = 128, layers: int = 2, experts: int = 4,
                   seed: int = 2) -> str:
    """A Qwen3-MoE model (4 experts of intermediate size 64, 2 per token, GQA, an untied lm_head)
    saved to `path` (once). transformers keeps each layer's experts fused ([E, 2I, H] and
    [E, H, I]) and saves them one tensor per expert, as vLLM loads them."""
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                            moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=hidden // 4, num_experts=experts,
                            num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                            max_position_embeddings=256, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(config).to(torch.float32).save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path, vocab)
    return path


def _save_tokenizer(path: str, vocab: int) -> None:
    """A word-level tokenizer: "t<i>" is token i."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(path)
