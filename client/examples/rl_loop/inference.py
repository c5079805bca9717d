"""One inference rank of the RL loop: registers its (vLLM-like, fused) buffers with its node's
daemon, then for every step waits for that version, checks that it holds exactly the trainer's
weights of that step in its own layout, and hands back its "rollouts" (here: what it checked)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

import shardcast  # noqa: E402

import model  # noqa: E402


def serve(rank: int, daemon: str, steps: int, rollouts) -> int:
    """Returns the number of wrong elements seen over all steps (0 when every step was exact)."""
    client = shardcast.Client(daemon)
    buffers = {n: np.zeros_like(a) for n, a in model.rank_buffers("inference", rank, 0).items()}
    reg = client.register("inference", rank, 4, buffers, model.layout("inference"))
    wrong = 0
    for step in range(1, steps + 1):
        got = client.wait_version("inference", step, timeout=120)  # an engine pauses generation here
        if got < step:
            raise TimeoutError(f"inference rank {rank}: version {step} did not arrive (at {got})")
        expected = model.rank_buffers("inference", rank, step)
        bad = sum(int(np.count_nonzero(reg.tensors[n] != expected[n])) for n in expected)
        wrong += bad
        print(f"inference rank {rank} ({reg.node}): version {step}: "
              f"{'every weight matches the trainer' if bad == 0 else f'{bad} WRONG elements'}", flush=True)
        rollouts.put((rank, step, bad))  # generation with the new weights would happen here
    reg.close()
    client.close()
    return wrong
