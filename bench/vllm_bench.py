"""What a Shardcast update of a real vLLM costs, beside vLLM's own reload from a saved checkpoint
(CPU backend, float32, run in the vLLM venv: bash bench/vllm.sh). Two daemons on loopback: n0 holds
the trainer (this process, a Llama of plain tensors), n1 vLLM's worker (TP=1). Every update adds
noise to every parameter, then:

- shardcast: the trainer engine's send_weights, split into start / sync / update / finish
  (seconds), with the sync's wire bytes; "blocked" is how long generation cannot run: start to
  finish without double buffering (bytes land in live parameters), finish alone with it;
- reload: the trainer saves the weights (safetensors) and vLLM reloads them in place
  (collective_rpc("reload_weights", weights_path=...)); generation is blocked for the reload.

    python bench/vllm_bench.py [--hidden 1024] [--layers 8] [--updates 3] [--double-buffer]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--double-buffer", action="store_true")
    args = parser.parse_args()

    import torch
    from transformers import LlamaForCausalLM
    from vllm import LLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from engines import OfflineClient, engine_args, generate, save_step, shutdown_llm
    from models import make_llama
    from shardcast.local import LocalCluster
    from shardcast.vllm.trainer import ShardcastTrainerInitInfo

    work = tempfile.mkdtemp(prefix="shardcast-vllm-bench-")
    model_dir = make_llama(os.path.join(work, "model"), vocab=4096, hidden=args.hidden, layers=args.layers,
                           heads=max(4, args.hidden // 128), kv_heads=max(2, args.hidden // 512))
    rows = []
    with LocalCluster(["n0", "n1"]) as cluster:
        os.environ["SHARDCAST_ADDRESS"] = cluster.target("n1")
        llm = LLM(model=model_dir, weight_transfer_config={"backend": "shardcast"},
                  **engine_args(1))
        client = OfflineClient(llm)
        model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        params = sum(p.numel() for p in model.parameters())
        engine = WeightTransferTrainerFactory.trainer_init(
            ShardcastTrainerInitInfo(rank=0, daemon=cluster.target("n0"), double_buffer=args.double_buffer),
            client=client, source=ModuleSource(model))
        sync, wire = engine.shardcast.sync, []

        def timed_sync(*a, **k):
            t = time.perf_counter()
            response = sync(*a, **k)
            wire.append((time.perf_counter() - t, response.wire_bytes))
            return response

        engine.shardcast.sync = timed_sync
        print(f"vllm_bench: {params / 1e6:.1f} M parameters ({params * 4 / 1e6:.0f} MB float32), "
              f"double buffering {'on' if args.double_buffer else 'off'}", file=sys.stderr)
        for update in range(1, args.updates + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 1e-3)
            t = time.perf_counter()
            engine.send_weights()
            total = time.perf_counter() - t
            s = client.seconds
            sync_s, wire_bytes = wire[-1]
            blocked = s["finish"] if args.double_buffer else s["start"] + sync_s + s["update"] + s["finish"]
            # vLLM's own path: the trainer saves, vLLM reloads from disk.
            t = time.perf_counter()
            path = os.path.join(work, f"step-{update}")
            save_step({k: v.detach() for k, v in model.state_dict().items()}, model_dir, path)
            save_s = time.perf_counter() - t
            t = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
            reload_s = time.perf_counter() - t
            rows.append({"update": update, "start_s": s["start"], "sync_s": sync_s, "update_s": s["update"],
                         "finish_s": s["finish"], "total_s": total, "wire_bytes": wire_bytes, "blocked_s": blocked,
                         "save_s": save_s, "reload_s": reload_s})
        generate(llm)  # still serving
        engine.shutdown()
        shutdown_llm(llm)
    print(f"{'update':>6} {'start':>7} {'sync':>7} {'update':>7} {'finish':>7} {'total':>7} {'wire MB':>8} "
          f"{'blocked':>8} | {'save':>7} {'reload':>7}  (seconds)")
    for r in rows:
        print(f"{r['update']:>6} {r['start_s']:7.3f} {r['sync_s']:7.3f} {r['update_s']:7.3f} {r['finish_s']:7.3f} "
              f"{r['total_s']:7.3f} {r['wire_bytes'] / 1e6:8.1f} {r['blocked_s']:8.3f} | {r['save_s']:7.3f} "
              f"{r['reload_s']:7.3f}")
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "update"}
    print("RESULT " + json.dumps({"parameters": params, "double_buffer": args.double_buffer, "median": med,
                                  "updates": rows}))


if __name__ == "__main__":
    main()
