"""What every test vLLM shares: its engine configuration (the fresh references run the same) and
the prompts it serves greedily, with their logprobs, for the bit-for-bit comparisons."""

from __future__ import annotations

PROMPTS = ["t5 t6 t7", "t9 t3", "t100 t200 t300 t400"]


def engine_args(tp: int, **extra) -> dict:
    """float32 (bf16 dies with SIGILL on this CPU), eager, a small KV cache."""
    return dict(dtype="float32", max_model_len=128, enforce_eager=True, seed=0, gpu_memory_utilization=0.1,
                tensor_parallel_size=tp, **extra)


def generate(llm) -> list:
    """Greedy tokens and the top-2 logprobs of each, for every prompt."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]}
            for o in outs]
