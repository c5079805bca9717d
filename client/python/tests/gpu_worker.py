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


# ---- FSDP2-style shards of a few GiB, as views at offsets inside one allocation per rank ----

# (name, rows, cols, dtype, salt): the trainer's tensors. Rows are odd, so the shards are uneven
# (torch.chunk: rank 0 holds one row more) and rank 1's shard is a view of a padded slot, as FSDP2's is.
def big_tensors(gib: float):
    cols = 8192
    embed_rows = int(gib * 0.75 * (1 << 30)) // (cols * 2) | 1
    proj_rows = int(gib * 0.25 * (1 << 30)) // (cols * 2) | 1
    return [("embed", embed_rows, cols, "bfloat16", 1), ("proj", proj_rows, cols, "bfloat16", 2)]


NORM = ("norm", 8192, "float32", 3)  # replicated, allocated on its own (a small block: a nonzero torch offset)
PATTERN_CHUNK = 64 << 20  # bytes generated at a time


def pattern(salt: int, start: int, n: int):
    """The bytes [start, start + n) of tensor `salt`'s row-major bytes: a hash of the byte index, so
    any slice can be made where it is needed, on the GPU, without the whole tensor."""
    import torch

    i = torch.arange(start, start + n, dtype=torch.int64, device="cuda")
    return ((i * 2654435761 + salt * 40503) >> 13).bitwise_and_(0xFF).to(torch.uint8)


def fill(dst, salt: int, start: int) -> None:
    """Writes pattern(salt, start + k) into byte k of the uint8 tensor `dst`."""
    for off in range(0, dst.numel(), PATTERN_CHUNK):
        n = min(PATTERN_CHUNK, dst.numel() - off)
        dst[off:off + n].copy_(pattern(salt, start + off, n))


def shard_rows(rows: int, world: int, rank: int):
    """torch.chunk's split of `rows`: (first row, row count) of `rank`."""
    per = -(-rows // world)
    first = min(rows, per * rank)
    return first, max(0, min(rows, first + per) - first)


def fsdp_main(rank: int, world: int, port: int, target: str, group: str, gib: float, conn) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import shardcast
    from shardcast.local import join_process_group

    try:
        join_process_group(port, rank, world)
        torch.cuda.set_device(0)
        mesh = init_device_mesh("cuda", (world,))
        specs = big_tensors(gib)
        # One allocation for every shard of this rank, each in a slot of ceil(rows / world) rows
        # (FSDP2's padded shard), slots 4 KiB + 36 bytes apart (not 16-byte aligned), the gaps and
        # the padding filled with 0x5A: a sync that read them would land wrong bytes.
        gap = 4096 + 36
        slots, end = [], gap
        for name, rows, cols, dtype, salt in specs:
            slots.append(end)
            end += -(-rows // world) * cols * 2 + gap
        flat = torch.full((end,), 0x5A, dtype=torch.uint8, device="cuda")
        params = {}
        for (name, rows, cols, dtype, salt), at in zip(specs, slots):
            first, count = shard_rows(rows, world, rank)
            row_bytes = cols * 2
            mine = flat[at:at + count * row_bytes]
            fill(mine, salt, first * row_bytes)
            local = mine.view(getattr(torch, dtype)).view(count, cols)
            params[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                              shape=torch.Size([rows, cols]), stride=(cols, 1))
        name, n, dtype, salt = NORM
        ahead = torch.empty(1000, device="cuda")  # so the norm is not at its block's start
        norm = torch.empty(n, dtype=getattr(torch, dtype), device="cuda")
        fill(norm.view(torch.uint8), salt, 0)
        params[name] = DTensor.from_local(norm, mesh, [Replicate()], run_check=False)
        torch.cuda.synchronize()
        client = shardcast.Client(target)
        reg = client.register_dtensors(group, params, version=1)
        conn.send(("registered", {"flat_bytes": end}))
        while conn.recv() != "exit":
            pass
        reg.close()
        client.close()
        del ahead
        dist.destroy_process_group()
        conn.send(("closed", None))
    except Exception as e:  # reported to the test, which fails with it
        import traceback

        conn.send(("error", f"trainer rank {rank}: {e!r}\n{traceback.format_exc()}"))


# ---- expandable segments: torch's 'e' handle, its allocations handed over, a sync ----

EXPANDABLE_ELEMENTS = 96 << 20  # bf16: 192 MiB, about ten 20 MiB segments


def expandable_main(src_target: str, dst_target: str, conn) -> None:
    """Run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the environment (the test sets
    it before spawning this process, so torch reads it at its first allocation). A source view at
    an odd offset inside a large expandable allocation is registered on `src_target`, a destination
    view inside another on `dst_target` (guard bytes 0xA5 around it), both by their cuMem
    allocations' descriptors; a sync between the daemons; every byte and every guard checked.
    Reports torch's 'e' handle as cuda_ipc reads it, and a tensor of a cudaMalloc block (expandable
    segments turned off) registering beside them."""
    import os

    import torch

    import shardcast
    from shardcast import cuda_ipc

    try:
        out = {"torch": torch.__version__, "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
        n = EXPANDABLE_ELEMENTS
        big = torch.empty(n + 2 * 12345, dtype=torch.bfloat16, device="cuda")
        src = big[12345:12345 + n]
        fill(src.view(torch.uint8), 5, 0)
        shared = src.untyped_storage()._share_cuda_()
        seg = cuda_ipc.decode(shared[1], int(shared[3]))
        out["decoded"] = type(seg).__name__
        if isinstance(seg, cuda_ipc.ExpandableSegment):
            nbytes = src.untyped_storage().nbytes()
            out.update(version=seg.version, handle_type=seg.handle_type, pid_is_ours=seg.pid == os.getpid(),
                       segments=len(seg.handles), covers=seg.offset + nbytes <= seg.bytes_spanned,
                       fds_open=seg.handle_type != "posix_fd" or all(_is_open(fd) for fd in seg.handles))
        guard = 4096 + 36
        dst_flat = torch.full((n * 2 + 2 * guard,), 0xA5, dtype=torch.uint8, device="cuda")
        dst = dst_flat[guard:guard + n * 2].view(torch.bfloat16)
        dst_shared = dst.untyped_storage()._share_cuda_()
        out["dst_decoded"] = type(cuda_ipc.decode(dst_shared[1], int(dst_shared[3]))).__name__
        torch.cuda.synchronize()

        def layout(group: str, node: str):
            return {"group": group, "mesh": {"shape": [1]}, "nodes": [node],
                    "tensors": [{"name": "w", "shape": [n], "dtype": "bfloat16", "placements": [{"replicate": {}}]}]}
        src_client, dst_client = shardcast.Client(src_target), shardcast.Client(dst_target)
        src_reg = src_client.register("gpu-expandable", 0, 1, {"w": src}, layout("gpu-expandable", "t0"),
                                      role="source", version=1)
        dst_reg = dst_client.register("gpu-expandable-dst", 0, 1, {"w": dst}, layout("gpu-expandable-dst", "i0"))
        result = src_client.sync("gpu-expandable", "gpu-expandable-dst", 1, verify=True, timeout=240)
        out["synced_version"] = result.version
        torch.cuda.synchronize()
        wrong = 0
        for off in range(0, n * 2, PATTERN_CHUNK):
            k = min(PATTERN_CHUNK, n * 2 - off)
            wrong += int((dst.view(torch.uint8)[off:off + k] != pattern(5, off, k)).sum())
        out["wrong_bytes"] = wrong
        out["guards_intact"] = bool((dst_flat[:guard] == 0xA5).all()) and bool((dst_flat[guard + n * 2:] == 0xA5).all())
        # A cudaMalloc tensor (expandable segments turned off) registers beside them, by IPC handle.
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        plain = torch.zeros(1024, dtype=torch.bfloat16, device="cuda")
        out["plain_decoded"] = type(cuda_ipc.decode(*_handle_and_offset(plain))).__name__
        plain_layout = {"group": "gpu-plain", "mesh": {"shape": [1]}, "nodes": ["t0"],
                        "tensors": [{"name": "w", "shape": [1024], "dtype": "bfloat16",
                                     "placements": [{"replicate": {}}]}]}
        plain_reg = src_client.register("gpu-plain", 0, 1, {"w": plain}, plain_layout)
        out["plain_registered"] = len(src_client.ranks("gpu-plain"))
        for reg in (plain_reg, dst_reg, src_reg):
            reg.close()
        src_client.close()
        dst_client.close()
        conn.send(("done", out))
    except Exception as e:
        import traceback

        conn.send(("error", f"expandable worker: {e!r}\n{traceback.format_exc()}"))


def _handle_and_offset(t):
    shared = t.untyped_storage()._share_cuda_()
    return shared[1], int(shared[3])


def _is_open(fd: int) -> bool:
    import os

    try:
        os.fstat(fd)
        return True
    except OSError:
        return False
