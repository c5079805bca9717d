"""One trainer rank of the GPU test (test_gpu.py), in its own process: torch.distributed over gloo,
a DTensor on a CUDA device mesh whose local shard is a CUDA tensor, registered in place with its
node's daemon (CUDA IPC, no copy). Talks to the test over a pipe."""

from __future__ import annotations

ROWS, COLS = 96, 64


def full_weights():
    import torch

    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(ROWS, COLS, generator=g),
            "b": torch.randn(COLS, generator=g).to(torch.bfloat16)}


def main(rank: int, world: int, port: int, target: str, group: str, conn) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import shardcast
    from shardcast.local import join_process_group

    try:
        join_process_group(port, rank, world)
        torch.cuda.set_device(0)  # every rank on the one GPU: IPC handles name device 0
        mesh = init_device_mesh("cuda", (world,))
        full = full_weights()
        # from_local: each rank's shard is its own CUDA tensor (no collective is needed to build it).
        params = {"w": DTensor.from_local(full["w"].chunk(world, dim=0)[rank].cuda(), mesh, [Shard(0)],
                                          run_check=False),
                  "b": DTensor.from_local(full["b"].cuda(), mesh, [Replicate()], run_check=False)}
        assert all(p.to_local().is_cuda for p in params.values())
        client = shardcast.Client(target)
        reg = client.register_dtensors(group, params, version=1)
        conn.send(("registered", None))
        while conn.recv() != "exit":
            pass
        reg.close()
        client.close()
        dist.destroy_process_group()
        conn.send(("closed", None))
    except Exception as e:  # reported to the test, which fails with it
        import traceback

        conn.send(("error", f"trainer rank {rank}: {e!r}\n{traceback.format_exc()}"))
