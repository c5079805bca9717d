"""A LoRA adapter into a running `vllm serve` (started with --enable-lora, --api-server-count 1 and
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; run_recovery.py runs it on its data-parallel server once the
full-weight steps are done), named in its OpenAI routes. The trainer, in the calling process: a
PEFT LoRA adapter "policy" on the Hugging Face model of `model_dir` (plain tensors), AdamW, the shardcast
trainer engine with lora=True, on daemon `trainer_daemon`, driving the server through vLLM's
HTTPVLLMWeightSyncClient. With DP > 1 engines each is one replica of the adapter's set
(`data_parallel`), and what is served is asked of every engine (`served_N`: one list per engine).

- Before the first update no model "policy" is listed, and a request naming it is refused (404)
  while the server serves on.
- Steps 1 and 2: each update names the adapter at the server (step 1) and serves the step's
  adapter to /v1/completions requests for model "policy"; the step's adapter is saved as PEFT
  saves it to `out`/step-N (for a fresh vLLM to load from disk).
- The server loads the adapter under an id of its own (its counter: 1): after step 2's update the
  worker puts it back under that id alone (`lora_ids_N`: the ids vLLM's adapter cache holds).
- The server's weight transfer shuts down before the trainer's engine: a request naming the
  adapter is served step 2's version (vLLM's engine survives it). The trainer engine shuts down:
  the name is taken back, a request naming it is refused, and the base model serves on.
- A new trainer engine takes the adapter: step 3 names it again and serves it.
"""

from __future__ import annotations


def adapter_steps(url: str, model_dir: str, trainer_daemon: str, out: str, dp: int) -> dict:
    """Runs the steps above against the server at `url`, started on `model_dir` (its base model's
    name in the OpenAI routes); the adapter trains on that model. Returns what each step saw."""
    import requests
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from engines import PolicyAdapterTrainer, Served
    from shardcast.vllm.trainer import ShardcastTrainerInitInfo

    result: dict = {}
    trainer = PolicyAdapterTrainer(model_dir, out)

    def models() -> list:
        return sorted(card["id"] for card in requests.get(f"{url}/v1/models", timeout=60).json()["data"])

    def policy_status() -> int:
        return requests.post(f"{url}/v1/completions", timeout=60, json={
            "model": "policy", "prompt": "hello", "max_tokens": 2}).status_code

    # "policy" asked of each engine (of whichever vLLM picks, without data-parallel engines)
    policy = [Served(url=url, model="policy", engine=k if dp > 1 else None) for k in range(dp)]
    base = Served(url=url, model=model_dir)
    client = HTTPVLLMWeightSyncClient(url)

    def init():
        return WeightTransferTrainerFactory.trainer_init(
            ShardcastTrainerInitInfo(rank=0, daemon=trainer_daemon, timeout_s=60, lora=True, data_parallel=dp > 1),
            client=client, source=ModuleSource(trainer.model))

    def lora_ids() -> list:  # with data-parallel engines: the first engine's (vLLM answers with its)
        r = requests.post(f"{url}/collective_rpc", timeout=60, json={"method": "shardcast_lora_ids"})
        r.raise_for_status()
        return r.json()["results"][0]

    def step(engine, n: int) -> None:
        trainer.train(n)
        engine.send_weights()
        result[f"lora_ids_{n}"] = lora_ids()
        result[f"dir_{n}"] = trainer.save(n)
        result[f"models_{n}"] = models()
        result[f"served_{n}"] = [p.generate() for p in policy]
        result[f"base_{n}"] = base.generate()

    engine = init()
    result["models_0"], result["policy_status_0"] = models(), policy_status()
    result["base_0"] = base.generate()
    step(engine, 1)
    step(engine, 2)
    # The server's weight transfer shut down first, the trainer's engine still up: the name is
    # still given, the workers dropped their adapters, and the request that names it is answered
    # from step 2's version (the engine survives it).
    client.shutdown_weight_transfer_engine()
    result["lora_ids_shut"] = lora_ids()
    result["served_shut"], result["models_shut"] = [p.generate() for p in policy], models()
    engine.shutdown()
    result["models_after"], result["policy_status_after"] = models(), policy_status()
    result["base_after"] = base.generate()
    # A new trainer engine takes the adapter again: named once its first update serves.
    engine = init()
    result["models_reinit"] = models()
    step(engine, 3)
    engine.shutdown()
    client.shutdown_weight_transfer_engine()
    return result
