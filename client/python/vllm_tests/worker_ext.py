"""A vLLM worker extension for the tests (`worker_extension_cls`, `--worker-extension-cls`): asks a
worker whether the bytes its shardcast backend registered are a checkpoint's, cut the vLLM way."""

from __future__ import annotations

import os


class ShardcastCheck:
    def shardcast_check(self, checkpoint_dir: str, strict: bool = False) -> dict:
        """Every tensor this worker's rank registered (a view into the live parameter for direct
        ones, the staging tensor for processed ones) against its box of the checkpoint in
        `checkpoint_dir`: the names that differ, and which parameters took which path; the group
        the rank registered, and the group its last catch-up read ("" for none); what the boxes say a
        sync writes into each parameter, and the bytes it writes into the rank. `strict`: raise
        when a tensor differs (vLLM returns one data-parallel engine's result over HTTP, but any
        engine's error)."""
        import torch
        from safetensors import safe_open

        memory = self.weight_transfer_engine.memory
        wrong = []
        with safe_open(os.path.join(checkpoint_dir, "model.safetensors"), "pt") as f:
            for name, view in memory.tensors.items():
                offsets, sizes = memory.pieces[name]
                want = f.get_tensor(name)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                if not torch.equal(view, want.to(view.dtype)):
                    wrong.append(name)
        engine = self.weight_transfer_engine
        if strict and wrong:
            raise AssertionError(f"{engine.group}: registered tensors differ from {checkpoint_dir}: {wrong}")
        return {"wrong": wrong, "checked": len(memory.tensors), "direct": memory.direct,
                "processed": memory.processed, "group": engine.group, "seeded_from": engine.seeded_from,
                # From the boxes: per parameter (elements, written by one tensor's box, zero padding),
                # and the bytes a sync writes into this rank.
                "coverage": memory.coverage,
                "registered_bytes": sum(t.numel() * t.element_size() for t in memory.tensors.values())}

    def shardcast_pp_buffers(self) -> bool:
        """vLLM 0.32's CPU backend with pipeline stages and enforce_eager: a later stage's model
        runner allocates its buffer for the previous stage's activations only in the warm-up run that
        compilation does, so an eager engine fails its first step (`assert self.intermediate_tensors
        is not None`, without Shardcast too). Allocates it as that run would. True where it did."""
        from vllm.distributed.parallel_state import get_pp_group

        runner = self.model_runner
        if get_pp_group().is_first_rank or runner.intermediate_tensors is not None:
            return False
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)
        return True

    def shardcast_lora_ids(self) -> list:
        """The ids of the LoRA adapters vLLM holds in this worker's adapter cache."""
        return sorted(self.model_runner.lora_manager.list_adapters())
