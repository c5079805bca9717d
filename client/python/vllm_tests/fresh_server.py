"""The tests' fresh vLLMs at TP=1, made in one process that stays for the whole session (conftest.py,
the `fresh` fixture): importing vLLM takes about 13 CPU-seconds, paid here once rather than by each
reference. Each request is one JSON line on standard input, {"served": [MODEL, ...]} (engines.
fresh_served) or {"lora": MODEL, "adapters": [DIR, ...]} (engines.fresh_served_lora); each answer
one line on standard output, "RESULT " and the JSON result, or {"error": ...}. Every engine is a
new one, in process (the "uni" executor), shut down before the next: what each serves is a fresh
vLLM's, as the one-shot scripts (run_generate.py, run_lora_generate.py) serve it.
Usage: python fresh_server.py   (ends at the end of its input)"""

from __future__ import annotations

import json
import sys
import traceback


def main() -> None:
    import vllm  # noqa: F401  (once, before the first request)

    from engines import fresh_served, fresh_served_lora

    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        try:
            if "served" in request:
                result = {"served": fresh_served("1", request["served"])}
            else:
                result = fresh_served_lora("1", request["lora"], request["adapters"])
        except Exception as e:  # the test names it; the next request gets a fresh engine all the same
            result = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
