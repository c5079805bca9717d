#!/usr/bin/env python3
"""The RL loop, end to end on this machine: 4 daemons (2 trainer nodes, 2 inference nodes), a
small transformer trained with real FSDP2 over 4 trainer ranks (gloo on the CPU, AdamW), and 4
vLLM-like inference ranks (two replicas of TP=2, one per node, fused qkv / gate_up: the replica
set "inference"), each its own process. Every step the trainer trains and syncs the new weights
into the set; every inference rank waits for the new version and checks every weight against the
trainer's full state dict of that step.

    .venv/bin/python client/examples/rl_loop/run.py [--steps 3]     (the venv scripts/deps.sh makes)

Exit status 0 when every inference rank saw every step exactly.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE))

from shardcast.local import LocalCluster, TorchRendezvous  # noqa: E402

import inference  # noqa: E402
import trainer  # noqa: E402


def _trainer(rank, port, daemon, steps, to_inference, rollouts, failures):
    try:
        trainer.train(rank, 4, port, daemon, steps, to_inference, rollouts)
    except Exception as e:
        failures.put(f"trainer rank {rank}: {e!r}")


def _inference(rank, daemon, nodes, steps, inbox, rollouts, failures):
    try:
        if inference.serve(rank, daemon, nodes, steps, inbox, rollouts):
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
        rollouts, failures = ctx.Queue(), ctx.Queue()
        inboxes = [ctx.Queue() for _ in range(4)]
        rendezvous = TorchRendezvous()
        procs = [ctx.Process(target=_trainer, args=(r, rendezvous.port, cluster.target(f"trainer-{r // 2}"), a.steps, inboxes,
                                                    rollouts, failures)) for r in range(4)]
        inference_nodes = [f"inference-{r // 2}" for r in range(4)]
        procs += [ctx.Process(target=_inference, args=(r, cluster.target(inference_nodes[r]), inference_nodes, a.steps,
                                                       inboxes[r], rollouts, failures)) for r in range(4)]
        for p in procs:
            p.start()
        # Wait for every rank; once one reports a failure the others may be stuck in a collective
        # or a queue: give them a few seconds, then stop them.
        deadline, failed_at = time.monotonic() + 600, None
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if failed_at is None and not failures.empty():
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > 5:
                break
            time.sleep(0.2)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
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
