"""Fresh vLLMs, one after the other in this process, on each MODEL at tensor-parallel size TP (CPU),
the engine configuration of the other scripts (engine_args): prints the greedy tokens and logprobs
of each for PROMPTS as one JSON result, a list in the order given.
Usage: python run_generate.py TP MODEL [MODEL...]   (TP: as engines.engine_args takes it, "2ep")"""

from __future__ import annotations

import gc
import json
import sys


def main() -> None:
    from vllm import LLM

    from engines import engine_args, generate, shutdown_llm

    tp, models = sys.argv[1], sys.argv[2:]
    served = []
    for model in models:
        llm = LLM(model=model, **engine_args(tp, **({"distributed_executor_backend": "uni"} if tp == "1" else {})))
        served.append(generate(llm))
        shutdown_llm(llm)  # its engine process (and workers) before the next one
        del llm
        gc.collect()
    print("RESULT " + json.dumps({"served": served}), flush=True)


if __name__ == "__main__":
    main()
