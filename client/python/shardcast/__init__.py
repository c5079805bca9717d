"""Shardcast's Python client: register a rank's tensors with the node's shardcastd, trigger syncs
between differently sharded groups, watch them and wait for versions.

    import shardcast
    client = shardcast.Client()                      # the node's daemon (Unix socket)
    # trainer rank (FSDP2 / TP DTensors), in place: every optimizer step lands in shared memory
    reg = client.register_dtensors("trainer", dict(model.named_parameters()))   # a source group
    with reg.writing(step):                          # waits for syncs reading it, then publishes step
        optimizer.step()
    client.sync("trainer", "vllm", version=step)     # every inference rank has step's weights
    # inference rank: its local tensors and its parallel plan (TP, fused qkv / gate_up, experts)
    plan = shardcast.ParallelPlan(tp_size=4, tp_rank=r, column=["*q_proj*"], row=["*o_proj*"], fused={...})
    client.register_inference("vllm", local_tensors, plan, meta_model.state_dict(), nodes=[...])
    # fp8 serving: ParallelPlan(..., fp8=["*proj.weight"]); shardcast.local_tensors(plan, model)
    # allocates each rank's fp8 parts and their float32 scale buffers
"""

import os

# gRPC's fork handlers run in every fork() after a channel exists (torch, multiprocessing,
# subprocess) and, since this client's channel threads are always busy, skip themselves and say so
# on stderr each time. Nothing here forks and uses gRPC in the child, so they are turned off. gRPC
# reads this once, when grpc is first imported: it is set before the imports below, and an
# application's own setting wins.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from shardcast import fp8  # light: its functions import torch when called
from shardcast.client import Client, ShardcastError, TlsFiles, default_target, describe_rank, DEFAULT_SOCKET
from shardcast.layout import load_layout, layout_from_dtensors, dtensor_available
from shardcast.memory import CuMemBuffer, ForeignMemoryWarning, Registration
from shardcast.parallel import ParallelPlan, fp8_scale_name, inference_layout, local_shapes, local_tensors

__all__ = [
    "fp8",
    "Client",
    "ShardcastError",
    "TlsFiles",
    "Registration",
    "CuMemBuffer",
    "ForeignMemoryWarning",
    "default_target",
    "describe_rank",
    "DEFAULT_SOCKET",
    "load_layout",
    "layout_from_dtensors",
    "dtensor_available",
    "ParallelPlan",
    "inference_layout",
    "local_shapes",
    "local_tensors",
    "fp8_scale_name",
]
