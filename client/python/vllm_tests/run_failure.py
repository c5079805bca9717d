"""A daemon killed in the middle of a vLLM update. Two daemons: n0 serves the trainer (this
process: a Hugging Face model of plain tensors, AdamW, the shardcast trainer engine from vLLM's
trainer factory), n1 serves vLLM (offline, TP=1, `double_buffer`). Step 1 updates vLLM, and what
vLLM serves while the bytes have landed but the update has not finished is recorded. Step 2
freezes n1 (SIGSTOP) as the update starts and kills it (SIGKILL) while the sync waits on it:
`send_weights` must raise naming the rank, and vLLM must serve step 1 as before. n1 is then
restarted (the workers' client re-registers the rank by itself) and step 3 must update vLLM.
Each step's weights are saved to OUT/step-N. Prints one JSON result.
Usage: python run_failure.py MODEL OUT"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    from vllm import LLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import shardcast
    from engines import OfflineClient, PlainTrainer, engine_args, generate
    from shardcast.local import LocalCluster
    from shardcast.vllm.trainer import ShardcastTrainerInitInfo

    result = {"seconds": {}}
    t0 = time.monotonic()

    def mark(what: str) -> None:  # how long each part took, for the log (not checked)
        result["seconds"][what] = round(time.monotonic() - t0, 1)
        print(f"run_failure: {what} at {result['seconds'][what]} s", file=sys.stderr, flush=True)
    with LocalCluster(["n0", "n1"]) as cluster:
        os.environ["SHARDCAST_ADDRESS"] = cluster.target("n1")  # vLLM's workers: node n1
        llm = LLM(model=model_dir, worker_extension_cls="worker_ext.ShardcastCheck",
                  weight_transfer_config={"backend": "shardcast"}, **engine_args(1))
        client = OfflineClient(llm)
        trainer = PlainTrainer(model_dir, out)
        train, save = trainer.train, trainer.save
        engine = WeightTransferTrainerFactory.trainer_init(
            ShardcastTrainerInitInfo(rank=0, daemon=cluster.target("n0"), timeout_s=60, double_buffer=True),
            client=client, source=ModuleSource(trainer.model))


        mark("vLLM up")
        result["served_0"] = generate(llm)
        # Step 1, double-buffered: the bytes have landed (the sync returned), the update has not
        # finished: vLLM serves what it served before.
        train(1)
        client.before["update"] = lambda: result.setdefault("served_landed", generate(llm))
        engine.send_weights()
        client.before["update"] = None
        result["served_1"], result["dir_1"] = generate(llm), save(1)
        result["checks_1"] = llm.collective_rpc("shardcast_check", args=(result["dir_1"],))
        mark("step 1")
        # Step 2: n1 frozen as the update starts, killed while the sync waits on it.
        train(2)
        n1 = cluster.daemons["n1"].proc.pid

        def freeze_then_kill():
            os.kill(n1, signal.SIGSTOP)
            threading.Timer(1.5, lambda: os.kill(n1, signal.SIGKILL)).start()

        client.before["start"] = freeze_then_kill
        try:
            engine.send_weights()
            result["failure"] = ""
        except Exception as e:
            result["failure"] = str(e)
        client.before["start"] = None
        mark("step 2 failed")
        result["served_after_failure"] = generate(llm)
        # n1 back; the workers' client re-registers their rank by itself.
        cluster.restart("n1")
        probe = shardcast.Client(cluster.target("n1"))
        deadline = time.monotonic() + 60
        while not any(g.group == "vllm" for g in probe.status().groups):
            if time.monotonic() > deadline:
                raise RuntimeError("the vLLM workers did not re-register with the restarted daemon in 60 s")
            time.sleep(0.2)
        probe.close()
        mark("re-registered")
        train(3)
        engine.send_weights()
        result["served_3"], result["dir_3"] = generate(llm), save(3)
        result["checks_3"] = llm.collective_rpc("shardcast_check", args=(result["dir_3"],))
        result["weight_version"] = llm.get_weight_version()
        mark("step 3")
        engine.shutdown()
        llm.llm_engine.engine_core.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
