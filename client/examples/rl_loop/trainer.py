"""One trainer rank of the RL loop: registers its shards with its node's daemon, then every step
updates its weights in place and, once all trainer ranks are done, rank 0 publishes the step to
the inference group with a sync and waits for the rollouts generated with it (synchronous
on-policy RL). run.py starts four of these as processes; in a real job they are the training
processes themselves and the barrier is torch.distributed's."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

import shardcast  # noqa: E402

import model  # noqa: E402


def train(rank: int, daemon: str, steps: int, barrier, rollouts, inference_ranks: int, verify: bool = True) -> None:
    try:
        import torch
    except ImportError:
        torch = None
    client = shardcast.Client(daemon)
    initial = model.rank_buffers("trainer", rank, 0)
    params = {n: torch.from_numpy(a) for n, a in initial.items()} if torch else initial
    # After registering, `params` live in shared memory: the daemon reads them where they are.
    reg = client.register("trainer", rank, 4, params, model.layout("trainer"))
    for step in range(1, steps + 1):
        target = model.rank_buffers("trainer", rank, step)
        for name, t in reg.tensors.items():  # "optimizer.step()": in place
            (t.numpy() if torch else t)[...] = target[name]
        barrier.wait()  # every trainer rank has written step `step`
        if rank == 0:
            result = client.sync("trainer", "inference", step, verify=verify, wait_for_ranks=True, timeout=120)
            print(f"trainer: step {step} published: {result.network_bytes} B over the network in "
                  f"{result.seconds * 1e3:.1f} ms{' (plan cached)' if result.plan_cached else ''}", flush=True)
            for _ in range(inference_ranks):  # the rollouts of this step's policy
                rollouts.get(timeout=120)
        barrier.wait()  # nobody writes step+1 before the rollouts of step are in
    reg.close()
    client.close()

