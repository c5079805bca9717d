"""LoRA adapters as versions, against a real vLLM: a trainer of two ranks (FSDP2 over gloo, AdamW)
trains two PEFT LoRA adapters of MODEL, "policy" (rank 8, every linear layer) and "critic" (rank 4,
q/v/down and the token embedding: PEFT's lora_embedding_A/B, vLLM's vocabulary-parallel LoRA
layer), and syncs them with the shardcast trainer engine (`lora=True`) into an offline vLLM at
tensor-parallel size TP started with enable_lora. Two daemons: n0 serves the trainer, n1 vLLM.

- Refused first: adapters vLLM does not take (a rank above its max_lora_rank, DoRA). Each
  trainer_init raises on both ranks naming the adapter and why, and leaves nothing registered on
  either daemon.
- Step 1 sends both adapters, step 2 only "policy", step 3 only "critic" (each adapter its own
  group and version; the other keeps serving its own).
- While a step's bytes have landed and vLLM's update has not finished (just before
  update_weights), vLLM serves each carried adapter's previous version, whole.
- After each step: what vLLM serves with each adapter (greedy tokens, logprobs), and without one
  (the base model, which no update touches); the step's adapters saved with PEFT's own
  get_peft_model_state_dict to OUT/step-N/<adapter> (for a fresh vLLM to load from disk,
  run_lora_generate.py).
- Step 4: n1 frozen as the update starts and killed while the sync waits on it: send_weights
  raises on both ranks, and vLLM serves step 3's adapters.
Prints one JSON result.
Usage: python run_lora.py MODEL TP OUT"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from engines import report_failure, run_trainer_ranks, shutdown_llm

ADAPTERS = {"policy": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"]),
            # Not lm_head: vLLM 0.32's CPU LoRA kernels apply the last adapter slot's lm_head delta to
            # requests without an adapter (the base model's would change; docs/vllm.md, "What is left").
            "critic": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens"])}
# The adapters each step sends (None: every one).
STEPS = {1: None, 2: ["policy"], 3: ["critic"], 4: None}


def trainer(rank: int, world: int, port: int, model_dir: str, tp: int, trainer_daemon: str, vllm_daemon: str,
            vllm_daemon_pid: int, out: str, results) -> None:
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from shardcast.local import join_process_group
    from shardcast.vllm.trainer import ShardcastTrainerInitInfo

    llm = None
    try:
        join_process_group(port, rank, world)
        client = None
        if rank == 0:  # the sender, with vLLM offline in this process
            from vllm import LLM

            from engines import OfflineClient, engine_args

            os.environ["SHARDCAST_ADDRESS"] = vllm_daemon  # where vLLM's workers find their node's daemon
            llm = LLM(model=model_dir, enable_lora=True, max_lora_rank=16, max_loras=2,
                      weight_transfer_config={"backend": "shardcast"}, **engine_args(tp))
            client = OfflineClient(llm)
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))

        def peft_model(adapters: dict):
            torch.manual_seed(0)
            base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            names = list(adapters)
            model = get_peft_model(base, LoraConfig(lora_dropout=0.0, **adapters[names[0]]), adapter_name=names[0])
            for name in names[1:]:
                model.add_adapter(name, LoraConfig(lora_dropout=0.0, **adapters[name]))
            model.base_model.set_adapter(names)  # all trained, each step
            for layer in model.base_model.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return base, model

        def init(model):
            return WeightTransferTrainerFactory.trainer_init(
                ShardcastTrainerInitInfo(rank=rank, daemon=trainer_daemon, timeout_s=60, lora=True),
                client=client, source=ModuleSource(model))

        record = {"refused": {}, "steps": []}
        for what, adapter in {"rank 32": dict(r=32, lora_alpha=32, target_modules=["q_proj"]),
                              "dora": dict(r=8, lora_alpha=8, target_modules=["q_proj"], use_dora=True)}.items():
            try:
                init(peft_model({"policy": adapter})[1])
                refused = ""
            except Exception as e:
                refused = str(e)
            dist.barrier()  # every rank has unregistered (each does when trainer_init raises)
            if rank == 0:
                import shardcast

                groups = {}
                for node, target in (("n0", trainer_daemon), ("n1", vllm_daemon)):
                    with shardcast.Client(target) as c:
                        groups[node] = sorted(g.group for g in c.status().groups)
                record["refused"][what] = {"error": refused, "groups": groups}
            dist.barrier()
        names = list(ADAPTERS)
        base, model = peft_model(ADAPTERS)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
        engine = init(model)
        record["ids"] = dict(engine.lora_ids)
        if rank == 0:
            from engines import generate

            def serve() -> dict:
                return {name: generate(llm, lora_request=engine.lora_request(name)) for name in names}

            record["base"] = generate(llm)

        def train(step: int) -> None:
            tokens = torch.randint(3, base.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        def save(step: int, carried) -> dict:
            """The carried adapters as PEFT saves them (every rank takes part in the gather)."""
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            dirs = {}
            if rank == 0:
                from safetensors.torch import save_file

                for name in carried:
                    path = os.path.join(out, f"step-{step}", name)
                    os.makedirs(path, exist_ok=True)
                    tensors = get_peft_model_state_dict(model, state_dict=state, adapter_name=name)
                    save_file({k: v.contiguous() for k, v in tensors.items()},
                              os.path.join(path, "adapter_model.safetensors"))
                    model.peft_config[name].save_pretrained(path)
                    dirs[name] = path
            return dirs

        served = {}
        for step in (1, 2, 3):
            carried = STEPS[step] or names
            train(step)
            if rank == 0 and served:
                during = {}
                client.before["update"] = lambda: during.update(
                    {name: generate(llm, lora_request=engine.lora_request(name)) for name in carried})
            t0 = time.monotonic()
            engine.send_weights(adapters=STEPS[step])
            seconds = time.monotonic() - t0
            dirs = save(step, carried)
            if rank == 0:
                client.before["update"] = None
                previous, served = served, serve()
                record["steps"].append({
                    "carried": carried, "dirs": dirs, "send_s": seconds, "served": served,
                    "during_matches_previous": {n: during[n] == previous[n] for n in carried} if previous else {},
                    "wire_bytes": {n: engine.syncs[n].wire_bytes for n in carried},
                    "network_bytes": {n: engine.syncs[n].network_bytes for n in carried},
                    "sync_s": {n: engine.syncs[n].seconds for n in carried},
                    "finish_s": client.seconds.get("finish"), "base": generate(llm)})
            if rank == 0 and step == 1:
                # vLLM drops an adapter (its own remove_lora, as its cache evicting it or a data-parallel
                # engine's idle step does): the next request naming it gets the version in service.
                llm.llm_engine.remove_lora(engine.lora_ids["policy"])
                record["after_drop_matches"] = serve() == served
            dist.barrier()

        # Step 4: n1 (vLLM's daemon) frozen as the update starts, killed while the sync waits on it.
        train(4)
        if rank == 0:
            def freeze_then_kill():
                os.kill(vllm_daemon_pid, signal.SIGSTOP)
                threading.Timer(1.5, lambda: os.kill(vllm_daemon_pid, signal.SIGKILL)).start()

            client.before["start"] = freeze_then_kill
        try:
            engine.send_weights()
            killed = ""
        except Exception as e:
            killed = str(e)
        if rank == 0:
            client.before["start"] = None
            record["killed"] = killed
            record["served_after_kill"] = serve()
        dist.barrier()
        engine.shutdown()
        if rank == 0:
            shutdown_llm(llm)  # its engine and worker processes, before this one exits
        dist.destroy_process_group()
        if rank == 0:
            results.put(record)
    except BaseException as e:  # the driver reports it
        report_failure(results, rank, e, llm)
        raise


def main() -> None:
    model_dir, tp, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    from shardcast.local import LocalCluster

    with LocalCluster(["n0", "n1"]) as cluster:
        run_trainer_ranks(trainer, model_dir, tp, cluster.target("n0"), cluster.target("n1"),
                          cluster.daemons["n1"].proc.pid, out)


if __name__ == "__main__":
    main()
