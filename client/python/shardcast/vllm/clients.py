"""Clients of vLLM's weight-sync protocol (init, start, update, finish) that a trainer engine
(`WeightTransferTrainerFactory.trainer_init(..., client=...)`) drives. vLLM ships this protocol for
`vllm serve` (HTTPVLLMWeightSyncClient) and Ray actors; here: an offline `vllm.LLM` in the trainer's
process, and several inference servers driven as the replicas of one replica set. No vLLM import:
they only call what they are given."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence


def error_text(e: BaseException) -> str:
    """`Type: message`; for an HTTP error, with the server's reply: vLLM's HTTP client raises
    requests' HTTPError, whose message is the status line alone, while vLLM's reply says why (the
    workers that failed, and their errors)."""
    text = f"{type(e).__name__}: {e}"
    body = getattr(getattr(e, "response", None), "text", None)
    if not isinstance(body, str) or not body:
        return text
    try:  # vLLM's error reply: {"error": {"message": ...}}
        body = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    return f"{text}: {str(body)[:4000]}"


def with_reply(call: Callable[..., Any], *args: Any) -> Any:
    """Runs one call of the protocol; an HTTP error is raised again with the server's reply
    (error_text)."""
    try:
        return call(*args)
    except Exception as e:
        if getattr(getattr(e, "response", None), "text", None):
            raise RuntimeError(error_text(e)) from e
        raise


def replica_group(replica_set: str, replica: int) -> str:
    """The group replica `replica` of set `replica_set` registers ("vllm.r3")."""
    return f"{replica_set}.r{replica}"


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


class ReplicaClients:
    """Several inference servers (each a client of the protocol: `vllm serve` through vLLM's
    HTTPVLLMWeightSyncClient, an offline LLM through LLMWeightSyncClient) driven as one client, each
    server one replica of the set the trainer syncs into (docs/vllm.md, "Data-parallel replicas").

    `init_weight_transfer_engine` tells server k it is replica k (`replica` in its init info; a
    server added later by `add` gets the next id). Every later call goes to every server at once,
    one thread each. A server whose start or update raises is left out of the rest of that update
    and named in `failed` (replica id -> its error) while the others finish it; the call raises
    only when every server failed. `updated` lists the replicas the last update finished."""

    def __init__(self, clients: Sequence[Any] = ()) -> None:
        self.clients: List[Any] = list(clients)
        self.init_info: Optional[dict] = None
        self.failed: Dict[int, str] = {}
        self.updated: List[int] = []

    def add(self, client: Any) -> int:
        """Adds a server as the next replica and, once the set is initialised, initialises it as
        the others were. Returns its replica id. (The trainer engine's `add_replica` also brings it
        to the version last sent.)"""
        replica = len(self.clients)
        if self.init_info is not None:
            client.init_weight_transfer_engine(dict(self.init_info, replica=replica))
        self.clients.append(client)
        return replica

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """Every server, replica k the k-th; any failure raises (a set-up error, not a replica's fault)."""
        self.init_info = dict(init_info)
        self._each("init", lambda k, c: c.init_weight_transfer_engine(dict(init_info, replica=k)),
                   range(len(self.clients)), tolerate=False)

    def start_weight_update(self) -> None:
        self.failed, self.updated = {}, []
        self._each("start", lambda k, c: c.start_weight_update(), range(len(self.clients)))

    def update_weights(self, update_info: dict) -> None:
        self._each("update", lambda k, c: c.update_weights(update_info), self._live())

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        live = self._live()
        # A server whose update call failed here (a timeout, a dropped connection) may still have
        # taken the update: its workers hold the version and its session is open. Finishing it
        # ends the session (vLLM refuses where the update failed on the server: nothing is applied
        # there); one that finishes took the version.
        recovered = []
        for k in [k for k, why in self.failed.items() if why.startswith("update: ")]:
            try:
                self.clients[k].finish_weight_update(weight_version)
            except Exception:
                continue
            del self.failed[k]
            recovered.append(k)
        if live or not recovered:
            self._each("finish", lambda k, c: c.finish_weight_update(weight_version), live)
        self.updated = sorted(k for k in live + recovered if k not in self.failed)

    def _live(self) -> List[int]:
        return [k for k in range(len(self.clients)) if k not in self.failed]

    def _each(self, what: str, call: Callable[[int, Any], None], replicas, tolerate: bool = True) -> None:
        """Runs `call` for the given replicas at once; a replica whose call raises goes into
        `failed` (or, not `tolerate`d, makes this raise). Raises when no replica is left."""
        replicas = list(replicas)
        if not replicas:
            raise RuntimeError(f"shardcast: {what}: no inference server to call (every replica failed: "
                               f"{self._failures()})" if self.failed else f"shardcast: {what}: no inference server")
        with ThreadPoolExecutor(max_workers=len(replicas)) as pool:
            futures = {k: pool.submit(call, k, self.clients[k]) for k in replicas}
        errors = {k: f.exception() for k, f in futures.items() if f.exception() is not None}
        if errors and not tolerate:
            raise RuntimeError(f"shardcast: {what} failed on " + "; ".join(
                f"replica {k}: {error_text(e)}" for k, e in sorted(errors.items())))
        for k, e in errors.items():
            self.failed[k] = f"{what}: {error_text(e)}"
        if not self._live():
            raise RuntimeError(f"shardcast: {what} failed on every replica: {self._failures()}")

    def _failures(self) -> str:
        return "; ".join(f"replica {k}: {e}" for k, e in sorted(self.failed.items()))


__all__ = ["LLMWeightSyncClient", "ReplicaClients", "error_text", "replica_group", "with_reply"]
