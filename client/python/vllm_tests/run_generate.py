"""Fresh vLLMs, one after the other in this process, on each MODEL at tensor-parallel size TP (CPU),
the engine configuration of the other scripts (engine_args): prints the greedy tokens and logprobs
of each for PROMPTS as one JSON result, a list in the order given (at TP >= 2, run as the ranks of
vLLM's external launcher: conftest.py's Fresh).
Usage: python run_generate.py TP MODEL [MODEL...]   (TP: as engines.engine_args takes it, "2ep")"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from engines import fresh_served

    print("RESULT " + json.dumps({"served": fresh_served(sys.argv[1], sys.argv[2:])}), flush=True)


if __name__ == "__main__":
    main()
