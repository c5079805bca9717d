"""vLLM servers as the data-parallel replicas of one replica set. Three daemons: n0 serves the
trainer (this process: a Hugging Face model of plain tensors, AdamW, the shardcast trainer engine
from vLLM's trainer factory, driving the servers through shardcast.vllm.clients.ReplicaClients),
n1 serves replica 0 and n2 replica 1 (offline vLLMs, TP=1, double-buffered). Replica 1 is started
with `enable_lora=True`, as a server that also serves adapters is: vLLM then wraps its linear
layers and embeddings (their weights become `<layer>.base_layer.weight`), and the full weights must
land there all the same, caught up from a replica without the wrapping.

- Step 1 reaches replica 0 alone; then replica 1 starts and joins (`add_replica`): it catches up
  to step 1 from replica 0, and the trainer sends no byte for it.
- Step 2: n2 is frozen as the update starts and thawed after the replica deadline. The sync cuts
  replica 1, naming it, and replica 0 commits; in the update, replica 1's workers catch up to step
  2 from replica 0. Both serve step 2.
- Step 3: n2 is frozen as the update starts and killed while the sync waits on it. Replica 1 is
  cut and its update fails, naming its rank; replica 0 takes step 3, and `send_weights` returns.
  Replica 1 serves step 2 as before.
- n2 is restarted (replica 1's workers re-register by themselves) and step 4 reaches both.
Each step's weights are saved to OUT/step-N. Prints one JSON result.
Usage: python run_replicas.py MODEL OUT"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.request


def bytes_sent(cluster, node: str) -> float:
    """The node's shardcast_bytes_sent_total."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.daemons[node].metrics_port}/metrics",
                                  timeout=10).read().decode()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("shardcast_bytes_sent_total ")))


class Warnings(logging.Handler):
    """The trainer engine's warnings (the replicas it names)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    from vllm import LLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import shardcast
    from engines import OfflineClient, PlainTrainer, engine_args, generate, shutdown_llm
    from shardcast.local import LocalCluster
    from shardcast.vllm.clients import ReplicaClients
    from shardcast.vllm.trainer import ShardcastTrainerInitInfo

    result: dict = {"seconds": {}}
    t0 = time.monotonic()
    warnings = Warnings()
    logging.getLogger("shardcast").addHandler(warnings)

    def mark(what: str) -> None:  # how long each part took, for the log (not checked)
        result["seconds"][what] = round(time.monotonic() - t0, 1)
        print(f"run_replicas: {what} at {result['seconds'][what]} s", file=sys.stderr, flush=True)

    def start_llm(node: str, **extra):
        os.environ["SHARDCAST_ADDRESS"] = cluster.target(node)  # the engine's workers: this node
        # Two engines in one process: the CPU backend counts the process's memory against each
        # engine's share, so the KV cache gets an explicit size (it changes no number served).
        args = dict(engine_args(1, **extra), kv_cache_memory_bytes=256 << 20)
        return LLM(model=model_dir, worker_extension_cls="worker_ext.ShardcastCheck",
                   weight_transfer_config={"backend": "shardcast"}, **args)

    with LocalCluster(["n0", "n1", "n2"]) as cluster:
        llms = [start_llm("n1")]
        servers = ReplicaClients([OfflineClient(llms[0])])
        trainer = PlainTrainer(model_dir, out)
        train, save = trainer.train, trainer.save
        engine = WeightTransferTrainerFactory.trainer_init(
            ShardcastTrainerInitInfo(rank=0, daemon=cluster.target("n0"), timeout_s=60, double_buffer=True,
                                     replica_deadline_s=1.0),
            client=servers, source=ModuleSource(trainer.model))


        def served(step: int) -> None:
            result[f"served_{step}"] = [generate(llm) for llm in llms]
            result[f"checks_{step}"] = [llm.collective_rpc("shardcast_check", args=(result[f"dir_{step}"],))
                                        for llm in llms]

        mark("replica 0 up")
        train(1)
        engine.send_weights()
        result["dir_1"] = save(1)
        result["replicas_1"] = dict(engine.replicas)
        mark("step 1")
        # Replica 1 joins after step 1 and catches up to it from replica 0.
        llms.append(start_llm("n2", enable_lora=True, max_lora_rank=16))
        sent_before = bytes_sent(cluster, "n0")
        result["joined_as"] = engine.add_replica(OfflineClient(llms[1]))
        result["trainer_sent_for_catch_up"] = bytes_sent(cluster, "n0") - sent_before
        result["caught_up"] = dict(engine.caught_up)
        served(1)
        mark("replica 1 caught up")
        n2 = cluster.daemons["n2"].proc.pid

        def freeze(then: int):
            """As replica 1's update starts: n2 stops, and gets `then` (SIGCONT, SIGKILL) 2 s later."""
            def at_start():
                os.kill(n2, signal.SIGSTOP)
                threading.Timer(2.0, lambda: os.kill(n2, then)).start()
            return at_start

        def faulty_step(step: int, then: int) -> None:
            train(step)
            servers.clients[1].before["start"] = freeze(then)
            warnings.messages.clear()
            try:
                engine.send_weights()
                result[f"failure_{step}"] = ""
            except Exception as e:
                result[f"failure_{step}"] = str(e)
            servers.clients[1].before["start"] = None
            result[f"dir_{step}"] = save(step)
            result[f"replicas_{step}"] = dict(engine.replicas)
            result[f"failed_{step}"] = {str(k): v for k, v in servers.failed.items()}
            result[f"updated_{step}"] = list(servers.updated)
            result[f"warnings_{step}"] = list(warnings.messages)

        # Step 2: n2 frozen past the replica deadline, then thawed: replica 1 is cut from the sync
        # and catches up in the update.
        faulty_step(2, signal.SIGCONT)
        served(2)
        mark("step 2")
        # Step 3: n2 frozen, then killed: replica 1 is cut and its update fails.
        faulty_step(3, signal.SIGKILL)
        result["served_3"] = [generate(llm) for llm in llms]
        result["checks_3"] = [llms[0].collective_rpc("shardcast_check", args=(result["dir_3"],))]
        mark("step 3")
        # n2 back; replica 1's workers re-register their rank by themselves.
        cluster.restart("n2")
        probe = shardcast.Client(cluster.target("n2"))
        deadline = time.monotonic() + 60
        while not any(g.group == "vllm.r1" for g in probe.status().groups):
            if time.monotonic() > deadline:
                raise RuntimeError("replica 1's workers did not re-register with the restarted daemon in 60 s")
            time.sleep(0.2)
        probe.close()
        mark("re-registered")
        train(4)
        engine.send_weights()
        result["dir_4"] = save(4)
        result["replicas_4"] = dict(engine.replicas)
        served(4)
        result["weight_versions"] = [llm.get_weight_version() for llm in llms]
        mark("step 4")
        engine.shutdown()
        for llm in llms:
            shutdown_llm(llm)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
