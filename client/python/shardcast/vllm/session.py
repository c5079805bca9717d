"""vLLM's weight-update calls for engines with the `shardcast` backend, on the engine core's side:
every call reaches every worker and comes back as one status per worker, the engine raises once
naming each worker that failed, and a finished update resets the prefix cache before the engine
schedules another step.

Why in the engine core: vLLM 0.32's MultiprocExecutor.collective_rpc raises at the first worker
reply that is an error and leaves the later workers' replies queued, where the next call reads them
as its own (at TP >= 2 one failed update then broke every later one); and the prefix cache lives
in the engine core's scheduler, out of a worker's reach. The offline `LLM`, `vllm serve` (AsyncLLM)
and vLLM's own HTTP and Ray clients all reach the workers through `EngineCore.collective_rpc`, so
the plugin wraps that method in every vLLM process (shardcast.vllm.plugin); engines of other
backends go through it unchanged."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

# Under vLLM's logger: these lines come from vLLM's engine core, and vLLM's logging configuration
# (handlers, VLLM_LOGGING_LEVEL) shows them with its own.
_log = logging.getLogger("vllm.shardcast")

BACKEND = "shardcast"
# vLLM's worker methods of the weight-transfer protocol (vllm/v1/worker/gpu_worker.py).
SESSION_CALLS = frozenset({"init_weight_transfer_engine", "shutdown_weight_transfer_engine", "start_weight_update",
                           "start_draft_weight_update", "update_weights", "finish_weight_update"})


@dataclass
class CacheReset:
    """One reset after a finished update, in this process's engine core: how long it took and how
    many running requests it sent back to be computed again under the new weights."""

    seconds: float
    recomputed: int


last_reset: Optional[CacheReset] = None  # this process's latest (an engine core in process: the tests read it)


def install() -> bool:
    """Wraps vLLM's EngineCore.collective_rpc (once per process). False where this vLLM has no
    such engine core: then nothing changes."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        return False
    original = EngineCore.collective_rpc
    if getattr(original, "_shardcast_session", False):
        return True

    @functools.wraps(original)
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if isinstance(method, str) and method in SESSION_CALLS and _backend(self) == BACKEND:
            return _session_call(self, original, method, timeout, args, kwargs)
        return original(self, method, timeout, args, kwargs)

    collective_rpc._shardcast_session = True  # type: ignore[attr-defined]
    EngineCore.collective_rpc = collective_rpc
    return True


def _backend(core: Any) -> Optional[str]:
    config = getattr(getattr(core, "vllm_config", None), "weight_transfer_config", None)
    return getattr(config, "backend", None)


def on_worker(worker: Any, method: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Runs vLLM's worker `method` and returns this worker's status instead of raising: `error`
    (None, or the error's text) and `finished` (for finish_weight_update: None when the backend's
    finish did not run, "" when the update went into service, else why not)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if engine is not None and hasattr(engine, "finished"):
        engine.finished = None
    if engine is not None and hasattr(engine, "runner"):
        engine.runner = getattr(worker, "model_runner", None)  # LoRA adapters are driven through it
    error = None
    try:
        getattr(worker, method)(*args, **kwargs)
    except Exception as e:  # the status says it; raising would leave the other workers' replies queued
        error = f"{type(e).__name__}: {e}"
    finished = getattr(engine, "finished", None) if method == "finish_weight_update" else None
    if finished is not None and hasattr(engine, "after_finish"):
        # vLLM's finish removed every LoRA adapter: the engine's own go back before the next step.
        try:
            readded = engine.after_finish()
        except Exception as e:
            readded = f"putting the LoRA adapters back failed: {type(e).__name__}: {e}"
        if readded:
            finished = f"{finished}; {readded}" if finished else readded
    return {"error": error or finished or None, "finished": finished}


def _session_call(core: Any, original, method: str, timeout, args, kwargs) -> List[None]:
    statuses = original(core, on_worker, timeout, (method, tuple(args or ()), dict(kwargs or {})), None)
    errors = [(k, s["error"]) for k, s in enumerate(statuses) if s["error"]]
    if method == "finish_weight_update" and any(s["finished"] is not None for s in statuses):
        # The live weights changed (or, a finish failing half-way, may have): no KV computed before
        # may be read again. This runs between two engine steps, so the next step already
        # schedules against an empty cache.
        try:
            _reset_caches(core)
        except Exception as e:
            errors.append((-1, f"the update is in service, but vLLM's caches were not reset: {type(e).__name__}: {e}"))
    if errors:
        raise RuntimeError(_describe(method, errors, len(statuses)))
    return [None] * len(statuses)


def _reset_caches(core: Any) -> None:
    """Empties the prefix cache (and a KV connector's, and for a multimodal model the encoder
    cache): requests still running go back to the waiting queue and compute their prompt and the
    tokens they have so far again, with the new weights."""
    global last_reset
    start = time.perf_counter()
    running = len(getattr(core.scheduler, "running", ()))
    # reset_running_requests: a running request holds KV blocks, and a reset that finds any
    # block in use does nothing (BlockPool.reset_prefix_cache); preempting them frees them all.
    if not core.reset_prefix_cache(reset_running_requests=True, reset_connector=True):
        raise RuntimeError("the KV connector refused to reset its cache")
    model_config = getattr(core.vllm_config, "model_config", None)
    if getattr(model_config, "is_multimodal_model", False):
        core.reset_encoder_cache()
    last_reset = CacheReset(time.perf_counter() - start, running)
    _log.info("shardcast: prefix cache reset after the update in %.3f ms (%d running request(s) recomputed)",
              last_reset.seconds * 1e3, running)


def _describe(method: str, errors: List[Tuple[int, str]], workers: int) -> str:
    """One error for the call: each distinct error once, with the workers (vLLM's ranks in this
    engine) it came from."""
    by_error: Dict[str, List[int]] = {}
    for k, e in errors:
        by_error.setdefault(e, []).append(k)
    parts = []
    for e, ks in by_error.items():
        who = "the engine" if ks == [-1] else ("worker " if len(ks) == 1 else "workers ") + ", ".join(map(str, ks))
        parts.append(f"{who}: {e}")
    return f"shardcast: vLLM's {method} failed ({len(errors)} of {workers} worker(s)) on " + "; ".join(parts)
