"""trainer_init and send_weights of a real vLLM at a MoE's tensor count (CPU backend, float32, run in
the vLLM venv: bash bench/vllm.sh --moe-init). A Qwen3-MoE of --layers layers of --experts experts
(the default, 48 x 128, is Qwen3-30B-A3B's count: 18 432 expert checkpoint tensors) at a small
--hidden, trained by two FSDP2 ranks (gloo, transformers keeping each layer's experts fused) into
vLLM at TP=2 on one daemon: client/python/vllm_tests/run_rl.py, which also checks every registered
byte after each step. Prints how long trainer_init took (the trainer's conversion of its fused
experts into checkpoint boxes, the workers' probe of vLLM's loaders, every registration) and each
send_weights.

    python bench/vllm_moe_init.py [--layers 48] [--experts 128] [--hidden 128] [--steps 2]
Prints a few lines and a JSON line (RESULT ...)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "client" / "python" / "vllm_tests"
sys.path.insert(0, str(TESTS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)  # vLLM 0.32's CPU MoE kernel dies below 128
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    from models import make_qwen3_moe
    from shardcast.local import LocalCluster

    work = tempfile.mkdtemp(prefix="shardcast-vllm-moe-init-")
    model = make_qwen3_moe(os.path.join(work, "model"), hidden=args.hidden, layers=args.layers,
                           experts=args.experts)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    with LocalCluster(["n0"]) as cluster:
        done = subprocess.run([sys.executable, str(TESTS / "run_rl.py"), model, "2", cluster.target("n0"),
                               os.path.join(work, "out"), str(args.steps), "offline"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    result = next((json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines()
                   if line.startswith("RESULT ")), None)
    if done.returncode != 0 or result is None or result.get("error"):
        sys.exit(f"run_rl.py failed (exit {done.returncode}): "
                 f"{(result or {}).get('error') or done.stderr[-3000:]}")
    checked = [c["checked"] for c in result["steps"][-1]["checks"]]
    wrong = [w for step in result["steps"] for c in step["checks"] for w in c["wrong"]]
    print(f"Qwen3-MoE, {args.layers} layers x {args.experts} experts, hidden {args.hidden}: "
          f"{checked[0]} checkpoint tensors per worker; trainer FSDP2 x 2 -> vLLM TP=2, one daemon")
    print(f"trainer_init: {result['init_s']:.1f} s")
    for n, step in enumerate(result["steps"], start=1):
        print(f"step {n}: send_weights {step['send_s']:.2f} s")
    print(f"registered bytes checked after each step: {'all equal' if not wrong else f'{len(wrong)} wrong'}")
    print("RESULT " + json.dumps({"layers": args.layers, "experts": args.experts, "hidden": args.hidden,
                                  "tensors": checked[0], "init_s": result["init_s"],
                                  "send_s": [s["send_s"] for s in result["steps"]], "wrong": len(wrong)}))
    if wrong:
        sys.exit(1)


if __name__ == "__main__":
    main()
