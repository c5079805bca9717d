"""Starts vLLM on MODEL at tensor-parallel size TP (CPU), probes every worker's parameters
(shardcast.vllm.probe) and prints one JSON object: per worker, per parameter, its loader-layout
shape, its landings, and, where the live parameter is in the loader's layout, whether it holds
exactly the checkpoint's bytes there; plus greedy tokens before and after probing.
Usage: python run_probe.py MODEL TP"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function


def probe_worker(worker, model_dir: str):
    import torch
    from safetensors import safe_open

    from shardcast.vllm.probe import probe

    model = worker.model_runner.model
    values = {}
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        for k in f.keys():
            values[k] = f.get_tensor(k)
    maps = probe(model, {k: tuple(v.shape) for k, v in values.items()})
    live = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name, pm in maps.items():
        held = None
        lp = live[name]
        if tuple(lp.shape) == pm.shape:  # direct: the live parameter is the loader's layout
            flat = lp.detach().reshape(-1)
            held = all(torch.equal(flat[l.at:l.at + l.numel],
                                   values[l.tensor][tuple(slice(o, o + s) for o, s in zip(l.offsets, l.sizes))]
                                   .reshape(-1).to(flat.dtype))
                       for l in pm.landings)
        out[name] = {"shape": list(pm.shape), "live_shape": list(lp.shape), "holds_checkpoint": held,
                     "landings": [[l.tensor, list(l.offsets), list(l.sizes), l.at] for l in pm.landings]}
    return out


def main() -> None:
    model_dir, tp = sys.argv[1], int(sys.argv[2])
    from vllm import LLM

    from engines import engine_args, generate

    llm = LLM(model=model_dir, **engine_args(tp, **({"distributed_executor_backend": "uni"} if tp == 1 else {})))
    before = generate(llm)
    workers = llm.collective_rpc(probe_worker, args=(model_dir,))
    after = generate(llm)
    print("RESULT " + json.dumps({"workers": workers, "before": before, "after": after}), flush=True)


if __name__ == "__main__":
    main()
