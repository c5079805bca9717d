"""vLLM's weight-sync client protocol over an offline `vllm.LLM` in the trainer's process: what a
trainer engine (`WeightTransferTrainerFactory.trainer_init(..., client=...)`) drives. vLLM ships
this protocol for `vllm serve` (HTTPVLLMWeightSyncClient) and Ray actors, not for an LLM held in
the same process. No vLLM import: it only calls the LLM given."""

from __future__ import annotations

from typing import Any, Callable, Optional


class LLMWeightSyncClient:
    """Forwards each call of the protocol to `llm`'s method of the same name."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def _call(self, what: str, fn: Callable[[], None]) -> None:
        """Runs one call (`what`: init, start, update, finish); a subclass may wrap it."""
        fn()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init", lambda: self.llm.init_weight_transfer_engine({"init_info": init_info}))

    def start_weight_update(self) -> None:
        self._call("start", self.llm.start_weight_update)

    def update_weights(self, update_info: dict) -> None:
        self._call("update", lambda: self.llm.update_weights({"update_info": update_info}))

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self._call("finish", lambda: self.llm.finish_weight_update(weight_version))


__all__ = ["LLMWeightSyncClient"]
