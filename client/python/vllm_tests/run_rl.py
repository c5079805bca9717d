"""An RL loop with a real vLLM: a trainer of two ranks (FSDP2 over gloo, AdamW) trains MODEL for
STEPS steps; after each, `send_weights()` of the shardcast trainer engine (vLLM's trainer factory)
publishes the step on both ranks, syncs it and drives vLLM's update. vLLM runs offline (an `LLM`
in trainer rank 0's process) at tensor-parallel size TP with `weight_transfer_config={"backend":
"shardcast"}`. (`vllm serve` over HTTP: run_recovery.py.) After each step rank 0 saves the full
weights to OUT/step-N (for a fresh vLLM to serve, run_generate.py), records what vLLM serves, and
asks every worker whether its registered bytes are that checkpoint's. An update to a version that
never comes must raise and leave vLLM serving the last step, and at TP >= 2 one more step must
then update it. Prints one JSON result.
Usage: python run_rl.py MODEL TP TARGET OUT STEPS offline|offline-unserved
  TP: "2ep" for expert parallelism, "2x2pp" for two pipeline stages of TP=2. offline-unserved: vLLM
  generates nothing (vLLM 0.32's CPU MoE kernel crashes generating under expert parallelism, with
  or without Shardcast); only the workers' registered bytes are checked."""

from __future__ import annotations

import os
import sys
import time

from engines import Served, report_failure, run_trainer_ranks, save_step, shutdown_llm


def trainer(rank: int, world: int, port: int, model_dir: str, tp: int, target: str, out: str, steps: int,
            mode: str, results) -> None:
    import torch
    import torch.distributed as dist
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
        served = None
        if rank == 0:  # the sender: its vLLM, in this process
            from vllm import LLM

            from engines import OfflineClient, engine_args

            llm = LLM(model=model_dir, worker_extension_cls="worker_ext.ShardcastCheck",
                      weight_transfer_config={"backend": "shardcast"}, **engine_args(tp))
            if str(tp).endswith("pp"):
                llm.collective_rpc("shardcast_pp_buffers")  # a vLLM 0.32 CPU bug (worker_ext.py)
            served, client = Served(llm=llm), OfflineClient(llm)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        t_init = time.monotonic()
        engine = WeightTransferTrainerFactory.trainer_init(
            ShardcastTrainerInitInfo(rank=rank, daemon=target, timeout_s=120),
            client=client if rank == 0 else None, source=ModuleSource(model))
        record = {"steps": [], "engine": type(engine).__name__, "init_s": time.monotonic() - t_init}

        def train_and_send(step: int) -> tuple:
            """One optimizer step and the update; on rank 0 the step's weights saved (and their
            directory), with the loss and how long send_weights took."""
            tokens = torch.randint(3, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            t0 = time.monotonic()
            engine.send_weights()
            seconds = time.monotonic() - t0
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            step_dir = os.path.join(out, f"step-{step}")
            if rank == 0:
                save_step(state, model_dir, step_dir, model)
            return step_dir, float(loss.detach()), seconds

        for step in range(1, steps + 1):
            step_dir, loss, seconds = train_and_send(step)
            if rank == 0:
                record["steps"].append({"dir": step_dir, "loss": loss, "send_s": seconds,
                                        "served": served.generate() if mode != "offline-unserved" else [],
                                        "checks": served.check(step_dir)})
            dist.barrier()
        if rank == 0:  # the groups the workers registered, with their versions
            import shardcast

            with shardcast.Client(target) as probe:
                record["groups"] = {g.group: [r.version for r in g.rank_states] for g in probe.status().groups}
        if rank == 0 and mode == "offline":
            # An update whose version never arrives raises (naming the rank and what it holds); vLLM
            # serves on what it had.
            llm.start_weight_update()
            try:
                llm.update_weights({"update_info": {"version": steps + 1, "timeout_s": 2}})
                record["missing_version_error"] = ""
            except Exception as e:  # vLLM wraps the worker's error
                record["missing_version_error"] = str(e)
            record["served_after"] = served.generate()
            record["weight_version"] = llm.get_weight_version()
        if mode == "offline" and tp != "1":
            # ... and, at TP >= 2, the next update goes through (every worker's reply to the failed
            # call was read, none is left for the next call to take as its own; at TP=1 there is
            # one). What it serves equals what it serves once its prefix cache is emptied by hand:
            # no KV of the old weights is read.
            step_dir, _, _ = train_and_send(steps + 1)
            if rank == 0:
                record["recovered"] = {"served": served.generate(), "checks": served.check(step_dir)}
                llm.reset_prefix_cache()
                record["recovered"]["served_recomputed"] = served.generate()
                record["weight_version"] = llm.get_weight_version()
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
    model_dir, tp, target, out, steps, mode = (sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4],
                                               int(sys.argv[5]), sys.argv[6])
    if mode not in ("offline", "offline-unserved"):
        sys.exit(f"run_rl.py: mode {mode!r}: offline or offline-unserved")
    os.environ["SHARDCAST_ADDRESS"] = target  # where vLLM's workers find their node's daemon
    run_trainer_ranks(trainer, model_dir, tp, target, out, steps, mode)


if __name__ == "__main__":
    main()
