"""Steps that run on every rank of a torch.distributed group and succeed on all of them or fail on
all of them: the trainer ranks' exchanges (shardcast.vllm.trainer) and a vLLM engine's workers'
set-up (shardcast.vllm.engine) both take their steps this way."""

from __future__ import annotations

from typing import Any, Callable, List


def gather_step(group: Any, world: int, what: str, step: Callable[[], Any], who: str) -> List[Any]:
    """Runs `step` on this rank and gathers every rank's result (a list, by rank). When the step
    raised on any rank, raises on every rank, naming each failing rank (`who`: "trainer rank",
    "worker") and its error: a rank that raised alone would leave the others waiting in the next
    collective for good. Every rank of `group` (of `world` ranks) must call it; `group` None and
    `world` 1 run the step alone."""
    import torch

    try:
        value, error = step(), None
    except Exception as e:  # every rank hears of it
        value, error, raised = None, f"{type(e).__name__}: {e}", e
    out: List[Any] = [(error, value)]
    if world > 1:
        out = [None] * world
        torch.distributed.all_gather_object(out, (error, value), group=group)
    failed = [(r, err) for r, (err, _) in enumerate(out) if err is not None]
    if failed:
        message = f"shardcast: {what} failed on {who}(s) " + "; ".join(f"{r}: {e}" for r, e in failed)
        if error is not None:
            raise RuntimeError(message) from raised
        raise RuntimeError(message)
    return [v for _, v in out]
