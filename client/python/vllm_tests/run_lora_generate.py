"""A fresh vLLM (CPU, engines.engine_args, enable_lora) at tensor-parallel size TP on MODEL serves
engines.PROMPTS with each adapter directory given, loaded from disk by vLLM itself (each under an id
of its own), and without one: prints the greedy tokens and logprobs of each as one JSON result, with
how long vLLM's own load of each adapter took (`add_lora`).
Usage: python run_lora_generate.py TP MODEL ADAPTER_DIR [ADAPTER_DIR...]"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    from engines import engine_args, generate, shutdown_llm

    tp, model, dirs = sys.argv[1], sys.argv[2], sys.argv[3:]
    llm = LLM(model=model, enable_lora=True, max_lora_rank=16, max_loras=2,
              **engine_args(tp, **({"distributed_executor_backend": "uni"} if tp == "1" else {})))
    served, load_s = [], []
    for k, path in enumerate(dirs, start=1):
        request = LoRARequest(f"disk-{k}", k, path)
        start = time.perf_counter()
        llm.llm_engine.add_lora(request)
        load_s.append(time.perf_counter() - start)
        served.append(generate(llm, lora_request=request))
    base = generate(llm)
    shutdown_llm(llm)
    print("RESULT " + json.dumps({"served": served, "base": base, "load_s": load_s}), flush=True)


if __name__ == "__main__":
    main()
