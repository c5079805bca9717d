"""One trainer rank of the RL loop: the example transformer trained with real FSDP2 (gloo on the
CPU, AdamW), its parameters registered in place with its node's daemon. Every step all ranks
train; rank 0 then publishes the step to the inference replicas with one sync into their replica
set, hands the step's full state dict to the inference ranks (so they can check every weight),
and waits for their rollouts before the next step (synchronous on-policy RL). run.py starts four
of these as processes."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import shardcast  # noqa: E402
from shardcast.local import join_process_group  # noqa: E402

import model  # noqa: E402


def train(rank: int, world: int, port: int, daemon: str, steps: int, to_inference, rollouts,
          verify: bool = True) -> None:
    join_process_group(port, rank, world)
    torch.manual_seed(0)  # the same initial weights on every rank before FSDP2 shards them
    net = model.shard_for_training(model.TinyLM(), "fsdp")
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)

    def train_step(step: int) -> float:
        opt.zero_grad()
        loss = model.loss_fn(net, step)
        loss.backward()
        opt.step()
        return loss.item()

    train_step(0)  # FSDP2's lazy init runs in the first forward: register after it
    client = shardcast.Client(daemon)
    # In place: from here on, every optimizer step writes into memory the daemon reads.
    reg = client.register_dtensors("trainer", dict(net.named_parameters()))
    for step in range(1, steps + 1):
        # Acquire (waits until no sync reads these weights), train, publish `step`: a sync reads
        # exactly the weights of the version it names. publish() also fails loudly if anything
        # replaced a registered parameter's storage.
        with reg.writing(step):
            loss = train_step(step)
        full = {n: p.full_tensor().detach().numpy().copy() for n, p in net.named_parameters()}  # collective
        dist.barrier()  # every rank has finished step `step`: its weights are final
        if rank == 0:
            # Into the replica set "inference": every replica (2 of TP=2) takes part, waited for
            # until registered; without min_replicas a replica not registered yet would be cut.
            result = client.sync("trainer", "inference", step, verify=verify, wait_for_ranks=True, timeout=120,
                                 min_replicas=len(to_inference) // 2)
            print(f"trainer: step {step} (loss {loss:.4f}) published: {result.network_bytes} B over the network in "
                  f"{result.seconds * 1e3:.1f} ms{' (plan cached)' if result.plan_cached else ''}", flush=True)
            for q in to_inference:
                q.put((step, full))
            for _ in to_inference:  # the rollouts of this step's policy
                rollouts.get(timeout=120)
        dist.barrier()  # nobody trains step+1 before the rollouts of step are in
    reg.close()
    client.close()
    dist.destroy_process_group()
