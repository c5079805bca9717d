"""What every test vLLM shares: its engine configuration (the fresh references run the same) and
the prompts it serves greedily, with their logprobs, for the bit-for-bit comparisons."""

from __future__ import annotations

import time

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


class OfflineClient:
    """vLLM's VLLMWeightSyncClient protocol over an offline LLM in this process (what a trainer
    engine drives). `before[call]`, if set, runs before that call (a test's fault injection);
    `seconds[call]` is how long the last one took (the benchmark's figures)."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.before: dict = {}
        self.seconds: dict = {}

    def _call(self, what: str, fn) -> None:
        if self.before.get(what):
            self.before[what]()
        t = time.perf_counter()
        fn()
        self.seconds[what] = time.perf_counter() - t

    def init_weight_transfer_engine(self, init_info):
        self._call("init", lambda: self.llm.init_weight_transfer_engine({"init_info": init_info}))

    def start_weight_update(self):
        self._call("start", self.llm.start_weight_update)

    def update_weights(self, update_info):
        self._call("update", lambda: self.llm.update_weights({"update_info": update_info}))

    def finish_weight_update(self, weight_version=None):
        self._call("finish", lambda: self.llm.finish_weight_update(weight_version))
