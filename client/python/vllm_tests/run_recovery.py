"""One `vllm serve` at tensor-parallel size TP (HTTP, VLLM_SERVER_DEV_MODE=1) under everything that
goes wrong in an RL loop, each time followed by an update that goes through. Two daemons: n0 serves
the trainer (this process: a Hugging Face model of plain tensors, AdamW, the shardcast trainer
engine from vLLM's trainer factory, driving the server through vLLM's HTTPVLLMWeightSyncClient),
n1 serves vLLM (double-buffered).

- Refused trainer_inits: checkpoints that do not fit vLLM's loaders (a tensor larger than vLLM's,
  one smaller, one of the wrong shape, one of a dtype no sync converts to vLLM's, a name vLLM does
  not have, a parameter no tensor reaches). Each raises naming the tensor and vLLM's parameter, and
  leaves nothing registered on either daemon. Then a trainer_init that fits.
- Before every update the prompts (engines.PROMPTS, two of them longer than a KV block and
  sharing it) are served, so the prefix cache holds KV of the weights being replaced. After each
  update what vLLM serves must equal what it serves once its prefix cache is emptied by hand
  (/reset_prefix_cache): no KV of the old weights is read.
- Step 1 goes through; while its bytes have landed and the update has not finished, vLLM serves
  its old weights. Then an update to a version that never comes (the user's own calls): it fails
  on every worker, each named. Step 2 goes through.
- Step 3: n1 frozen as the update starts and killed while the sync waits on it: send_weights
  raises naming the ranks, vLLM serves step 2. n1 restarted, the workers re-register by themselves,
  and step 4 goes through.
After every step each worker's registered bytes are that step's (strict), and what the boxes say
a sync writes (every parameter element by exactly one tensor, or padding) is recorded with the
daemon's plan. Each step's weights are saved to OUT/step-N. Prints one JSON result.

With DP > 1 the server runs that many data-parallel engines (--data-parallel-size), each one
replica of the set "vllm" (`data_parallel`), and requests land on any of them: the same cases, two
of the refusals, and no figures. That server also serves LoRA adapters (--enable-lora, one API
server, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): once the full-weight steps are done and their
engines shut down, a trainer of a LoRA adapter takes over the same server, on top of step 4's
weights (serve_adapters.py: its results under "lora", its adapters in OUT/adapters/step-N).
Usage: python run_recovery.py MODEL TP OUT [DP]"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import sys
import threading
import time
import traceback


def main() -> None:
    model_dir, tp, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    # The groups vLLM's workers register on n1: one of TP ranks, or one per data-parallel engine.
    vllm_groups = {"vllm": tp} if dp == 1 else {f"vllm.r{r}": tp for r in range(dp)}
    import requests
    import torch
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import shardcast
    from engines import PlainTrainer, Served, start_server
    from serve_adapters import adapter_steps
    from shardcast.local import LocalCluster
    from shardcast.vllm.trainer import ShardcastTrainerInitInfo

    class Client(HTTPVLLMWeightSyncClient):
        """vLLM's HTTP client; `before[path]`, if set, runs before that route is called;
        `seconds[path]` lists how long each call of it took."""

        before: dict = {}
        seconds: dict = {}

        def _post(self, path, json=None):
            if self.before.get(path):
                self.before[path]()
            start = time.perf_counter()
            super()._post(path, json)
            self.seconds.setdefault(path, []).append(round(time.perf_counter() - start, 4))

    result: dict = {"seconds": {}, "refused": {}}
    t0 = time.monotonic()

    def mark(what: str) -> None:  # how long each part took, for the log (not checked)
        result["seconds"][what] = round(time.monotonic() - t0, 1)
        print(f"run_recovery: {what} at {result['seconds'][what]} s", file=sys.stderr, flush=True)

    with LocalCluster(["n0", "n1"]) as cluster:
        log_path = os.path.join(out, "vllm-serve.log")
        lora = dp > 1
        server, url = start_server(model_dir, tp, cluster.target("n1"), log_path, dp=dp,
                                   extra_args=["--enable-lora", "--max-lora-rank", "16", "--max-loras", "2",
                                               "--api-server-count", "1"] if lora else [],
                                   env_extra={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if lora else None)
        try:
            served, client = Served(url=url, model=model_dir), Client(url)
            trainer = PlainTrainer(model_dir, out)

            def groups(node: str, versions: bool = False) -> dict:
                """Each group on `node`: its rank count, or with `versions` each rank's version."""
                with shardcast.Client(cluster.target(node)) as c:
                    return {g.group: [r.version for r in g.rank_states] if versions else len(g.rank_states)
                            for g in c.status().groups}

            def init(model, name_map=None):
                return WeightTransferTrainerFactory.trainer_init(
                    ShardcastTrainerInitInfo(rank=0, daemon=cluster.target("n0"), timeout_s=60, double_buffer=True,
                                             name_map=name_map, data_parallel=dp > 1),
                    client=client, source=ModuleSource(model))

            def changed(edit):
                model = copy.deepcopy(trainer.model)
                edit(model.model)
                return model

            def param(module, name: str, value: torch.Tensor) -> None:
                setattr(module, name, torch.nn.Parameter(value))

            attn, mlp = (lambda m: m.layers[0].self_attn), (lambda m: m.layers[0].mlp)
            refusals = {
                # vLLM holds 4 query heads of 64 (256 rows): 300 rows would be cut silently.
                "longer": (changed(lambda m: param(attn(m).q_proj, "weight", torch.randn(300, 256))), None),
                # 2 KV heads of 64 (128 rows), one per rank at TP=2: rank 1's rows are not there.
                "shorter": (changed(lambda m: param(attn(m).k_proj, "weight", torch.randn(64, 256))), None),
                "transposed": (changed(lambda m: param(mlp(m).gate_proj, "weight", torch.randn(256, 512))), None),
                "float16": (changed(lambda m: setattr(m, "norm", m.norm.to(torch.float16))), None),
                "unknown name": (trainer.model, {"model.norm.weight": "model.final_norm.weight"}),
                "left out": (trainer.model, {"model.norm.weight": None}),
            }
            if dp > 1:  # the refusal paths are the same per engine: one by shape, one by name
                refusals = {k: refusals[k] for k in ("longer", "unknown name")}
            for what, (model, name_map) in refusals.items():
                try:
                    accepted = init(model, name_map)
                except Exception as e:
                    result["refused"][what] = {"error": str(e), "n0": groups("n0"), "n1": groups("n1")}
                    continue
                result["refused"][what] = {"error": "", "n0": groups("n0"), "n1": groups("n1")}
                accepted.shutdown()  # taken after all: undone on both sides, for the next case
                requests.post(f"{url}/shutdown_weight_transfer_engine", timeout=60).raise_for_status()
            mark("refusals")
            engine = init(trainer.model)
            result["registered"] = {"n0": groups("n0"), "n1": groups("n1")}
            mark("initialised")

            def reset_by_hand() -> None:
                requests.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()

            def after(step: int) -> None:
                result[f"dir_{step}"] = trainer.save(step)
                result[f"served_{step}"] = served.generate()
                reset_by_hand()
                result[f"recomputed_{step}"] = served.generate()
                result[f"checks_{step}"] = served.check(result[f"dir_{step}"])
                mark(f"step {step}")

            result["served_0"] = served.generate()  # the prefix cache now holds the system prompt's block
            trainer.train(1)
            # Double-buffered: while step 1's bytes have landed (the sync returned) and the update
            # has not finished, vLLM serves what it served before.
            client.before["update_weights"] = lambda: result.setdefault("served_landed", served.generate())
            engine.send_weights()
            client.before["update_weights"] = None
            result["replicas_1"] = dict(getattr(engine, "replicas", {}))
            after(1)
            with shardcast.Client(cluster.target("n0")) as c:  # what the plan of one replica writes
                result["plan_bytes_needed"] = c.plan("trainer", "vllm" if dp == 1 else "vllm.r0")["bytes_needed"]

            # The user's own calls: an update to a version that never comes.
            requests.post(f"{url}/start_weight_update", timeout=60).raise_for_status()
            reply = requests.post(f"{url}/update_weights", timeout=60,
                                  json={"update_info": {"version": 99, "timeout_s": 1}})
            result["missing_version"] = {"status": reply.status_code, "reply": reply.text}
            result["served_after_missing"] = served.generate()
            trainer.train(2)
            engine.send_weights()
            result["replicas_2"] = dict(getattr(engine, "replicas", {}))
            after(2)

            # n1 frozen as the update starts, killed while the sync waits on it.
            n1 = cluster.daemons["n1"].proc.pid

            def freeze_then_kill():
                os.kill(n1, signal.SIGSTOP)
                threading.Timer(1.5, lambda: os.kill(n1, signal.SIGKILL)).start()

            trainer.train(3)
            client.before["start_weight_update"] = freeze_then_kill
            try:
                engine.send_weights()
                result["killed"] = ""
            except Exception as e:
                result["killed"] = str(e)
            client.before["start_weight_update"] = None
            result["served_after_kill"] = served.generate()
            cluster.restart("n1")
            deadline = time.monotonic() + 60
            while groups("n1") != vllm_groups:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the vLLM workers did not re-register with the restarted daemon in 60 s: "
                                       f"{groups('n1')}, expected {vllm_groups}")
                time.sleep(0.2)
            mark("re-registered")
            trainer.train(4)
            engine.send_weights()
            result["replicas_4"] = dict(getattr(engine, "replicas", {}))
            after(4)
            result["versions_4"] = groups("n1", versions=True)
            result["weight_version"] = requests.get(f"{url}/weight_info", timeout=60).json()["weight_version"]

            if dp == 1:
                # What the reset costs: the engine's own time for it, from its log, and the first
                # request of a long prompt after an update (its prefix computed again) against the
                # same request once the prefix is cached.
                engine.send_weights()
                result["first_after_update_s"] = timed(lambda: served.generate_one(-1))
                result["cached_s"] = timed(lambda: served.generate_one(-1))
                result["finish_s"] = client.seconds.get("finish_weight_update", [])
            engine.shutdown()
            if lora:  # the same server, from a trainer of adapters (step 4's weights stay the base)
                requests.post(f"{url}/shutdown_weight_transfer_engine", timeout=60).raise_for_status()
                try:  # its failure is test_lora.py's; the full-weight results stand
                    result["lora"] = adapter_steps(url, model_dir, cluster.target("n0"),
                                                   os.path.join(out, "adapters"), dp)
                except Exception:
                    result["lora"] = {"error": traceback.format_exc()}
                mark("adapters")
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except Exception:
                server.kill()
        with open(log_path) as f:
            log = f.read()
        result["reset_ms"] = [float(m) for m in re.findall(r"prefix cache reset after the update in ([0-9.]+) ms", log)]
        if "lora" in result and "error" not in result["lora"]:
            # The server's own id for "policy" (its counter starts at 1), as vLLM logged the load.
            result["lora"]["server_log_loads"] = [line.strip() for line in log.splitlines()
                                                  if "Loaded new LoRA adapter" in line]
    print("RESULT " + json.dumps(result), flush=True)


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
