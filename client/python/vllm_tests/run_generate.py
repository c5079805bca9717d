"""A fresh vLLM on MODEL at tensor-parallel size TP (CPU), the same engine configuration as
run_sync.py: prints its greedy tokens and logprobs for run_sync.PROMPTS as one JSON result.
Usage: python run_generate.py MODEL TP"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm import LLM

    from run_sync import generate

    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=128, enforce_eager=True, seed=0,
              gpu_memory_utilization=0.1, tensor_parallel_size=int(sys.argv[2]))
    print("RESULT " + json.dumps({"served": generate(llm)}), flush=True)


if __name__ == "__main__":
    main()
