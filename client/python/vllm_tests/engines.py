"""What every test vLLM shares: its engine configuration (the fresh references run the same) and
the prompts it serves greedily, with their logprobs, for the bit-for-bit comparisons."""

from __future__ import annotations

import time

from shardcast.vllm.clients import LLMWeightSyncClient

# A shared "system prompt" of 130 tokens, longer than one KV block (128 tokens on vLLM's CPU
# backend), so the prefix cache holds its first block once it has been served: the two long
# prompts (133 and 170 tokens) read it back on every later request. (The word-level tokenizer
# makes "t<i>" token i; words starting "t1" or "t2" split at its special tokens, so the prefix
# avoids them.)
SYSTEM = " ".join(f"t{30 + (i * 7) % 70}" for i in range(130))
PROMPTS = ["t5 t6 t7", "t9 t3", "t100 t200 t300 t400", SYSTEM + " t5 t6 t7",
           SYSTEM + " " + " ".join(f"t{300 + i}" for i in range(40))]


def engine_args(tp, **extra) -> dict:
    """float32 (bf16 dies with SIGILL on this CPU), eager, a small KV cache, room for PROMPTS. `tp`: the tensor-
    parallel size, or a string of it: "2ep" is TP=2 with expert parallelism (a MoE layer's experts
    split over the ranks, whole, instead of each expert's matrices)."""
    spec = str(tp)
    ep = spec.endswith("ep")
    return dict(dtype="float32", max_model_len=256, enforce_eager=True, seed=0, gpu_memory_utilization=0.1,
                tensor_parallel_size=int(spec[:-2] if ep else spec), **({"enable_expert_parallel": True} if ep else {}),
                **extra)


def generate(llm) -> list:
    """Greedy tokens and the top-2 logprobs of each, for every prompt."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]}
            for o in outs]


class OfflineClient(LLMWeightSyncClient):
    """The package's offline client with fault injection and timings: `before[call]`, if set, runs
    before that call (init, start, update, finish); `seconds[call]` is how long the last one took
    (the benchmark's figures)."""

    def __init__(self, llm) -> None:
        super().__init__(llm)
        self.before: dict = {}
        self.seconds: dict = {}

    def _call(self, what: str, fn) -> None:
        if self.before.get(what):
            self.before[what]()
        t = time.perf_counter()
        fn()
        self.seconds[what] = time.perf_counter() - t


class PlainTrainer:
    """A trainer of plain tensors in this process: a Hugging Face causal LM and AdamW. `train(step)`
    takes one optimizer step on tokens seeded by `step`; `save(step)` writes the full weights to
    OUT/step-N as a model directory a fresh vLLM loads, and returns it."""

    def __init__(self, model_dir: str, out: str) -> None:
        import torch
        from transformers import LlamaForCausalLM

        self.model_dir, self.out = model_dir, out
        self.model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def train(self, step: int) -> None:
        import torch

        tokens = torch.randint(3, self.model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
        self.model(input_ids=tokens, labels=tokens).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def save(self, step: int) -> str:
        import os

        from run_rl import save_step

        path = os.path.join(self.out, f"step-{step}")
        save_step({k: v.detach() for k, v in self.model.state_dict().items()}, self.model_dir, path)
        return path
