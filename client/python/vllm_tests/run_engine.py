"""vLLM with `weight_transfer_config={"backend": "shardcast"}` (the plugin found through its
entry point, nothing else changed in vLLM): the RL calls as a trainer makes them. Registers the
checkpoint plus 1 as a source rank on the daemon at TARGET, inits the engine, syncs version 1,
then start / update_weights({"version": 1}) / finish; prints the served tokens, and what an
update to a version that never comes raises, and what is served after it.
Usage: python run_engine.py MODEL TP TARGET"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    model_dir, tp, target = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    import torch
    from safetensors import safe_open
    from vllm import LLM

    import shardcast
    from run_sync import generate

    llm = LLM(model=model_dir, dtype="float32", max_model_len=128, enforce_eager=True, seed=0,
              gpu_memory_utilization=0.1, tensor_parallel_size=tp,
              weight_transfer_config={"backend": "shardcast"})
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        values = {k: f.get_tensor(k) for k in f.keys()}
    checkpoint = {k: [list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in values.items()}
    llm.init_weight_transfer_engine({"init_info": {"checkpoint": checkpoint, "group": "vllm", "daemon": target}})
    # The trainer: version 1 is the checkpoint plus 1.
    client = shardcast.Client(target)
    node = client.status().node
    trained = {k: (v + 1.0).contiguous() for k, v in values.items()}
    layout = {"group": "trainer", "mesh": {"shape": [1]}, "nodes": [node],
              "tensors": [{"name": k, "shape": list(v.shape), "dtype": "float32"} for k, v in trained.items()]}
    src = client.register("trainer", 0, 1, trained, layout, role="source", version=1)
    client.sync("trainer", "vllm", 1)
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 1}})
    llm.finish_weight_update("1")
    served = generate(llm)
    # An update whose version never arrives: raises, and the engine serves on what it had.
    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": {"version": 2, "timeout_s": 2}})
        missing = ""
    except Exception as e:  # vLLM wraps the worker's error
        missing = str(e)
    served_after = generate(llm)
    print("RESULT " + json.dumps({"served": served, "missing_version_error": missing, "served_after": served_after,
                                  "weight_version": llm.get_weight_version()}), flush=True)
    src.close()


if __name__ == "__main__":
    main()
