"""Starts vLLM on MODEL at tensor-parallel size TP (CPU); every worker probes its parameters,
derives its destination rank (shardcast.vllm.layout) and registers it with the daemon at TARGET
as group GROUP (the layout gathered from every worker); then this process registers the
checkpoint plus 1 as a source rank ("trainer", version 1), syncs it into GROUP, and asks every
worker whether each registered tensor holds exactly its box of those values. Prints one JSON
result. Usage: python run_sync.py MODEL TP TARGET GROUP"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function

def derive(worker, model_dir: str, target: str):
    from safetensors import safe_open
    from vllm.distributed import get_tensor_model_parallel_rank

    import shardcast
    from shardcast.vllm.layout import rank_memory
    from shardcast.vllm.probe import probe

    model = worker.model_runner.model
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    maps = probe(model, shapes)
    rm = rank_memory(maps, dict(model.named_parameters(remove_duplicate=False)), dict(model.named_modules()))
    client = shardcast.Client(target)
    # Kept on the worker between calls (these functions travel by value: no module state survives).
    worker.shardcast_test = {"rm": rm, "maps": maps, "client": client}
    dtypes = {l.tensor: str(pm.dtype).replace("torch.", "") for pm in maps.values() for l in pm.landings}
    return {"rank": get_tensor_model_parallel_rank(), "node": client.status().node, "pieces": rm.pieces,
            "dtypes": dtypes, "direct": rm.direct, "processed": rm.processed}


def register(worker, group: str, layout: dict):
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    state = worker.shardcast_test
    rm = state["rm"]
    reg = state["client"].register(group, get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(),
                                    rm.tensors, layout)
    state["reg"] = reg
    return reg.registered_bytes


def check(worker, model_dir: str, delta: float):
    import torch
    from safetensors import safe_open

    rm = worker.shardcast_test["rm"]
    wrong = []
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        for name, view in rm.tensors.items():
            offsets, sizes = rm.pieces[name]
            want = f.get_tensor(name)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] + delta
            if not torch.equal(view, want.to(view.dtype)):
                wrong.append(name)
    return {"wrong": wrong, "checked": len(rm.tensors)}


PROMPTS = ["t5 t6 t7", "t9 t3", "t100 t200 t300 t400"]


def generate(llm):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]}
            for o in outs]


def apply(worker):
    from shardcast.vllm.apply import process_staged

    return process_staged(worker.model_runner.model, worker.shardcast_test["rm"].reprocess)


def main() -> None:
    model_dir, tp, target, group = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    from safetensors import safe_open
    from vllm import LLM

    import shardcast
    import torch
    from shardcast.vllm.layout import destination_layout

    llm = LLM(model=model_dir, dtype="float32", max_model_len=128, enforce_eager=True, seed=0,
              gpu_memory_utilization=0.1, tensor_parallel_size=tp)
    ranks = sorted(llm.collective_rpc(derive, args=(model_dir, target)), key=lambda r: r["rank"])
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        values = {k: f.get_tensor(k) for k in f.keys()}
    dtypes = {}
    for r in ranks:
        dtypes.update(r["dtypes"])
    checkpoint = {k: (tuple(v.shape), getattr(torch, dtypes.get(k, "float32"))) for k, v in values.items()}
    layout = destination_layout(group, [r["node"] for r in ranks], [r["pieces"] for r in ranks], checkpoint)
    registered = llm.collective_rpc(register, args=(group, layout))
    # The trainer's side: one source rank holding the checkpoint plus 1, as version 1.
    client = shardcast.Client(target)
    trained = {k: (v + 1.0).contiguous() for k, v in values.items() if any(t["name"] == k for t in layout["tensors"])}
    node = client.status().node
    source = {"group": "trainer", "mesh": {"shape": [1]}, "nodes": [node],
              "tensors": [{"name": k, "shape": list(v.shape), "dtype": "float32"} for k, v in trained.items()]}
    src = client.register("trainer", 0, 1, trained, source, role="source", version=1)
    result = client.sync("trainer", group, 1)
    client.wait_version(group, 1, timeout=60)
    checks = llm.collective_rpc(check, args=(model_dir, 1.0))
    processed = llm.collective_rpc(apply)
    served = generate(llm)
    print("RESULT " + json.dumps({"ranks": [{k: r[k] for k in ("rank", "node", "direct", "processed")} for r in ranks],
                                  "registered_bytes": registered, "checks": checks,
                                  "processed_layers": processed, "served": served,
                                  "bytes_needed": result.bytes_needed, "layout_tensors": len(layout["tensors"])}),
          flush=True)
    src.close()


if __name__ == "__main__":
    main()
