"""A LoRA adapter into vLLM servers as the replicas of one replica set. Three daemons: n0 serves
the trainer (this process: a PEFT LoRA adapter "policy" on a Hugging Face model of plain tensors,
AdamW, the shardcast trainer engine with lora=True, driving the servers through
shardcast.vllm.clients.ReplicaClients), n1 serves replica 0 and n2 replica 1 (offline vLLMs, TP=1,
enable_lora): the adapter is the set "vllm.lora.policy", replica k group "vllm.lora.policy.r<k>".

- Step 1 reaches replica 0 alone; then replica 1 starts and joins (`add_replica`): its adapter
  catches up to step 1 from replica 0, and the trainer sends no byte for it.
- Step 2: n2 is frozen as the update starts and thawed after the replica deadline. The sync cuts
  replica 1, naming it, and replica 0 commits; in the update, replica 1's workers catch up to step
  2 from replica 0. Both serve step 2.
- Both sides' engines shut down; a new trainer engine initialises the same adapter (its id free
  again in vLLM) and step 3 reaches both replicas.
After each step both replicas serve the adapter, and the step's adapter is saved as PEFT saves it
to OUT/step-N (for a fresh vLLM to load from disk). Prints one JSON result.
Usage: python run_lora_replicas.py MODEL OUT"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

from run_replicas import bytes_sent


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    from vllm import LLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from engines import OfflineClient, PolicyAdapterTrainer, engine_args, generate, shutdown_llm
    from shardcast.local import LocalCluster
    from shardcast.vllm.clients import ReplicaClients
    from shardcast.vllm.trainer import ShardcastTrainerInitInfo

    result: dict = {}

    def start_llm(node: str):
        os.environ["SHARDCAST_ADDRESS"] = cluster.target(node)  # the engine's workers: this node
        # Two engines in one process: the KV cache gets an explicit size (see run_replicas.py).
        return LLM(model=model_dir, enable_lora=True, max_lora_rank=16, max_loras=2,
                   weight_transfer_config={"backend": "shardcast"},
                   **dict(engine_args(1), kv_cache_memory_bytes=256 << 20))

    trainer = PolicyAdapterTrainer(model_dir, out)
    model, train, save = trainer.model, trainer.train, trainer.save

    with LocalCluster(["n0", "n1", "n2"]) as cluster:
        llms = [start_llm("n1")]
        servers = ReplicaClients([OfflineClient(llms[0])])
        engine = WeightTransferTrainerFactory.trainer_init(
            ShardcastTrainerInitInfo(rank=0, daemon=cluster.target("n0"), timeout_s=60, replica_deadline_s=1.0,
                                     lora=True),
            client=servers, source=ModuleSource(model))

        def served() -> list:
            return [generate(llm, lora_request=engine.lora_request("policy")) for llm in llms]

        train(1)
        engine.send_weights()
        result["dir_1"], result["replicas_1"] = save(1), dict(engine.replicas)
        # Replica 1 joins after step 1 and catches up to it from replica 0.
        llms.append(start_llm("n2"))
        sent_before = bytes_sent(cluster, "n0")
        result["joined_as"] = engine.add_replica(OfflineClient(llms[1]))
        result["trainer_sent_for_catch_up"] = bytes_sent(cluster, "n0") - sent_before
        result["caught_up"] = dict(engine.caught_up)
        result["served_1"] = served()
        # Step 2: n2 frozen past the replica deadline, then thawed: replica 1 is cut from the sync
        # and catches up in the update.
        n2 = cluster.daemons["n2"].proc.pid

        def freeze() -> None:
            os.kill(n2, signal.SIGSTOP)
            threading.Timer(2.0, lambda: os.kill(n2, signal.SIGCONT)).start()

        train(2)
        servers.clients[1].before["start"] = freeze
        engine.send_weights()
        servers.clients[1].before["start"] = None
        result["dir_2"], result["replicas_2"] = save(2), dict(engine.replicas)
        result["updated_2"], result["failed_2"] = list(servers.updated), dict(servers.failed)
        result["served_2"] = served()
        # The engines shut down on both sides, and a new trainer engine takes the same adapter: its id
        # is free again in vLLM (the workers removed it), and step 3 reaches both replicas.
        engine.shutdown()
        for llm in llms:
            llm.collective_rpc("shutdown_weight_transfer_engine")
        engine = WeightTransferTrainerFactory.trainer_init(
            ShardcastTrainerInitInfo(rank=0, daemon=cluster.target("n0"), timeout_s=60, lora=True),
            client=ReplicaClients([OfflineClient(llm) for llm in llms]), source=ModuleSource(model))
        train(3)
        engine.send_weights()
        result["dir_3"], result["replicas_3"], result["served_3"] = save(3), dict(engine.replicas), served()
        # Each engine's workers registered again with their own node's daemon (both engines share
        # this process, whose SHARDCAST_ADDRESS names n2 by now).
        import shardcast

        with shardcast.Client(cluster.target("n0")) as lister:
            result["nodes_3"] = sorted({(r.group, r.node) for r in lister.list(all_nodes=True).ranks
                                        if r.group.startswith("vllm.lora.policy.r")})
        engine.shutdown()
        for llm in llms:
            shutdown_llm(llm)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
