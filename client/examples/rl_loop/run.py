#!/usr/bin/env python3
"""The RL loop, end to end on this machine: 4 daemons (2 trainer nodes, 2 inference nodes), 4
trainer ranks (FSDP x TP) and 4 inference ranks (vLLM-like TP=2 per node, fused qkv / gate_up),
each its own process. Every step the trainer updates its weights and syncs them; every inference
rank waits for the new version and checks it holds exactly the trainer's weights.

    /usr/bin/python3 client/examples/rl_loop/run.py [--steps 3]

Exit status 0 when every inference rank saw every step exactly.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE))

from shardcast.local import LocalCluster  # noqa: E402

import inference  # noqa: E402
import trainer  # noqa: E402


def _trainer(rank, daemon, steps, barrier, rollouts, failures):
    try:
        trainer.train(rank, daemon, steps, barrier, rollouts, inference_ranks=4)
    except Exception as e:
        failures.put(f"trainer rank {rank}: {e!r}")
        barrier.abort()


def _inference(rank, daemon, steps, rollouts, failures):
    try:
        if inference.serve(rank, daemon, steps, rollouts):
            failures.put(f"inference rank {rank} saw wrong weights")
    except Exception as e:
        failures.put(f"inference rank {rank}: {e!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    nodes = ["trainer-0", "trainer-1", "inference-0", "inference-1"]
    with LocalCluster(nodes) as cluster:
        print(f"started shardcastd for {', '.join(nodes)}", flush=True)
        barrier, rollouts, failures = ctx.Barrier(4), ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=_trainer, args=(r, cluster.target(f"trainer-{r // 2}"), a.steps, barrier, rollouts, failures))
                 for r in range(4)]
        procs += [ctx.Process(target=_inference, args=(r, cluster.target(f"inference-{r // 2}"), a.steps, rollouts, failures))
                  for r in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
            if p.is_alive():
                p.kill()
                failures.put(f"a rank did not finish ({p.name})")
        problems = []
        while not failures.empty():
            problems.append(failures.get())
        if any(p.exitcode != 0 for p in procs):
            problems.append("a rank process exited abnormally")
    for problem in problems:
        print(f"rl_loop: {problem}", file=sys.stderr)
    print("rl_loop: " + ("FAILED" if problems else f"{a.steps} steps, every inference rank saw every step exactly"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
