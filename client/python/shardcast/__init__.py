"""Shardcast's Python client: register a rank's tensors with the node's shardcastd, trigger syncs
between differently sharded groups, watch them and wait for versions.

    import shardcast
    client = shardcast.Client()                      # the node's daemon (Unix socket)
    reg = client.register("trainer", rank, world, model.state_dict(), layout)
    ...                                              # train: the tensors now live in shared memory
    client.sync("trainer", "vllm", version=step)     # every inference rank has step's weights
"""

from shardcast.client import Client, ShardcastError, default_target, DEFAULT_SOCKET
from shardcast.layout import load_layout, layout_from_dtensors, dtensor_available
from shardcast.memory import Registration

__all__ = [
    "Client",
    "ShardcastError",
    "Registration",
    "default_target",
    "DEFAULT_SOCKET",
    "load_layout",
    "layout_from_dtensors",
    "dtensor_available",
]
