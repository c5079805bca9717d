"""A fresh vLLM (CPU, engines.engine_args, enable_lora) at tensor-parallel size TP on MODEL serves
engines.PROMPTS with each adapter directory given, loaded from disk by vLLM itself (each under an id
of its own), and without one: prints the greedy tokens and logprobs of each as one JSON result, with
how long vLLM's own load of each adapter took (`add_lora`).
Usage: python run_lora_generate.py TP MODEL ADAPTER_DIR [ADAPTER_DIR...]"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from engines import fresh_served_lora

    print("RESULT " + json.dumps(fresh_served_lora(sys.argv[1], sys.argv[2], sys.argv[3:])), flush=True)


if __name__ == "__main__":
    main()
