"""What a Shardcast update of a LoRA adapter in a real vLLM costs, beside vLLM's own load of the
same adapter from disk (CPU backend, float32, run in the vLLM venv: bash bench/vllm.sh --lora). Two
daemons on loopback: n0 holds the trainer (this process: a PEFT LoRA adapter of rank RANK on every
linear layer of a Llama of plain tensors), n1 vLLM's worker (TP=1, enable_lora). Every update adds
noise to every adapter parameter, then:

- shardcast: the trainer engine's send_weights(lora=...), split into start / sync / update /
  finish (seconds), with the sync's wire bytes; generation is blocked for the finish alone (the
  adapter lands in the worker's own buffers while vLLM serves the previous one);
- disk: the trainer saves the adapter as PEFT does (save_pretrained) and vLLM loads it from there
  (add_lora under a new id, as a request naming a new adapter directory makes it). The bench
  fails unless vLLM serves both alike (tokens, logprobs within 1e-5: see _alike).

    python bench/vllm_lora_bench.py [--hidden 1024] [--layers 8] [--rank 16] [--updates 3]
Prints one table and a JSON line (RESULT ...)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client" / "python" / "vllm_tests"))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _alike(a: list, b: list) -> bool:
    """The same tokens, logprobs within 1e-5: at this model's size vLLM's CPU LoRA path itself gives
    logprobs that differ by up to about 1e-6 between two generations with one adapter loaded from
    disk (measured; the tests' smaller model is bit-stable and is compared bit for bit)."""
    return all(x["tokens"] == y["tokens"] and all(
        sx.keys() == sy.keys() and all(abs(sx[t] - sy[t]) <= 1e-5 for t in sx)
        for sx, sy in zip(x["logprobs"], y["logprobs"])) for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--updates", type=int, default=3)
    args = parser.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM
    from vllm import LLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.lora.request import LoRARequest

    from engines import OfflineClient, engine_args, generate, shutdown_llm
    from models import make_llama
    from shardcast.local import LocalCluster
    from shardcast.vllm.trainer import ShardcastTrainerInitInfo

    work = tempfile.mkdtemp(prefix="shardcast-vllm-lora-bench-")
    model_dir = make_llama(os.path.join(work, "model"), vocab=4096, hidden=args.hidden, layers=args.layers,
                           heads=max(4, args.hidden // 128), kv_heads=max(2, args.hidden // 512))
    rows = []
    with LocalCluster(["n0", "n1"]) as cluster:
        os.environ["SHARDCAST_ADDRESS"] = cluster.target("n1")
        llm = LLM(model=model_dir, enable_lora=True, max_lora_rank=args.rank, max_loras=2,
                  weight_transfer_config={"backend": "shardcast"}, **engine_args(1))
        client = OfflineClient(llm)
        base = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS,
                                                lora_dropout=0.0), adapter_name="policy")
        adapter = [p for n, p in model.named_parameters() if ".lora_" in n]
        params = sum(p.numel() for p in adapter)
        engine = WeightTransferTrainerFactory.trainer_init(
            ShardcastTrainerInitInfo(rank=0, daemon=cluster.target("n0"), lora=True),
            client=client, source=ModuleSource(model))
        request = engine.lora_request("policy")
        print(f"vllm_lora_bench: an adapter of rank {args.rank} on {len(TARGETS)} projections of {args.layers} "
              f"layers: {params / 1e6:.2f} M parameters ({params * 4 / 1e6:.1f} MB float32)", file=sys.stderr)
        for update in range(1, args.updates + 1):
            with torch.no_grad():
                for p in adapter:
                    p.add_(torch.randn_like(p) * 1e-2)
            t = time.perf_counter()
            engine.send_weights()
            total = time.perf_counter() - t
            s, resp = client.seconds, engine.syncs["policy"]
            served = generate(llm, lora_request=request)
            # vLLM's own path: the trainer saves the adapter, vLLM loads it from disk.
            path = os.path.join(work, f"step-{update}")
            t = time.perf_counter()
            model.save_pretrained(path, selected_adapters=["policy"])
            save_s = time.perf_counter() - t
            loaded = LoRARequest(f"disk-{update}", 100 + update, os.path.join(path, "policy")
                                 if os.path.isdir(os.path.join(path, "policy")) else path)
            t = time.perf_counter()
            llm.llm_engine.add_lora(loaded)
            load_s = time.perf_counter() - t
            if not _alike(generate(llm, lora_request=loaded), served):
                raise RuntimeError(f"update {update}: vLLM serves the synced adapter otherwise than the one it loaded")
            rows.append({"update": update, "start_s": s["start"], "sync_s": resp.seconds, "update_s": s["update"],
                         "finish_s": s["finish"], "total_s": total, "wire_bytes": resp.wire_bytes,
                         "disk_bytes": sum(f.stat().st_size for f in Path(path).rglob("*.safetensors")),
                         "save_s": save_s, "load_s": load_s})
        engine.shutdown()
        shutdown_llm(llm)
    print(f"{'update':>6} {'start':>7} {'sync':>7} {'update':>7} {'finish':>7} {'total':>7} {'wire MB':>8} "
          f"| {'save':>7} {'load':>7} {'disk MB':>8}  (seconds)")
    for r in rows:
        print(f"{r['update']:>6} {r['start_s']:7.3f} {r['sync_s']:7.3f} {r['update_s']:7.3f} {r['finish_s']:7.3f} "
              f"{r['total_s']:7.3f} {r['wire_bytes'] / 1e6:8.2f} | {r['save_s']:7.3f} {r['load_s']:7.3f} "
              f"{r['disk_bytes'] / 1e6:8.2f}")
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "update"}
    print("RESULT " + json.dumps({"adapter_parameters": params, "rank": args.rank, "median": med, "updates": rows}))


if __name__ == "__main__":
    main()
