"""The `shardcast` backend from both ends through vLLM's own factories: a trainer (the Hugging
Face model of MODEL, in this process) takes the trainer engine from
`WeightTransferTrainerFactory.trainer_init(ShardcastTrainerInitInfo(...), client=..., source=
ModuleSource(model))`; vLLM (TP) takes the worker engine from `weight_transfer_config`. One
"training step" adds 1 to every parameter, `send_weights()` publishes, syncs and updates vLLM.
Prints the served tokens and vLLM's weight version. Usage: python run_trainer.py MODEL TP TARGET"""

from __future__ import annotations

import json
import sys


class OfflineClient:
    """vLLM's VLLMWeightSyncClient protocol over an offline LLM in this process."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info):
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self):
        self.llm.start_weight_update()

    def update_weights(self, update_info):
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version=None):
        self.llm.finish_weight_update(weight_version)


def main() -> None:
    model_dir, tp, target = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    import torch
    from transformers import LlamaForCausalLM
    from vllm import LLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from run_sync import generate
    from shardcast.vllm.trainer import ShardcastTrainerInitInfo

    llm = LLM(model=model_dir, dtype="float32", max_model_len=128, enforce_eager=True, seed=0,
              gpu_memory_utilization=0.1, tensor_parallel_size=tp, weight_transfer_config={"backend": "shardcast"})
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    engine = WeightTransferTrainerFactory.trainer_init(ShardcastTrainerInitInfo(rank=0, daemon=target),
                                                       client=OfflineClient(llm), source=ModuleSource(model))
    with torch.no_grad():  # the training step
        for p in model.parameters():
            p.add_(1.0)
    engine.send_weights()
    print("RESULT " + json.dumps({"served": generate(llm), "weight_version": llm.get_weight_version(),
                                  "engine": type(engine).__name__}), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
