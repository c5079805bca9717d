"""One inference rank of the RL loop: a vLLM-like rank (TP=2 within its replica, q/k/v fused into
qkv_proj and gate/up into gate_up_proj) that registers its local weights with its node's daemon
through its parallel plan (its replica is one of the replica set "inference": group
`inference.r<replica>`), then for every step waits for that version, checks every weight against
the trainer's full state dict of that step, and hands back its "rollouts"."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

import torch  # noqa: E402

import shardcast  # noqa: E402

import model  # noqa: E402


def serve(rank: int, daemon: str, nodes, steps: int, inbox, rollouts) -> int:
    """Returns the number of wrong elements seen over all steps (0 when every step was exact)."""
    tp_size = 2
    plan = model.inference_plan(rank % tp_size, tp_size, rank // tp_size, len(nodes) // tp_size)
    meta = model.meta_model()
    weights = {n: torch.zeros(shape, dtype=getattr(torch, dtype))  # what the engine allocated
               for n, (shape, dtype) in shardcast.local_shapes(plan, meta).items()}
    client = shardcast.Client(daemon)
    # Replica `plan.replica` of the set "inference": its own group, reg.group ("inference.r0", ...).
    reg = client.register_inference("inference", weights, plan, meta, nodes=nodes)
    wrong = 0
    for _ in range(steps):
        step, full = inbox.get(timeout=300)
        # An engine pauses generation here; a version that does not arrive in time raises
        # (DEADLINE_EXCEEDED): stale weights are never served.
        client.wait_version(reg.group, step, timeout=120)
        expected = model.expected_local({n: torch.from_numpy(a) for n, a in full.items()}, plan.tp_rank, tp_size)
        bad = sum(int((weights[n] != expected[n]).sum()) for n in expected)
        wrong += bad
        print(f"inference rank {rank} ({reg.node}): version {step}: "
              f"{'every weight matches the trainer' if bad == 0 else f'{bad} WRONG elements'}", flush=True)
        rollouts.put((rank, step, bad))  # generation with the new weights would happen here
    reg.close()
    client.close()
    return wrong
