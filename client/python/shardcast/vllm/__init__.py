"""Shardcast inside vLLM (docs/vllm.md).

`shardcast.vllm.probe` finds where each checkpoint tensor lands in a vLLM worker's parameters by
running vLLM's own weight loaders on index tensors: the ground truth a worker's destination layout
is built from. Importing this package does not import vLLM; its modules do, when they are used.
"""
