#!/usr/bin/env python3
"""Reinforcement learning with a real vLLM, its weights kept current by Shardcast.

A policy (a tiny Llama made here from a transformers config, or --model DIR) is trained by two
trainer ranks (FSDP2 over gloo on the CPU, AdamW). Every step vLLM samples completions from the
current policy, each is rewarded for how many of its tokens are among the 64 lowest ids ("t0" to
"t63", an eighth of the vocabulary), the trainer takes a policy-gradient
step on them (REINFORCE with a mean baseline), and `send_weights()` of the shardcast trainer
engine puts the new weights into vLLM. vLLM takes them through its weight-transfer API:
`LLM(..., weight_transfer_config={"backend": "shardcast"})`; nothing else in it changes.

Every step it also checks that the loop is on-policy: the log-probabilities vLLM reported for the
tokens it sampled must be the trainer's own for the same tokens (float32, up to kernel rounding).

    bash scripts/deps.sh vllm && bash scripts/build.sh     # the vLLM venv, and shardcastd
    .venv-vllm/bin/python client/examples/vllm_rl/run.py [--steps 5] [--model DIR]

Exit status 0 when every step's rollouts came from the weights the trainer had at that step.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch.multiprocessing as mp

REWARDED = 64  # token ids below this earn the reward
PROMPTS = ["t5 t6", "t9 t3", "t100 t200", "t11 t12 t13"]
SAMPLES = 4  # completions per prompt
TOLERANCE = 1e-3  # |vLLM's logprob - the trainer's| for the same token


def make_policy(path: str) -> str:
    """A Llama of 2 layers (hidden 256, GQA) with a word-level tokenizer ("t<i>" is token i),
    saved to `path` in float32 (once)."""
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    tokenizer = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(512)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(path)
    return path


def rollouts(llm, step: int):
    """SAMPLES completions per prompt from vLLM: (prompt ids, completion ids, vLLM's logprob of
    each completion token, reward)."""
    from vllm import SamplingParams

    params = SamplingParams(n=SAMPLES, max_tokens=8, temperature=1.0, logprobs=0, seed=step)
    out = []
    for request in llm.generate(PROMPTS, params, use_tqdm=False):
        for c in request.outputs:
            tokens = list(c.token_ids)
            logprobs = [c.logprobs[i][t].logprob for i, t in enumerate(tokens)]
            reward = sum(t < REWARDED for t in tokens) / len(tokens)
            out.append((list(request.prompt_token_ids), tokens, logprobs, reward))
    return out


def token_logprobs(model, samples):
    """The model's log-probability of every completion token (one row per sample, padded)."""
    import torch

    longest = max(len(p) + len(c) for p, c, _, _ in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest - 1, dtype=torch.bool)
    for i, (prompt, completion, _, _) in enumerate(samples):
        ids[i, :len(prompt) + len(completion)] = torch.tensor(prompt + completion)
        mask[i, len(prompt) - 1:len(prompt) + len(completion) - 1] = True
    logits = model(input_ids=ids).logits[:, :-1].float()
    chosen = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return chosen, mask


def trainer(rank: int, port: int, policy: str, daemon: str, steps: int, results) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from shardcast.local import join_process_group
    from shardcast.vllm.clients import LLMWeightSyncClient
    from shardcast.vllm.trainer import ShardcastTrainerInitInfo

    join_process_group(port, rank, 2)
    llm = client = None
    if rank == 0:  # vLLM runs beside trainer rank 0 (its engine and worker are processes of their own)
        from vllm import LLM

        llm = LLM(model=policy, dtype="float32", max_model_len=128, enforce_eager=True, seed=0,
                  gpu_memory_utilization=0.1, weight_transfer_config={"backend": "shardcast"})
        client = LLMWeightSyncClient(llm)  # vLLM's sync-client protocol over this LLM
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Registers this rank's shards in place with the node's daemon; rank 0 tells vLLM's workers.
    engine = WeightTransferTrainerFactory.trainer_init(ShardcastTrainerInitInfo(rank=rank, daemon=daemon),
                                                       client=client, source=ModuleSource(model))
    worst = 0.0
    for step in range(1, steps + 1):
        box = [rollouts(llm, step) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        samples = box[0]
        with torch.no_grad():  # on-policy: vLLM sampled from the weights the trainer holds
            chosen, mask = token_logprobs(model, samples)
        served = torch.zeros_like(chosen)
        for i, (prompt, _, logprobs, _) in enumerate(samples):
            served[i, len(prompt) - 1:len(prompt) - 1 + len(logprobs)] = torch.tensor(logprobs)
        gap = float((chosen - served).abs()[mask].max())
        worst = max(worst, gap)
        rewards = torch.tensor([s[3] for s in samples])
        advantages = rewards - rewards.mean()
        mine = list(range(rank, len(samples), 2))  # each rank trains on half of the rollouts
        chosen, mask = token_logprobs(model, [samples[i] for i in mine])
        loss = -(advantages[mine] * (chosen * mask).sum(dim=1)).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        t0 = time.monotonic()
        engine.send_weights()  # every rank publishes the step; rank 0 syncs and updates vLLM
        if rank == 0:
            print(f"step {step}: mean reward {float(rewards.mean()):.3f}, |vLLM - trainer| logprob "
                  f"{gap:.1e}, weights to vLLM in {time.monotonic() - t0:.2f} s (version "
                  f"{llm.get_weight_version()})", flush=True)
    engine.shutdown()
    if rank == 0:
        import psutil

        try:
            llm.llm_engine.engine_core.shutdown()  # vLLM's engine and worker processes
        except psutil.NoSuchProcess:
            pass  # vLLM 0.32, forcing a slow engine down, tripped over a worker that had exited; the engine exits with us
        results.put(worst)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model", help="a float32 Hugging Face model directory (default: a tiny Llama made here)")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
    from shardcast.local import LocalCluster, TorchRendezvous

    with tempfile.TemporaryDirectory() as scratch, LocalCluster(["n0"]) as cluster:
        policy = args.model or make_policy(os.path.join(scratch, "policy"))
        os.environ["SHARDCAST_ADDRESS"] = cluster.target("n0")  # where vLLM's workers find the daemon
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        rendezvous = TorchRendezvous()
        ranks = [ctx.Process(target=trainer, args=(r, rendezvous.port, policy, cluster.target("n0"), args.steps,
                                                   results)) for r in range(2)]
        for p in ranks:
            p.start()
        while any(p.is_alive() for p in ranks):
            if any(p.exitcode not in (None, 0) for p in ranks):
                break  # a rank failed: the other would wait for it in a collective
            time.sleep(0.5)
        if any(p.exitcode != 0 for p in ranks):
            for p in ranks:
                p.kill()  # (rank 0's vLLM processes notice their parent is gone and exit)
            print("a trainer rank failed (its error is above)", file=sys.stderr)
            return 1
        worst = results.get(timeout=10)
    print(f"on-policy: the largest gap between vLLM's and the trainer's logprobs was {worst:.1e} "
          f"(tolerance {TOLERANCE:g})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
